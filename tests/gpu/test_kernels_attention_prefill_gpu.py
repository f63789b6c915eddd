"""The ragged prefill attention template `attention_prefill` on CUDA, bf16, at the full spec's TP-8 shapes (6 query
heads, 1 KV head of 128; sliding layers: ring of window - 1 + max chunk positions, window 512; full layers: paged,
page 16, shuffled block table), against the fp32 reference (`attention_ref` with q in fp32, on the same cache).

- ||out - ref|| / ||ref|| < 1e-2 (flash-attention numerics: P rounded to bf16 for P @ V), outputs poisoned with
  NaN first, every cache row the reference does not read NaN (the kernel reads nothing else);
- ragged batches: prior context 0, 511, 4096 and chunks of 1, 16, 257, 300, 700 tokens (tiles straddle sequences),
  a shuffled token order, one sequence at 100,000 tokens of prior context; bf16 and fp8 e4m3 KV (the reference fed
  the same fp8 cache and scales);
- a CUDA graph captured once replays on new inputs (other prior contexts, q, caches copied into the captured
  buffers) to the eager launch's bits;
- the compiled kernel (sm_90a, as aot_compile builds it) spills no registers.
One line per case is printed; with BEAMC_GPU_OUT set, a JSON summary goes to $BEAMC_GPU_OUT/attention_prefill.json.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from beamc.codegen.kernel import KernelSpec, aot_compile, load_kernel
from beamc.spec import load_spec
from conftest import write_gpu_summary
from test_kernels_attention_prefill import make_case, reference, spec_constants

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
SUMMARY: dict = {"cases": [], "graph": [], "compile": []}
_MODULES: dict = {}

RAGGED = [(0, 0, 700), (1, 511, 300), (2, 4096, 1), (3, 4096, 257), (4, 5, 16)]
CASES = {
    # name: (sequences (slot, prior, chunk), shuffled token order)
    "ragged": (RAGGED, False),
    "ragged-shuffled": (RAGGED, True),
    "long-100k": ([(0, 100_000, 300)], False),
    "long-100k+decode": ([(1, 100_000, 1), (0, 100_003, 64), (2, 0, 33)], False),
}


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield from write_gpu_summary(SUMMARY, "attention_prefill.json")


@pytest.fixture(scope="module")
def kdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("attention_prefill_gpu")


def _constants(kind: str, cache: str) -> dict:
    return spec_constants(load_spec(ROOT / "models/beam.yaml"), 8, kind, cache, page=16)


def _module(c: dict, directory: Path):
    spec = KernelSpec("attention_prefill", "attention", c)
    if spec.name not in _MODULES:
        _MODULES[spec.name] = load_kernel(spec, directory)
    return _MODULES[spec.name]


def _norm_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _gate_inputs(q: torch.Tensor, seed: int, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The output gate's inputs beside q [T, HQ, D]: g [T, HQ, D] bf16 (pad > 0: rows `pad` heads longer than their
    HQ heads, strided as the packed projection leaves them) and b [HQ, 1] bf16, drawn from a generator seeded `seed`."""
    T, hq, d = q.shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    g = torch.randn(T, (hq + pad) * d, device="cuda", generator=gen).to(torch.bfloat16)[:, :hq * d].view(T, hq, d)
    return g, torch.randn(hq, 1, device="cuda", generator=gen).to(torch.bfloat16)


def _run_plain(m, ins: list, graph: bool = False) -> torch.Tensor:
    """One launch of a render without scratch, its output poisoned with NaN first, eager or (graph) captured and
    replayed once; synchronised."""
    out = torch.full_like(ins[0], float("nan"))
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            m.launch(*ins, out)
        g.replay()
    else:
        m.launch(*ins, out)
    torch.cuda.synchronize()
    return out


def _run_poisoned(m, ins: list) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of a mirrored render with its output and scratch (the mirrors, the plan) poisoned with NaN first:
    (out, scratch), synchronised."""
    out = torch.full_like(ins[0], float("nan"))
    scratch = torch.full((m.scratch_numel(ins[0].shape[0]),), float("nan"), dtype=torch.bfloat16, device="cuda")
    m.launch(*ins, out, scratch)
    torch.cuda.synchronize()
    return out, scratch


def _twin_modules(c: dict, gate: bool, flag: str, kdir: Path) -> tuple:
    """The render of constants c (op attention_gate when gate) and its twin with render option `flag` on:
    (without, with), the option checked on in the twin only."""
    op = "attention_gate" if gate else "attention"
    base = load_kernel(KernelSpec("attention_prefill", op, c), kdir)
    twin = load_kernel(KernelSpec("attention_prefill", op, dict(c, **{flag: True})), kdir)
    assert getattr(twin, flag) and not getattr(base, flag)
    return base, twin


def _case_inputs(c: dict, case: str, seed: int, gate: bool, gseed: int, pad: int) -> list:
    """A CASES case's inputs (6 slots, bf16 q), with the output gate's g (rows `pad` heads longer: strided, as the
    packed projection leaves them) and b when gate."""
    seqs, shuffle = CASES[case]
    ins = make_case(c, seqs, seed=seed, device="cuda", q_dtype=torch.bfloat16, shuffle=shuffle, n_slots=6)
    return [*ins, *_gate_inputs(ins[0], gseed, pad=pad)] if gate else ins


def _replay_poisoned(m, ins: list, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """The launch (after `_run_poisoned`: compiled, the scratch as it left it) captured in a CUDA graph into out,
    poisoned with NaN first, and replayed once: out, synchronised."""
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m.launch(*ins, out, scratch)
    graph.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("cache", ["bf16", "f8e4m3"])
@pytest.mark.parametrize("kind", ["sliding", "full"])
@pytest.mark.parametrize("case", list(CASES))
def test_bf16_matches_fp32_reference(case, kind, cache, kdir):
    c = _constants(kind, cache)
    mod = _module(c, kdir)
    seqs, shuffle = CASES[case]
    ins = make_case(c, seqs, seed=7, device="cuda", q_dtype=torch.bfloat16, shuffle=shuffle)
    out = torch.full_like(ins[0], float("nan"))
    mod.launch(*ins, out)
    torch.cuda.synchronize()
    want = reference(c, ins, torch.float32)  # q in fp32: the fp32 reference of the bf16 inputs
    assert not want.isnan().any()
    nan = int(out.isnan().sum())
    err = _norm_rel(out, want) if nan == 0 else float("inf")
    print(f"attention_prefill {kind} {cache} {case}: T={len(out)} rel err {err:.3e}")
    SUMMARY["cases"].append(dict(case=case, kind=kind, cache=cache, T=len(out), rel_err=err, nan=nan))
    assert nan == 0, f"{nan} unwritten (NaN) output elements"
    assert err < 1e-2, err


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("kind", ["sliding", "full"])
@pytest.mark.parametrize("case", ["ragged-shuffled", "long-100k+decode"])
def test_f16_dot_matches_fp32_reference(case, kind, gate, kdir):
    """F16_DOT (fp8 caches: q, K, V and p as fp16 MMA operands) against the fp32 reference (< 1e-2; gated: against
    the default render's gated output, the gate being the same epilogue), beside the default render's error."""
    c = dict(_constants(kind, "f8e4m3"), GATE=gate)
    op = "attention_gate" if gate else "attention"
    mod = load_kernel(KernelSpec("attention_prefill", op, c), kdir)
    f16 = load_kernel(KernelSpec("attention_prefill", op, dict(c, F16_DOT=True)), kdir)
    assert f16.F16_DOT and not mod.F16_DOT
    seqs, shuffle = CASES[case]
    ins = make_case(c, seqs, seed=8, device="cuda", q_dtype=torch.bfloat16, shuffle=shuffle)
    if gate:
        ins = [*ins, *_gate_inputs(ins[0], 3)]
    outs = [_run_plain(m, ins) for m in (mod, f16)]
    for m, out in zip((mod, f16), outs):
        assert not out.isnan().any(), (case, kind, gate, m.F16_DOT)
    if gate:
        errs = [_norm_rel(outs[1], outs[0])]
    else:
        want = reference(c, ins, torch.float32)
        errs = [_norm_rel(o, want) for o in outs]
    print(f"attention_prefill {kind} fp8 {case} gate={gate}: rel err {', '.join(f'{e:.3e}' for e in errs)}")
    SUMMARY.setdefault("f16_dot", []).append(dict(case=case, kind=kind, gate=gate, rel_err=errs))
    assert errs[-1] < 1e-2, errs


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("case", ["ragged-shuffled", "long-100k+decode", "ragged"])
def test_sliding_step_tile_matches_reference(case, gate, kdir):
    """The sliding layers' prefill tile the emitter picks on sm90 (F16_DOT with ATTENTION_SLIDING_PREFILL_TILES: 4
    warps, EX2_FTZ, Q16_OUT) against the fp32 reference (< 1e-2; gated: against the 8-warp render's gated output), eager and
    under graph replay the same bits; whether it equals the 8-warp render bit for bit is recorded."""
    from beamc.codegen.emitters import ATTENTION_SLIDING_PREFILL_TILES

    c = dict(_constants("sliding", "f8e4m3"), GATE=gate, F16_DOT=True)
    op = "attention_gate" if gate else "attention"
    base = load_kernel(KernelSpec("attention_prefill", op, c), kdir)
    step = load_kernel(KernelSpec("attention_prefill", op, dict(c, **ATTENTION_SLIDING_PREFILL_TILES)), kdir)
    seqs, shuffle = CASES[case]
    ins = make_case(c, seqs, seed=19, device="cuda", q_dtype=torch.bfloat16, shuffle=shuffle, n_slots=6)
    if gate:
        ins = [*ins, *_gate_inputs(ins[0], 5)]
    outs = [_run_plain(m, ins) for m in (base, step)]
    graphed = _run_plain(step, ins, graph=True)
    assert not outs[1].isnan().any() and torch.equal(graphed, outs[1]), case
    err = _norm_rel(outs[1], outs[0] if gate else reference(c, ins, torch.float32))
    line = dict(case=case, gate=gate, tiles=ATTENTION_SLIDING_PREFILL_TILES, rel_err=err,
                bitwise_8_warps=bool(torch.equal(outs[1], outs[0])))
    SUMMARY.setdefault("sliding_step_tile", []).append(line)
    print(f"attention_prefill sliding step tile {case}: {line}")
    assert err < 1e-2, line


@pytest.mark.parametrize("kind,case,gate,warps", [
    ("sliding", "ragged-shuffled", True, 4), ("sliding", "long-100k+decode", False, 4), ("sliding", "ragged", False, 8),
    ("full", "ragged-shuffled", False, 4)])
def test_q16_out_gives_the_same_bits(kind, case, gate, warps, kdir):
    """Q16_OUT (F16_DOT: q's fp16 tile through the program's output rows): the same bits as the render without it,
    eager and under graph replay, every output written."""
    c = dict(_constants(kind, "f8e4m3"), GATE=gate, F16_DOT=True, NUM_WARPS=warps, EX2_FTZ=True)
    base, q16 = _twin_modules(c, gate, "Q16_OUT", kdir)
    ins = _case_inputs(c, case, 23, gate, 7, 1)
    outs = [_run_plain(m, ins) for m in (base, q16)]
    graphed = _run_plain(q16, ins, graph=True)
    line = dict(kind=kind, case=case, gate=gate, warps=warps, bitwise=bool(torch.equal(outs[1], outs[0])),
                bitwise_graph=bool(torch.equal(graphed, outs[0])), nan=int(outs[1].isnan().sum()))
    SUMMARY.setdefault("q16_out", []).append(line)
    print(f"attention_prefill Q16_OUT {case}: {line}")
    assert line["nan"] == 0 and line["bitwise"] and line["bitwise_graph"], line


@pytest.mark.parametrize("kind,cache,extra", [
    pytest.param("sliding", "bf16", {}, id="sliding"), pytest.param("full", "bf16", {}, id="full"),
    # the mirrored full layer's Gluon pass (WGMMA), the mirrors in a scratch the graph keeps
    pytest.param("full", "f8e4m3", dict(MIRROR=True, WGMMA=True), id="full-wgmma")])
def test_cuda_graph_replays_new_inputs(kind, cache, extra, kdir):
    """Capture one launch; copy other inputs (the same chunk lengths at other prior contexts) into the captured
    buffers; the replay equals an eager launch bit for bit and the reference within 1e-2."""
    c = dict(_constants(kind, cache), **extra)
    mod = _module(c, kdir)
    first = [(0, 0, 300), (1, 511, 17), (2, 4096, 1)]
    second = [(0, 3797, 300), (1, 0, 17), (2, 527, 1)]  # the same longest sequence: the same cache shapes
    ins = make_case(c, first, seed=1, device="cuda", q_dtype=torch.bfloat16)
    out = torch.full_like(ins[0], float("nan"))
    scratch = torch.full((mod.scratch_numel(len(out)),), float("nan"), dtype=torch.bfloat16, device="cuda")
    mod.launch(*ins, out, scratch)  # warm-up: compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            mod.launch(*ins, out, scratch)
    torch.cuda.synchronize()

    fresh = make_case(c, second, seed=2, device="cuda", q_dtype=torch.bfloat16)
    assert all(a.shape == b.shape for a, b in zip(ins, fresh))
    for a, b in zip(ins, fresh):
        a.copy_(b)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = torch.full_like(out, float("nan"))
    mod.launch(*ins, eager, scratch)
    torch.cuda.synchronize()
    err = _norm_rel(out, reference(c, ins, torch.float32))
    SUMMARY["graph"].append(dict(kind=kind + ("-wgmma" if extra else ""), equal_eager=bool(torch.equal(out, eager)),
                                 rel_err=err))
    assert not out.isnan().any() and torch.equal(out, eager)
    assert err < 1e-2, err


@pytest.mark.parametrize("cache", ["bf16", "f8e4m3"])
@pytest.mark.parametrize("kind", ["sliding", "full"])
def test_compiled_kernel_does_not_spill(kind, cache, kdir):
    """The kernel as aot_compile builds it for sm_90a (the launcher's OPTIONS), loaded: registers, no spills, except
    the full layer over an fp8 cache, whose tiles (BLOCK_M 64, BLOCK_N 128, 4 warps, 2 stages) were chosen by time
    on the H200 (2026-12-01: 23.4 ms vs 32.8 for the spill-free 128 / 64 / 8 warps at 8 x 2048 tokens over 100K)
    and spill 6 registers there: a few, bounded here."""
    c = _constants(kind, cache)
    mod = _module(c, kdir)
    ck = aot_compile(mod, 90)
    ck._init_handles()
    SUMMARY["compile"].append(dict(kind=kind, cache=cache, n_regs=ck.n_regs, n_spills=ck.n_spills,
                                   shared=ck.metadata.shared, BLOCK_M=mod.BLOCK_M, BLOCK_N=mod.BLOCK_N,
                                   num_warps=mod.NUM_WARPS))
    print(f"attention_prefill {kind} {cache}: {ck.n_regs} registers, {ck.n_spills} spills, "
          f"{ck.metadata.shared} B shared")
    assert ck.n_spills <= (8 if (kind, cache) == ("full", "f8e4m3") else 0), ck.n_spills


@pytest.mark.parametrize("kind,cache", [("full", "f8e4m3"), ("sliding", "bf16")])
def test_gated_kernel_equals_attention_then_sigmoid_gate(kind, cache, kdir):
    """attention_gate's prefill kernel (GATE) equals the attention prefill kernel then the sigmoid_gate kernel bit
    for bit (bf16, TP-8 shapes, a ragged batch, strided gate rows, outputs poisoned)."""
    c = _constants(kind, cache)
    mod = _module(c, kdir)
    gated = _module(dict(c, GATE=True), kdir)
    gate_mod = load_kernel(KernelSpec("sigmoid_gate", "sigmoid_gate", dict(DTYPE="bf16", HEADS=c["HQ"],
                                                                          HEAD_DIM=c["HEAD_DIM"], PDL=True)), kdir)
    ins = make_case(c, [(0, 0, 300), (1, 511, 17), (2, 4096, 1)], seed=3, device="cuda", q_dtype=torch.bfloat16)
    T, hq, d = ins[0].shape
    g, b = _gate_inputs(ins[0], 13, pad=2)
    o = torch.full_like(ins[0], float("nan"))
    unfused = torch.full_like(o, float("nan"))
    fused = torch.full_like(o, float("nan"))
    mod.launch(*ins, o)
    gate_mod.launch(o, g.contiguous(), b, unfused)
    gated.launch(*ins, g, b, fused)
    torch.cuda.synchronize()
    assert not fused.isnan().any() and torch.equal(fused, unfused), (kind, cache)
    SUMMARY.setdefault("gate", []).append(dict(kind=kind, cache=cache, tokens=T, bitwise=True))


# the mirror pages that hold the first slot of long-100k+decode only: 6,250 pages of 16 (full), 10 of 64 (sliding:
# positions 99,456 .. 100,066)
SHORT_PAGES = {"full": 6300, "sliding": 10}


@pytest.mark.parametrize("kind,case,short,tiles", [
    ("full", "ragged", False, {}),  # room for every slot: all read from the mirror
    ("full", "long-100k+decode", True, {}),  # room for one 100K context only: the other slots read from the pool
    ("full", "ragged-shuffled", False, dict(BLOCK_M=128, BLOCK_N=128, NUM_WARPS=8, NUM_STAGES=2)),  # bf16's tiles
    ("full", "ragged", False, dict(TMA=True)),  # the mirrored pass's unmasked blocks by TMA copies
    ("full", "long-100k+decode", True, dict(TMA=True)),
    # the sliding layers' ring: each slot's window starts on, across the ring's wrap
    ("sliding", "ragged", False, {}),
    ("sliding", "long-100k+decode", True, {}),
    ("sliding", "ragged-shuffled", False, dict(TMA=True)),
])
def test_mirror_render_gives_the_same_bits(kind, case, short, tiles, kdir):
    """MIRROR (the layer's fp8 K/V converted once per launch into a bf16 mirror, then read without page lookups,
    ring wraps or conversions; slots without room read from the cache): the same bits as the render without it at
    the same tiles, and the fp32 reference to < 1e-2; outputs and the mirrors poisoned first."""
    pages = SHORT_PAGES[kind] if short else None
    c = dict(_constants(kind, "f8e4m3"), **tiles)
    mirror = _module(dict(c, MIRROR=True, **({"MIRROR_PAGES": pages} if pages else {})), kdir)
    # the plain render at the mirror render's tiles (MIRROR has tiles of its own by default; BLOCK_N sets the order
    # of the softmax's sums, so only equal tiles give equal bits)
    plain = _module(dict(c, BLOCK_M=mirror.BLOCK_M, BLOCK_N=mirror.BLOCK_N, NUM_WARPS=mirror.NUM_WARPS,
                         NUM_STAGES=mirror.NUM_STAGES), kdir)
    seqs, shuffle = CASES[case]
    ins = make_case(c, seqs, seed=7, device="cuda", q_dtype=torch.bfloat16, shuffle=shuffle, n_slots=6)
    T = ins[0].shape[0]
    want = torch.full_like(ins[0], float("nan"))
    plain.launch(*ins, want)
    got, scratch = _run_poisoned(mirror, ins)
    run = scratch[2 * mirror.MIRROR_NUMEL:].view(torch.int32)[:6]
    err = _norm_rel(got, reference(c, ins, torch.float32))
    line = dict(kind=kind, case=case, mirror_pages=mirror.MIRROR_PAGES, tiles=tiles, tokens=T,
                mirrored_slots=int((run >= 0).sum()), bitwise=bool(torch.equal(got, want)), rel_err=err)
    SUMMARY.setdefault("mirror", []).append(line)
    print(f"attention_prefill MIRROR {case}: {line}")
    assert line["bitwise"] and err < 1e-2, line
    assert line["mirrored_slots"] == (1 if pages else len(seqs)), line


@pytest.mark.parametrize("kind,case,short,gate,tiles", [
    ("full", "ragged", False, False, {}),  # room for every slot: all rows by the Gluon pass
    ("full", "ragged-shuffled", False, True, {}),  # tiles straddling sequences, the output gate in the epilogue
    ("full", "long-100k", False, False, {}),
    ("full", "long-100k+decode", True, False, {}),  # room for one 100K context only: the other slots from the pool
    ("full", "long-100k+decode", False, True, {}),
    ("full", "ragged-shuffled", False, True, dict(WG_SPLIT=True)),  # the two warpgroups as two partitions
    ("full", "long-100k+decode", True, False, dict(WG_SPLIT=True)),
    ("full", "ragged", False, False, dict(WG_STAGES=2)),
    # the sliding layers (window 512, the ring's mirror): the window mask on the first blocks of every trip
    ("sliding", "ragged", False, False, dict(WG_SPLIT=True)),
    ("sliding", "ragged-shuffled", False, True, dict(WG_SPLIT=True)),
    ("sliding", "long-100k", False, False, {}),
    ("sliding", "long-100k+decode", True, False, dict(WG_SPLIT=True)),
])
def test_wgmma_render_matches_reference(kind, case, short, gate, tiles, kdir):
    """WGMMA (MIRROR's stage 2 as a warp-specialised Gluon kernel: K/V by TMA into a ring, S of the next block issued
    before P @ V of this one): the fp32 reference to < 1e-2 (gated: the MIRROR render's gated output, the gate being
    the same epilogue, to < 1e-2), no output left unwritten; outputs and the mirrors poisoned with NaN first (rows of
    a block past the slot's last position must be zeroed, not read). How far from the Triton MIRROR render it is
    (bitwise or not) is recorded."""
    pages = SHORT_PAGES[kind] if short else None
    c = dict(_constants(kind, "f8e4m3"), GATE=gate, MIRROR=True, **({"MIRROR_PAGES": pages} if pages else {}))
    op = "attention_gate" if gate else "attention"
    tri = load_kernel(KernelSpec("attention_prefill", op, c), kdir)
    wg = load_kernel(KernelSpec("attention_prefill", op, dict(c, WGMMA=True, **tiles)), kdir)
    assert wg.WGMMA and not tri.WGMMA
    seqs, shuffle = CASES[case]
    ins = make_case(c, seqs, seed=11, device="cuda", q_dtype=torch.bfloat16, shuffle=shuffle, n_slots=6)
    T, hq, d = ins[0].shape
    if gate:
        ins = [*ins, *_gate_inputs(ins[0], 5, pad=2)]
    outs = [_run_poisoned(m, ins)[0] for m in (tri, wg)]
    nan = int(outs[1].isnan().sum())
    vs_triton = _norm_rel(outs[1], outs[0]) if nan == 0 else float("inf")
    err = vs_triton if gate else (_norm_rel(outs[1], reference(c, ins, torch.float32)) if nan == 0 else float("inf"))
    line = dict(kind=kind, case=case, mirror_pages=wg.MIRROR_PAGES, gate=gate, tiles=tiles, tokens=T, nan=nan, rel_err=err,
                rel_err_vs_triton_mirror=vs_triton, bitwise_vs_triton_mirror=bool(torch.equal(outs[1], outs[0])))
    SUMMARY.setdefault("wgmma", []).append(line)
    print(f"attention_prefill WGMMA {case}: {line}")
    assert nan == 0 and err < 1e-2, line


@pytest.mark.parametrize("kind,case,short,gate", [
    ("full", "ragged-shuffled", False, True),  # tiles straddling sequences, the output gate
    ("full", "long-100k+decode", True, False),  # the other slots' rows from the pool
    ("full", "long-100k", False, False),
    ("sliding", "ragged-shuffled", False, False)])
def test_pingpong_gives_the_same_bits(kind, case, short, gate, kdir):
    """WG_PINGPONG (the two MMA partitions issue each key block's MMAs in turn): the same bits as WG_SPLIT without
    it (the same MMAs and softmax in each partition), eager and under graph replay, nothing left unwritten."""
    pages = SHORT_PAGES[kind] if short else None
    c = dict(_constants(kind, "f8e4m3"), GATE=gate, MIRROR=True, WGMMA=True, WG_SPLIT=True, TILE_ORDER=True,
             **({"MIRROR_PAGES": pages} if pages else {}))
    split, pp = _twin_modules(c, gate, "WG_PINGPONG", kdir)
    ins = _case_inputs(c, case, 17, gate, 7, 2)
    want = _run_poisoned(split, ins)[0]
    out, scratch = _run_poisoned(pp, ins)
    got = out.clone()
    out = _replay_poisoned(pp, ins, out, scratch)  # ... and under graph replay
    line = dict(kind=kind, case=case, gate=gate, tokens=ins[0].shape[0], nan=int(got.isnan().sum()),
                bitwise=bool(torch.equal(got, want)), bitwise_graph=bool(torch.equal(out, want)))
    SUMMARY.setdefault("pingpong", []).append(line)
    print(f"attention_prefill WG_PINGPONG {case}: {line}")
    assert line["nan"] == 0 and line["bitwise"] and line["bitwise_graph"], line


@pytest.mark.parametrize("kind,case,short,tiles", [
    ("full", "ragged-shuffled", False, dict(WGMMA=True, WG_SPLIT=True)),  # tiles straddling sequences
    ("full", "long-100k+decode", True, dict(WGMMA=True, WG_SPLIT=True)),  # the other slots' rows from the pool
    ("full", "ragged", False, {}),  # the Triton MIRROR pass
    ("sliding", "long-100k+decode", False, dict(WGMMA=True, WG_SPLIT=True))])
def test_tile_order_gives_the_same_bits(kind, case, short, tiles, kdir):
    """TILE_ORDER (the plan ranks the token tiles by their work and the passes take them in that order): the same
    bits as the same render without it, eager and under graph replay; the order a permutation of the tiles."""
    pages = SHORT_PAGES[kind] if short else None
    c = dict(_constants(kind, "f8e4m3"), MIRROR=True, **({"MIRROR_PAGES": pages} if pages else {}), **tiles)
    base = load_kernel(KernelSpec("attention_prefill", "attention", c), kdir)
    ordered = load_kernel(KernelSpec("attention_prefill", "attention", dict(c, TILE_ORDER=True)), kdir)
    assert ordered.TILE_ORDER and not base.TILE_ORDER
    seqs, shuffle = CASES[case]
    ins = make_case(c, seqs, seed=13, device="cuda", q_dtype=torch.bfloat16, shuffle=shuffle, n_slots=6)
    T = ins[0].shape[0]
    outs = [_run_poisoned(base, ins)[0]]
    out, scratch = _run_poisoned(ordered, ins)
    outs.append(out.clone())
    n = -(-T // ordered.BLOCK_T)
    order = scratch[2 * ordered.MIRROR_NUMEL:].view(torch.int32)[3 * ordered.MIRROR_SLOTS:][:n]
    assert sorted(order.tolist()) == list(range(n))
    outs.append(_replay_poisoned(ordered, ins, out, scratch))  # ... and under graph replay
    line = dict(kind=kind, case=case, tiles=tiles, tokens=T, bitwise=bool(torch.equal(outs[1], outs[0])),
                bitwise_graph=bool(torch.equal(outs[2], outs[0])), nan=int(outs[0].isnan().sum()))
    SUMMARY.setdefault("tile_order", []).append(line)
    print(f"attention_prefill TILE_ORDER {case}: {line}")
    assert line["nan"] == 0 and line["bitwise"] and line["bitwise_graph"], line


@pytest.mark.parametrize("kind,cache,tiles", [("full", "f8e4m3", dict(MIRROR=True)), ("full", "bf16", {}),
                                              ("sliding", "bf16", {}), ("sliding", "f8e4m3", {})])
def test_ex2_ftz_matches_reference(kind, cache, tiles, kdir):
    """EX2_FTZ (the softmax's exp2 as one ex2.approx.ftz): the fp32 reference to < 1e-2, no output left unwritten;
    whether it gives the same bits as the render without it (only p below 2^-126 can differ) is recorded."""
    c = dict(_constants(kind, cache), **tiles)
    plain = _module(c, kdir)
    ftz = _module(dict(c, EX2_FTZ=True), kdir)
    assert ftz.EX2_FTZ and not plain.EX2_FTZ
    ins = make_case(c, [(0, 0, 700), (1, 511, 300), (2, 100_000, 64), (3, 4096, 1)], seed=21, device="cuda",
                    q_dtype=torch.bfloat16, shuffle=True, n_slots=4)
    outs = [_run_plain(m, ins) for m in (plain, ftz)]
    nan = int(outs[1].isnan().sum())
    err = _norm_rel(outs[1], reference(c, ins, torch.float32)) if nan == 0 else float("inf")
    line = dict(kind=kind, cache=cache, tiles=tiles, nan=nan, rel_err=err, bitwise=bool(torch.equal(*outs)))
    SUMMARY.setdefault("ex2_ftz", []).append(line)
    print(f"attention_prefill EX2_FTZ {kind} {cache}: {line}")
    assert nan == 0 and err < 1e-2, line
