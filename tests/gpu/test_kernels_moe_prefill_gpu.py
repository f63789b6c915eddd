"""Generated `moe_nvfp4_prefill` (IR op `moe_experts`, format "nvfp4", the large-T path) on CUDA.

bf16 kernel outputs against an fp32 reference on the dequantised weights (`REFS["moe_experts"]` with x in fp32:
`expert_weights` dequantises to fp32, the GEMMs and SwiGLU run in fp32), judged by ||y - ref|| / ||ref|| < 1e-2 (the
bf16 reference's error is printed beside it). Shapes: the full spec at TP 8 (E 256, H 5120, I 320, top-k 8) with
M in {1, 65, 1000, 16384} tokens, and odd shapes (E 5, H 272, I 48, top-k 3; E 7, H 320, I 96, top-k 4); routings:
k distinct random experts per token, every pair on one expert, a few experts only (the others empty), repeated
experts within a token. y poisoned with NaN, the scratch with canaries past scratch_numel(M); the sort's counts
checked against torch.bincount. Rendered as by default for bf16 (PDL on), once with PDL off, and with NATIVE_FP4
(tl.dot_scaled, Triton's emulation on sm_90) where the installed Triton compiles it (3.6 does not: skipped, with the
reason). A CUDA graph captured with a fixed scratch replays new x and idx to the same bits as a direct launch.
Re-laid-out weights (`moe_nvfp4_decode.relayout`: what the runtime feeds both MoE kernels on sm90): y bit for bit
the ModelOpt-layout run's, and within the same 1e-2 of the fp32 reference; TP 8 (K steps of half a 256-value chunk
in gate_up, one 64-value chunk in down) and an odd shape (E 7, H 384, I 96, top-k 4: steps of 4 chunks of 32 values
in gate_up, one in down).
WGMMA (stages 3 and 4 as the warp-specialised Gluon kernel; re-laid-out weights): the fp32 reference to < 1e-2 and
the default render to < 5e-3 (the global scale on the fp32 sums: ~1e-3 from the reference, not bitwise), TP 8 at
1 to 16,384 tokens and an odd shape (E 7, H 768, I 192, top-k 3), skewed routings, every tile form the bench times;
its ModelOpt fallback (the module's Triton stages); graph replay bitwise equal to direct launches.
COMBINE (y in the sort's order, WG_YTMA's box stores, the combine as the module's stage 6): out and each pair's y row
bit for bit the route before (the form without it, then `moe_combine`), eager and replayed, ids outside [0, E)
included.

One short line per case is printed; with BEAMC_GPU_OUT set, a JSON summary goes to $BEAMC_GPU_OUT/moe_prefill.json.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from beamc.codegen.kernel import KernelSpec, load_kernel
from beamc.ir.reference import REFS
from beamc.spec import load_spec
from conftest import captured_graph, write_gpu_summary
from test_kernels_moe import moe_constants, nvfp4_experts
from test_kernels_moe_wgmma import FORMS as WG_FORMS  # (the WGMMA render's tile forms, compiled there)

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = "moe_nvfp4_prefill"
SUMMARY: dict = {"moe_nvfp4_prefill": []}
_CACHE: dict = {}

SHAPES = {
    "tp8": None,  # the full spec's
    "odd-e5": dict(E=5, H=272, I=48, TOP_K=3),
    "odd-e7": dict(E=7, H=320, I=96, TOP_K=4),
    "odd-relaid": dict(E=7, H=384, I=96, TOP_K=4),  # (relayout needs H % 128 == 0 and I % 32 == 0)
    "odd-wg": dict(E=7, H=768, I=192, TOP_K=3),  # (WGMMA: K steps of 64 within the relayout's chunks of 64 / 64)
    "odd-rk128": dict(E=5, H=512, I=192, TOP_K=3),  # (WG_WTMA with relayout chunks RK0 of 128)
}


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield from write_gpu_summary(SUMMARY, "moe_prefill.json")


def _constants(shape: str, **extra) -> dict:
    c = moe_constants(load_spec(ROOT / "models/beam.yaml"), 8, "bf16") if SHAPES[shape] is None else \
        dict(DTYPE="bf16", **SHAPES[shape])
    return dict(c, **extra)


def _module(shape: str, tmp_path_factory, **extra):
    key = ("mod", shape, tuple(sorted(extra.items())))
    if key not in _CACHE:
        _CACHE[key] = load_kernel(KernelSpec(TEMPLATE, "moe_experts", _constants(shape, **extra)),
                                  tmp_path_factory.mktemp("moe_prefill_kernels"))
    return _CACHE[key]


def _weights(shape: str):
    """The experts of a shape (quantised on the GPU), made once."""
    if ("params", shape) not in _CACHE:
        c = _constants(shape)
        _CACHE[("params", shape)] = nvfp4_experts(c["E"], c["H"], c["I"], torch.Generator().manual_seed(0),
                                                  device="cuda")
    return _CACHE[("params", shape)]


def _relaid(shape: str, tmp_path_factory):
    """The shape's experts after `moe_nvfp4_decode.relayout` (the runtime's load-time transform on sm90), made once."""
    if ("relaid", shape) not in _CACHE:
        decode = load_kernel(KernelSpec("moe_nvfp4_decode", "moe_experts", _constants(shape)),
                             tmp_path_factory.mktemp("moe_decode_kernels"))
        _CACHE[("relaid", shape)] = decode.relayout(_weights(shape))
    return _CACHE[("relaid", shape)]


def _routing(kind: str, M: int, E: int, k: int, g: torch.Generator) -> torch.Tensor:
    if kind == "distinct":
        r = torch.rand(M, E, generator=g).argsort(dim=1)[:, :k]
    elif kind == "one":  # every pair on one expert
        r = torch.full((M, k), E // 2)
    elif kind == "few":  # 3 experts get every pair, the others none (repeats within a token too)
        keep = torch.tensor([1, E // 2, E - 1])
        r = keep[torch.randint(0, 3, (M, k), generator=g)]
    else:  # "repeat": random with repeats
        r = torch.randint(0, E, (M, k), generator=g)
    return r.long().cuda()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _run(mod, params, x, idx, keep: dict | None = None):
    """y of one launch (poisoned first, the scratch's canaries and the sort's counts checked); `keep`: gets the
    scratch under "scratch"."""
    M, k, H = x.shape[0], mod.TOP_K, mod.H
    y = torch.full((M, k, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    n = mod.scratch_numel(M)
    scratch = torch.full((n + 64,), float("nan"), dtype=torch.bfloat16, device="cuda")
    mod.launch(x, idx, *params, y, scratch)
    torch.cuda.synchronize()
    assert torch.isnan(scratch[n:]).all(), "a write past scratch_numel(M)"
    assert torch.isfinite(y).all(), "unwritten (or non-finite) outputs"
    counts = mod.scratch_views(scratch, M)["count"].long()
    assert torch.equal(counts, torch.bincount(idx.flatten(), minlength=mod.E)), "the sort's counts"
    if keep is not None:
        keep["scratch"] = scratch
    return y


def _h_by_pair(mod, scratch, M: int) -> torch.Tensor:
    """h (the gate_up stage's output) of each (token, choice) pair, from the scratch after a launch: the sorted rows
    of every expert mapped back to their pairs (renders with other BLOCK_M sort into other rows)."""
    v = mod.scratch_views(scratch, M)
    rows = torch.cat([v["start"][e] + torch.arange(int(v["count"][e]), device=scratch.device)
                      for e in range(mod.E) if int(v["count"][e]) > 0])
    out = torch.full((M * mod.TOP_K, mod.I), float("nan"), dtype=scratch.dtype, device=scratch.device)
    out[v["sorted"][rows].long()] = v["h"][rows]
    return out


def _worst_row(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Each output row's relative error against the reference's (a norm over all rows would hide a handful of wrong
    rows: an edge of the sort or of a tile)."""
    return (y.float() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)


def _check(mod, shape: str, M: int, kind: str, label: str = "") -> dict:
    params = _weights(shape)
    g = torch.Generator().manual_seed(M + len(kind))
    x = torch.randn(M, mod.H, generator=g).bfloat16().cuda()
    idx = _routing(kind, M, mod.E, mod.TOP_K, g)
    y = _run(mod, params, x, idx)
    ref32 = REFS["moe_experts"]([x.float(), idx, *params], {"format": "nvfp4"})[0]
    ref16 = REFS["moe_experts"]([x, idx, *params], {"format": "nvfp4"})[0]
    err, err16 = _rel(y, ref32), _rel(y, ref16)
    row = _worst_row(y, ref32).max().item()
    line = dict(shape=shape, M=M, routing=kind, variant=label or "default", pdl=mod.PDL, native=mod.NATIVE_FP4,
                rel_err_fp32_ref=err, worst_row_rel_err=row, rel_err_bf16_ref=err16,
                bf16_ref_vs_fp32_ref=_rel(ref16, ref32), bitwise_equal_bf16_ref=(y == ref16).float().mean().item())
    SUMMARY["moe_nvfp4_prefill"].append(line)
    print(f"moe_nvfp4_prefill {shape} M={M} {kind} {line['variant']}: rel err {err:.2e} (fp32 ref), "
          f"{err16:.2e} (bf16 ref; bf16 ref itself {line['bf16_ref_vs_fp32_ref']:.2e})")
    assert err < 1e-2 and row < 3e-2, line
    return line


@pytest.mark.parametrize("M,kind", [(1, "distinct"), (65, "distinct"), (1000, "distinct"), (16384, "distinct"),
                                    (1000, "one"), (16384, "one"), (1000, "few"), (1000, "repeat")])
def test_tp8_matches_fp32_reference(M, kind, tmp_path_factory):
    _check(_module("tp8", tmp_path_factory), "tp8", M, kind)


@pytest.mark.parametrize("shape", ["odd-e5", "odd-e7"])
@pytest.mark.parametrize("M,kind", [(1000, "distinct"), (1000, "few"), (333, "repeat")])
def test_odd_shapes_match_fp32_reference(shape, M, kind, tmp_path_factory):
    _check(_module(shape, tmp_path_factory), shape, M, kind)


def test_tp8_pdl_off(tmp_path_factory):
    mod = _module("tp8", tmp_path_factory, PDL=False)
    assert mod.PDL is False
    _check(mod, "tp8", 1000, "distinct", "pdl-off")


@pytest.mark.parametrize("shape,M", [("tp8", 1000), ("odd-e7", 1000)])
def test_native_fp4_path(shape, M, tmp_path_factory):
    """NATIVE_FP4 (tl.dot_scaled with e4m3 block scales; the sm100 path) where Triton compiles it on this GPU."""
    import triton

    mod = _module(shape, tmp_path_factory, NATIVE_FP4=True)
    try:
        _check(mod, shape, M, "distinct", "native_fp4")
    except Exception as e:  # noqa: BLE001
        if "PassManager" in str(e) or "CompilationError" in type(e).__name__:
            pytest.skip(f"Triton {triton.__version__} does not compile bf16 x e2m1 dot_scaled with e4m3 scales: "
                        f"{type(e).__name__}")
        raise


def _replays_equal_direct_launches(mod, params, M: int, seed: int, runs, check_ref: bool) -> None:
    """Captured once with fixed buffers (x, idx, y, scratch), replayed with new x and idx copied in for each (seed,
    routing) of `runs` (other experts, other block counts): the same bits as a direct launch (and, with check_ref,
    the fp32 reference to < 1e-2)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, mod.H, generator=g).bfloat16().cuda()
    idx = _routing("distinct", M, mod.E, mod.TOP_K, g)
    y = torch.empty(M, mod.TOP_K, mod.H, dtype=torch.bfloat16, device="cuda")
    scratch = torch.empty(mod.scratch_numel(M), dtype=torch.bfloat16, device="cuda")
    graph = captured_graph(lambda: mod.launch(x, idx, *params, y, scratch))  # compiled and warmed up outside it
    for seed, kind in runs:
        g = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(M, mod.H, generator=g).bfloat16())
        idx.copy_(_routing(kind, M, mod.E, mod.TOP_K, g))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        direct = torch.full_like(y, float("nan"))
        mod.launch(x, idx, *params, direct, torch.full_like(scratch, float("nan")))
        torch.cuda.synchronize()
        assert torch.equal(y, direct), kind
        if check_ref:
            ref = REFS["moe_experts"]([x.float(), idx, *params], {"format": "nvfp4"})[0]
            assert _rel(y, ref) < 1e-2, kind


def test_cuda_graph_replay(tmp_path_factory):
    """Graph replays with new inputs: the same bits as direct launches, and the fp32 reference (< 1e-2)."""
    _replays_equal_direct_launches(_module("tp8", tmp_path_factory), _weights("tp8"), 1000, 7,
                                   ((8, "distinct"), (9, "few"), (10, "one")), check_ref=True)
    SUMMARY["moe_nvfp4_prefill"].append(dict(cuda_graph_replay="bitwise equal to direct launches", M=1000))


@pytest.mark.parametrize("shape,M,kind", [("tp8", 1000, "distinct"), ("tp8", 333, "few"),
                                          ("odd-relaid", 1000, "repeat")])
def test_relaid_weights_give_the_same_bits(shape, M, kind, tmp_path_factory):
    """The runtime's layout on sm90: the bf16 kernel on re-laid-out weights equals its run on the ModelOpt tensors
    they come from bit for bit (same weights rounded at the same point, same tiles into the same tl.dot), and the
    fp32 reference to ||d|| / ||ref|| < 1e-2."""
    mod = _module(shape, tmp_path_factory)
    params, relaid = _weights(shape), _relaid(shape, tmp_path_factory)
    assert relaid[0].dtype == torch.int32 and relaid[1].dtype == torch.uint8 and mod.RELAYOUT_OK
    g = torch.Generator().manual_seed(M + 11)
    x = torch.randn(M, mod.H, generator=g).bfloat16().cuda()
    idx = _routing(kind, M, mod.E, mod.TOP_K, g)
    y_raw = _run(mod, params, x, idx)
    y = _run(mod, relaid, x, idx)
    ref = REFS["moe_experts"]([x.float(), idx, *params], {"format": "nvfp4"})[0]
    differ = y.view(torch.int16) != y_raw.view(torch.int16)
    line = dict(shape=shape, M=M, routing=kind, variant="relaid", rel_err_fp32_ref=_rel(y, ref),
                bits_differing=int(differ.sum()), only_signed_zeros=bool((y[differ] == 0).all()) if differ.any()
                else None)
    SUMMARY["moe_nvfp4_prefill"].append(line)
    print(f"moe_nvfp4_prefill {shape} M={M} {kind} relaid: rel err {line['rel_err_fp32_ref']:.2e} (fp32 ref), "
          f"{line['bits_differing']} outputs differ from the ModelOpt layout's")
    assert line["bits_differing"] == 0 and line["rel_err_fp32_ref"] < 1e-2, line


@pytest.mark.parametrize("down", [False, True], ids=["dequant", "dequant-down"])
@pytest.mark.parametrize("shape,M,kind", [("tp8", 16384, "distinct"), ("tp8", 4096, "one"), ("tp8", 1000, "few"),
                                          ("tp8", 65, "distinct"), ("odd-e7", 1000, "repeat"),
                                          ("odd-relaid", 1000, "distinct")])
def test_dequant_render(shape, M, kind, down, tmp_path_factory):
    """DEQUANT (the long-prefill render: the gate_up weights of the experts with rows dequantised into the scratch
    first, each stage a binary of its own; DEQUANT_DOWN: the down weights too, the down GEMM over every column tile in
    one flattened loop): the fp32 reference to < 1e-2 on the ModelOpt tensors, and on the re-laid-out ones (what the
    runtime feeds it) the same bits; its dequantised weights are the reference's bf16 weights exactly for every
    expert with a row."""
    mod = _module(shape, tmp_path_factory, DEQUANT=True, DEQUANT_DOWN=down)
    assert mod.DEQUANT and mod.DEQUANT_DOWN == down and len(mod.LAUNCH_OPTIONS) == 4
    line = _check(mod, shape, M, kind, "dequant-down" if down else "dequant")
    if mod.RELAYOUT_OK:
        g = torch.Generator().manual_seed(M + len(kind))  # _check's inputs again
        x = torch.randn(M, mod.H, generator=g).bfloat16().cuda()
        idx = _routing(kind, M, mod.E, mod.TOP_K, g)
        y = torch.full((M, mod.TOP_K, mod.H), float("nan"), dtype=torch.bfloat16, device="cuda")
        scratch = torch.full((mod.scratch_numel(M),), float("nan"), dtype=torch.bfloat16, device="cuda")
        mod.launch(x, idx, *_relaid(shape, tmp_path_factory), y, scratch)
        y_raw = _run(mod, _weights(shape), x, idx)
        line["relaid_bits_differing"] = int((y.view(torch.int16) != y_raw.view(torch.int16)).sum())
        views = mod.scratch_views(scratch, M)
        used = [e for e in range(mod.E) if views["count"][e] > 0]
        from beamc.ir.reference import expert_weights

        line["wq_experts_checked"] = len(used)
        for e in used[:: max(1, len(used) // 16)]:
            want = expert_weights(_weights(shape), "nvfp4", e, torch.bfloat16)
            assert torch.equal(views["wq"][e], want[0]), e
            assert not down or torch.equal(views["wq_down"][e], want[1]), e
        assert line["relaid_bits_differing"] == 0, line


def test_dequant_cuda_graph_replay(tmp_path_factory):
    """The DEQUANT render captured once and replayed with new x and idx: the same bits as direct launches."""
    for down in (False, True):
        _replays_equal_direct_launches(_module("tp8", tmp_path_factory, DEQUANT=True, DEQUANT_DOWN=down),
                                       _relaid("tp8", tmp_path_factory), 4096, 17, ((18, "distinct"), (19, "few")),
                                       check_ref=False)
    SUMMARY["moe_nvfp4_prefill"].append(dict(dequant_cuda_graph_replay="bitwise equal to direct launches", M=4096,
                                             renders=["DEQUANT", "DEQUANT + DEQUANT_DOWN"]))


@pytest.mark.parametrize("M", [1000, 16384])
def test_f32_dequant_down_at_the_tiny_specs_shapes(M, tmp_path_factory):
    """The fp32 instances the runtime's fp32 checks run (the tiny spec's MoE: E 16, H 256, I 64, top-4), with
    DEQUANT and with DEQUANT_DOWN, on re-laid-out weights: each against the fp32 reference row by row (< 1e-5; the
    2026-12-01 s8run7 runtime prefill of 16 x 1,024 tokens through DEQUANT_DOWN differed from the interpreter by
    2.3e-4, where the Triton interpreter gives both renders the same values)."""
    E, H, I, k = 16, 256, 64, 4
    kdir = tmp_path_factory.mktemp("moe_prefill_f32")
    params = nvfp4_experts(E, H, I, torch.Generator().manual_seed(3), device="cuda")
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, H, generator=g).cuda()
    idx = _routing("distinct", M, E, k, g)
    ref = REFS["moe_experts"]([x, idx, *params], {"format": "nvfp4"})[0]
    line = dict(shape="tiny-f32", M=M)
    dims = dict(DTYPE="f32", E=E, H=H, I=I, TOP_K=k)
    relaid = load_kernel(KernelSpec("moe_nvfp4_decode", "moe_experts", dims), kdir).relayout(params)
    ys = {}
    for label, extra in (("dequant", {}), ("dequant-down", dict(DEQUANT_DOWN=True))):
        mod = load_kernel(KernelSpec(TEMPLATE, "moe_experts", dict(dims, DEQUANT=True, **extra)), kdir)
        y = torch.full((M, k, H), float("nan"), device="cuda")
        scratch = torch.full((mod.scratch_numel(M),), float("nan"), device="cuda")
        mod.launch(x, idx, *relaid, y, scratch)
        torch.cuda.synchronize()
        row = _worst_row(y, ref)
        line[f"{label}_worst_row_rel_err"] = row.max().item()
        line[f"{label}_rows_over_1e-5"] = int((row > 1e-5).sum())
        ys[label] = y
    line["renders_bitwise_equal"] = bool(torch.equal(ys["dequant"], ys["dequant-down"]))
    SUMMARY["moe_nvfp4_prefill"].append(line)
    print(f"moe_nvfp4_prefill tiny f32 M={M}: {line}")
    assert line["dequant_worst_row_rel_err"] < 1e-5 and line["dequant-down_worst_row_rel_err"] < 1e-5, line


# (smallest first: were a form to hang, the log shows how far the others got before the timeout)
@pytest.mark.parametrize("shape,M,kind,form", [
    ("tp8", 65, "distinct", "default"), ("odd-wg", 333, "few", "default"), ("tp8", 1, "distinct", "default"),
    ("odd-wg", 1000, "repeat", "default"), ("tp8", 1000, "few", "default"), ("tp8", 4096, "one", "default"),
    ("tp8", 16384, "distinct", "default"), ("tp8", 4096, "distinct", "bn128"), ("tp8", 4096, "distinct", "bn2-256"),
    ("tp8", 4096, "distinct", "bm256"), ("odd-wg", 1000, "distinct", "bm256"), ("tp8", 4096, "few", "load8"),
    ("odd-wg", 1000, "repeat", "store"), ("tp8", 16384, "distinct", "store"), ("odd-wg", 1000, "few", "hres"),
    ("tp8", 4096, "one", "hres"), ("tp8", 16384, "distinct", "hres-store"), ("odd-wg", 1000, "few", "wdepth8"),
    ("tp8", 4096, "distinct", "wdepth8"), ("odd-wg", 1000, "few", "acopy"), ("tp8", 4096, "distinct", "acopy"),
    ("odd-wg", 333, "repeat", "acopy-hres"), ("tp8", 16384, "distinct", "acopy-hres"),
    ("odd-wg", 1000, "few", "wsteps2"), ("tp8", 4096, "distinct", "wsteps2"), ("tp8", 4096, "few", "wsteps4"),
    ("tp8", 16384, "distinct", "wsteps2-acopy"), ("odd-wg", 1000, "distinct", "bm256-wsteps2"),
    ("tp8", 16384, "distinct", "bm256-wsteps2"), ("odd-wg", 1000, "few", "bm256-wsteps2-v16"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16"), ("tp8", 4096, "distinct", "acopy-hres-wsteps2-v16"),
    ("tp8", 4096, "distinct", "acopy-hres-wsteps2"), ("odd-wg", 1000, "repeat", "acopy-hres-wsteps2"),
    # WG_HALF: every expert's one block of <= 64 rows at 1,000 tokens (~31 rows an expert), tails of <= 64 and of
    # 65-128 rows at 4,096 / 16,384 (~64 / ~512 an expert), none with every pair on one expert
    ("tp8", 1000, "distinct", "bm256-wsteps2-v16-half"), ("odd-wg", 1000, "few", "bm256-wsteps2-v16-half"),
    ("tp8", 4096, "one", "bm256-wsteps2-v16-half"), ("tp8", 4096, "distinct", "bm256-wsteps2-v16-half"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half"), ("tp8", 2048, "distinct", "acopy-hres-wsteps2-v16-half"),
    ("odd-wg", 333, "repeat", "acopy-hres-wsteps2-v16-half"),
    ("odd-wg", 1000, "few", "bm256-wsteps2-v16-load8"), ("tp8", 16384, "distinct", "bm256-wsteps2-v16-load8"),
    ("odd-wg", 1000, "distinct", "bn128-wsteps2-v16-hres"), ("tp8", 16384, "distinct", "bn128-wsteps2-v16-hres"),
    ("odd-wg", 1000, "few", "bm256-wsteps2-v16-half-load8s3"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load8s3"),
    # ring slots of 4 K steps (bitwise equal to slots of 2); WG_AQ (bitwise equal to the form without WG_HALF)
    ("tp8", 4096, "one", "bm256-wsteps4-v16-half-load8s3"), ("odd-wg", 1000, "few", "bm256-wsteps4-v16-half-load8s3-aq"),
    ("tp8", 16384, "distinct", "bm256-wsteps4-v16-half-load8s3-aq"),
    ("tp8", 1000, "distinct", "bm256-wsteps2-v16-half-load8s3-aq"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load8s3-aq"),
    ("tp8", 2048, "distinct", "acopy-hres-wsteps2-v16-half-aq"), ("odd-wg", 333, "repeat", "acopy-hres-wsteps2-v16-half-aq"),
    # two load partitions on alternate runs (bitwise equal to the form without WG_HALF), with 32-bit A offsets
    ("odd-wg", 1000, "few", "bm256-wsteps2-v16-half-parts2"), ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-parts2"),
    ("odd-wg", 333, "repeat", "bm256-wsteps2-v16-half-parts2-a32"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-parts2-a32"),
    # stage 4's store partition in the 256-row form, one buffer, with WG_HALF (every block a tail at 1,000 tokens)
    ("tp8", 1000, "distinct", "bm256-wsteps2-v16-half-load8s3-store1"),
    ("odd-wg", 1000, "few", "bm256-wsteps2-v16-half-load8s3-store1"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load8s3-store1"),
    # the 256-row form's A rows by a partition of their own (and only as far as the MMAs read them)
    ("odd-wg", 1000, "few", "bm256-wsteps2-v16-half-load8s3-acopy"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load8s3-acopy"),
    ("tp8", 1000, "distinct", "bm256-wsteps2-v16-half-load4-acopy-aq"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load4-acopy-aq"),
    # stage 4's A rows by TMA (every block a tail at 1,000 tokens: padding rows read from h, never stored)
    ("tp8", 1000, "distinct", "bm256-wsteps2-v16-half-load8s3-atma"),
    ("odd-wg", 1000, "few", "bm256-wsteps2-v16-half-load8s3-atma"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load8s3-atma"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load8s3-atma-store1"),
    # stage 3's words and scale bytes by TMA boxes (bitwise equal to the form without WG_WTMA), with the A partition
    ("tp8", 1000, "distinct", "bm256-wsteps2-v16-half-load8s3-wtma"),
    ("odd-rk128", 1000, "few", "bm256-wsteps2-v16-half-load8s3-wtma"),
    ("tp8", 4096, "one", "bm256-wsteps2-v16-half-load8s3-wtma"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load8s3-wtma"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load8s3-wtma-acopy"),
    # the A-row copies after the fence (bitwise equal to the form without WG_HALF), with WG_WTMA
    ("tp8", 1000, "distinct", "bm256-wsteps2-v16-half-load8s3-alate"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load8s3-alate"),
    ("odd-rk128", 1000, "few", "bm256-wsteps2-v16-half-load8s3-wtma-alate"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load8s3-wtma-alate"),
    ("tp8", 2048, "distinct", "acopy-hres-wsteps2-v16-half-aq-wtma"),
    # both stages' TMA forms together, and WG_WTMA beside the A partition (4 load warps)
    ("tp8", 1000, "distinct", "bm256-wsteps2-v16-half-load8s3-wtma-atma"),
    ("odd-rk128", 1000, "few", "bm256-wsteps2-v16-half-load8s3-wtma-atma"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load8s3-wtma-atma"),
    ("tp8", 1000, "distinct", "bm256-wsteps2-v16-half-load8s3-wtma-atma-nofence4"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load8s3-wtma-atma-nofence4"),
    ("tp8", 1000, "distinct", "bm256-wsteps2-v16-half-load4-acopy-wtma"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load4-acopy-wtma"),
    # the A partition in stage 3 only, stage 4's A rows by TMA (and without stage 4's fence)
    ("tp8", 1000, "distinct", "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4"),
    ("odd-rk128", 1000, "few", "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-nofence4"),
    # stage 4's stores deferred into the next tile's K steps (bitwise against the form without WG_DSTORE)
    ("tp8", 1000, "distinct", "bm256-wsteps2-v16-half-load8s3-wtma-atma-dstore"),
    ("odd-rk128", 1000, "few", "bm256-wsteps2-v16-half-load8s3-wtma-atma-dstore"),
    ("odd-wg", 1000, "few", "bm256-wsteps2-v16-half-load4-acopy-atma4-dstore"),  # (odd-wg: RK0 64, no WG_WTMA)
    ("tp8", 1000, "distinct", "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-a64"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load8s3-wtma-atma-dstore"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore"),
    ("tp8", 2048, "distinct", "acopy-hres-wsteps2-v16-half-aq-dstore"),
    ("odd-wg", 1000, "few", "acopy-hres-wsteps2-v16-half-aq-dstore"),
    # the 128-row form's resident h rows by TMA (bitwise against the form with its A partition in stage 4)
    ("tp8", 2048, "distinct", "acopy-hres-wsteps2-v16-half-aq-atma4"),
    ("odd-wg", 1000, "few", "acopy-hres-wsteps2-v16-half-aq-atma4"),
    # SORT_ALONE (bitwise against the same form without it)
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-sort"),
    ("tp8", 1000, "repeat", "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-sort"),
    ("tp8", 2048, "distinct", "acopy-hres-wsteps2-v16-half-aq-sort"),
    ("odd-wg", 1000, "few", "acopy-hres-wsteps2-v16-half-aq-sort"),
    # WG_DPAIRS (bitwise against the same form without it)
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-dpairs"),
    ("tp8", 1000, "repeat", "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-dpairs"),
    # WG_WTMA4: stage 4's words by TMA boxes, its scale words by loads (bitwise against the same form without it)
    ("tp8", 1000, "distinct", "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-wtma4"),
    ("tp8", 1000, "repeat", "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-wtma4"),
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-wtma4"),
    ("odd-wg", 1000, "few", "bm256-wsteps2-v16-half-load4-acopy-atma4-dstore-wtma4"),
    # WG_YSTREAM: y's stores evict-first (bitwise against the same form without it)
    ("tp8", 16384, "distinct", "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-wtma4-ystream")])
def test_wgmma_render(shape, M, kind, form, tmp_path_factory):
    """WGMMA (stages 3 and 4 as the warp-specialised Gluon kernel, weights decoded by its load partition) on the
    re-laid-out experts: y poisoned first, the scratch's canaries intact, the sort's counts right; the fp32 reference
    to ||d|| / ||ref|| < 1e-2 (worst row < 3e-2), and the default render on the same inputs to < 5e-3 (the global
    scale on the fp32 sums instead of on the bf16 weights: ~1e-3 expected). At 1,000 tokens also the ModelOpt bytes
    (the Triton stages of the same module: BLOCK_M 128) against the fp32 reference."""
    mod = _module(shape, tmp_path_factory, WGMMA=True, **WG_FORMS[form])
    assert mod.WGMMA and not mod.DEQUANT and len(mod.LAUNCH_OPTIONS) == 3 + mod.SORT_ALONE
    params, relaid = _weights(shape), _relaid(shape, tmp_path_factory)
    g = torch.Generator().manual_seed(M + 3 * len(kind))
    x = torch.randn(M, mod.H, generator=g).bfloat16().cuda()
    idx = _routing(kind, M, mod.E, mod.TOP_K, g)
    kw, kb = {}, {}
    y = _run(mod, relaid, x, idx, kw)
    base_mod = _module(shape, tmp_path_factory)
    base = _run(base_mod, relaid, x, idx, kb)
    ref = REFS["moe_experts"]([x.float(), idx, *params], {"format": "nvfp4"})[0]
    # h of each pair against the default render's: a failure in stage 3 (gate_up + SwiGLU) told from one in stage 4
    h_err = _rel(_h_by_pair(mod, kw["scratch"], M), _h_by_pair(base_mod, kb["scratch"], M))
    line = dict(shape=shape, M=M, routing=kind, variant=f"wgmma-{form}", h_rel_err_default_render=h_err,
                rel_err_fp32_ref=_rel(y, ref),
                worst_row_rel_err=_worst_row(y, ref).max().item(), rel_err_default_render=_rel(y, base),
                default_render_rel_err_fp32_ref=_rel(base, ref), tiles=dict(BLOCK_M=mod.BLOCK_M, WG_BN=mod.WG_BN,
                                                                              WG_BN2=mod.WG_BN2, WG_NT2=mod.WG_NT2,
                                                                              WG_STAGES=mod.WG_STAGES,
                                                                              WG_LOAD_WARPS=mod.WG_LOAD_WARPS,
                                                                              WG_STORE=mod.WG_STORE,
                                                                              WG_HRES=mod.WG_HRES))
    if shape == "tp8" and M == 1000 and form == "default":
        line["modelopt_rel_err_fp32_ref"] = _rel(_run(mod, params, x, idx), ref)
    # the twins of this form that must give the same bits: (summary key, applies, the twin's constants)
    f = WG_FORMS[form]
    twins = (
        # the tail blocks' half MMAs give the rows the full block's MMAs give them
        ("bitwise_equal_without_half", mod.WG_HALF, {k: v for k, v in f.items() if k not in ("WG_HALF", "WG_AQ")}),
        # stage 4's MMAs without their fence read what they read with it
        ("bitwise_equal_with_fence", mod.WG_NOFENCE4, {k: v for k, v in f.items() if k != "WG_NOFENCE4"}),
        # stage 4's A rows by TMA give the MMAs the rows the threads' cp.async copies give
        ("bitwise_equal_without_atma", mod.WG_ATMA,
         {k: v for k, v in f.items() if k not in ("WG_ATMA", "WG_NOFENCE4", "WG_ACOPY4", "WG_WTMA4")}),
        # the tiles' stores deferred give y the bits the epilogue's stores give
        ("bitwise_equal_without_dstore", mod.WG_DSTORE, {k: v for k, v in f.items() if k != "WG_DSTORE"}),
        # the words' TMA boxes give the tiles the cp.async copies give
        ("bitwise_equal_without_wtma", mod.WG_WTMA, {k: v for k, v in f.items() if k != "WG_WTMA"}),
        # the words' copies in runs of 4 steps give the tiles runs of 2 give
        ("bitwise_equal_wsteps2", form.startswith("bm256-wsteps4"), dict(f, WG_WSTEPS=2, WG_WDEPTH=2)),
        # the sort in a binary of its own sorts as it does in the GEMMs' binary
        ("bitwise_equal_without_sort_alone", mod.SORT_ALONE, {k: v for k, v in f.items() if k != "SORT_ALONE"}),
        # the chunks' pair indices loaded a K step ahead store the same rows at the same places
        ("bitwise_equal_without_dpairs", mod.WG_DPAIRS, {k: v for k, v in f.items() if k != "WG_DPAIRS"}),
        # stage 4's words by TMA boxes and its scale words by loads give the tiles the cp.async copies give
        ("bitwise_equal_without_wtma4", mod.WG_WTMA4, {k: v for k, v in f.items() if k != "WG_WTMA4"}),
        # y's stores evict-first store the same values at the same places
        ("bitwise_equal_without_ystream", mod.WG_YSTREAM, {k: v for k, v in f.items() if k != "WG_YSTREAM"}))
    for key, applies, twin in twins:
        if applies:
            line[key] = bool(torch.equal(y, _run(_module(shape, tmp_path_factory, WGMMA=True, **twin), relaid, x, idx)))
    SUMMARY["moe_nvfp4_prefill"].append(line)
    print(f"moe_nvfp4_prefill {shape} M={M} {kind} wgmma-{form}: rel err {line['rel_err_fp32_ref']:.2e} (fp32 ref; "
          f"default render {line['default_render_rel_err_fp32_ref']:.2e}), {line['rel_err_default_render']:.2e} "
          f"from the default render, worst row {line['worst_row_rel_err']:.2e}")
    assert line["h_rel_err_default_render"] < 5e-3, line
    assert line["rel_err_fp32_ref"] < 1e-2 and line["worst_row_rel_err"] < 3e-2, line
    assert line["rel_err_default_render"] < 5e-3 and line.get("modelopt_rel_err_fp32_ref", 0) < 1e-2, line
    assert line.get("bitwise_equal_without_half", True) and line.get("bitwise_equal_wsteps2", True), line
    assert line.get("bitwise_equal_without_wtma", True) and line.get("bitwise_equal_with_fence", True), line
    assert line.get("bitwise_equal_without_atma", True) and line.get("bitwise_equal_without_dstore", True), line
    assert line.get("bitwise_equal_without_sort_alone", True), line
    assert line.get("bitwise_equal_without_dpairs", True), line
    assert line.get("bitwise_equal_without_wtma4", True), line
    assert line.get("bitwise_equal_without_ystream", True), line


def test_wgmma_cuda_graph_replay(tmp_path_factory):
    """The WGMMA render (as by default, with WG_STORE and WG_HRES, with WG_ACOPY, and the emitter's forms: 8 load warps
    in stage 3, WG_AQ) captured once and replayed with new x and idx: the same bits as direct launches (no atomics:
    each output written by one program)."""
    for extra in ({}, WG_FORMS["hres-store"], WG_FORMS["acopy-hres"], WG_FORMS["wsteps2-acopy"],
                  WG_FORMS["bm256-wsteps2"], WG_FORMS["bm256-wsteps2-v16-half"],
                  WG_FORMS["acopy-hres-wsteps2-v16-half"], WG_FORMS["bm256-wsteps2-v16-half-load8s3"],
                  WG_FORMS["acopy-hres-wsteps2-v16-half-aq"]):
        _replays_equal_direct_launches(_module("tp8", tmp_path_factory, WGMMA=True, **extra),
                                       _relaid("tp8", tmp_path_factory), 4096, 27,
                                       ((28, "distinct"), (29, "few"), (30, "one")), check_ref=False)
    SUMMARY["moe_nvfp4_prefill"].append(dict(wgmma_cuda_graph_replay="bitwise equal to direct launches", M=4096))


def test_the_emitters_forms_replay_bitwise(tmp_path_factory):
    """The emitter's WGMMA forms as they are now (emitters.MOE_WGMMA_FORMS: the 256-row form's TMA rows, A partition
    and deferred stores) captured once and replayed with new x and idx at 16,384 tokens: the same bits as direct
    launches."""
    from beamc.codegen.emitters import MOE_WGMMA_FORMS, moe_wgmma_form

    for name in MOE_WGMMA_FORMS:
        _replays_equal_direct_launches(_module("tp8", tmp_path_factory, **moe_wgmma_form(name)),
                                       _relaid("tp8", tmp_path_factory),
                                       16384, 31, ((32, "distinct"), (33, "few")), check_ref=False)
    SUMMARY["moe_nvfp4_prefill"].append(dict(emitter_forms_replay="bitwise equal to direct launches", M=16384,
                                             forms=sorted(MOE_WGMMA_FORMS)))


def _bad_ids(idx: torch.Tensor, E: int, g: torch.Generator) -> torch.Tensor:
    """idx with ~5% of its ids outside [0, E) (-1 or E): pairs with no expert."""
    bad = torch.rand(idx.shape, generator=g).cuda() < 0.05
    return torch.where(bad, torch.where(torch.rand(idx.shape, generator=g).cuda() < 0.5, -1, E), idx)


@pytest.mark.parametrize("shape,M,kind,form", [
    ("tp8", 16384, "distinct", "bm256"), ("tp8", 2048, "distinct", "bm128"), ("tp8", 1000, "repeat", "bm256"),
    ("tp8", 4096, "few", "bm128"), ("tp8", 65, "one", "bm256"), ("odd-wg", 1000, "bad", "bm128"),
    ("odd-wg", 4099, "bad", "bm128")])
def test_rank_sort_same_rows(shape, M, kind, form, tmp_path_factory):
    """RANK_SORT (stage 2's ranks from a sort of each chunk; the default since s41) against the emitter's form with
    RANK_SORT=False (the ranks from comparison tiles), the sort's stages
    alone (`launch_stages((0, 1, 2), ...)`: no GEMM): the scratch's sort (prefix, starts, counts, the block map, the
    sorted rows) bit for bit, and the y rows of bad ids (zeroed by stage 2) with the rest of y still poison; the
    rows against a stable torch argsort (`check_sort`). Also eager against a CUDA graph replay of the same launch."""
    from beamc.codegen.emitters import moe_wgmma_form
    from test_kernels_moe_prefill import check_sort

    base = _module(shape, tmp_path_factory, **moe_wgmma_form(form), RANK_SORT=False)
    mod = _module(shape, tmp_path_factory, **moe_wgmma_form(form))
    assert mod.RANK_SORT and not base.RANK_SORT
    relaid = _relaid(shape, tmp_path_factory)
    g = torch.Generator().manual_seed(M + 7 * len(kind))
    x = torch.randn(M, mod.H, generator=g).bfloat16().cuda()
    if kind == "bad":  # ids outside [0, E) among repeats: no row, their y rows zeros
        idx = _bad_ids(_routing("repeat", M, mod.E, mod.TOP_K, g), mod.E, g)
    else:
        idx = _routing(kind, M, mod.E, mod.TOP_K, g)
    outs = []
    for m, graph in ((base, False), (mod, False), (mod, True)):
        y = torch.full((M, mod.TOP_K, mod.H), float("nan"), dtype=torch.bfloat16, device="cuda")
        n = m.scratch_numel(M)
        scratch = torch.full((n + 64,), float("nan"), dtype=torch.bfloat16, device="cuda")
        run = lambda: m.launch_stages((0, 1, 2), x, idx, *relaid, y, scratch)  # noqa: E731
        if graph:  # (captured after a warm-up launch, then everything poisoned again before the replay)
            replay = captured_graph(run)
            scratch.fill_(float("nan"))
            y.fill_(float("nan"))
            replay.replay()
        else:
            run()
        torch.cuda.synchronize()
        assert torch.isnan(scratch[n:]).all(), "a write past scratch_numel(M)"
        views = {k: v.clone() for k, v in m.scratch_views(scratch, M).items() if k not in ("h", "wq")}
        outs.append((y.view(torch.int16).clone(), views))
    check_sort(mod, {k: v.cpu() for k, v in outs[1][1].items()}, idx.cpu())
    ok = (idx >= 0) & (idx < mod.E)
    for y16, views in outs[1:]:
        assert all(torch.equal(views[k], outs[0][1][k]) for k in views), [k for k in views
                                                                         if not torch.equal(views[k], outs[0][1][k])]
        assert torch.equal(y16, outs[0][0]), "the bad ids' y rows"
    y = outs[1][0].view(torch.bfloat16)
    assert (y[~ok] == 0).all() and torch.isnan(y[ok]).all(), "bad rows zeroed, the others untouched"
    SUMMARY["moe_nvfp4_prefill"].append(dict(rank_sort_same_rows=True, shape=shape, M=M, routing=kind, form=form,
                                             bad_pairs=int((~ok).sum())))


def _combine_form(shape: str, form: str) -> dict:
    """The emitter's WGMMA form `form` ("bm256" / "bm128", "-noytma": WG_YTMA off) for a shape, as `_moe_experts`
    renders it (WG_WTMA where the shapes take it)."""
    from beamc.codegen.emitters import moe_wgmma_form, wtma_shapes

    c = _constants(shape)
    f = moe_wgmma_form(form.split("-")[0])
    if not wtma_shapes(c["H"], c["I"]):
        f.pop("WG_WTMA", None)
    return dict(f, WG_YTMA=False) if form.endswith("-noytma") else f


@pytest.mark.parametrize("shape,M,kind,form", [
    ("tp8", 16384, "distinct", "bm256"), ("tp8", 16384, "distinct", "bm256-noytma"), ("tp8", 1000, "repeat", "bm256"),
    ("tp8", 4096, "one", "bm256"), ("tp8", 2048, "few", "bm128"), ("odd-wg", 1000, "bad", "bm256"),
    ("odd-wg", 4099, "bad", "bm128"), ("tp8", 333, "bad", "modelopt")])
def test_combine_gives_the_same_bits(shape, M, kind, form, tmp_path_factory):
    """COMBINE (the combine_experts pass's prefill route: y in the sort's order, WG_YTMA's box stores, stage 6's
    combine through inv) against the same form without it followed by `moe_combine`: out bit for bit, and each pair's
    y row (at inv[pair]) bit for bit; ids outside [0, E) (inv -1, no row); outputs poisoned first; a CUDA graph
    replay with everything poisoned again gives the same bits. "modelopt": the default render on the ModelOpt bytes
    (Triton stages 3 and 4, y rows by pointer)."""
    f = {} if form == "modelopt" else _combine_form(shape, form)
    base = _module(shape, tmp_path_factory, **f)
    mod = _module(shape, tmp_path_factory, **f, COMBINE=True, ROUTED_SCALE=2.5)
    assert mod.COMBINE and mod.STAGES[-1] == 6 and mod.WG_YTMA == (form in ("bm256",))
    comb = load_kernel(KernelSpec("moe_combine", "boundary", dict(DTYPE="bf16", H=mod.H, TOP_K=mod.TOP_K,
                                                                  ROUTED_SCALE=2.5)),
                       tmp_path_factory.mktemp("moe_combine_kernels"))
    params = _weights(shape) if form == "modelopt" else _relaid(shape, tmp_path_factory)
    g = torch.Generator().manual_seed(M + 11 * len(kind))
    x = torch.randn(M, mod.H, generator=g).bfloat16().cuda()
    idx = _routing("repeat" if kind == "bad" else kind, M, mod.E, mod.TOP_K, g)
    if kind == "bad":
        idx = _bad_ids(idx, mod.E, g)
    w = torch.rand(M, mod.TOP_K, generator=g).cuda()
    y0 = torch.full((M, mod.TOP_K, mod.H), float("nan"), dtype=torch.bfloat16, device="cuda")
    base.launch(x, idx, *params, y0)
    out0 = torch.full((M, mod.H), float("nan"), dtype=torch.bfloat16, device="cuda")
    comb.launch(y0, w, idx, out0)
    y = torch.empty_like(y0)
    out = torch.empty_like(out0)
    n = mod.scratch_numel(M)
    scratch = torch.empty(n + 64, dtype=torch.bfloat16, device="cuda")
    run = lambda: mod.launch(x, idx, *params, y, w, out, scratch)  # noqa: E731
    results = []
    for graph in (False, True):
        replay = captured_graph(run) if graph else None
        for t in (y, out, scratch):
            t.fill_(float("nan"))
        replay.replay() if graph else run()
        torch.cuda.synchronize()
        assert torch.isnan(scratch[n:]).all(), "a write past scratch_numel(M)"
        inv = mod.scratch_views(scratch, M)["inv"].long()
        ok = ((idx >= 0) & (idx < mod.E)).flatten()
        assert torch.equal(inv[~ok], torch.full_like(inv[~ok], -1)), "inv of the bad ids"
        assert torch.equal(torch.sort(inv[ok]).values, torch.arange(int(ok.sum()), device="cuda")), "inv: a bijection"
        rows = torch.equal(y.view(-1, mod.H)[inv[ok]].view(torch.int16), y0.view(-1, mod.H)[ok].view(torch.int16))
        results.append(dict(out=torch.equal(out.view(torch.int16), out0.view(torch.int16)), y_rows=rows))
    line = dict(shape=shape, M=M, routing=kind, variant=f"combine-{form}", bad_pairs=int((~ok).sum()),
                eager=results[0], graph=results[1], out_finite=bool(torch.isfinite(out0).all()))
    SUMMARY["moe_nvfp4_prefill"].append(line)
    print(f"moe_nvfp4_prefill {shape} M={M} {kind} combine-{form}: {results}")
    assert line["out_finite"] and all(r["out"] and r["y_rows"] for r in results), line
