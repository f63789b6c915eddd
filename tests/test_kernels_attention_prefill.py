"""The ragged (chunked) prefill attention template `attention_prefill` (IR op `attention`) on CPU.

1. fp32 instances under Triton's CPU interpreter (in a subprocess, see `interpreted`) equal
   `beamc.ir.reference.attention_ref` on the same inputs (max relative error < 1e-5), outputs poisoned with NaN:
   ragged batches of 3 sequences with prior context in the cache and chunks of 1 token, a few tokens, and more than
   a tile (tiles straddle sequences); sliding window 5 over rings of window - 1 + max chunk positions with chunks
   across the ring's wrap; full layers over paged caches (page 4) with a shuffled block table spanning many pages;
   fp8 e4m3 caches with per-tensor scales (the reference fed the same cache); G = 3 query heads per KV head (rows
   of a tile left idle); the default fp32 block sizes; a batch whose tokens are shuffled (the kernel is correct for
   any layout); a PDL render. Every cache row outside the positions the reference reads is NaN: the kernel reads
   nothing else.
2. bf16 instances at the full spec's TP-8 shapes (6 query heads, 1 KV head of 128: ring window 512 with a bf16
   cache, paged page 16 with bf16 and fp8 caches) and the tiny spec's full layer compile ahead of time for sm_90a
   and sm_100a: tensor-core MMAs, shared memory within the limit, PDL facts (launch_dependents first, one wait, no
   store before it), no flush-to-zero, IEEE division only; a PDL-off render holds no griddepcontrol.
3. The rendered module keeps the contract of `beamc.codegen.kernel`.
"""
from __future__ import annotations

import inspect
import math
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

from beamc.codegen.kernel import KernelSpec, aot_compile, launch_options, load_kernel
from beamc.ir.reference import REFS, attention_ref, kv_store
from conftest import assert_template_contract, interpret_cases, run_interpreted_main
from test_kernels_attn_router import check_pdl_ptx, pdl_facts

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = "attention_prefill"
SMEM_LIMIT = 232448  # bytes of shared memory a block may use on sm_90 / sm_100
FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------- constants and inputs
def constants(hq: int, hkv: int, d: int, window: int, page: int | None, dtype: str = "bf16", cache: str = "bf16",
              **extra) -> dict:
    """The template's constants for one attention layer (page None: a ring cache)."""
    return dict(DTYPE=dtype, CACHE_DTYPE=cache, HQ=hq, HKV=hkv, HEAD_DIM=d, WINDOW=window, SCALE=1 / math.sqrt(d),
                PAGED=page is not None, PAGE_SIZE=page or 0, **extra)


def spec_constants(spec, tp: int, kind: str, cache: str = "bf16", page: int = 16, dtype: str = "bf16") -> dict:
    """Constants of a `spec` layer of `kind` (sliding: ring; full: paged) at tensor-parallel size tp."""
    a = spec.attention
    return constants(a.num_heads // tp, max(a.num_kv_heads // tp, 1), a.head_dim,
                     a.sliding.window if kind == "sliding" else 0, None if kind == "sliding" else page, dtype, cache)


def make_case(c: dict, seqs: list[tuple[int, int, int]], seed: int, device="cpu", q_dtype=torch.float32,
              shuffle: bool = False, n_slots: int | None = None):
    """Inputs of one launch, in launcher order, and the ring capacity / pages used.

    seqs: (slot, prior context, chunk) per sequence; the step's tokens are each sequence's chunk, consecutive, at
    positions prior ... prior + chunk - 1 (SlotTable.plan's layout; shuffle permutes the tokens). The cache holds
    random K/V (fp8: kv_store of random values with the scales) at exactly the positions the reference reads for
    each sequence, [max(0, first - window + 1), last] (full: [0, last]); every other row is NaN."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, window = c["HQ"], c["HKV"], c["HEAD_DIM"], c["WINDOW"]
    S = n_slots or (max(s for s, _, _ in seqs) + 1)
    slot = torch.cat([torch.full((n,), s, dtype=torch.int64) for s, _, n in seqs])
    pos = torch.cat([torch.arange(p, p + n, dtype=torch.int64) for _, p, n in seqs])
    if shuffle:
        perm = torch.randperm(len(slot), generator=g)
        slot, pos = slot[perm], pos[perm]
    T = len(slot)
    cache_dtype = {"f8e4m3": FP8, "f32": torch.float32, "bf16": torch.bfloat16}[c["CACHE_DTYPE"]]
    scales = [torch.tensor([0.02]), torch.tensor([0.3])] if cache_dtype == FP8 else [None, None]
    if c["PAGED"]:
        ps = c["PAGE_SIZE"]
        mp = max(-(-(p + n) // ps) for _, p, n in seqs)
        P = S * mp + 7
        bt = torch.randperm(P, generator=g)[: S * mp].view(S, mp).to(torch.int32)
        shape = (P, ps, hkv, d)
    else:
        cap = window - 1 + max(n for _, _, n in seqs) if window else max(p + n for _, p, n in seqs)
        bt = None
        shape = (S, cap, hkv, d)
    kc = torch.full(shape, float("nan"), dtype=torch.float32)
    vc = kc.clone()
    for s, p, n in seqs:
        lo = max(p - window + 1, 0) if window else 0
        kpos = torch.arange(lo, p + n)
        rows = (bt[s, kpos // ps].long(), kpos % ps) if bt is not None else (torch.full_like(kpos, s), kpos % shape[1])
        kc[rows] = torch.randn(len(kpos), hkv, d, generator=g)
        vc[rows] = torch.randn(len(kpos), hkv, d, generator=g)
    if cache_dtype == FP8:
        nan = torch.isnan(kc)
        kc, vc = kv_store(kc, FP8, scales[0]), kv_store(vc, FP8, scales[1])  # |x / scale| mostly < 448
        kc.view(torch.uint8)[nan], vc.view(torch.uint8)[nan] = 0x7F, 0x7F  # NaN rows stay NaN
    else:
        kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    q = (torch.randn(T, hq, d, generator=g) * 2).to(q_dtype)
    ins = [q, kc, vc, slot, pos] + ([bt] if bt is not None else []) + (scales if cache_dtype == FP8 else [])
    return [x.to(device) for x in ins]


def reference(c: dict, ins: list[torch.Tensor], out_dtype=None) -> torch.Tensor:
    """attention_ref on the same inputs (q cast to out_dtype first: fp32 gives the fp32 reference of a bf16 run)."""
    q = ins[0] if out_dtype is None else ins[0].to(out_dtype)
    return attention_ref(q, *ins[1:], window=c["WINDOW"] or None, scale=c["SCALE"], paged=c["PAGED"])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


# ---------------------------------------------------------------- 1. fp32 instances under the interpreter
SMALL = dict(BLOCK_M=16, BLOCK_N=16)  # interpreter-sized tiles: 8 tokens of 2 heads, 16 keys
RAGGED = [(2, 37, 19), (0, 0, 1), (1, 12, 3)]  # a chunk > a tile, across the ring's wrap; a first token; a short one
CASES = {
    # name: (constants, sequences, shuffle)
    "ring-w5": (constants(4, 2, 16, 5, None, "f32", "f32", **SMALL), RAGGED, False),
    "ring-w5-g3-d32": (constants(6, 2, 32, 5, None, "f32", "f32", **SMALL), [(0, 100, 1), (1, 3, 12), (2, 0, 7)],
                       False),
    "ring-w5-fp8": (constants(4, 2, 16, 5, None, "f32", "f8e4m3", **SMALL), RAGGED, False),
    "paged4-full": (constants(4, 2, 16, 0, 4, "f32", "f32", **SMALL), [(1, 45, 11), (0, 0, 9), (2, 7, 1)], False),
    "paged4-full-fp8": (constants(4, 2, 32, 0, 4, "f32", "f8e4m3", **SMALL), [(1, 45, 11), (0, 0, 9), (2, 7, 1)],
                        False),
    "paged4-full-shuffled": (constants(4, 2, 16, 0, 4, "f32", "f32", **SMALL), [(1, 30, 11), (0, 0, 9), (2, 7, 5)],
                             True),
    "ring-w5-default-blocks": (constants(4, 2, 16, 5, None, "f32", "f32"), RAGGED, False),
    "paged4-full-pdl": (constants(4, 2, 16, 0, 4, "f32", "f32", PDL=True, **SMALL), [(0, 20, 10), (1, 3, 2)], False),
    # GATE (attention_gate): the output gate in the epilogue (strided g rows)
    "ring-w5-gate": (constants(4, 2, 16, 5, None, "f32", "f32", GATE=True, **SMALL), RAGGED, False),
    "paged4-full-fp8-gate": (constants(4, 2, 32, 0, 4, "f32", "f8e4m3", GATE=True, **SMALL),
                             [(1, 45, 11), (0, 0, 9), (2, 7, 1)], True),
    # MIRROR (fp8 pages converted once into a mirror, then read linearly): the same bits as without it, with room
    # for every slot, and with room for the first slot only (the others read from the pool: 3 + 14 pages > 16)
    "paged4-full-fp8-mirror": (constants(4, 2, 32, 0, 4, "f32", "f8e4m3", MIRROR=True, MIRROR_PAGES=64, **SMALL),
                               [(1, 45, 11), (0, 0, 9), (2, 7, 1)], False),
    "paged4-full-fp8-mirror-short": (constants(4, 2, 32, 0, 4, "f32", "f8e4m3", MIRROR=True, MIRROR_PAGES=16,
                                               **SMALL), [(1, 45, 11), (0, 0, 9), (2, 7, 1)], False),
    "paged4-full-fp8-mirror-gate-pdl": (constants(4, 2, 32, 0, 4, "f32", "f8e4m3", MIRROR=True, MIRROR_PAGES=64,
                                                  GATE=True, PDL=True, **SMALL), [(1, 45, 11), (0, 0, 9), (2, 7, 1)],
                                        True),
    # 3 KV heads: a page of 4 x 3 x 16 = 192 values (the copy's tile is the next power of 2, masked)
    "paged4-full-fp8-mirror-hkv3": (constants(6, 3, 16, 0, 4, "f32", "f8e4m3", MIRROR=True, MIRROR_PAGES=64, **SMALL),
                                    [(1, 45, 11), (0, 0, 9), (2, 7, 1)], True),
    # TMA: the mirrored pass's unmasked blocks by descriptor loads (3 KV heads: a head's columns at kvh x d)
    "paged4-full-fp8-mirror-tma": (constants(4, 2, 32, 0, 4, "f32", "f8e4m3", MIRROR=True, MIRROR_PAGES=64, TMA=True,
                                              **SMALL), [(1, 45, 11), (0, 0, 9), (2, 7, 1)], False),
    "paged4-full-fp8-mirror-tma-hkv3-short": (constants(6, 3, 16, 0, 4, "f32", "f8e4m3", MIRROR=True, MIRROR_PAGES=16,
                                                         TMA=True, **SMALL), [(1, 45, 11), (0, 0, 9), (2, 7, 1)], True),
    # MIRROR over a ring (sliding layers): each slot's positions from its first row's window start (rounded down to
    # BLOCK_N, the rows below the start zero) in pages of 64 rows, read linearly, across the ring's wrap; room for
    # all, for the first slot only (short), and slots of two pages with TMA blocks and the gate (shuffled tokens)
    "ring-w5-fp8-mirror": (constants(4, 2, 16, 5, None, "f32", "f8e4m3", MIRROR=True, MIRROR_PAGES=8, **SMALL),
                           RAGGED, False),
    "ring-w5-fp8-mirror-short": (constants(4, 2, 16, 5, None, "f32", "f8e4m3", MIRROR=True, MIRROR_PAGES=1,
                                           **SMALL), RAGGED, False),
    "ring-w20-fp8-mirror-tma-gate": (constants(4, 2, 32, 20, None, "f32", "f8e4m3", MIRROR=True, MIRROR_PAGES=8,
                                               TMA=True, GATE=True, **SMALL), [(1, 40, 70), (0, 3, 5), (3, 100, 17)],
                                     True),
    # TILE_ORDER: the plan ranks the tiles by the key positions their trips read, the passes take them in that order
    # (the same bits; shuffled tokens: runs of one slot within a tile are short; 12 tiles ranked in chunks of 4)
    "paged4-full-fp8-mirror-order": (constants(4, 2, 32, 0, 4, "f32", "f8e4m3", MIRROR=True, MIRROR_PAGES=64,
                                               TILE_ORDER=True, **SMALL), [(1, 45, 11), (0, 0, 9), (2, 7, 1)], False),
    "ring-w20-fp8-mirror-tma-gate-order": (constants(4, 2, 32, 20, None, "f32", "f8e4m3", MIRROR=True, MIRROR_PAGES=8,
                                                     TMA=True, GATE=True, TILE_ORDER=True, PLAN_TILES=4, **SMALL),
                                           [(1, 40, 70), (0, 3, 5), (3, 100, 17)], True),
    # head dims that are not a power of 2 >= 16 (8, 24, 40): tiles D_P wide, the padding columns masked (loaded as 0,
    # never stored); with the gate, and in the mirror (the same bits as without it)
    "ring-w5-d24-gate": (constants(4, 2, 24, 5, None, "f32", "f32", GATE=True, **SMALL), RAGGED, True),
    "ring-w5-d8": (constants(4, 2, 8, 5, None, "f32", "f32", **SMALL), RAGGED, False),
    "paged4-full-fp8-d40-mirror": (constants(6, 3, 40, 0, 4, "f32", "f8e4m3", MIRROR=True, MIRROR_PAGES=64, **SMALL),
                                   [(1, 45, 11), (0, 0, 9), (2, 7, 1)], False),
}
# a block table of 40 rows (the runtime's max_batch + 1), 3 of them with tokens: the plan's per-slot reduction (a row of
# 32 tokens of one slot: one atomic; the rest one a token) and the copy's search over the slots' run starts, with room
# for all three runs and, short, for the first only (slot 5's; slots 17 and 33 read the cache)
ROWS40 = {"paged4-full-fp8-mirror-order-rows40": (constants(4, 2, 32, 0, 4, "f32", "f8e4m3", MIRROR=True,
                                                            MIRROR_PAGES=64, TILE_ORDER=True, **SMALL),
                                                  [(33, 45, 40), (5, 0, 9), (17, 7, 1)], False),
          "paged4-full-fp8-mirror-rows40-short": (constants(4, 2, 32, 0, 4, "f32", "f8e4m3", MIRROR=True,
                                                            MIRROR_PAGES=4, **SMALL),
                                                  [(33, 45, 40), (5, 0, 9), (17, 7, 1)], True)}
CASES.update(ROWS40)


def tile_work(c: dict, slot: torch.Tensor, pos: torch.Tensor, block_t: int) -> list[int]:
    """TILE_ORDER's work of each token tile, in Python: per run of one slot among a tile's consecutive tokens, its
    last position + 1, less (with a window) its first one's window start."""
    out = []
    for t0 in range(0, len(slot), block_t):
        s, p = slot[t0:t0 + block_t].tolist(), pos[t0:t0 + block_t].tolist()
        w = sum(p[i] + 1 for i in range(len(s)) if i + 1 == len(s) or s[i + 1] != s[i])
        if c["WINDOW"]:
            w -= sum(max(p[i] - (c["WINDOW"] - 1), 0) for i in range(len(s)) if i == 0 or s[i - 1] != s[i])
        out.append(w)
    return out


def check_case(name: str, directory: Path) -> dict:
    c, seqs, shuffle = CASES[name]
    gated = c.get("GATE", False)
    mod = load_kernel(KernelSpec(TEMPLATE, "attention_gate" if gated else "attention", c), directory)
    assert mod._interpreted(), "triton did not pick the interpreter"
    n_slots = 40 if name in ROWS40 else 4
    ins = make_case(c, seqs, seed=len(name), shuffle=shuffle, n_slots=n_slots)
    gate = []
    if gated:  # g [T, HQ, D], rows a head apart more than their heads (strided), b [HQ, 1]
        gen = torch.Generator().manual_seed(len(name))
        T, hq, d = ins[0].shape
        gate = [torch.randn(T, (hq + 1) * d, generator=gen)[:, :hq * d].view(T, hq, d),
                torch.randn(hq, 1, generator=gen)]
    out = torch.full_like(ins[0], float("nan"))
    scratch = torch.full((mod.scratch_numel(len(ins[0])),), float("nan"))  # (MIRROR: the mirrors poisoned)
    mod.launch(*ins, *gate, out, scratch)
    want = reference(c, ins)
    if gated:
        want = REFS["sigmoid_gate"]([want, *gate], {})[0]
    assert not want.isnan().any()
    facts = dict(err=float("inf") if out.isnan().any() else rel_err(out, want), tiles=-(-len(ins[0]) // mod.BLOCK_T))
    if mod.MIRROR:  # the same bits as the render without MIRROR; which slots the plan mirrored
        plain = load_kernel(KernelSpec(TEMPLATE, "attention_gate" if gated else "attention",
                                       {k: v for k, v in c.items()
                                        if k not in ("MIRROR", "MIRROR_PAGES", "TMA", "TILE_ORDER")}),
                           directory)
        base = torch.full_like(out, float("nan"))
        plain.launch(*ins, *gate, base)
        assert torch.equal(out.view(torch.int32), base.view(torch.int32)), (out - base).abs().max()
        facts["mirrored_slots"] = int((scratch[2 * mod.MIRROR_NUMEL:].view(torch.int32)[:n_slots] >= 0).sum())
        assert facts["mirrored_slots"] == (1 if name.endswith("-short") else 3), facts
    if mod.TILE_ORDER:  # the plan's order: a permutation of the tiles, by work (the Python rule's), the most first
        n = facts["tiles"]
        meta = scratch[2 * mod.MIRROR_NUMEL:].view(torch.int32)[3 * mod.MIRROR_SLOTS:]
        order, work = meta[:n].tolist(), meta[n:2 * n].tolist()
        assert work == tile_work(c, ins[3], ins[4], mod.BLOCK_T), (work, tile_work(c, ins[3], ins[4], mod.BLOCK_T))
        assert sorted(order) == list(range(n)) and order == sorted(range(n), key=lambda j: (-work[j], -j)), order
        facts["order"] = order
    return facts


def _interpreted_main(out: str) -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: every case -> {name: {err, tiles} or {error}}."""
    directory = Path(out).parent / "kernels"
    interpret_cases(out, CASES, lambda name: check_case(name, directory))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    return run_interpreted_main("test_kernels_attention_prefill",
                                tmp_path_factory.mktemp("interpreted_attention_prefill") / "results.json")


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_fp32_matches_reference(name, interpreted):
    r = interpreted[name]
    assert "error" not in r, r.get("error")
    assert r["err"] < 1e-5, r


def test_cases_cover_the_layouts():
    """The ragged cases hold what the docstring promises: a chunk longer than a tile, 1-token chunks, prior context,
    ring chunks across the wrap, many shuffled pages."""
    c, seqs, _ = CASES["ring-w5"]
    cap = c["WINDOW"] - 1 + max(n for _, _, n in seqs)
    assert max(n for _, _, n in seqs) > c["BLOCK_M"] // (c["HQ"] // c["HKV"]) and min(n for _, _, n in seqs) == 1
    assert any(p // cap != (p + n - 1) // cap for _, p, n in seqs)  # across the wrap
    ins = make_case(*CASES["paged4-full"][:2], seed=0)
    bt = ins[5]
    assert bt.shape[1] >= 14 and not torch.equal(bt.flatten().sort()[0], bt.flatten())


# ---------------------------------------------------------------- 2. ahead-of-time compiles
def _jobs() -> list[tuple[str, dict, int]]:
    """(label, constants, arch): the full spec's TP-8 layers (sliding: ring, window 512; full: paged, page 16; bf16
    caches, and fp8 for the full layer) and the tiny spec's full layer, as rendered by default (PDL on), each for
    sm_90a and sm_100a. (The fp8 ring runs in the interpreter and on the GPU; a PDL-off render is checked by its
    source in test_pdl_off_render: an sm_100a compile costs ~12 s of CPU.)"""
    from beamc.spec import load_spec

    full, tiny = load_spec(ROOT / "models/beam.yaml"), load_spec(ROOT / "models/beam-tiny.yaml")
    variants = [("full-tp8,sliding,bf16", spec_constants(full, 8, "sliding")),
                ("full-tp8,full,bf16", spec_constants(full, 8, "full", page=16)),
                ("full-tp8,full,f8e4m3", spec_constants(full, 8, "full", "f8e4m3", page=16)),
                ("tiny,full", spec_constants(tiny, 1, "full", page=4)),
                ("full-tp8,full,f8e4m3,gate", dict(spec_constants(full, 8, "full", "f8e4m3", page=16), GATE=True)),
                # F16_DOT: q, K, V and p as fp16 MMA operands
                ("full-tp8,full,f8e4m3,gate,f16-dot", dict(spec_constants(full, 8, "full", "f8e4m3", page=16),
                                                           GATE=True, F16_DOT=True)),
                # EX2_FTZ: the softmax's exp2 as one ex2.approx.ftz
                ("full-tp8,sliding,bf16,ex2-ftz", dict(spec_constants(full, 8, "sliding"), EX2_FTZ=True))]
    # the MIRROR render (sm_90a): its three binaries (_OPTION: the index in LAUNCH_OPTIONS: the attention, the plan,
    # the copy)
    mirror = [(f"full-tp8,full,f8e4m3,gate,mirror,o{i}", dict(spec_constants(full, 8, "full", "f8e4m3", page=16),
                                                              GATE=True, MIRROR=True, _OPTION=i), 90) for i in range(3)]
    # and its attention with TMA loads of the mirrors' unmasked blocks (descriptor arguments), both targets
    tma = [("full-tp8,full,f8e4m3,gate,mirror,tma", dict(spec_constants(full, 8, "full", "f8e4m3", page=16),
                                                         GATE=True, MIRROR=True, TMA=True), arch) for arch in (90, 100)]
    # and its stage 2 as the warp-specialised Gluon kernel (WGMMA: wgmma, so sm_90a only), with and without the gate,
    # and with its two warpgroups as two partitions (WG_SPLIT)
    wgmma = [(f"full-tp8,full,f8e4m3,{'gate,' if gate else ''}mirror,wgmma",
              dict(spec_constants(full, 8, "full", "f8e4m3", page=16), GATE=gate, MIRROR=True, WGMMA=True, _OPTION=4),
              90) for gate in (False, True)] + [
        ("full-tp8,full,f8e4m3,gate,mirror,wgmma,split", dict(spec_constants(full, 8, "full", "f8e4m3", page=16),
                                                              GATE=True, MIRROR=True, WGMMA=True, WG_SPLIT=True,
                                                              _OPTION=4), 90)]
    # the sliding layers' MIRROR render over the ring (its plan, copy and Triton pass; sm_90a and sm_100a) and its
    # stage 2 on wgmma with the window mask (WG_SPLIT, the emitter's form; and gated)
    ring = [(f"full-tp8,sliding,f8e4m3,mirror,o{i}", dict(spec_constants(full, 8, "sliding", "f8e4m3"), MIRROR=True,
                                                          _OPTION=i), arch) for i in range(3) for arch in (90, 100)]
    ring += [(f"full-tp8,sliding,f8e4m3,{'gate,' if gate else ''}mirror,wgmma,split",
              dict(spec_constants(full, 8, "sliding", "f8e4m3"), GATE=gate, MIRROR=True, WGMMA=True, WG_SPLIT=True,
                   _OPTION=4), 90) for gate in (False, True)]
    # TILE_ORDER (the plan's ranking of the tiles by their work): the emitter's full-layer form's plan and Gluon pass
    order = [(f"full-tp8,full,f8e4m3,gate,mirror,wgmma,split,order,o{i}",
              dict(spec_constants(full, 8, "full", "f8e4m3", page=16), GATE=True, MIRROR=True, WGMMA=True,
                   WG_SPLIT=True, TILE_ORDER=True, _OPTION=i), 90) for i in (1, 4)]
    # ... with its partitions' key-block MMAs in turn (WG_PINGPONG)
    order += [("full-tp8,full,f8e4m3,gate,mirror,wgmma,split,order,pingpong",
               dict(spec_constants(full, 8, "full", "f8e4m3", page=16), GATE=True, MIRROR=True, WGMMA=True,
                    WG_SPLIT=True, TILE_ORDER=True, WG_PINGPONG=True, _OPTION=4), 90)]
    # the sliding layers' step render on sm90 (emitters.ATTENTION_SLIDING_PREFILL_TILES: 4 warps, EX2_FTZ), both targets
    from beamc.codegen.emitters import ATTENTION_SLIDING_PREFILL_TILES
    step = [("full-tp8,sliding,f8e4m3,gate,f16-dot,step-tile", dict(spec_constants(full, 8, "sliding", "f8e4m3"),
                                                                   GATE=True, F16_DOT=True,
                                                                   **ATTENTION_SLIDING_PREFILL_TILES), arch)
            for arch in (90, 100)]
    # head dims padded to a power of 2 (96 -> 128, 80 -> 128): the sliding step render over an fp8 ring (Q16_OUT
    # writes q's fp16 tile through the output rows: masked to the real columns) and a full layer's mirrored pass
    pad = [("d96,sliding,f8e4m3,gate,f16-dot,step-tile", dict(constants(6, 1, 96, 512, None, "bf16", "f8e4m3"),
                                                              GATE=True, F16_DOT=True,
                                                              **ATTENTION_SLIDING_PREFILL_TILES), 90),
           ("d80,full,f8e4m3,gate,mirror", dict(constants(6, 1, 80, 0, 16, "bf16", "f8e4m3"), GATE=True,
                                                MIRROR=True), 100)]
    return [(label, c, arch) for label, c in variants for arch in (90, 100)] + mirror + tma + wgmma + ring + order + \
        step + pad


def _compile(args) -> dict:
    """One AOT compile in a worker process (interpreter off)."""
    label, c, arch, directory = args
    os.environ.pop("TRITON_INTERPRET", None)
    c = dict(c)
    option = c.pop("_OPTION", 0)
    mod = load_kernel(KernelSpec(TEMPLATE, "attention_gate" if c.get("GATE") else "attention", c), directory)
    options = launch_options(mod)[option]
    ck = aot_compile(mod, arch, options)
    ptx = ck.asm["ptx"]
    return dict(label=f"{label}@sm_{arch}", arch=arch, cubin=len(ck.asm["cubin"]), shared=ck.metadata.shared,
                mma=bool(re.search(r"\b(wgmma|mma|tcgen05\.mma)\b", ptx)), target=f".target sm_{arch}a" in ptx,
                div_rn="div.rn.f32" in ptx, div_approx=bool(re.search(r"div\.(full|approx)", ptx)),
                pdl=c.get("PDL", True), launch_pdl=bool(ck.metadata.launch_pdl), options=options,
                stage=options.get("constexprs", {}).get("ONLY", 2), f16_dot=mod.F16_DOT,
                wgmma_dtypes=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.f32\.(\w+)\.", ptx))),
                **pdl_facts(ptx))


def test_aot_compile_every_variant(tmp_path):
    """Full spec TP-8 (HQ 6, HKV 1, d 128; window 512 ring / page 16 paged; bf16 and fp8 caches) and tiny spec
    variants for sm_90a and sm_100a (2 processes): tensor-core MMAs, shared memory within the limit, the OPTIONS
    contract, PDL (launch_dependents first, one wait, no store before it), no flush-to-zero, no approximate
    division."""
    jobs = [(label, c, arch, str(tmp_path / f"sm{arch}")) for label, c, arch in _jobs()]
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_compile, jobs))
    for r in results:
        assert r["cubin"] > 0 and r["target"] and r["shared"] <= SMEM_LIMIT, r
        if r["stage"] == 2:  # the attention (MIRROR's plan and copy stages: no MMA, no division)
            assert r["mma"], f"{r['label']}: no tensor-core MMA"
            assert r["div_rn"] and not r["div_approx"], r  # the normalisation: IEEE reciprocals, no approximate division
        opts = {k: v for k, v in r["options"].items() if k not in ("num_stages", "constexprs", "fn")}  # (num_stages
        # only where not Triton's 3; fn: a module's second kernel)
        assert opts == dict(num_warps=opts["num_warps"], enable_fp_fusion=False, enable_reflect_ftz=False,
                            launch_pdl=r["pdl"]) and r["options"].get("num_stages", 2) == 2, r
        assert r["launch_pdl"] == r["pdl"], r
        check_pdl_ptx(r, True, r["label"])
        assert r["waits"] == 1, r
        if r["arch"] == 90 and r["stage"] == 2 and "f8e4m3" in r["label"]:  # wgmma operands: fp16 only with F16_DOT
            assert r["wgmma_dtypes"] == (["f16"] if r["f16_dot"] else ["bf16"]), r
    assert len(results) == 37


# ---------------------------------------------------------------- 3. the contract
@pytest.mark.parametrize("paged,cache", [(False, "bf16"), (True, "bf16"), (True, "f8e4m3"), (False, "f8e4m3")])
def test_rendered_module_contract(paged, cache, tmp_path):
    c = constants(6, 1, 128, 0 if paged else 512, 16 if paged else None, "bf16", cache)
    mod = load_kernel(KernelSpec(TEMPLATE, "attention", c), tmp_path)
    assert mod.__doc__ and "attention" in mod.__doc__ and isinstance(mod.GRID, str)
    args = ["q", "kc", "vc", "slot", "pos"] + (["block_table"] if paged else []) + \
        (["k_scale", "v_scale"] if cache == "f8e4m3" else []) + ["out", "scratch"]
    assert list(inspect.signature(mod.launch).parameters) == args
    assert inspect.signature(mod.launch).parameters["scratch"].default is None and mod.scratch_numel(1000) == 0
    assert_template_contract(mod)
    assert mod.G == 6 and mod.BLOCK_T == mod.BLOCK_M // 6 and mod.WINDOW == (0 if paged else 512)
    if cache == "f8e4m3":  # the MIRROR render: the same launcher arguments, scratch for the mirrors (pages of the
        # pool's 16 rows, or of 64 over a ring), the plan's three int32 arrays and its three per-slot ones
        mirror = load_kernel(KernelSpec(TEMPLATE, "attention", dict(c, MIRROR=True)), tmp_path)
        assert list(inspect.signature(mirror.launch).parameters) == args and mirror.MIRROR and not mod.MIRROR
        rows = 65536 * 16 if paged else 512 * 64
        assert mirror.MPAGE == (16 if paged else 64) and mirror.scratch_numel(1000) == 2 * rows * 128 + 6 * 4096 * 2
        assert_template_contract(mirror)


def test_pdl_off_render(tmp_path):
    """PDL=False (and the fp32 default): no griddepcontrol in the kernel, launch_pdl off."""
    for c in (constants(6, 1, 128, 512, None, "bf16", "f8e4m3", PDL=False), constants(4, 2, 16, 0, 4, "f32", "f32")):
        ks = KernelSpec(TEMPLATE, "attention", c)
        src = ks.source()
        assert "gdc_" not in src and "tl.extra.cuda" not in src
        mod = load_kernel(ks, tmp_path)
        assert mod.PDL is False and mod.OPTIONS["launch_pdl"] is False
