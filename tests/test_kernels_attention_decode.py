"""The decode attention template `attention_decode` (IR op `attention`, flash-decoding) on CPU.

1. fp32 instances under Triton's CPU interpreter (one child process, see conftest.run_interpreted_main) equal
   `beamc.ir.reference.attention_ref` on the same inputs (max |out - ref| / max |ref| < 1e-5), outputs and a
   caller's scratch poisoned with NaN (plus canaries past scratch_numel), the cache rows no token may read poisoned
   too (NaN; 0x7F bytes for fp8): sliding ring caches with positions across the ring's wrap, full paged caches with a
   shuffled block table and contexts spanning many pages (page 4 with 16-position blocks, page 32 with 16-position
   blocks), a full ring, fp8 e4m3 caches with per-tensor scales (q fp32; the reference fed the same cache), several
   sequences of different lengths in one launch, 1 and 16 query tokens of one sequence, context 1; each with the
   default split count and forced ones (one split: stage 0 writes out; several blocks per split; more splits than
   blocks), and one case rendered with PDL on.
2. bf16 instances (bf16 and fp8 caches) at the full spec's TP-8 shapes (6 query heads, 1 KV head, head dim 128;
   sliding window 512 over a ring, full layers over pages of 16) and the tiny spec's compile ahead of time for
   sm_90a and sm_100a: tensor-core products, shared memory within the limit, PDL facts (launch_dependents first, one
   wait, no store before it; the fp8 scales loaded before it), no flush-to-zero.
3. The rendered module keeps the contract of `beamc.codegen.kernel`; the split rule fills an H200 at T = 1.
4. QKN (IR op `qk_attention`): the fp32 render on raw q, k, v equals qk_norm_pos_kv_ref then attention_ref (and the
   gate) under the interpreter, with the token rows of the cache poisoned before the launch (the kernel must not read
   them back), the written rows equal to the reference's, every other row untouched; RoPE and SSMax, ring and
   pages, fp8 caches, forced split counts.
"""
from __future__ import annotations

import inspect
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

from beamc.codegen.kernel import KernelSpec, aot_compile, load_kernel
from beamc.ir.reference import REFS, attention_ref, cache_rows, kv_store, qk_norm_pos_kv_ref
from conftest import assert_template_contract, interpret_cases, run_interpreted_main
from test_kernels_attn_router import SMEM_LIMIT, check_pdl_ptx, pdl_facts

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = "attention_decode"


# ---------------------------------------------------------------- constants and inputs (shared with tests/gpu, bench)
def constants(hq: int, hkv: int, d: int, window: int, dtype: str = "bf16", cache: str = "bf16",
              page: int | None = None, scale: float | None = None, **extra) -> dict:
    """The template's constants for one attention node (extra: PDL, BLOCK_N, NUM_WARPS, NUM_STAGES, ...)."""
    return dict(DTYPE=dtype, CACHE_DTYPE=cache, HQ=hq, HKV=hkv, HEAD_DIM=d, WINDOW=window,
                SCALE=scale if scale is not None else d ** -0.5, PAGED=page is not None, PAGE_SIZE=page or 0, **extra)


def spec_constants(spec, tp: int, kind: str, dtype: str = "bf16", cache: str = "bf16", page: int = 16,
                   **extra) -> dict:
    """Constants of a spec's sliding (ring) or full (paged) layer at tensor-parallel size tp."""
    a = spec.attention
    return constants(a.num_heads // tp, max(a.num_kv_heads // tp, 1), a.head_dim,
                     spec.effective_window if kind == "sliding" else 0, dtype, cache,
                     page if kind == "full" else None, **extra)


def make_case(c: dict, seqs: list[tuple[int, list[int]]], *, cap: int | None = None, extra_pages: int = 3,
              min_pages: int = 0, seed: int = 0, device="cpu", scales=(0.02, 0.005)) -> dict:
    """Inputs of one launch: `seqs` lists (slot, query positions); every slot's positions 0..max are written into
    its cache (ring rows p % cap, or pages of a shuffled block table of >= min_pages pages per slot) in order, as
    the step's kv writes leave them; every other cache row is poisoned. fp8 caches hold kv_store(x, e4m3, scale). Returns the launcher's tensors
    (`args`, in IR order without out) and the reference's inputs."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hq, hkv, d = c["HQ"], c["HKV"], c["HEAD_DIM"]
    slot = torch.tensor([s for s, ps in seqs for _ in ps], dtype=torch.int64)
    pos = torch.tensor([p for _, ps in seqs for p in ps], dtype=torch.int64)
    S = int(slot.max()) + 1
    last = {s: int(pos[slot == s].max()) for s in slot.unique().tolist()}
    fp8 = c["CACHE_DTYPE"] == "f8e4m3"
    cdt = torch.float8_e4m3fn if fp8 else {"f32": torch.float32, "bf16": torch.bfloat16}[c["CACHE_DTYPE"]]
    qdt = {"f32": torch.float32, "bf16": torch.bfloat16}[c["DTYPE"]]
    if c["PAGED"]:
        page = c["PAGE_SIZE"]
        mp = max(max(last.values()) // page + 1, min_pages)
        P = S * mp + extra_pages
        block_table = torch.randperm(P, generator=g)[: S * mp].view(S, mp).to(torch.int32)
        shape = (P, page, hkv, d)
    else:
        block_table = None
        shape = (S, cap, hkv, d)
    kc = torch.empty(shape, dtype=cdt)
    vc = torch.empty(shape, dtype=cdt)
    for x in (kc, vc):  # poison: NaN (fp8: the 0x7F byte is NaN in e4m3)
        x.view(torch.uint8).fill_(0x7F) if fp8 else x.fill_(float("nan"))
    ks, vs = (torch.tensor(scales[0]), torch.tensor(scales[1])) if fp8 else (None, None)
    for s, hi in last.items():
        p = torch.arange(hi + 1)
        if block_table is None:
            p = p[max(0, hi + 1 - cap):]  # what the ring still holds (the older rows were overwritten)
            rows = (torch.full_like(p, s), p % cap)
        else:
            rows = (block_table[s, p // c["PAGE_SIZE"]].long(), p % c["PAGE_SIZE"])
        k = torch.randn(len(p), hkv, d, generator=g)
        v = torch.randn(len(p), hkv, d, generator=g)
        kc[rows] = kv_store(k, cdt, ks) if fp8 else k.to(cdt)
        vc[rows] = kv_store(v, cdt, vs) if fp8 else v.to(cdt)
    q = (torch.randn(len(pos), hq, d, generator=g) * 2).to(qdt)
    extras = ([block_table] if block_table is not None else []) + ([ks, vs] if fp8 else [])
    args = [q, kc, vc, slot, pos, *extras]
    return dict(args=[a.to(device) for a in args], T=len(pos))


def reference(c: dict, case: dict, fp32: bool = False) -> torch.Tensor:
    """attention_ref on the launch's inputs. fp32: on q.float(), an fp8 cache given as its dequantised fp32 values
    (kc.float() * k_scale: what the kernel reads; and no fp8 indexing on the device)."""
    q, kc, vc, slot, pos, *extras = case["args"]
    if fp32:
        q = q.float()
        if c["CACHE_DTYPE"] == "f8e4m3":
            ks, vs = extras[-2:]
            kc, vc, extras = kc.float() * ks, vc.float() * vs, extras[:-2]
    return attention_ref(q, kc, vc, slot, pos, *extras, window=c["WINDOW"] or None, scale=c["SCALE"],
                         paged=c["PAGED"])


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


# ---------------------------------------------------------------- 1. fp32 instances under the interpreter
TINY = dict(hq=4, hkv=2, d=16)
# name: (constants, seqs, ring capacity, forced split counts besides the default)
CASES = {
    # sliding window 5 over a ring of 8: slot 0's 4 tokens cross the wrap (rows 6, 7, 0, 1), a short context, context 1
    "ring-w5": (constants(**TINY, window=5, dtype="f32", cache="f32", BLOCK_N=16),
                [(0, [14, 15, 16, 17]), (1, [3]), (2, [0]), (3, [9])], 8, (2,)),
    # window 40 over a ring of 44: 3 blocks of 16, the chunk of 5 crosses the wrap at 88
    "ring-w40": (constants(**TINY, window=40, dtype="f32", cache="f32", BLOCK_N=16),
                 [(0, list(range(86, 91))), (1, [20]), (2, [0])], 44, (1, 5)),
    # full layer over a ring of 64 (NoPE-style, window 0)
    "ring-full": (constants(**TINY, window=0, dtype="f32", cache="f32", BLOCK_N=16),
                  [(0, [63]), (1, [30, 31]), (2, [0])], 64, (1, 3)),
    # full paged, page 4, blocks of 16 (4 pages each), shuffled block table, contexts spanning up to 31 pages
    "paged-p4": (constants(**TINY, window=0, dtype="f32", cache="f32", page=4, BLOCK_N=16),
                 [(0, [122]), (1, [0]), (2, [37, 38]), (3, [63]), (4, [64])], None, (1, 4)),
    # full paged, page 32 (pages of 2 blocks), 6 query heads per KV head (the TP-8 group)
    "paged-p32-g6": (constants(hq=6, hkv=1, d=32, window=0, dtype="f32", cache="f32", page=32, BLOCK_N=16),
                     [(0, [150]), (1, [31, 32]), (2, [95])], None, (1, 3)),
    # 16 query tokens of one sequence (speculative verification), paged and sliding ring (cap = window - 1 + 16)
    "spec16-paged": (constants(**TINY, window=0, dtype="f32", cache="f32", page=4, BLOCK_N=16),
                     [(1, list(range(40, 56)))], None, (1,)),
    "spec16-ring": (constants(**TINY, window=5, dtype="f32", cache="f32", BLOCK_N=16),
                    [(0, list(range(30, 46)))], 20, (1,)),
    # one token, context 1, in a block table of 20 pages (5 splits by default: 4 of them idle)
    "ctx1-paged": (constants(**TINY, window=0, dtype="f32", cache="f32", page=4, BLOCK_N=16),
                   [(0, [0])], None, (1,)),
    # fp8 e4m3 caches with per-tensor scales (q fp32)
    "fp8-paged": (constants(**TINY, window=0, dtype="f32", cache="f8e4m3", page=4, BLOCK_N=16),
                  [(0, [120]), (1, [5, 6]), (2, [0])], None, (1, 3)),
    "fp8-ring": (constants(hq=4, hkv=2, d=32, window=40, dtype="f32", cache="f8e4m3", BLOCK_N=16),
                 [(0, list(range(95, 99))), (1, [7])], 43, (1,)),
    # rendered with PDL on: the gdc calls are skipped in the interpreter
    "paged-p4-pdl": (constants(**TINY, window=0, dtype="f32", cache="f32", page=4, BLOCK_N=16, PDL=True),
                     [(0, [70]), (1, [2, 3])], None, ()),
    # GATE (attention_gate): the output gate in the epilogue of stage 1 and of the one-split stage 0; strided g rows
    "ring-w5-gate": (constants(**TINY, window=5, dtype="f32", cache="f32", BLOCK_N=16, GATE=True),
                     [(0, [14, 15, 16, 17]), (1, [3]), (2, [0])], 8, (1, 2)),
    "fp8-paged-gate": (constants(**TINY, window=0, dtype="f32", cache="f8e4m3", page=4, BLOCK_N=16, GATE=True),
                       [(0, [120]), (1, [5, 6]), (2, [0])], None, (1, 3)),
    # the loop without the software pipeline (PREFETCH off: one block's loads, then its arithmetic), paged and ring
    "paged-p4-noprefetch": (constants(**TINY, window=0, dtype="f32", cache="f32", page=4, BLOCK_N=16, PREFETCH=False),
                            [(0, [122]), (1, [0]), (2, [37, 38])], None, (1, 4)),
    "ring-w40-noprefetch": (constants(**TINY, window=40, dtype="f32", cache="f32", BLOCK_N=16, PREFETCH=False),
                            [(0, list(range(86, 91))), (1, [20])], 44, (1, 5)),
    # deeper software pipelines (2 and 3 blocks of K/V in flight), paged and ring, shares of 1 to many blocks
    "paged-p4-prefetch2": (constants(**TINY, window=0, dtype="f32", cache="f32", page=4, BLOCK_N=16, PREFETCH=2),
                           [(0, [122]), (1, [0]), (2, [37, 38])], None, (1, 4)),
    "ring-w40-prefetch3": (constants(**TINY, window=40, dtype="f32", cache="f32", BLOCK_N=16, PREFETCH=3),
                           [(0, list(range(86, 91))), (1, [20])], 44, (1, 2)),
    # stage 1 (splits > LAST_MERGE_MAX 2) in several chunks of splits (MERGE_CHUNK 2) and head-dim slices (MERGE_D 8
    # of 16); 2 splits: the last-arriver merge in head-dim slices
    "paged-p4-merge": (constants(**TINY, window=0, dtype="f32", cache="f32", page=4, BLOCK_N=16, MERGE_CHUNK=2,
                                 MERGE_D=8, LAST_MERGE_MAX=2), [(0, [122]), (1, [37, 38])], None, (2, 3, 5, 8)),
    # TMA_KV: each block's pages as TMA boxes (pages of 16, 2 or 4 a block); the poisoned rows past a context read
    # whole with their page (masked scores, zeroed V rows), shares of 1 to many blocks, a context of 1; stacked into
    # one tile (TMA_JOIN, the default: bitwise the render without TMA_KV) or each page's own dots
    "paged-p16-tma": (constants(**TINY, window=0, dtype="f32", cache="f32", page=16, BLOCK_N=32, TMA_KV=True),
                      [(0, [122]), (1, [0]), (2, [37, 38]), (3, [63]), (4, [64])], None, (1, 4)),
    "paged-p16-tma-pages": (constants(**TINY, window=0, dtype="f32", cache="f32", page=16, BLOCK_N=64, TMA_KV=True,
                                      TMA_JOIN=False), [(0, [122]), (1, [0]), (2, [37, 38])], None, (1, 3)),
    "fp8-paged-p16-tma-gate": (constants(hq=6, hkv=1, d=32, window=0, dtype="f32", cache="f8e4m3", page=16,
                                         BLOCK_N=64, TMA_KV=True, GATE=True),
                               [(0, [150]), (1, [5, 6]), (2, [0])], None, (1, 3)),
    # the gate in stage 1's epilogue (LAST_MERGE_MAX 1: every split count > 1 merges in stage 1)
    "fp8-paged-gate-stage1": (constants(**TINY, window=0, dtype="f32", cache="f8e4m3", page=4, BLOCK_N=16, GATE=True,
                                        LAST_MERGE_MAX=1), [(0, [120]), (1, [5, 6]), (2, [0])], None, (1, 3)),
}


def check_case(name: str, directory: Path) -> list[dict]:
    c, seqs, cap, forced = CASES[name]
    gated = c.get("GATE", False)
    mod = load_kernel(KernelSpec(TEMPLATE, "attention_gate" if gated else "attention", c), directory)
    assert mod._interpreted(), "triton did not pick the interpreter"
    case = make_case(c, seqs, cap=cap, seed=len(name), min_pages=20 if name.startswith("ctx1") else 0)
    want = reference(c, case)
    T = case["T"]
    gate = []
    if gated:  # g [T, HQ, D] with rows 8 values apart more than their heads (strided), b [HQ, 1]; the reference gate
        gen = torch.Generator().manual_seed(len(name))
        hq, d = c["HQ"], c["HEAD_DIM"]
        gate = [torch.randn(T, hq * d + 8, generator=gen)[:, :hq * d].view(T, hq, d), torch.randn(hq, 1, generator=gen)]
        want = REFS["sigmoid_gate"]([want, *gate], {})[0]
    plain = load_kernel(KernelSpec(TEMPLATE, "attention_gate" if gated else "attention", dict(c, TMA_KV=False)),
                        directory) if mod.TMA_KV and mod.TMA_JOIN else None  # (TMA_JOIN: the render to equal)
    out = []
    for splits in (None, *forced):
        got = torch.full_like(want, float("nan"))
        n = mod.scratch_numel(T, splits)
        scratch = torch.full((n + 64,), float("nan"))  # 64 canaries past the end
        mod.launch(*case["args"], *gate, got, scratch=scratch, splits=splits)
        assert torch.isnan(scratch[n:]).all(), f"{name} splits={splits}: a write past the scratch"
        assert all(int(c.abs().sum()) == 0 for c in mod._COUNTERS["cpu"]), f"{name}: counters not back at 0"
        err = float("inf") if got.isnan().any() else rel_err(got, want)
        run = dict(splits=splits, used=splits or mod.num_splits(T, _max_context(mod, case)), err=err)
        if plain is not None:  # the joined pages run the default's block arithmetic: its bits exactly
            ref = torch.full_like(want, float("nan"))
            plain.launch(*case["args"], *gate, ref, splits=splits)
            run["same_as_default"] = bool(torch.equal(got, ref))
        out.append(run)
    return out


# ---------------------------------------------------------------- 4. QKN (qk_attention) under the interpreter
def qkn_constants(c: dict, mode: str, **extra) -> dict:
    """`constants` plus qk_norm_pos_kv's (eps, weight form, RoPE theta or the SSMax q-scale's length / offset /
    exponent) for the QKN render."""
    return dict(c, QKN=True, EPS=1e-6, NORM_OFFSET=0.0, MODE=mode, THETA=10000.0, LENGTH=16.0, POS_OFFSET=1.0,
                EXPONENT=0.1, **extra)


def qkn_inputs(c: dict, case: dict, seed: int, device="cpu") -> dict:
    """Raw q [T, HQ, d], k / v [T, HKV, d] (as the QKV projection makes them) and the norm weights, for a case of
    make_case; the IR attributes of the qk_attention node."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    T, hq, hkv, d = case["T"], c["HQ"], c["HKV"], c["HEAD_DIM"]
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[c["DTYPE"]]
    raw = [(torch.randn(T, h, d, generator=g) * 3).to(dt).to(device) for h in (hq, hkv, hkv)]
    w = [(1.0 + 0.1 * torch.randn(d, generator=g)).to(dt).to(device) for _ in range(2)]
    a = dict(eps=c["EPS"], w_offset=c["NORM_OFFSET"], mode=c["MODE"], theta=c["THETA"], length=c["LENGTH"],
             offset=c["POS_OFFSET"], exponent=c["EXPONENT"], window=c["WINDOW"] or None, scale=c["SCALE"],
             paged=c["PAGED"], gate=c.get("GATE", False))
    return dict(raw=raw, w=w, attrs=a)


def poison_token_rows(c: dict, case: dict) -> None:
    """The cache rows of the launch's tokens poisoned (NaN; 0x7F bytes for fp8): QKN writes them and must never
    read them back."""
    _, kc, vc, slot, pos, *extras = case["args"]
    rows = cache_rows(kc, slot, pos, extras[0] if c["PAGED"] else None)
    for x in (kc, vc):
        if c["CACHE_DTYPE"] == "f8e4m3":
            x.view(torch.uint8)[rows] = 0x7F
        else:
            x[rows] = float("nan")


QKN_CASES = {
    # sliding ring (RoPE): a token past the ring's wrap, short contexts, context 1; gated
    "qkn-ring-w5-rope-gate": (qkn_constants(constants(**TINY, window=5, dtype="f32", cache="f32", BLOCK_N=16,
                                                      GATE=True), "rope"),
                              [(0, [17]), (1, [3]), (2, [0]), (3, [9])], 8, (1, 2)),
    # full paged (SSMax), shuffled block table, a position on a block's first key (the owner's block holds only it)
    "qkn-paged-p4-ssmax": (qkn_constants(constants(**TINY, window=0, dtype="f32", cache="f32", page=4, BLOCK_N=16),
                                         "ssmax"), [(0, [122]), (1, [0]), (2, [48]), (3, [63]), (4, [64])], None,
                           (1, 4)),
    # the TP-8 group (6 query heads of one KV head), head dim 24 (padded tiles, partners across the pad), window 40
    "qkn-ring-w40-g6-d24": (qkn_constants(constants(hq=6, hkv=1, d=24, window=40, dtype="f32", cache="f32",
                                                    BLOCK_N=16), "rope"), [(0, [90]), (1, [20]), (2, [41])], 44,
                            (1, 5)),
    # TMA_KV (pages of 16 by TMA boxes) with the owner's cache write: a position on a page's first key, fp8, gated
    "qkn-fp8-paged-p16-tma-gate": (qkn_constants(constants(**TINY, window=0, dtype="f32", cache="f8e4m3", page=16,
                                                           BLOCK_N=32, TMA_KV=True, GATE=True), "ssmax"),
                                   [(0, [120]), (1, [32]), (2, [0]), (3, [70])], None, (1, 3)),
    # fp8 caches with per-tensor scales, paged SSMax and ring RoPE (gated)
    "qkn-fp8-paged-ssmax": (qkn_constants(constants(**TINY, window=0, dtype="f32", cache="f8e4m3", page=4,
                                                    BLOCK_N=16), "ssmax"), [(0, [120]), (1, [5]), (2, [0])], None,
                            (1, 3)),
    "qkn-fp8-ring-rope-gate": (qkn_constants(constants(hq=4, hkv=2, d=32, window=40, dtype="f32", cache="f8e4m3",
                                                       BLOCK_N=16, GATE=True), "rope"), [(0, [98]), (1, [7])], 43,
                               (1,)),
    # KV_TILES (off by default): k and v as tiles repeating their row, ring RoPE (gated, fp8) and paged SSMax
    "qkn-fp8-ring-rope-gate-kvtiles": (qkn_constants(constants(hq=4, hkv=2, d=32, window=40, dtype="f32",
                                                               cache="f8e4m3", BLOCK_N=16, GATE=True), "rope",
                                                     KV_TILES=True), [(0, [98]), (1, [7])], 43, (1,)),
    "qkn-paged-p4-ssmax-kvtiles": (qkn_constants(constants(**TINY, window=0, dtype="f32", cache="f32", page=4,
                                                           BLOCK_N=16), "ssmax", KV_TILES=True),
                                   [(0, [122]), (1, [0]), (2, [48])], None, (1, 4)),
    # EARLY_KV off (on by default: the first K/V block loaded before the wait): the loads after the norms, as before
    "qkn-paged-p4-ssmax-late-kv": (qkn_constants(constants(**TINY, window=0, dtype="f32", cache="f32", page=4,
                                                           BLOCK_N=16), "ssmax", EARLY_KV=False),
                                   [(0, [122]), (1, [0]), (2, [48])], None, (1, 4)),
    "qkn-ring-w5-rope-late-kv": (qkn_constants(constants(**TINY, window=5, dtype="f32", cache="f32", BLOCK_N=16),
                                               "rope", EARLY_KV=False), [(0, [17]), (1, [3]), (2, [0])], 8, (1, 2)),
    # rendered with PDL on (the parameters and step inputs loaded before the wait; the interpreter skips the gdc)
    "qkn-paged-p4-rope-pdl": (qkn_constants(constants(**TINY, window=0, dtype="f32", cache="f32", page=4, BLOCK_N=16,
                                                      PDL=True), "rope"), [(0, [70]), (1, [2])], None, ()),
    # and with both stages' PDL triggers after their main work (LATE_TRIGGER, LATE_TRIGGER1: the same results)
    "qkn-paged-p4-ssmax-pdl-late": (qkn_constants(constants(**TINY, window=0, dtype="f32", cache="f32", page=4,
                                                            BLOCK_N=16, PDL=True), "ssmax",
                                                  LATE_TRIGGER=True, LATE_TRIGGER1=True),
                                    [(0, [122]), (1, [0]), (2, [48])], None, (1, 2)),
    # with PDL the merge's position and gate bias are read before its wait (MERGE_EARLY, the default); and the render
    # without it (both after the wait: the same results)
    "qkn-fp8-ring-rope-gate-pdl": (qkn_constants(constants(hq=4, hkv=2, d=32, window=40, dtype="f32", cache="f8e4m3",
                                                           BLOCK_N=16, GATE=True, PDL=True), "rope"),
                                   [(0, [98]), (1, [7]), (2, [30])], 43, (1, 3)),
    "qkn-paged-p4-ssmax-pdl-merge-late": (qkn_constants(constants(**TINY, window=0, dtype="f32", cache="f32", page=4,
                                                                  BLOCK_N=16, PDL=True), "ssmax", MERGE_EARLY=False),
                                          [(0, [122]), (1, [0]), (2, [48])], None, (1, 4)),
    # EARLY_QKV (off by default): q, k, their partners and v loaded together before the norms; RoPE over a ring (the
    # TP-8 group, head dim 24: partners across the pad) and SSMax over pages, fp8 and PDL
    "qkn-ring-w40-g6-d24-early-qkv": (qkn_constants(constants(hq=6, hkv=1, d=24, window=40, dtype="f32", cache="f32",
                                                              BLOCK_N=16, GATE=True), "rope", EARLY_QKV=True),
                                      [(0, [90]), (1, [20]), (2, [41])], 44, (1, 5)),
    "qkn-fp8-paged-ssmax-pdl-early-qkv": (qkn_constants(constants(**TINY, window=0, dtype="f32", cache="f8e4m3", page=4,
                                                                  BLOCK_N=16, PDL=True), "ssmax", EARLY_QKV=True),
                                          [(0, [120]), (1, [5]), (2, [0])], None, (3,)),
}


def check_qkn_case(name: str, directory: Path) -> list[dict]:
    c, seqs, cap, forced = QKN_CASES[name]
    mod = load_kernel(KernelSpec(TEMPLATE, "qk_attention", c), directory)
    assert mod._interpreted(), "triton did not pick the interpreter"
    case = make_case(c, seqs, cap=cap, seed=len(name))
    poison_token_rows(c, case)
    _, kc, vc, slot, pos, *extras = case["args"]
    x = qkn_inputs(c, case, seed=len(name) + 1)
    a, fp8 = x["attrs"], c["CACHE_DTYPE"] == "f8e4m3"
    gate = []
    if a["gate"]:
        gen = torch.Generator().manual_seed(len(name))
        gate = [torch.randn(case["T"], c["HQ"], c["HEAD_DIM"], generator=gen), torch.randn(c["HQ"], 1, generator=gen)]
    want, kc_ref, vc_ref = REFS["qk_attention"]([*x["raw"], *x["w"], kc.clone(), vc.clone(), slot, pos, *extras,
                                                 *gate], a)
    rows = cache_rows(kc, slot, pos, extras[0] if c["PAGED"] else None)
    out = []
    for splits in (None, *forced):
        kc1, vc1 = kc.clone(), vc.clone()
        got = torch.full_like(want, float("nan"))
        mod.launch(*x["raw"], *x["w"], kc1, vc1, slot, pos, *extras, *gate, got, splits=splits)
        others = torch.ones(kc.shape[:2], dtype=torch.bool)
        others[rows] = False
        untouched = all(torch.equal(y.view(torch.uint8)[others], z.view(torch.uint8)[others])
                        for y, z in ((kc1, kc), (vc1, vc)))
        if fp8:  # the interpreter's e4m3 rounding loses the carry into the next binade (test_kernels_attn_router):
            # such elements hold half the reference's value; the attention is judged over the rows as written
            for y, r in ((kc1[rows], kc_ref[rows]), (vc1[rows], vc_ref[rows])):
                bad = y.view(torch.uint8) != r.view(torch.uint8)
                assert bad.float().mean() < 0.1 and torch.equal(y.float()[bad] * 2, r.float()[bad]), name
            want = REFS["attention_gate" if a["gate"] else "attention"](
                [_qn(x, kc, vc, slot, pos, extras, a), kc1, vc1, slot, pos, *extras, *gate], a)[0]
            cache_err = 0.0
        else:
            cache_err = max(rel_err(kc1[rows], kc_ref[rows]), rel_err(vc1[rows], vc_ref[rows]))
        err = float("inf") if got.isnan().any() else rel_err(got, want)
        out.append(dict(splits=splits, used=splits or mod.num_splits(case["T"], _max_context(mod, case)), err=err,
                        cache_err=cache_err, untouched=untouched))
    return out


def _qn(x, kc, vc, slot, pos, extras, a):
    """qk_norm_pos_kv_ref's q for the raw inputs (the caches it would write are not used)."""
    return qk_norm_pos_kv_ref(*x["raw"], *x["w"], kc.clone(), vc.clone(), slot, pos, *extras, a=a)[0]


def _max_context(mod, case) -> int:
    kc = case["args"][1]
    return case["args"][5].shape[1] * mod.PAGE_SIZE if mod.PAGED else kc.shape[1]


def _interpreted_main(out: str) -> None:
    """In a child with TRITON_INTERPRET=1: every case -> {name: {"runs"} | {"error"}}."""
    directory = Path(out).parent / "kernels"
    interpret_cases(out, {**CASES, **QKN_CASES}, lambda name: dict(runs=(check_qkn_case if name in QKN_CASES
                                                                          else check_case)(name, directory)))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    return run_interpreted_main("test_kernels_attention_decode",
                                tmp_path_factory.mktemp("interpreted_attn") / "results.json")


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_fp32_matches_reference(name, interpreted):
    """fp32 instance vs attention_ref, default and forced split counts (one split: stage 0 alone)."""
    r = interpreted[name]
    assert "error" not in r, r["error"]
    errs = [x["err"] for x in r["runs"]]
    assert max(errs) < 1e-5, r["runs"]
    assert all(x.get("same_as_default", True) for x in r["runs"]), r["runs"]  # TMA_JOIN: the default's bits


@pytest.mark.parametrize("name", list(QKN_CASES))
def test_interpreted_qkn_fp32_matches_the_two_ops(name, interpreted):
    """QKN (qk_attention) vs qk_norm_pos_kv_ref then attention_ref (+ gate): the output, the token rows written
    (poisoned before: never read back), every other cache row untouched; default and forced split counts."""
    r = interpreted[name]
    assert "error" not in r, r["error"]
    assert max(x["err"] for x in r["runs"]) < 1e-5 and max(x["cache_err"] for x in r["runs"]) < 1e-5, r["runs"]
    assert all(x["untouched"] for x in r["runs"]), r["runs"]


def test_interpreted_cases_cover_the_paths(interpreted):
    """The default split counts exercise both the one-stage (splits == 1) and the two-stage path."""
    used = [x["used"] for r in interpreted.values() if "error" not in r for x in r["runs"]]
    assert 1 in used and max(used) >= 8, used


# ---------------------------------------------------------------- 2. AOT compiles (bf16; bf16 and fp8 caches)
def _variants() -> list[tuple[str, dict]]:
    from beamc.spec import load_spec

    full, tiny = load_spec(ROOT / "models/beam.yaml"), load_spec(ROOT / "models/beam-tiny.yaml")
    out = []
    for tag, spec, tp, page in (("full-tp8", full, 8, 16), ("tiny", tiny, 1, 4)):
        for kind in ("sliding", "full"):
            for cache in ("bf16", "f8e4m3"):
                out.append((f"{tag},{kind},{cache}", spec_constants(spec, tp, kind, "bf16", cache, page)))
    out.append(("tiny,full,bf16,no-pdl", spec_constants(tiny, 1, "full", "bf16", "bf16", 4, PDL=False)))
    for kind in ("sliding", "full"):  # attention_gate: the output gate in the epilogues
        out.append((f"full-tp8,{kind},f8e4m3,gate", spec_constants(full, 8, kind, "bf16", "f8e4m3", 16, GATE=True)))
    out.append(("full-tp8,full,f8e4m3,no-prefetch", spec_constants(full, 8, "full", "bf16", "f8e4m3", 16,
                                                                   PREFETCH=False)))
    out.append(("full-tp8,full,f8e4m3,prefetch2", spec_constants(full, 8, "full", "bf16", "f8e4m3", 16, PREFETCH=2)))
    for cache in ("bf16", "f8e4m3"):  # TMA_KV: the pages by TMA boxes (plain and QKN, as the emitter would render it)
        out.append((f"full-tp8,full,{cache},tma", spec_constants(full, 8, "full", "bf16", cache, 16, TMA_KV=True)))
        out.append((f"full-tp8,full,{cache},tma-pages", spec_constants(full, 8, "full", "bf16", cache, 16, TMA_KV=True,
                                                                        TMA_JOIN=False)))
        out.append((f"full-tp8,full,{cache},gate,qkn,tma",
                    qkn_constants(spec_constants(full, 8, "full", "bf16", cache, 16, GATE=True, TMA_KV=True,
                                                 **({"F16_DOT": True} if cache == "f8e4m3" else {})), "ssmax")))
    for cache in ("bf16", "f8e4m3"):  # the last-arriver merge (sliding layers' split counts), gated, as emitted
        out.append((f"full-tp8,sliding,{cache},gate,last-merge", spec_constants(full, 8, "sliding", "bf16", cache, 16,
                                                                                GATE=True, BLOCK_N=32, _LAST=True)))
    for tag, spec, tp in (("full-tp8", full, 8), ("tiny", tiny, 1)):  # QKN (qk_attention), as the emitter renders it
        for kind, mode in (("sliding", "rope"), ("full", "ssmax")):
            for cache in ("bf16", "f8e4m3"):
                c = spec_constants(spec, tp, kind, "bf16", cache, 16 if tag == "full-tp8" else 4, GATE=True,
                                   **({"BLOCK_N": 32} if kind == "sliding" else {}))
                out.append((f"{tag},{kind},{cache},gate,qkn", qkn_constants(c, mode)))
    out.append(("full-tp8,full,f8e4m3,gate,qkn,late-kv",  # (EARLY_KV off: the first K/V loads after the wait)
                qkn_constants(spec_constants(full, 8, "full", "bf16", "f8e4m3", 16, GATE=True), "ssmax",
                              EARLY_KV=False)))
    for kind, mode in (("sliding", "rope"), ("full", "ssmax")):  # LATE_TRIGGER off: stage 0 triggers first too
        out.append((f"full-tp8,{kind},f8e4m3,gate,qkn,trigger-first",
                    qkn_constants(spec_constants(full, 8, kind, "bf16", "f8e4m3", 16, GATE=True,
                                                 **({"BLOCK_N": 32} if kind == "sliding" else {})), mode,
                                  LATE_TRIGGER=False)))
    out.append(("full-tp8,sliding,f8e4m3,gate,qkn,late-trigger-both",  # and the merge's (LATE_TRIGGER1)
                qkn_constants(spec_constants(full, 8, "sliding", "bf16", "f8e4m3", 16, GATE=True, BLOCK_N=32), "rope",
                              LATE_TRIGGER=True, LATE_TRIGGER1=True)))
    out.append(("full-tp8,full,f8e4m3,gate,qkn,f16-dot",  # F16_DOT: the MMAs on fp16 operands
                qkn_constants(spec_constants(full, 8, "full", "bf16", "f8e4m3", 16, GATE=True), "ssmax",
                              F16_DOT=True)))
    for kind, mode in (("sliding", "rope"), ("full", "ssmax")):  # MERGE_EARLY off: the merge's inputs after its wait
        out.append((f"full-tp8,{kind},f8e4m3,gate,qkn,merge-late",
                    qkn_constants(spec_constants(full, 8, kind, "bf16", "f8e4m3", 16, GATE=True,
                                                 **({"BLOCK_N": 32} if kind == "sliding" else {})), mode,
                                  MERGE_EARLY=False)))
    out.append(("full-tp8,sliding,f8e4m3,gate,qkn,kv-tiles",
                qkn_constants(spec_constants(full, 8, "sliding", "bf16", "f8e4m3", 16, GATE=True, BLOCK_N=32), "rope",
                              KV_TILES=True)))
    return out


def _compile(args) -> dict:
    label, c, arch, directory = args
    os.environ.pop("TRITON_INTERPRET", None)
    c = dict(c)
    last = c.pop("_LAST", False)
    op = "qk_attention" if c.get("QKN") else "attention_gate" if c.get("GATE") else "attention"
    mod = load_kernel(KernelSpec(TEMPLATE, op, c), directory)
    if last:  # what the launcher launches with for 1 < splits <= LAST_MERGE_MAX
        mod.CONSTEXPRS = dict(mod.CONSTEXPRS, LAST_MERGE=True)
    ck = aot_compile(mod, arch)
    ptx = ck.asm["ptx"]
    assert bool(re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx)) == last, label  # the counter, only there
    return dict(label=f"{label}@sm_{arch}", arch=arch, cubin=len(ck.asm["cubin"]), shared=ck.metadata.shared,
                target=f".target sm_{arch}a" in ptx, mma=bool(re.search(r"\b(w?mma|tcgen05\.mma)", ptx)),
                fp8=c["CACHE_DTYPE"] == "f8e4m3", qkn=bool(c.get("QKN")), pdl=mod.PDL, early=mod.EARLY_KV,
                late=mod.LATE_TRIGGER or mod.LATE_TRIGGER1, late_both=mod.LATE_TRIGGER and mod.LATE_TRIGGER1,
                launch_pdl=bool(ck.metadata.launch_pdl), f16_dot=mod.F16_DOT, tma=mod.TMA_KV,
                tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", ptx)),
                mma_dtypes=sorted(set(re.findall(r"mma\.sync\.aligned\.\w+\.row\.col\.f32\.(\w+)\.\w+\.f32", ptx))),
                **pdl_facts(ptx))


def test_aot_compile_every_variant(tmp_path):
    """Every variant for sm_90a and sm_100a (2 processes): a cubin, tensor-core products, shared memory within the
    limit; PDL on: launch_dependents first (LATE_TRIGGER, the default: stage 0's after its block loop), one wait
    (QKN with EARLY_KV: one on each stage's path), no store before it
    (fp8: the scales loaded before it; QKN: the norm weights, RoPE table, position, slot and block-table entry too;
    EARLY_KV: and the first block's K/V)."""
    jobs = [(label, c, arch, str(tmp_path / f"sm{arch}")) for label, c in _variants() for arch in (90, 100)]
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_compile, jobs))
    assert len(results) == 74
    for r in results:
        assert (r["tma_loads"] > 0) == r["tma"], r  # TMA_KV: the pages by TMA boxes (and only there)
        if r["arch"] == 90 and r["fp8"]:  # the fp8 renders' MMA operands: bf16, or fp16 with F16_DOT
            assert r["mma_dtypes"] == (["f16"] if r["f16_dot"] else ["bf16"]), r
        assert r["cubin"] > 0 and r["target"] and r["shared"] <= SMEM_LIMIT, r
        assert r["mma"], f"{r['label']}: no tensor-core products"
        assert r["launch_pdl"] == r["pdl"], r
        check_pdl_ptx(r, r["pdl"], r["label"], r["late"])
        if r["late"]:  # one trigger on each stage's path: stage 1's first, or (both late) after both stages' loops
            assert r["launch_dependents"] == 2 and r["launch_dependents_first"] != r["late_both"], r
        if r["pdl"]:
            # (EARLY_KV: stage 0 and stage 1 wait on paths of their own; LATE_TRIGGER: the compiler may copy the one
            # wait onto both sides of the branch that gives stage 1 its trigger first: one wait on each path still)
            assert r["waits"] in ((1, 2) if r["late"] and not r["early"] else (2 if r["early"] else 1,)), r
            assert (max(r["loads_before_wait"]) > 0) == (r["fp8"] or r["qkn"]), r  # only parameters / step inputs


# ---------------------------------------------------------------- 3. contract, split rule
@pytest.fixture(scope="module")
def kdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("attn_kernels")


@pytest.mark.parametrize("paged,fp8", [(False, False), (True, False), (True, True), (False, True)])
def test_rendered_module_contract(paged, fp8, kdir):
    c = constants(6, 1, 128, 0 if paged else 512, "bf16", "f8e4m3" if fp8 else "bf16", 16 if paged else None)
    mod = load_kernel(KernelSpec(TEMPLATE, "attention", c), kdir)
    assert mod.__doc__ and "attention" in mod.__doc__ and isinstance(mod.GRID, str)
    params = list(inspect.signature(mod.launch).parameters)
    ir = ["q", "kc", "vc", "slot", "pos"] + (["block_table"] if paged else []) + (["k_scale", "v_scale"] if fp8 else [])
    assert params == ir + ["out", "scratch", "splits"]
    assert inspect.signature(mod.launch).parameters["scratch"].default is None
    assert_template_contract(mod)
    off = load_kernel(KernelSpec(TEMPLATE, "attention", dict(c, PDL=False)), kdir)
    assert off.OPTIONS == dict(mod.OPTIONS, launch_pdl=False) and "gdc_" not in inspect.getsource(off)
    f32 = load_kernel(KernelSpec(TEMPLATE, "attention", dict(c, DTYPE="f32", CACHE_DTYPE="f32")), kdir)
    assert f32.OPTIONS["launch_pdl"] is False


def test_split_rule(kdir):
    """T = 1 at the TP-8 shapes fills the GPU (>= 2 programs per SM of 132) and gives >= 128 splits at 100K context
    (full layer), batches of 16 and more aim at 4 programs an SM; a sliding layer never splits past its window's
    blocks; the scratch bound covers any context. By default (WHOLE_WAVES, s50run1-2) the splits are the most within
    the target; WHOLE_WAVES=False rounds up to it instead (the rule before)."""
    full = load_kernel(KernelSpec(TEMPLATE, "attention", constants(6, 1, 128, 0, page=16)), kdir)
    slide = load_kernel(KernelSpec(TEMPLATE, "attention", constants(6, 1, 128, 512)), kdir)
    up = load_kernel(KernelSpec(TEMPLATE, "attention", constants(6, 1, 128, 0, page=16, WHOLE_WAVES=False)), kdir)
    s = full.num_splits(1, 131072)
    assert full.WHOLE_WAVES and s >= 2 * 132 - 8 and s <= full.MAX_SPLITS
    assert slide.num_splits(1, 527) == 512 // slide.BLOCK_N and slide.num_splits(1, 10**6) <= 512 // slide.BLOCK_N
    for T in (1, 2, 3, 5, 7, 8, 16, 32, 48, 64, 100, 128, 1000):
        target = full.BATCH_TARGET_PROGRAMS if T >= full.BATCH_MIN_TOKENS else full.TARGET_PROGRAMS
        for k in (full, up):
            for m in (16, 4096, 10**6):
                assert k.scratch_numel(T) >= k.scratch_numel(T, k.num_splits(T, m))
        # rounded up: the fewest splits that reach the target; floored: the most within it (whole waves)
        assert up.num_splits(T, 10**6) * T * up.HKV >= min(target, T * up.MAX_SPLITS)
        s = full.num_splits(T, 10**6)
        assert s * T <= max(target, T) and (s == full.MAX_SPLITS or (s + 1) * T > target), (T, s)
    # (from BATCH_MIN_TOKENS tokens on, 4 programs an SM, not 2: the full layers' walks over 100K contexts)
    assert [up.num_splits(T, 10**6) for T in (8, 16, 64)] == [33, 33, 9]
    assert [full.num_splits(T, 10**6) for T in (1, 8, 16, 32, 64, 128)] == [256, 33, 33, 16, 8, 4]


def _stage0_loads(cubin: bytes, tmp: Path) -> tuple[int, int]:
    """In stage 0's SASS path (from the first griddepcontrol wait, ACQBULK, to its first store): the global loads
    issued right after the wait, before any barrier, and those issued after a barrier."""
    from test_kernels_gemv import cuobjdump_text

    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", cuobjdump_text(cubin, tmp))
    seq = [o.split(".")[0] for o in ops[ops.index("ACQBULK") + 1:]]
    seq = seq[:seq.index("STG")]
    first_bar = seq.index("BAR") if "BAR" in seq else len(seq)
    return seq[:first_bar].count("LDG"), seq[first_bar:].count("LDG")


@pytest.mark.parametrize("kind,mode", [("sliding", "rope"), ("full", "ssmax")])
def test_register_cap_fits_four_programs_an_sm(kind, mode, tmp_path):
    """MAXNREG (off until measured): the step's QKN render at TP 8 over an fp8 cache, blocks of 32 keys, capped at 128
    registers, compiles for sm_90a and sm_100a within the cap (4 programs of 4 warps an SM) with no spill (local
    memory within an ABI frame: Triton 3.6 and 3.8 show 0 / 32 bytes); the option is in the launch options."""
    from test_kernels_gemv import SMALL_LOCAL, cuobjdump_text, local_bytes

    from beamc.spec import load_spec

    full = load_spec(ROOT / "models/beam.yaml")
    c = qkn_constants(spec_constants(full, 8, kind, "bf16", "f8e4m3", 16, GATE=True, BLOCK_N=32, MAXNREG=128), mode)
    mod = load_kernel(KernelSpec(TEMPLATE, "qk_attention", c), tmp_path / "k")
    assert mod.OPTIONS["maxnreg"] == 128 and mod.BLOCK_N == 32
    for arch in (90, 100):
        cubin = aot_compile(mod, arch).asm["cubin"]
        res = cuobjdump_text(cubin, tmp_path, "-res-usage")
        if res is None:
            pytest.skip("no cuobjdump")
        assert int(re.search(r"REG:(\d+)", res).group(1)) <= 128, res
        assert local_bytes(cubin, tmp_path) <= min(SMALL_LOCAL, 64), res


@pytest.mark.parametrize("kind,mode", [("sliding", "rope"), ("full", "ssmax")])
def test_early_qkv_loads_q_k_and_v_before_the_norms(kind, mode, tmp_path):
    """EARLY_QKV (off until measured): in the sm_90a binary of the step's QKN render at TP 8, every global load of
    stage 0 between its wait and its cache write is issued before the first barrier, the same loads as the
    default's; with Triton 3.6 (the H200's) the default issues some of them after the norms' cross-warp sums (k, the
    partners, v: sliding 16 + 3, full 9 + 1), with the CI's newer Triton none."""
    import triton

    from beamc.spec import load_spec

    full = load_spec(ROOT / "models/beam.yaml")
    c = qkn_constants(spec_constants(full, 8, kind, "bf16", "bf16", 16, GATE=True,
                                     **({"BLOCK_N": 32} if kind == "sliding" else {})), mode)
    base = load_kernel(KernelSpec(TEMPLATE, "qk_attention", c), tmp_path / "k")
    early = load_kernel(KernelSpec(TEMPLATE, "qk_attention", dict(c, EARLY_QKV=True)), tmp_path / "k")
    assert early.EARLY_QKV and not base.EARLY_QKV
    (b_first, b_later), (e_first, e_later) = (_stage0_loads(aot_compile(m, 90).asm["cubin"], tmp_path)
                                              for m in (base, early))
    assert e_later == 0 and e_first == b_first + b_later, (b_first, b_later, e_first, e_later)
    if triton.__version__.startswith("3.6"):  # (the H200's Triton: its default binary has loads behind barriers;
        assert b_later >= 1, (b_first, b_later)  # the CI's newer Triton already hoists them)
