"""Generated `moe_nvfp4_decode` (IR op `moe_experts`, format "nvfp4") on CUDA against `REFS["moe_experts"]` on CUDA.

Full spec at TP 8 (E 256, H 5120, I 320 per rank, top-k 8), bf16, T in {1, 4, 8, 16, 64}; NVFP4 weights quantised
from random bf16 weights per expert and part (`tests/test_kernels_moe.nvfp4_experts`), passed re-laid out
(`relayout`, the fast path) and as stored (ModelOpt's layout); routings: ids distinct per token, skewed (every token
on the same 8 experts: 64 pairs per expert, 8 passes of MP = 8), and with ids outside [0, E) (zero rows). The
kernel dequantises the weights exactly and applies the global scale to the fp32 sums, while the reference rounds
each weight to bf16 first, and it sums in another order than cuBLAS: judged by relative error,
||y - ref|| / ||ref|| < 1e-2 (and h, stage 0's output, against the reference's swiglu the same way). Outputs
poisoned first. Rendered as by default for bf16 (PDL on) and once with PDL off; a CUDA graph captured with a fixed
scratch buffer replays new inputs to the same bits as a direct launch.
Timing (reported, not asserted): both launches in a CUDA graph, L2 flushed before each replay, median us at
T = 1, 8, 64 and TB/s of the distinct chosen experts' bytes (the issue's targets at T = 1: <= 8 us, >= 2.8 TB/s).

One short line per case is printed; with BEAMC_GPU_OUT set, a JSON summary goes to $BEAMC_GPU_OUT/moe.json.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from beamc.codegen.kernel import KernelSpec, load_kernel
from beamc.spec import load_spec
from conftest import captured_graph, load_bench_module, write_gpu_summary
from test_kernels_moe import (TEMPLATE, combine_constants, combined_reference, distinct_idx, h_reference,
                              moe_constants, nvfp4_experts, y_reference)

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
SUMMARY: dict = {"moe_nvfp4_decode": [], "moe_nvfp4_decode_timing": []}
_CACHE: dict = {}


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield from write_gpu_summary(SUMMARY, "moe.json")


def _constants(pdl: bool | None = None) -> dict:
    c = moe_constants(load_spec(ROOT / "models/beam.yaml"), 8, "bf16")
    return c if pdl is None else dict(c, PDL=pdl)


def _module(pdl: bool | None, tmp_path_factory):
    key = ("mod", pdl)
    if key not in _CACHE:
        _CACHE[key] = load_kernel(KernelSpec(TEMPLATE, "moe_experts", _constants(pdl)),
                                  tmp_path_factory.mktemp("moe_kernels"))
    return _CACHE[key]


def _rendered(name: str, extra: dict, tmp_path_factory):
    """The TP-8 bf16 module rendered with `extra` over the default constants, made once per name."""
    if ("render", name) not in _CACHE:
        _CACHE[("render", name)] = load_kernel(KernelSpec(TEMPLATE, "moe_experts", dict(_constants(), **extra)),
                                               tmp_path_factory.mktemp("moe_render"))
    return _CACHE[("render", name)]


def _weights(relaid: bool, mod=None):
    """The TP-8 experts (quantised on the GPU: 256 experts x 3 parts), made once; re-laid out once."""
    if "params" not in _CACHE:
        c = _constants()
        g = torch.Generator().manual_seed(0)
        _CACHE["params"] = nvfp4_experts(c["E"], c["H"], c["I"], g, device="cuda")
    if relaid and "relaid" not in _CACHE:
        _CACHE["relaid"] = mod.relayout(_CACHE["params"])
    return _CACHE["relaid"] if relaid else _CACHE["params"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _flushed_us(graph) -> float:
    """The median us of 30 replays of a CUDA graph, the L2 flushed (a 256 MB write) before each
    (bench/moe_decode.py's timing)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    return load_bench_module("moe_decode").replay_us(graph, flush)


def _idx(kind: str, T: int, c: dict, g: torch.Generator) -> torch.Tensor:
    idx = distinct_idx(T, c["E"], c["TOP_K"], g)
    if kind == "skewed":  # every token on experts 0..7: 64 pairs per expert at T = 64
        idx = torch.arange(c["TOP_K"]).repeat(T, 1)
    elif kind == "bad":  # ids outside [0, E): zero rows, nothing read
        idx[0, 0], idx[T - 1, 3] = -1, c["E"]
    elif kind == "none":  # every id outside [0, E): no weight read at all, out all zeros (the chains' fixed cost)
        idx[:] = -1
    return idx


CASES = [(1, True, None, "distinct"), (4, True, None, "distinct"), (8, True, None, "distinct"),
         (16, True, None, "bad"), (64, True, None, "distinct"), (64, True, None, "skewed"),
         (1, False, None, "distinct"), (8, False, None, "distinct"), (4, True, False, "distinct"),
         # (the decode range since s50: to 128 tokens, planned from 33 pairs: 5 tokens at top-8)
         (5, True, None, "distinct"), (100, True, None, "bad"), (128, True, None, "distinct"),
         (128, True, None, "skewed")]


@pytest.mark.parametrize("T,relaid,pdl,kind", CASES)
def test_moe_nvfp4_decode_matches_reference(T, relaid, pdl, kind, tmp_path_factory):
    mod = _module(pdl, tmp_path_factory)
    c = _constants(pdl)
    params = _weights(False)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, c["H"], generator=g).bfloat16().cuda()
    idx = _idx(kind, T, c, g).cuda()
    y = torch.full((T, c["TOP_K"], c["H"]), float("nan"), dtype=torch.bfloat16, device="cuda")
    scratch = torch.full((mod.scratch_numel(T) + 64,), float("nan"), dtype=torch.bfloat16, device="cuda")
    mod.launch(x, idx, *_weights(relaid, mod), y, scratch)
    torch.cuda.synchronize()
    assert torch.isnan(scratch[mod.scratch_numel(T):]).all(), "a write past scratch_numel(T)"
    assert torch.isfinite(y).all()
    ref = y_reference(x, idx, params)
    err = _rel(y, ref)
    h = scratch[:T * c["TOP_K"] * c["I"]].view(T, c["TOP_K"], c["I"])  # (PLAN: the plan after h)
    h_err = _rel(h, h_reference(x, idx, params))
    exact = (y == ref).float().mean().item()
    bad = (idx < 0) | (idx >= c["E"])
    line = dict(T=T, relaid=relaid, pdl=mod.PDL, routing=kind, rel_err=err, h_rel_err=h_err,
                bitwise_equal_fraction=exact)
    SUMMARY["moe_nvfp4_decode"].append(line)
    print(f"moe_nvfp4_decode T={T} relaid={relaid} pdl={mod.PDL} {kind}: rel err {err:.2e}, h rel err {h_err:.2e}, "
          f"{exact:.1%} bits equal")
    assert err < 1e-2 and h_err < 1e-2, line
    assert (y[bad] == 0).all()


@pytest.mark.parametrize("kind", ["distinct", "bad", "repeated"])
def test_moe_nvfp4_decode_without_scan_at_one_token(kind, tmp_path_factory):
    """SCAN_T1 off (each pair its own program at one token, no idx scan): the same bits as the default render at
    T = 1 (re-laid out; a repeated expert is then read twice, computed the same way), and within 1e-2 of the
    reference; bad ids give zero rows; a CUDA-graph replay equals the eager launch."""
    mod = _module(None, tmp_path_factory)
    solo = load_kernel(KernelSpec(TEMPLATE, "moe_experts", dict(_constants(), SCAN_T1=False)),
                       tmp_path_factory.mktemp("moe_solo"))
    c = _constants()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, c["H"], generator=g).bfloat16().cuda()
    idx = _idx("bad" if kind == "bad" else "distinct", 1, c, g)
    if kind == "repeated":
        idx[0, 5] = idx[0, 2]
    idx = idx.cuda()
    outs = []
    for m in (mod, solo):
        y = torch.full((1, c["TOP_K"], c["H"]), float("nan"), dtype=torch.bfloat16, device="cuda")
        scratch = torch.full((m.scratch_numel(1),), float("nan"), dtype=torch.bfloat16, device="cuda")
        m.launch(x, idx, *_weights(True, mod), y, scratch)
        outs.append((y, scratch))
    torch.cuda.synchronize()
    (y0, h0), (y1, h1) = outs
    err = _rel(y1, y_reference(x, idx, _weights(False)))
    graph = captured_graph(lambda: solo.launch(x, idx, *_weights(True, mod), y1, h1))
    y1_eager = y1.clone()
    y1.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    line = dict(routing=kind, rel_err=err, bitwise_equal_to_scan=bool(torch.equal(y0, outs[1][0])),
                h_bitwise=bool(torch.equal(h0, h1)), graph_bitwise=bool(torch.equal(y1, y1_eager)))
    SUMMARY.setdefault("scan_t1_off", []).append(line)
    print(f"moe_nvfp4_decode SCAN_T1 off, {kind}: {line}")
    bad = (idx < 0) | (idx >= c["E"])
    assert err < 1e-2 and line["bitwise_equal_to_scan"] and line["h_bitwise"] and line["graph_bitwise"], line
    assert (y1[bad] == 0).all()


@pytest.mark.parametrize("T,relaid,scan,kind", [(1, True, True, "distinct"), (1, True, False, "distinct"),
                                                 (3, True, True, "bad"), (8, True, True, "distinct"),
                                                 (1, False, True, "distinct")])
def test_moe_nvfp4_decode_ksplit8(T, relaid, scan, kind, tmp_path_factory):
    """KSPLIT 8 (stage 0 on 8 warps, each stage its own binary, stage 0's registers capped at 80): within 1e-2 of
    the reference (y and h) on its own relayout (gate_up in chunks of H / 8) or the ModelOpt bytes, bad ids zero
    rows, a CUDA-graph replay equal to the eager launch (its registers: bench/moe_decode.py)."""
    key = ("ksplit8", scan)
    if key not in _CACHE:
        _CACHE[key] = load_kernel(KernelSpec(TEMPLATE, "moe_experts", dict(_constants(), KSPLIT=8, SCAN_T1=scan)),
                                  tmp_path_factory.mktemp("moe_ks8"))
    mod = _CACHE[key]
    assert mod.KSPLIT == 8 and mod.BK0 == 128 and mod.STAGE_OPTIONS[0]["maxnreg"] == 80
    if relaid and ("ks8_relaid",) not in _CACHE:
        _CACHE[("ks8_relaid",)] = mod.relayout(_weights(False))
    params = _CACHE[("ks8_relaid",)] if relaid else _weights(False)
    c = _constants()
    g = torch.Generator().manual_seed(21 + T)
    x = torch.randn(T, c["H"], generator=g).bfloat16().cuda()
    idx = _idx(kind, T, c, g).cuda()
    y = torch.full((T, c["TOP_K"], c["H"]), float("nan"), dtype=torch.bfloat16, device="cuda")
    scratch = torch.full((mod.scratch_numel(T),), float("nan"), dtype=torch.bfloat16, device="cuda")
    mod.launch(x, idx, *params, y, scratch)
    torch.cuda.synchronize()
    ref = _weights(False)
    err = _rel(y, y_reference(x, idx, ref))
    h_err = _rel(scratch.view(T, c["TOP_K"], c["I"]), h_reference(x, idx, ref))
    eager = y.clone()
    graph = captured_graph(lambda: mod.launch(x, idx, *params, y, scratch))
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    line = dict(T=T, relaid=relaid, scan=scan, routing=kind, rel_err=err, h_rel_err=h_err,
                graph_bitwise=bool(torch.equal(y, eager)))
    SUMMARY.setdefault("ksplit8", []).append(line)
    print(f"moe_nvfp4_decode KSPLIT 8: {line}")
    bad = (idx < 0) | (idx >= c["E"])
    assert err < 1e-2 and h_err < 1e-2 and line["graph_bitwise"], line
    assert (y[bad] == 0).all()


WIDE_RENDERS = {"maxnreg128": dict(MAXNREG=128), "bi16": dict(BLOCK_I=16), "rw64": dict(RW=64),
                "bi16-rw64-cap168": dict(BLOCK_I=16, RW=64, MAXNREG=168),
                "idx128-cap128": dict(IDX_CHUNK=128, MAXNREG=128, PLAN=False),
                # PLAN (the default): the pairs grouped by expert by a first launch (from 65 pairs; every step with
                # PLAN_MIN_PAIRS 0), against the scanning render as the rest
                "plan": dict(PLAN=True), "plan-cap128": dict(PLAN=True, MAXNREG=128),
                "plan-all-cap128": dict(PLAN=True, PLAN_MIN_PAIRS=0, MAXNREG=128)}
SCANNING = dict(PLAN=False)  # the reference render of test_moe_nvfp4_decode_register_cap: every program scans idx


@pytest.mark.parametrize("render", sorted(WIDE_RENDERS))
@pytest.mark.parametrize("T,kind", [(3, "bad"), (16, "distinct"), (64, "distinct"), (64, "skewed")])
def test_moe_nvfp4_decode_register_cap(T, kind, render, tmp_path_factory):
    """The plain render's register cap (MAXNREG 128: the emitter's on sm90, 4 programs an SM), the wider programs
    (16 rows of I a stage-0 program, 64 rows of H a stage-1 warp; with a cap), the idx scan in steps of 128 and PLAN
    (the pairs grouped by a first launch): y and h bitwise equal to the default render's on the same inputs (each
    row's dot runs the same K steps in the same order; a pair's column of the MMA changes none of its bits), eager
    and in a CUDA-graph replay. The reference is the scanning render (PLAN off; the other renders keep the default
    PLAN)."""
    wide, plain = (_rendered(name, extra, tmp_path_factory)
                   for name, extra in ((render, WIDE_RENDERS[render]), ("scanning", SCANNING)))
    assert wide.OPTIONS.get("maxnreg") == WIDE_RENDERS[render].get("MAXNREG") and "maxnreg" not in plain.OPTIONS
    assert not plain.PLAN and wide.PLAN == WIDE_RENDERS[render].get("PLAN", True)
    c = _constants()
    g = torch.Generator().manual_seed(40 + T)
    x = torch.randn(T, c["H"], generator=g).bfloat16().cuda()
    idx = _idx(kind, T, c, g).cuda()
    outs = []
    for mod in (plain, wide):
        y = torch.full((T, c["TOP_K"], c["H"]), float("nan"), dtype=torch.bfloat16, device="cuda")
        h = torch.full((mod.scratch_numel(T),), float("nan"), dtype=torch.bfloat16, device="cuda")
        mod.launch(x, idx, *_weights(True, mod), y, h)
        torch.cuda.synchronize()
        outs.append((y.clone(), h.clone()))
    graph = captured_graph(lambda: wide.launch(x, idx, *_weights(True, wide), y, h))
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    n = T * c["TOP_K"] * c["I"]  # h (PLAN: the plan after it)
    line = dict(T=T, routing=kind, render=render, y_bitwise=bool(torch.equal(outs[0][0], outs[1][0])),
                h_bitwise=bool(torch.equal(outs[0][1][:n], outs[1][1][:n])), graph_bitwise=bool(torch.equal(y, outs[1][0])),
                rel_err=_rel(outs[1][0], y_reference(x, idx, _weights(False))))
    SUMMARY.setdefault("wide_renders", []).append(line)
    print(f"moe_nvfp4_decode {render}: {line}")
    assert line["y_bitwise"] and line["h_bitwise"] and line["graph_bitwise"] and line["rel_err"] < 1e-2, line


@pytest.mark.parametrize("T,relaid,kind", [(1, True, "distinct"), (3, True, "bad"), (8, True, "skewed"),
                                            (1, False, "distinct")])
def test_moe_nvfp4_decode_combine_render(T, relaid, kind, tmp_path_factory):
    """The COMBINE render (the combine_experts pass: the top-k combine x 2.5 in stage 1) against the fp32
    reference's combine (relative error < 1e-2) and against the two launches it replaces (the plain render, then
    the moe_combine kernel): the same rounding points, so the bits should agree but for sums in another order."""
    c = _constants()
    if ("combine",) not in _CACHE:
        d = tmp_path_factory.mktemp("moe_combine")
        _CACHE[("combine",)] = (
            load_kernel(KernelSpec(TEMPLATE, "moe_experts", dict(c, COMBINE=True, ROUTED_SCALE=2.5)), d),
            load_kernel(KernelSpec("moe_combine", "moe_experts", combine_constants(c, 2.5)), d))
    fused, comb = _CACHE[("combine",)]
    plain = _module(None, tmp_path_factory)
    g = torch.Generator().manual_seed(100 + T)
    x = torch.randn(T, c["H"], generator=g).bfloat16().cuda()
    idx = _idx(kind, T, c, g).cuda()
    w = (torch.rand(T, c["TOP_K"], generator=g) + 0.05).cuda()
    params = _weights(relaid, plain)
    out = torch.full((T, c["H"]), float("nan"), dtype=torch.bfloat16, device="cuda")
    h = torch.full((fused.scratch_numel(T),), float("nan"), dtype=torch.bfloat16, device="cuda")
    fused.launch(x, idx, *params, w, out, h)
    y = torch.full((T, c["TOP_K"], c["H"]), float("nan"), dtype=torch.bfloat16, device="cuda")
    plain.launch(x, idx, *params, y)
    two = torch.full_like(out, float("nan"))
    comb.launch(y, w, idx, two)
    torch.cuda.synchronize()
    ref = combined_reference(x.float(), idx, _weights(False), w, 2.5)
    err, equal = _rel(out, ref), (out.view(torch.int16) == two.view(torch.int16)).float().mean().item()
    line = dict(T=T, relaid=relaid, routing=kind, rel_err=err, rel_err_two_launches=_rel(two, ref),
                bits_equal_two_launches=equal,
                h_rel_err=_rel(h.view(T, c["TOP_K"], c["I"]), h_reference(x, idx, _weights(False))))
    SUMMARY.setdefault("moe_nvfp4_decode_combine", []).append(line)
    print(f"moe_nvfp4_decode COMBINE T={T} relaid={relaid} {kind}: rel err {err:.2e}, {equal:.2%} bits equal to "
          f"the two launches")
    assert torch.isfinite(out).all() and err < 1e-2 and line["rel_err_two_launches"] < 1e-2, line
    assert line["h_rel_err"] < 1e-2, line


# COMBINE render options that change no value: EARLY1 (stage 1 reads its routing and its weights before the PDL wait);
# COMBINE_R 64 (64 A rows per stage-1 warp: twice the rows of H per program, half the programs).
# (The twentieth session's L2 prefetch renders ran here too before they were removed: s20run2-3; so did GSCALE_EARLY
# and SCALAR_BASE, stage 0's early global scales and scalar base pointers, before they were measured slower and
# removed: 2026-12-02.)
# PERSIST (both stages in one cooperative launch, a grid barrier between them): as many programs as fit at once, 7
# programs walking many items each, and 132; without the idx scan at one token (SCAN_T1 off: in the two-launch form
# faster alone but slower in the step, because later kernels' programs then shared stage 0's SMs, which PERSIST's
# trigger after the barrier rules out); as a plain launch (PERSIST_COOP off); and with EARLY1 (each program's first
# stage-1 item loads its first K steps' weights before the barrier).
RENDER_VARIANTS = {"early1": dict(EARLY1=True), "r64": dict(COMBINE_R=64), "persist": dict(PERSIST=True),
                   "persist-g7": dict(PERSIST=True, PERSIST_PROGRAMS=7),
                   "persist-g132": dict(PERSIST=True, PERSIST_PROGRAMS=132),
                   "persist-noscan": dict(PERSIST=True, SCAN_T1=False),
                   "persist-nocoop": dict(PERSIST=True, PERSIST_COOP=False),
                   "persist-early1": dict(PERSIST=True, EARLY1=True)}


@pytest.mark.parametrize("variant", sorted(RENDER_VARIANTS))
@pytest.mark.parametrize("T,relaid,kind", [(1, True, "distinct"), (3, True, "bad"), (8, True, "skewed"),
                                            (2, True, "distinct"), (1, False, "distinct"), (1, True, "none")])
def test_moe_nvfp4_decode_combine_variant(T, relaid, kind, variant, tmp_path_factory):
    """A render option that changes no value (RENDER_VARIANTS) against the default COMBINE render: the same dots in
    the same order, so bitwise the same out, eagerly and replayed from a CUDA graph (new inputs copied in); both timed
    in graphs (median of 30 replays, L2 flushed before each; reported, not asserted)."""
    c = _constants()
    key = ("combine-variant", variant)
    if key not in _CACHE:
        d = tmp_path_factory.mktemp(f"moe_combine_{variant}")
        _CACHE[key] = tuple(load_kernel(KernelSpec(TEMPLATE, "moe_experts", dict(c, COMBINE=True, ROUTED_SCALE=2.5,
                                                                                  **extra)), d)
                            for extra in ({}, RENDER_VARIANTS[variant]))
    mods = _CACHE[key]
    assert (mods[0].EARLY1_CHUNKS, mods[0].COMBINE_R, mods[0].PERSIST) == (0, 32, False)
    want = {"early1": (5, 32, False), "r64": (0, 64, False), "persist-early1": (5, 32, True)}.get(variant,
                                                                                                 (0, 32, True))
    assert (mods[1].EARLY1_CHUNKS, mods[1].COMBINE_R, mods[1].PERSIST) == want
    params = _weights(relaid, mods[0])
    x = torch.empty(T, c["H"], dtype=torch.bfloat16, device="cuda")
    idx = torch.empty(T, c["TOP_K"], dtype=torch.int64, device="cuda")
    w = torch.empty(T, c["TOP_K"], dtype=torch.float32, device="cuda")

    def fresh(seed):
        g = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(T, c["H"], generator=g).bfloat16())
        idx.copy_(_idx(kind, T, c, g))
        w.copy_(torch.rand(T, c["TOP_K"], generator=g) + 0.05)

    outs = [torch.empty(T, c["H"], dtype=torch.bfloat16, device="cuda") for _ in mods]
    hs = [torch.empty(mods[0].scratch_numel(T), dtype=torch.bfloat16, device="cuda") for _ in mods]
    runs = [lambda m=m, o=o, h=h: m.launch(x, idx, *params, w, o, h) for m, o, h in zip(mods, outs, hs)]
    fresh(300 + T)
    for o, run in zip(outs, runs):
        o.fill_(float("nan"))
        run()
    torch.cuda.synchronize()
    eager = [o.clone() for o in outs]
    graphs = [captured_graph(run) for run in runs]
    fresh(400 + T)
    for o, gr in zip(outs, graphs):
        o.fill_(float("nan"))
        gr.replay()
    torch.cuda.synchronize()
    replayed = [o.clone() for o in outs]
    direct = torch.full_like(outs[1], float("nan"))
    mods[1].launch(x, idx, *params, w, direct, torch.empty_like(hs[1]))
    torch.cuda.synchronize()
    ref = combined_reference(x.float(), idx, _weights(False), w, 2.5)
    us = [_flushed_us(gr) for gr in graphs]
    line = dict(T=T, relaid=relaid, routing=kind, bitwise=bool(torch.equal(eager[0], eager[1])),
                graph_bitwise=bool(torch.equal(replayed[0], replayed[1]) and torch.equal(replayed[1], direct)),
                rel_err=0.0 if kind == "none" and not replayed[1].any() else _rel(replayed[1], ref),
                us_default=us[0], us_variant=us[1])
    SUMMARY.setdefault(f"moe_nvfp4_decode_combine_{variant}", []).append(line)
    print(f"moe_nvfp4_decode COMBINE {variant} T={T} relaid={relaid} {kind}: bitwise {line['bitwise']}, graph "
          f"{line['graph_bitwise']}, rel err {line['rel_err']:.2e}, us default / {variant} {us[0]:.2f} / {us[1]:.2f}")
    assert line["bitwise"] and line["graph_bitwise"] and line["rel_err"] < 1e-2, line
    if mods[1].PERSIST:  # the barrier's counters back at 0 after every launch (the next one starts from there)
        assert int(mods[1].counters(x.device, 2)[:2].abs().sum()) == 0


def test_moe_nvfp4_decode_cuda_graph(tmp_path_factory):
    """Captured once with fixed buffers (x, idx, y, scratch), replayed with new x and idx copied in: the same bits
    as a direct launch."""
    mod = _module(None, tmp_path_factory)
    c = _constants()
    params = _weights(True, mod)
    T = 4
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, c["H"], generator=g).bfloat16().cuda()
    idx = distinct_idx(T, c["E"], c["TOP_K"], g).cuda()
    y = torch.empty(T, c["TOP_K"], c["H"], dtype=torch.bfloat16, device="cuda")
    scratch = torch.empty(mod.scratch_numel(T), dtype=torch.bfloat16, device="cuda")
    graph = captured_graph(lambda: mod.launch(x, idx, *params, y, scratch))  # compiled and warmed up outside it
    for seed in (8, 9):
        g = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(T, c["H"], generator=g).bfloat16())
        idx.copy_(distinct_idx(T, c["E"], c["TOP_K"], g))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        direct = torch.full_like(y, float("nan"))
        mod.launch(x, idx, *params, direct, torch.empty_like(scratch))
        torch.cuda.synchronize()
        assert torch.equal(y, direct)
        assert _rel(y, y_reference(x, idx, _weights(False))) < 1e-2


@pytest.mark.parametrize("T,relaid", [(1, True), (8, True), (64, True), (1, False)])
def test_moe_nvfp4_decode_timing(T, relaid, tmp_path_factory):
    """Both launches as one CUDA graph, the L2 flushed (a 256 MB write) before each replay: the median of 30
    replays, and the distinct chosen experts' bytes over it. Reported, not asserted."""
    mod = _module(None, tmp_path_factory)
    c = _constants()
    params = _weights(relaid, mod)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, c["H"], generator=g).bfloat16().cuda()
    idx = distinct_idx(T, c["E"], c["TOP_K"], g).cuda()
    y = torch.empty(T, c["TOP_K"], c["H"], dtype=torch.bfloat16, device="cuda")
    scratch = torch.empty(mod.scratch_numel(T), dtype=torch.bfloat16, device="cuda")
    mod.launch(x, idx, *params, y, scratch)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mod.launch(x, idx, *params, y, scratch)
    us = _flushed_us(graph)
    H, I = c["H"], c["I"]
    per_expert = 2 * I * H // 2 + 2 * I * H // 16 + H * I // 2 + H * I // 16
    n = int(torch.unique(idx).numel())
    line = dict(T=T, relaid=relaid, us=us, experts=n, tb_s=n * per_expert / us / 1e6)
    SUMMARY["moe_nvfp4_decode_timing"].append(line)
    print(f"moe_nvfp4_decode timing T={T} relaid={relaid}: {us:.1f} us, {n} experts, {line['tb_s']:.2f} TB/s")


# moe_nvfp4_frag (the Gluon kernel for the smallest decode steps, `--moe-frag-max-tokens`): the TP-8 shapes and the
# tiny spec's TP-1 / TP-2 shapes
FRAG_SHAPES = {"full-tp8": None, "tiny-tp1": dict(E=16, H=256, I=64, TOP_K=4),
               "tiny-tp2": dict(E=16, H=256, I=32, TOP_K=4)}


FRAG_CASES = ([(s, k, 1) for s in sorted(FRAG_SHAPES) for k in ("distinct", "bad", "repeated")]
              + [("full-tp8", "distinct", 8), ("tiny-tp2", "bad", 3)])


@pytest.mark.parametrize("shape,kind,T", FRAG_CASES)
def test_moe_nvfp4_frag(shape, kind, T, tmp_path_factory):
    """moe_nvfp4_frag at T tokens against the fp32 reference's combine (relative error < 1e-2, h too) and against
    the decode kernel's COMBINE render on the same re-laid-out weights; routings: distinct experts, ids outside
    [0, E) (nothing read, zero terms), an expert chosen twice (ties ranked by position). Outputs poisoned first; a
    CUDA graph replays new inputs to the bits of a direct launch. Both launches timed at the TP-8 shapes (reported)."""
    c = _constants() if FRAG_SHAPES[shape] is None else dict(DTYPE="bf16", **FRAG_SHAPES[shape])
    key = ("frag", shape)
    if key not in _CACHE:
        d = tmp_path_factory.mktemp("moe_frag")
        fused = load_kernel(KernelSpec(TEMPLATE, "moe_experts", dict(c, COMBINE=True, ROUTED_SCALE=2.5)), d)
        frag = load_kernel(KernelSpec("moe_nvfp4_frag", "moe_experts", dict(c, ROUTED_SCALE=2.5)), d)
        raw = (_weights(False) if FRAG_SHAPES[shape] is None else
               nvfp4_experts(c["E"], c["H"], c["I"], torch.Generator().manual_seed(3), device="cuda"))
        _CACHE[key] = fused, frag, raw, fused.relayout(raw)
    fused, frag, raw, ps = _CACHE[key]
    g = torch.Generator().manual_seed(sum(map(ord, shape + kind)) + T)
    x = torch.randn(T, c["H"], generator=g).bfloat16().cuda()
    idx = _idx("bad" if kind == "bad" else "distinct", T, c, g)
    if kind == "repeated":
        idx[0, 1] = idx[0, 0]
    idx = idx.cuda()
    w = (torch.rand(T, c["TOP_K"], generator=g) + 0.05).cuda()
    out = torch.full((T, c["H"]), float("nan"), dtype=torch.bfloat16, device="cuda")
    h = torch.full((frag.scratch_numel(T),), float("nan"), dtype=torch.bfloat16, device="cuda")
    frag.launch(x, idx, *ps, w, out, h)
    two = torch.full_like(out, float("nan"))
    fused.launch(x, idx, *ps, w, two)
    torch.cuda.synchronize()
    ref = combined_reference(x.float(), idx, raw, w, 2.5)
    line = dict(shape=shape, routing=kind, T=T, rel_err=_rel(out, ref), rel_err_combine_render=_rel(out, two),
                h_rel_err=_rel(h.view(T, c["TOP_K"], c["I"]), h_reference(x, idx, raw)))
    # a graph with fixed buffers: new inputs copied in, replayed, bitwise a direct launch's
    gx, gi, gw = x.clone(), idx.clone(), w.clone()
    graph = captured_graph(lambda: frag.launch(gx, gi, *ps, gw, out, h))
    x2 = torch.randn(T, c["H"], generator=g).bfloat16().cuda()
    gx.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    direct = torch.full_like(out, float("nan"))
    frag.launch(x2, idx, *ps, w, direct, torch.empty_like(h))
    torch.cuda.synchronize()
    line["graph_bitwise"] = bool(torch.equal(out.view(torch.int16), direct.view(torch.int16)))
    if shape == "full-tp8" and kind == "distinct":  # (T 1 and 8)
        line["us_both_flushed"] = _flushed_us(captured_graph(lambda: frag.launch(gx, gi, *ps, gw, out, h)))
        line["us_combine_render_flushed"] = _flushed_us(captured_graph(lambda: fused.launch(gx, gi, *ps, gw, two)))
    SUMMARY.setdefault("moe_nvfp4_frag", []).append(line)
    print(f"moe_nvfp4_frag {shape} {kind} T={T}: {line}")
    assert torch.isfinite(out).all() and line["rel_err"] < 1e-2 and line["h_rel_err"] < 1e-2, line
    assert line["rel_err_combine_render"] < 1e-2 and line["graph_bitwise"], line
