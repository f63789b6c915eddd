"""Generated `qk_norm_pos_kv` and `moe_router` kernels on CUDA against the torch references on CUDA.

qk_norm_pos_kv (bf16): q_out and the written cache rows compared bit for bit with the reference ops run on CUDA on
identical inputs (full spec TP-8 / TP-1 shapes and an odd spec; T in {1, 5, 300}; several slots, positions across
the ring's wrap; bf16 and fp8 caches; ring and paged). The norm's sum of squares is the one step summed in another
order than torch's, which can move a bf16 rounding: mismatches are counted (next to the baseline count between
torch's CPU and CUDA references on the same inputs) and must stay rare (<= 1e-4 of the elements) and within
2 bf16 ulps of the row's scale.
V rows (no arithmetic) must be identical, and no other cache row may change.

moe_router: fp32 logits within 1e-6 (relative to the largest) of the exact (fp64) product, and of cuBLAS's; the
same expert ids as the reference selection except near-ties; weights within fp32 rounding (rel 1e-6) of the
reference selection applied to the kernel's own logits (in practice: the same bits). The small-M and large-M paths
agree to 1e-6.

Kernels run as rendered for bf16, with Programmatic Dependent Launch (PDL: griddepcontrol in the kernel, launch_pdl
at the launch; the router's stage 1 waits for stage 0); a few cases run the PDL=False render, and a chain of
dependent qk_norm_pos_kv and moe_router launches must give the same bits with PDL as launched serially (on a stream
and in a CUDA graph).

One short line per case is printed; with BEAMC_GPU_OUT set, a JSON summary goes to $BEAMC_GPU_OUT/attn_router.json.
"""
from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from beamc.codegen.kernel import KernelSpec, load_kernel
from beamc.ir.reference import REFS, moe_select_ref
from beamc.spec import load_spec
from conftest import captured_graph, loaded_local_bytes, write_gpu_summary
from test_kernels_attn_router import (ODD_ROUTER, ODD_WINDOW, odd_qk_constants, qk_constants, qk_reference,
                                      router_constants, router_ties)

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
SUMMARY: dict = {"qk_norm_pos_kv": [], "moe_router": []}
_MODULES: dict = {}


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield from write_gpu_summary(SUMMARY, "attn_router.json")


@pytest.fixture(scope="module")
def kdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def _module(template: str, constants: dict, directory: Path):
    spec = KernelSpec(template, template, constants)
    if spec.name not in _MODULES:
        _MODULES[spec.name] = load_kernel(spec, directory)
    return _MODULES[spec.name]


def _time_us(fn, reps: int = 20) -> float | None:
    """GPU time of one call: `reps` calls captured in a CUDA graph, replayed (no Python launch cost counted)."""
    try:
        graph = captured_graph(fn, reps)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000 / reps
    except Exception as e:  # noqa: BLE001 - a timing, not a check
        print(f"(no timing: {e!r})")
        return None


def _ordered(bits: torch.Tensor, width: int) -> torch.Tensor:
    """Float bit patterns as integers whose differences count ulps (sign-magnitude -> two's complement)."""
    b = bits.to(torch.int64) & ((1 << width) - 1)
    sign, mag = b >> (width - 1), b & ((1 << (width - 1)) - 1)
    return torch.where(sign == 1, -mag, mag)


def _bits(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    return (x.view(torch.int16), 16) if x.element_size() == 2 else (x.view(torch.uint8), 8)


def _at(cache: torch.Tensor, rows) -> torch.Tensor:
    """cache[rows] (indexed through an integer view: fp8 tensors have no CUDA index kernel everywhere)."""
    return _bits(cache)[0][rows].view(cache.dtype)


def _compare(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """Bitwise: mismatching elements, the largest ulp distance, and the largest |diff| over its row's max |ref|."""
    gb, w = _bits(got)
    rb, _ = _bits(ref)
    bad = gb != rb
    n = int(bad.sum())
    out = dict(mismatch=n, of=got.numel(), max_ulp=int((_ordered(gb, w) - _ordered(rb, w)).abs().max()) if n else 0)
    g, r = got.float().reshape(got.shape[0], -1), ref.float().reshape(ref.shape[0], -1)
    out["max_row_rel"] = float(((g - r).abs().amax(-1) / r.abs().amax(-1).clamp_min(1e-30)).max()) if n else 0.0
    return out


# ---------------------------------------------------------------- qk_norm_pos_kv
QK_SHAPES = {"tp8": (8, 512), "tp1": (1, 512), "odd": (None, ODD_WINDOW)}
QK_CASES = [(shape, mode, cache, layout, T, True, {}) for shape in QK_SHAPES for mode in ("rope", "ssmax")
            for cache in ("bf16", "f8e4m3") for layout in ("ring", "paged") for T in (1, 5, 300)]
QK_CASES += [("tp8", "rope", "bf16", "ring", 300, False, {}),  # no PDL
             ("odd", "ssmax", "f8e4m3", "paged", 5, False, {})]
# render variants (bench/qk_norm_prefill.py times them): TOKENS tokens a program (T = 5 with 3: the last program's
# third token masked), NUM_WARPS
QK_CASES += [("tp8", "rope", "f8e4m3", "ring", 300, True, {"TOKENS": 4}),
             ("tp8", "ssmax", "f8e4m3", "paged", 300, True, {"TOKENS": 4}),
             ("tp8", "rope", "bf16", "paged", 5, True, {"TOKENS": 3}),
             ("tp8", "rope", "f8e4m3", "ring", 300, True, {"NUM_WARPS": 8})]
# the prefill steps' render on sm90 (emitters.QK_NORM_PREFILL_TILES: 2 tokens), and with k's tile as q's (KV_BLOCK)
QK_CASES += [("tp8", mode, "f8e4m3", layout, T, True, {"TOKENS": 2}) for mode, layout in (("rope", "ring"),
             ("ssmax", "paged")) for T in (5, 300)]
QK_CASES += [("tp8", "rope", "f8e4m3", "ring", 300, True, {"TOKENS": 2, "KV_BLOCK": 8})]


def _positions(T: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk in slot 0 that crosses the ring's wrap (3 cap), then decode tokens in slots 1.. at scattered
    positions (small and large)."""
    n_dec = min(T - 1, 10)
    chunk = T - n_dec
    start = 3 * cap - chunk // 2 - 1
    pos = list(range(start, start + chunk)) + [(s * 977) % (20 * cap) + (s % 3) * cap for s in range(1, n_dec + 1)]
    slot = [0] * chunk + list(range(1, n_dec + 1))
    return torch.tensor(slot, device="cuda"), torch.tensor(pos, device="cuda")


@pytest.mark.parametrize("shape,mode,cache,layout,T,pdl,tiles", QK_CASES)
def test_qk_norm_pos_kv_bitwise(shape, mode, cache, layout, T, pdl, tiles, kdir, summary):
    tp, window = QK_SHAPES[shape]
    page = (16 if shape != "odd" else 3) if layout == "paged" else None
    c = (qk_constants(load_spec(ROOT / "models/beam.yaml"), tp, mode, "bf16", cache, page) if tp
         else odd_qk_constants(mode, "bf16", cache, page))
    if not pdl:
        c["PDL"] = False  # (the bf16 default is on)
    c.update(tiles)
    mod = _module("qk_norm_pos_kv", c, kdir)
    assert mod.OPTIONS["launch_pdl"] is pdl
    hq, hkv, d = c["HQ"], c["HKV"], c["HEAD_DIM"]
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{shape}{mode}{cache}{layout}{T}".encode()))
    bf = torch.bfloat16
    q = torch.randn(T, hq, d, device="cuda", generator=g).to(bf) * 2
    k = torch.randn(T, hkv, d, device="cuda", generator=g).to(bf)
    # v as a strided view of a wider buffer, like a packed QKV projection's output
    v = torch.randn(T, hkv * d + 64, device="cuda", generator=g).to(bf)[:, :hkv * d].view(T, hkv, d)
    w0 = 0.0 if c["NORM_OFFSET"] else 1.0
    wq = (w0 + 0.1 * torch.randn(d, device="cuda", generator=g)).to(bf)
    wk = (w0 + 0.1 * torch.randn(d, device="cuda", generator=g)).to(bf)
    cap = window - 1 + T
    slot, pos = _positions(T, cap)
    S = int(slot.max()) + 1
    cdt = torch.float8_e4m3fn if cache == "f8e4m3" else bf
    if layout == "paged":
        max_pages = -(-(int(pos.max()) + 1) // page)
        P = S * max_pages + 7
        block_table = torch.randperm(P, device="cuda", generator=g)[:S * max_pages].view(S, max_pages).to(torch.int32)
        rows = (block_table[slot, pos // page].long(), pos % page)
        kc = torch.empty(P, page, hkv, d, dtype=torch.uint8, device="cuda")
    else:
        block_table = None
        rows = (slot, pos % cap)
        kc = torch.empty(S, cap, hkv, d, dtype=torch.uint8, device="cuda")
    kc = kc.random_(generator=g).view(cdt) if cache == "f8e4m3" else kc.new_empty(kc.shape, dtype=bf).fill_(float("nan"))
    vc = kc.clone()
    kc0, vc0 = kc.clone(), vc.clone()
    scales = [torch.tensor(0.01, device="cuda"), torch.tensor(0.01, device="cuda")] if cache == "f8e4m3" else []
    q_out = torch.full_like(q, float("nan"))
    args = [q, k, v, wq, wk, kc, vc, slot, pos] + ([block_table] if block_table is not None else []) + scales + [q_out]
    mod.launch(*args)
    torch.cuda.synchronize()

    q_ref, k_ref, v_ref = qk_reference(c, q, k, v, wq, wk, pos, cdt, *scales)
    cpu = qk_reference(c, *(t.cpu() for t in (q, k, v, wq, wk, pos)), cdt, *(s.cpu() for s in scales))
    rq, rk, rv = _compare(q_out, q_ref), _compare(_at(kc, rows), k_ref), _compare(_at(vc, rows), v_ref)
    base_q, base_k = _compare(cpu[0].cuda(), q_ref), _compare(cpu[1].cuda(), k_ref)
    written = torch.zeros(kc.shape[:2], dtype=torch.bool, device="cuda")
    written[rows] = True
    untouched = all(torch.equal(_bits(a)[0][~written], _bits(b)[0][~written]) for a, b in ((kc, kc0), (vc, vc0)))
    us = _time_us(lambda: mod.launch(*args)) if T in (1, 300) else None
    rec = dict(case=f"{shape}-{mode}-{cache}-{layout}-T{T}{'' if pdl else '-no-pdl'}"
               + "".join(f"-{k}{v}" for k, v in tiles.items()), q=rq, k=rk, v_mismatch=rv["mismatch"],
               untouched=untouched, cpu_vs_cuda_ref_q=base_q["mismatch"], cpu_vs_cuda_ref_k=base_k["mismatch"], us=us)
    summary["qk_norm_pos_kv"].append(rec)
    print(f"qk {rec['case']}: q {rq['mismatch']}/{rq['of']} (max {rq['max_ulp']} ulp), k {rk['mismatch']}/{rk['of']}, "
          f"v {rv['mismatch']}; torch cpu-vs-cuda q {base_q['mismatch']} k {base_k['mismatch']}"
          + (f"; {us:.1f} us" if us else ""))

    assert rv["mismatch"] == 0 and untouched
    for r in (rq, rk):
        assert r["mismatch"] <= max(3, 1e-4 * r["of"]) and r["max_row_rel"] <= 2 ** -6, rec


# ---------------------------------------------------------------- moe_router
ROUTER_CASES = [(spec, T, True) for spec in ("full", "tiny", "odd") for T in (1, 64, 4096)]
ROUTER_CASES += [("full", 1, False), ("full", 4096, False)]  # without PDL: the small-M and large-M paths


def _router_constants(spec_name: str, path: str, pdl: bool = True) -> dict:
    """bf16 router constants; pdl=False renders without PDL (the bf16 default is on)."""
    if spec_name == "odd":
        c = dict(ODD_ROUTER, DTYPE="bf16", PATH=path)
    else:
        c = router_constants(load_spec(ROOT / f"models/{'beam' if spec_name == 'full' else 'beam-tiny'}.yaml"), path)
    return c if pdl else dict(c, PDL=False)


def _router_inputs(c: dict, T: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, c["H"], device="cuda", generator=g).to(torch.bfloat16)
    W = torch.randn(c["E"], c["H"], device="cuda", generator=g) * 0.02
    bias = torch.randn(c["E"], device="cuda", generator=g) * 0.05
    return x, W, bias


def _run_router(mod, x, W, bias):
    T = x.shape[0]
    weights = torch.full((T, mod.TOP_K), float("nan"), device="cuda")
    ids = torch.full((T, mod.TOP_K), -1, dtype=torch.int64, device="cuda")
    n = mod.scratch_numel(T)
    scratch = torch.full((n + 1024,), float("nan"), device="cuda")  # canaries past the end
    mod.launch(x, W, bias, weights, ids, scratch)
    torch.cuda.synchronize()
    assert torch.isnan(scratch[n:]).all(), "a write past scratch_numel(T)"
    return weights, ids, mod.logits(scratch, T).clone(), scratch[:n]


@pytest.mark.parametrize("spec_name,T,pdl", ROUTER_CASES)
def test_moe_router(spec_name, T, pdl, kdir, summary):
    _router_case(spec_name, T, pdl, kdir, summary)


@pytest.mark.parametrize("path", ["small", "large"])
def test_moe_router_reserves_no_local_memory(path, kdir, summary):
    """Each launch of the router its own binary (STAGE pinned): none needs local memory, and launching them takes
    none of the GPU's free memory (the driver reserves a launched binary's local memory for every thread slot of the
    GPU). With a runtime stage, the selection's binary compiled ahead of time held stage 0's GEMM at one warp, 25 KB
    of stack a thread; the JIT's binary for stage = 1 did not (it specialises an argument equal to 1)."""
    mod = _module("moe_router", _router_constants("full", path), kdir / f"local-{path}")
    T = 70 if path == "small" else 4096
    x, W, bias = _router_inputs(mod.CONSTEXPRS, T, seed=5)
    weights = torch.empty((T, mod.TOP_K), device="cuda")
    ids = torch.empty((T, mod.TOP_K), dtype=torch.int64, device="cuda")
    scratch = torch.empty(mod.scratch_numel(T), device="cuda")
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    mod.launch(x, W, bias, weights, ids, scratch)
    torch.cuda.synchronize()
    drop = free0 - torch.cuda.mem_get_info()[0]
    local = loaded_local_bytes(mod.kernel)
    summary[f"router_local[{path}]"] = dict(free_drop_mb=drop / 2**20, local_bytes=local)
    print(f"router {path}: free memory -{drop / 2**20:.0f} MB at the first launch, local bytes a thread {local}")
    assert len(local) == len(mod.LAUNCH_OPTIONS) and max(local) == 0, local
    assert drop < 64 * 2**20, drop  # (the binaries' code and the launch's own state: a few MB)


@pytest.mark.parametrize("spec_name,T", [("full", 70), ("full", 4096), ("full", 16384), ("odd", 70), ("odd", 1000),
                                         ("tiny", 300)])
def test_moe_router_bf16x3(spec_name, T, kdir, summary):
    """BF16X3 (the large path's W split by a first launch into three exact bf16 parts, three bf16 MMAs a step): the
    checks of every router case (logits within 1e-6 of the exact product, the reference's selection away from
    near-ties), and its graph replay equal to its eager launch bit for bit, outputs poisoned first."""
    mod = _router_case(spec_name, T, True, kdir, summary, dict(BF16X3=True))
    assert mod.BF16X3 and not mod.TF32X2
    x, W, bias = _router_inputs(mod.CONSTEXPRS, T, seed=T + 13)
    _, _, same_graph, _, _, _ = _renders_agree(mod, mod, x, W, bias)
    assert same_graph


@pytest.mark.parametrize("spec_name,T", [("full", 70), ("full", 512), ("full", 2048), ("full", 4096), ("full", 16384),
                                         ("odd", 1000), ("tiny", 300)])
def test_moe_router_split_k(spec_name, T, kdir, summary):
    """SPLIT_K (the default: the large path's K split over programs below a wave of tiles; the selection sums each
    token's partials): the checks of every router case, its graph replay equal to its eager launch bit for bit, and
    its ids equal to the unsplit render's away from near-ties; both timed."""
    mod = _router_case(spec_name, T, True, kdir, summary, dict(SPLIT_K=True))
    base = _module("moe_router", dict(_router_constants(spec_name, "large"), SPLIT_K=False), kdir)
    assert mod.SPLIT_K and not base.SPLIT_K and mod.constexprs(T)["SPLITS"] == mod.k_splits(T)
    x, W, bias = _router_inputs(mod.CONSTEXPRS, T, seed=T + 17)
    _, _, same_graph, t0, t1, rows_differ = _renders_agree(base, mod, x, W, bias)
    rec = dict(case=f"split-k-{spec_name}-T{T}", splits=mod.k_splits(T), graph_bitwise=same_graph, us_unsplit=t0,
               us_split_k=t1, rows_differ=rows_differ)
    summary["moe_router"].append(rec)
    print(f"router split-k {spec_name} T{T} ({rec['splits']} splits): graph {same_graph}, rows differing "
          f"{rows_differ}, {t0 and round(t0, 2)} -> {t1 and round(t1, 2)} us")
    assert same_graph and rows_differ <= max(2, 0.01 * T), rec


def _router_case(spec_name, T, pdl, kdir, summary, extra: dict | None = None):
    """One router render (the default's constants, updated by extra) on fresh inputs, checked against the exact
    product and the reference selection; recorded in the summary; returns the module."""
    torch.backends.cuda.matmul.allow_tf32 = False
    path = "small" if T <= 64 else "large"
    c = dict(_router_constants(spec_name, path, pdl), **(extra or {}))
    mod = _module("moe_router", c, kdir)
    assert mod.OPTIONS["launch_pdl"] is pdl
    x, W, bias = _router_inputs(c, T, seed=T + len(spec_name))
    weights, ids, logits, scratch = _run_router(mod, x, W, bias)
    attrs = dict(n_group=c["N_GROUP"], topk_group=c["TOPK_GROUP"], top_k=c["TOP_K"], renormalize=c["RENORMALIZE"],
                 eps=c["EPS"])

    exact = x.double() @ W.double().T
    cublas = F.linear(x.float(), W.float())  # the reference's GEMM
    rel = lambda a, b: float((a.double() - b.double()).abs().max() / b.double().abs().max())  # noqa: E731
    # the selection, against the reference selection of the kernel's own logits: exact but for near-ties
    w_own, id_own = moe_select_ref(logits, bias, attrs)
    ok_own = ~router_ties(logits, bias, c, 1e-6)
    w_rel_own = float(((weights - w_own).abs() / w_own)[ok_own].max()) if ok_own.any() else 0.0
    # against the whole reference (cuBLAS logits): ties counted with the logits' difference as well
    w_ref, id_ref = REFS["moe_router"]([x, W, bias], attrs)
    dchoice = float((logits.sigmoid() - cublas.sigmoid()).abs().max())
    ok_ref = ~router_ties(cublas, bias, c, max(1e-6, 4 * dchoice))
    w_rel_ref = float(((weights - w_ref).abs() / w_ref)[ok_ref].max()) if ok_ref.any() else 0.0
    scratch_t = torch.empty_like(scratch)
    us = _time_us(lambda: mod.launch(x, W, bias, weights, ids, scratch_t))
    tag = "".join(f"-{k}={v}" for k, v in (extra or {}).items())
    rec = dict(case=f"{spec_name}-T{T}-{path}{'' if pdl else '-no-pdl'}{tag}", logits_rel_exact=rel(logits, exact), cublas_rel_exact=rel(cublas, exact),
               logits_rel_cublas=rel(logits, cublas), ties_own=int((~ok_own).sum()), ties_ref=int((~ok_ref).sum()),
               ids_mismatch_own=int((ids != id_own)[ok_own].any(-1).sum()),
               ids_mismatch_ref=int((ids != id_ref)[ok_ref].any(-1).sum()),
               weights_rel_own=w_rel_own, weights_bitwise_own=bool(torch.equal(weights[ok_own], w_own[ok_own])),
               weights_rel_ref=w_rel_ref, us=us)
    summary["moe_router"].append(rec)
    print(f"router {rec['case']}: logits rel {rec['logits_rel_exact']:.1e} (cuBLAS {rec['cublas_rel_exact']:.1e}), "
          f"ids diff {rec['ids_mismatch_own']}/{rec['ids_mismatch_ref']} (ties {rec['ties_own']}/{rec['ties_ref']}), "
          f"w rel {w_rel_own:.1e}/{w_rel_ref:.1e}; {us:.1f} us")

    assert rec["logits_rel_exact"] < 1e-6 and rec["logits_rel_cublas"] < 2e-6, rec
    assert rec["ids_mismatch_own"] == 0 and rec["ids_mismatch_ref"] == 0 and rec["ties_ref"] <= max(2, 0.05 * T), rec
    assert w_rel_own <= 1e-6 and w_rel_ref <= 1e-6 + 4 * rec["logits_rel_cublas"] * float(cublas.abs().max()), rec
    return mod


def _renders_agree(base, other, x, W, bias):
    """Two renders of the router on the same inputs: (logits equal, ids and weights equal bit for bit, the other's
    graph replay (outputs poisoned first) equal to its eager launch, us of base, us of other, rows that differ)."""
    w0, i0, l0, _ = _run_router(base, x, W, bias)
    w1, i1, l1, _ = _run_router(other, x, W, bias)
    same = torch.equal(i0, i1) and torch.equal(w0.view(torch.int32), w1.view(torch.int32))
    wg, ig = torch.full_like(w1, float("nan")), torch.full_like(i1, -1)
    scratch = torch.full((other.scratch_numel(x.shape[0]),), float("nan"), device="cuda")
    graph = captured_graph(lambda: other.launch(x, W, bias, wg, ig, scratch), 1)
    wg.fill_(float("nan"))
    ig.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    same_graph = torch.equal(ig, i1) and torch.equal(wg.view(torch.int32), w1.view(torch.int32))
    t0 = _time_us(lambda: base.launch(x, W, bias, w0, i0, scratch))
    t1 = _time_us(lambda: other.launch(x, W, bias, wg, ig, scratch))
    return torch.equal(l0, l1), same, same_graph, t0, t1, int((i0 != i1).any(-1).sum())


@pytest.mark.parametrize("spec_name,T,ties", [(s, T, ties) for s in ("full", "odd") for T in (1, 5, 64, 70, 4096)
                                               for ties in (False, True)] + [("tiny", 1, False), ("full", 16384, False)])
def test_moe_router_select_sort_bitwise(spec_name, T, ties, kdir, summary):
    """SELECT_SORT (the groups and the experts by bitonic top-k over packed keys, the weights from the chosen logits
    again) against the iterative render on the same inputs: the same ids and weights, bit for bit (exact ties too:
    experts and groups copied), eagerly and replayed from a CUDA graph; the outputs poisoned before each run."""
    path = "small" if T <= 64 else "large"
    plain = dict(_router_constants(spec_name, path), SELECT_SORT=False)  # the iterative render
    sort = _module("moe_router", dict(plain, SELECT_SORT=True), kdir)  # (the default)
    base = _module("moe_router", plain, kdir)
    assert sort.SELECT_SORT and not base.SELECT_SORT
    x, W, bias = _router_inputs(plain, T, seed=T + 7 * ties)
    if ties:
        gsz = plain["E"] // plain["N_GROUP"]
        W[1:3], bias[1:3] = W[0].clone(), bias[0].clone()
        W[gsz:2 * gsz], bias[gsz:2 * gsz] = W[:gsz].clone(), bias[:gsz].clone()
    same_logits, same, same_graph, t0, t1, rows_differ = _renders_agree(base, sort, x, W, bias)
    assert same_logits, "the logits differ: the render changed stage 0"
    rec = dict(case=f"select-sort-{spec_name}-T{T}{'-ties' if ties else ''}", bitwise=same, graph_bitwise=same_graph,
               us_iterative=t0, us_sort=t1, rows_differ=rows_differ)
    summary["moe_router"].append(rec)
    print(f"router select-sort {spec_name} T{T}{' ties' if ties else ''}: bitwise {same} (graph {same_graph}), "
          f"{t0 and round(t0, 2)} -> {t1 and round(t1, 2)} us")
    assert same and same_graph, rec


@pytest.mark.parametrize("spec_name,T,block_m", [(s, T, m) for s, T in (("full", 70), ("full", 16384), ("odd", 1000))
                                                   for m in (2, 4)] + [("full", 4096, 2)])
def test_moe_router_block_m_bitwise(spec_name, T, block_m, kdir, summary):
    """BLOCK_M tokens a selection program (the large path) against one: the same ids and weights bit for bit, eagerly
    and from a CUDA graph, with exact ties in one case (T = 4096: experts and groups copied)."""
    c = _router_constants(spec_name, "large")
    base = _module("moe_router", c, kdir)
    other = _module("moe_router", dict(c, BLOCK_M=block_m), kdir)
    assert base.BLOCK_M == 1 and other.BLOCK_M == block_m
    x, W, bias = _router_inputs(c, T, seed=T + block_m)
    if T == 4096:
        gsz = c["E"] // c["N_GROUP"]
        W[1:3], bias[1:3] = W[0].clone(), bias[0].clone()
        W[gsz:2 * gsz], bias[gsz:2 * gsz] = W[:gsz].clone(), bias[:gsz].clone()
    same_logits, same, same_graph, t0, t1, rows_differ = _renders_agree(base, other, x, W, bias)
    rec = dict(case=f"block-m{block_m}-{spec_name}-T{T}", bitwise=same, graph_bitwise=same_graph, us_m1=t0, us=t1,
               rows_differ=rows_differ)
    summary["moe_router"].append(rec)
    print(f"router BLOCK_M {block_m} {spec_name} T{T}: bitwise {same} (graph {same_graph}), "
          f"{t0 and round(t0, 2)} -> {t1 and round(t1, 2)} us")
    assert same_logits and same and same_graph, rec


@pytest.mark.parametrize("spec_name,T", [("full", 70), ("full", 4096), ("full", 16384), ("odd", 70), ("odd", 1000)])
def test_moe_router_w_split(spec_name, T, kdir, summary):
    """W_SPLIT (the large path's TF32X2 with W's TF32 head and rest split once per launch into the scratch, by a first
    launch) against the per-tile split on the same inputs: the same logits, ids and weights bit for bit (the same
    operand values in the same MMAs), eagerly and replayed from a CUDA graph, outputs poisoned first; both timed."""
    # (TF32X2: the default before BF16X3; W_SPLIT keeps K whole)
    plain = dict(_router_constants(spec_name, "large"), BF16X3=False, SPLIT_K=False)
    base = _module("moe_router", plain, kdir)
    split = _module("moe_router", dict(plain, W_SPLIT=True), kdir)
    assert split.W_SPLIT and not base.W_SPLIT and base.TF32X2
    x, W, bias = _router_inputs(plain, T, seed=T + 11)
    same_logits, same, same_graph, t0, t1, rows_differ = _renders_agree(base, split, x, W, bias)
    rec = dict(case=f"w-split-{spec_name}-T{T}", logits_bitwise=same_logits, bitwise=same, graph_bitwise=same_graph,
               us_per_tile=t0, us_w_split=t1, rows_differ=rows_differ)
    summary["moe_router"].append(rec)
    print(f"router w-split {spec_name} T{T}: logits bitwise {same_logits}, ids/weights {same} (graph {same_graph}), "
          f"{t0 and round(t0, 2)} -> {t1 and round(t1, 2)} us")
    assert same_logits and same and same_graph, rec


@pytest.mark.parametrize("spec_name,T", [("full", 5), ("full", 64), ("odd", 37)])
def test_moe_router_paths_agree(spec_name, T, kdir, summary):
    """The small-M (GEMV, tree sums) and large-M (FMA chains) paths: logits within 1e-6, the same choice."""
    small, large = (_module("moe_router", _router_constants(spec_name, p), kdir) for p in ("small", "large"))
    x, W, bias = _router_inputs(small.CONSTEXPRS, T, seed=99)
    (ws, is_, ls, _), (wl, il, ll, _) = _run_router(small, x, W, bias), _run_router(large, x, W, bias)
    rel = float((ls - ll).abs().max() / ll.abs().max())
    ok = ~router_ties(ll, bias, small.CONSTEXPRS, 1e-6)
    same_ids = bool(torch.equal(is_[ok], il[ok]))
    w_rel = float(((ws - wl).abs() / wl)[ok].max())
    summary["moe_router"].append(dict(case=f"paths-agree-{spec_name}-T{T}", logits_rel=rel, same_ids=same_ids,
                                      weights_rel=w_rel, ties=int((~ok).sum())))
    print(f"router paths {spec_name} T{T}: logits rel {rel:.1e}, same ids {same_ids}, w rel {w_rel:.1e}")
    assert rel < 1e-6 and same_ids and w_rel < 4e-6


@pytest.mark.parametrize("spec_name,path,num_warps", [(s, p, w) for s in ("tiny", "odd") for p in ("small", "large")
                                                      for w in (1, 2, 4, 8)])
def test_moe_router_any_num_warps(spec_name, path, num_warps, kdir, summary):
    """The selection is right at every num_warps (Triton once miscompiled a reduced tile's layout at 1-2 warps)."""
    mod = _module("moe_router", _router_constants(spec_name, path), kdir)
    saved = dict(mod.OPTIONS), dict(mod.OPTIONS_SELECT)
    mod.OPTIONS["num_warps"] = mod.OPTIONS_SELECT["num_warps"] = num_warps  # both launches (the selection's own)
    try:
        x, W, bias = _router_inputs(mod.CONSTEXPRS, 37, seed=num_warps)
        weights, ids, logits, _ = _run_router(mod, x, W, bias)
    finally:
        for d, old in zip((mod.OPTIONS, mod.OPTIONS_SELECT), saved):
            d.clear()
            d.update(old)
    attrs = dict(n_group=mod.N_GROUP, topk_group=mod.TOPK_GROUP, top_k=mod.TOP_K, renormalize=mod.RENORMALIZE,
                 eps=mod.EPS)
    w_own, id_own = moe_select_ref(logits, bias, attrs)
    ok = ~router_ties(logits, bias, mod.CONSTEXPRS, 1e-6)
    wrong = int((ids != id_own)[ok].any(-1).sum())
    w_rel = float(((weights - w_own).abs() / w_own)[ok].max())
    summary["moe_router"].append(dict(case=f"num-warps-{spec_name}-{path}-{num_warps}", rows_wrong=wrong, w_rel=w_rel))
    print(f"router {spec_name} {path} num_warps={num_warps}: rows wrong {wrong}, w rel {w_rel:.1e}")
    assert wrong == 0 and w_rel <= 1e-6


# ---------------------------------------------------------------- PDL: a dependent chain, with and without
def qk_router_chain(pdl: bool | None, path: str, T: int, directory, steps: int = 6, device: str = "cuda",
                    dt: str = "bf16", seed: int = 5):
    """Dependent launches at the odd shapes (6 query / 3 key-value heads of 64, RoPE, ring cache; a router over the
    384 values of a token's q_out). Per step i, after q_out[0] is reset from the input (a torch copy):
        qk_norm_pos_kv(q = qo[i%2], k = qo[i%2][:, :3], v = qo[i%2][:, 3:6]) -> qo[(i+1)%2], the K/V cache rows
        moe_router(x = qo[(i+1)%2] as [T, 384]) -> weights[i], ids[i], through one scratch for all steps
    RAW on q_out and the scratch (stage 1 reads stage 0's partials / logits), WAR and WAW on q_out, the scratch and
    the cache rows (the same rows every step). pdl: the PDL render constant (None: the default). Returns (run: the
    whole sequence, {name: output buffer})."""
    qc = odd_qk_constants("rope", dt, dt)
    hq, hkv, d = qc["HQ"], qc["HKV"], qc["HEAD_DIM"]
    rc = dict(ODD_ROUTER, H=hq * d, DTYPE=dt, PATH=path)
    if pdl is not None:
        qc["PDL"] = rc["PDL"] = pdl
    qk, router = _module("qk_norm_pos_kv", qc, directory), _module("moe_router", rc, directory)
    assert qk.OPTIONS["launch_pdl"] == router.OPTIONS["launch_pdl"] == (dt != "f32" if pdl is None else pdl)
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[dt]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, dtype=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    def nan(*shape, dtype=dtype):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    C = 8  # ring rows per slot; one slot per token, so no two tokens write one row
    q0 = rnd(T, hq, d, scale=2.0)
    wq, wk = rnd(d, scale=0.1), rnd(d, scale=0.1)  # weight form 1 + w
    slot = torch.arange(T, device=device)
    pos = (torch.arange(T) * 5 + 3).to(device)
    W, bias = rnd(rc["E"], rc["H"], scale=0.05, dtype=torch.float32), rnd(rc["E"], scale=0.02, dtype=torch.float32)
    qo, kc, vc = [nan(T, hq, d), nan(T, hq, d)], nan(T, C, hkv, d), nan(T, C, hkv, d)
    weights = [nan(T, rc["TOP_K"], dtype=torch.float32) for _ in range(steps)]
    ids = [torch.full((T, rc["TOP_K"]), -1, dtype=torch.int64, device=device) for _ in range(steps)]
    scratch = nan(router.scratch_numel(T), dtype=torch.float32)

    def run():
        qo[0].copy_(q0)
        for i in range(steps):
            src, dst = qo[i % 2], qo[(i + 1) % 2]
            qk.launch(src, src[:, :hkv], src[:, hkv:2 * hkv], wq, wk, kc, vc, slot, pos, dst)
            router.launch(dst.view(T, hq * d), W, bias, weights[i], ids[i], scratch)

    outs = {"qo0": qo[0], "qo1": qo[1], "kc": kc, "vc": vc, "scratch": scratch}
    outs.update({f"weights{i}": w for i, w in enumerate(weights)})
    outs.update({f"ids{i}": x for i, x in enumerate(ids)})
    return run, outs


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("graph", [False, True], ids=["stream", "cuda-graph"])
@pytest.mark.parametrize("path,T", [("small", 1), ("small", 37), ("large", 300)])
def test_pdl_chain_same_bits_as_serial(path, T, graph, kdir, summary):
    """The qk -> router chain with PDL gives the bits of the same chain launched serially (PDL=False), five times
    over, on a stream or replayed from a CUDA graph (where PDL becomes programmatic graph edges)."""
    run_ref, ref = qk_router_chain(False, path, T, kdir)
    run_ref()
    torch.cuda.synchronize()
    assert not any(ref[f"weights{i}"].isnan().any() or (ref[f"ids{i}"] < 0).any() for i in range(6))
    run, got = qk_router_chain(None, path, T, kdir)
    if graph:
        run()  # compile, warm up and compute inv_freq outside the capture
        torch.cuda.synchronize()
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            run()
    for rep in range(5):
        for t in got.values():
            t.fill_(float("nan") if t.is_floating_point() else -1)
        if graph:
            cg.replay()
        else:
            run()
        torch.cuda.synchronize()
        bad = sorted(k for k in ref if not _same_bits(got[k], ref[k]))
        summary["moe_router"].append(dict(case=f"pdl-chain-{path}-T{T}-{'graph' if graph else 'stream'}-{rep}",
                                          differing=bad))
        assert not bad, (rep, bad)
    print(f"pdl chain {path} T{T} {'graph' if graph else 'stream'}: same bits as serial, 5 runs")
