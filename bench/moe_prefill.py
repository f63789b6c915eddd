"""The prefill NVFP4 MoE experts kernel (`moe_nvfp4_prefill`, issue 8) at one TP-8 rank of Beam, beside torch.

Imported by `bench/kernels.py` (`bench_cases(graph_time, copy_bw)`; `graph_time(fn, reps)` gives the seconds of one
`fn()` replayed in a CUDA graph); its records join that JSON:
- 16384 tokens x top-8 of 256 experts (k distinct random experts per token: ~512 rows per expert) at the TP-8
  shapes (H 5120, I 320), bf16 activations, NVFP4 weights: the generated kernel (all five launches: the sort and
  the two grouped GEMMs), TFLOP/s = 2 x pairs x 3 x H x I / time, TB/s = (all experts' NVFP4 bytes + x + y) / time;
- the torch baseline in the same run, on the experts' bf16 dequantised weights (what the reference multiplies):
  pairs sorted by expert on the device (argsort, scatter_add counts, cumsum), x rows gathered, torch._grouped_mm
  (gate_up), SwiGLU in fp32, torch._grouped_mm (down), rows scattered back to [T, k, H]; where _grouped_mm is
  missing or refuses, one torch.mm per expert on host-known row ranges (routing fixed for the run);
- the same kernel with other tiles (BLOCK_M 256 with 2 stages; BLOCK_M 64 with 4 warps), to choose the default from;
- the kernel rendered with NATIVE_FP4 (tl.dot_scaled; the sm100 path, emulated by Triton on sm_90) where the
  installed Triton compiles it (>= 3.9; 3.6 rejects a bf16 operand with e4m3 scales): a record, or the reason.
The kernel's y is checked against the baseline's (relative error < 1e-2) after the timing.
    python bench/moe_prefill.py [--tokens 16384]     (standalone: prints the records)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from beamc.codegen.kernel import KernelSpec, load_kernel  # noqa: E402
from beamc.spec import load_spec  # noqa: E402

TEMPLATE = "moe_nvfp4_prefill"
TOKENS = 16384
# (record label, render constants beside the node's, weights re-laid out): the default tiles on both layouts (the
# runtime re-lays out at load on sm90), the transposed GEMMs (SWAP: dequantised weights as wgmma's register A
# operand), alternatives to choose from, the sm100 path (emulated on sm_90)
# the 256-row form with WG_HALF and stage 3's load partition on 8 warps (stage 4's on 4); with two load partitions
# of 4 warps in stage 3 instead, a ring slot ahead each; ring slots of 4 K steps, a slot ahead (stage 4's 2)
_LOAD8S3 = dict(WGMMA=True, BLOCK_M=256, WG_STAGES=3, WG_WDEPTH=2, WG_WSTEPS=2, WG_V16=True, WG_HALF=True,
                WG_LOAD_WARPS=8, WG_LOAD_REGS=64, WG_LOAD_WARPS4=4, WG_LOAD_REGS4=96)
_PARTS2 = dict(_LOAD8S3, WG_WDEPTH=1, WG_WDEPTH4=2, WG_LOAD_WARPS=4, WG_LOAD_PARTS=2)
_WSTEPS4 = dict(WG_WDEPTH=1, WG_WDEPTH4=2, WG_WSTEPS=4)
# the emitter's forms (`emitters.MOE_WGMMA_FORMS`) as they stand, and with stage 2's ranks from comparison tiles
# (RANK_SORT=False: the template's default before s41, when s41run1-2 ran these as "RANK_SORT" beside the default
# then; the sort alone: bench/moe_sort.py), the form a second time after it (the drift between the two)
from beamc.codegen.emitters import moe_wgmma_form  # noqa: E402


def _form_variants(tag: str, names: tuple, extras: tuple) -> tuple:
    """The emitter's forms `names`, each with every (label, constants) of `extras`, re-laid-out weights."""
    return tuple((f"moe_nvfp4_prefill emitter {name}{label} ({tag})", dict(moe_wgmma_form(name), **extra), True)
                 for name in names for label, extra in extras)


_RANKSORT = _form_variants("ranksort", ("bm256", "bm128"),
                           (("", {}), (" RANK_SORT=0", dict(RANK_SORT=False)), (" again", {})))
# the 128-row form (2,048 .. 8,191 tokens) with the sort in a binary of its own (SORT_ALONE; the 256-row form has it):
# s37 measured no gain with the comparison-tile ranks; the sort alone now 10.9 -> 8.1 us at 2,048 tokens (s41run1)
_SORT128 = _form_variants("sort128", ("bm128",), (("", {}), (" SORT_ALONE", dict(SORT_ALONE=True)), (" again", {}),
                                                   (" SORT_ALONE again", dict(SORT_ALONE=True))))
# the 256-row form with parts of stages 3 / 4 left out (WG_DIAG, WRONG outputs: timing only, no checks): what bounds
# each stage. 1 the load partition's decode, 2 the words' copies, 4 the A rows' copies, 8 the wgmma, 16 the output
# stores (in stage 3 the compiler then drops the MMA partition's work: read stage 4 only); 7 no load-side work, 24
# the load side alone, 23 the MMAs and barriers alone
_DIAG = _form_variants("diag", ("bm256",), tuple((f" diag={d}" if d else "", dict(WG_DIAG=d) if d else {})
                                                 for d in (0, 1, 2, 3, 4, 7, 8, 16, 23, 24))
                        + (("", {}), (" again", {})))
# the 256-row form with stage 4's words by TMA boxes and its scale words by loads a tile ahead (WG_WTMA4)
_WTMA4 = _form_variants("wtma4", ("bm256",), (("", {}), (" WG_WTMA4", dict(WG_WTMA4=True)), (" again", {}),
                                              (" WG_WTMA4 again", dict(WG_WTMA4=True))))
# ... and y's stores evict-first (WG_YSTREAM), alone and with WG_WTMA4
_YSTREAM = _form_variants("ystream", ("bm256",), tuple(
    (label, extra) for _ in range(2) for label, extra in (
        ("", {}), (" WG_WTMA4", dict(WG_WTMA4=True)), (" WG_YSTREAM", dict(WG_YSTREAM=True)),
        (" WG_WTMA4 WG_YSTREAM", dict(WG_WTMA4=True, WG_YSTREAM=True)))))
VARIANTS = _RANKSORT + _SORT128 + _DIAG + _WTMA4 + _YSTREAM + (
    ("moe_nvfp4_prefill", {}, False),
    ("moe_nvfp4_prefill relaid", {}, True),
    ("moe_nvfp4_prefill swap", dict(SWAP=True), False),
    ("moe_nvfp4_prefill swap relaid", dict(SWAP=True), True),
    ("moe_nvfp4_prefill swap relaid stages=4", dict(SWAP=True, NUM_STAGES=4), True),
    ("moe_nvfp4_prefill swap relaid BLOCK_M=64", dict(SWAP=True, BLOCK_M=64), True),
    ("moe_nvfp4_prefill relaid BLOCK_M=64 warps=4", dict(BLOCK_M=64, NUM_WARPS=4), True),
    ("moe_nvfp4_prefill swap relaid BLOCK_M=64 warps=4", dict(SWAP=True, BLOCK_M=64, NUM_WARPS=4), True),
    ("moe_nvfp4_prefill BLOCK_M=256 stages=2", dict(BLOCK_M=256, NUM_STAGES=2), False),
    ("moe_nvfp4_prefill native_fp4", dict(NATIVE_FP4=True), False),
    # DEQUANT: the gate_up weights of the experts with rows dequantised once into bf16 scratch, then that GEMM on plain
    # bf16 tiles; the down GEMM with its dequantisation in the loop on 64-row parts of the 128-row blocks
    ("moe_nvfp4_prefill dequant relaid", dict(DEQUANT=True), True),
    # WGMMA: stages 3 and 4 as one warp-specialised Gluon kernel (wgmma, the weights decoded by a load partition in
    # the main loop: no dequantised scratch); its tile forms (tests/gpu: test_wgmma_render checks the same)
    # (2026-12-05 run 2, the words a step ahead in registers: every form 1.1-1.7x slower than DEQUANT_DOWN, stage 3
    # ~2,400 cycles a K step; stages=6, WG_NT2=40, WG_LOAD_REGS=128 no better: dropped here; now a cp.async ring)
    ("moe_nvfp4_prefill wgmma relaid", dict(WGMMA=True), True),
    ("moe_nvfp4_prefill wgmma relaid WG_WDEPTH=2", dict(WGMMA=True, WG_WDEPTH=2), True),
    ("moe_nvfp4_prefill wgmma relaid WG_WDEPTH=8", dict(WGMMA=True, WG_WDEPTH=8), True),
    ("moe_nvfp4_prefill wgmma relaid stages=5", dict(WGMMA=True, WG_STAGES=5), True),
    ("moe_nvfp4_prefill wgmma relaid WG_BN=128 stages=3", dict(WGMMA=True, WG_BN=128, WG_STAGES=3), True),
    ("moe_nvfp4_prefill wgmma relaid WG_BN2=256 stages=2", dict(WGMMA=True, WG_BN2=256, WG_STAGES=2), True),
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2", dict(WGMMA=True, BLOCK_M=256, WG_STAGES=3,
                                                                              WG_WDEPTH=2), True),
    ("moe_nvfp4_prefill wgmma relaid WG_LOAD_WARPS=8", dict(WGMMA=True, WG_LOAD_WARPS=8), True),
    ("moe_nvfp4_prefill wgmma relaid WG_STORE", dict(WGMMA=True, WG_STORE=True), True),
    ("moe_nvfp4_prefill wgmma relaid WG_HRES", dict(WGMMA=True, WG_HRES=True), True),
    ("moe_nvfp4_prefill wgmma relaid WG_ACOPY", dict(WGMMA=True, WG_ACOPY=True), True),
    ("moe_nvfp4_prefill wgmma relaid WG_WSTEPS=2", dict(WGMMA=True, WG_WSTEPS=2), True),
    ("moe_nvfp4_prefill wgmma relaid WG_WSTEPS=4 WG_WDEPTH=2", dict(WGMMA=True, WG_WSTEPS=4, WG_WDEPTH=2), True),
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2", dict(WGMMA=True, BLOCK_M=256,
                                                                                       WG_STAGES=3, WG_WDEPTH=2,
                                                                                       WG_WSTEPS=2), True),
    ("moe_nvfp4_prefill wgmma relaid WG_WSTEPS=2 WG_ACOPY WG_HRES", dict(WGMMA=True, WG_WSTEPS=2, WG_ACOPY=True,
                                                                         WG_HRES=True), True),
    ("moe_nvfp4_prefill wgmma relaid WG_ACOPY WG_HRES", dict(WGMMA=True, WG_ACOPY=True, WG_HRES=True), True),
    # WG_V16: stage 4's words (the relayout's chunks of one K step) in 16-byte copies; the two default forms with it
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16",
     dict(WGMMA=True, BLOCK_M=256, WG_STAGES=3, WG_WDEPTH=2, WG_WSTEPS=2, WG_V16=True), True),
    ("moe_nvfp4_prefill wgmma relaid WG_WSTEPS=2 WG_ACOPY WG_HRES WG_V16",
     dict(WGMMA=True, WG_WSTEPS=2, WG_ACOPY=True, WG_HRES=True, WG_V16=True), True),
    # WG_HALF: the experts' last blocks' MMAs on 64 rows (at most 64 real) or 128 (at most 128, BLOCK_M 256): random
    # routing pads 19% of the 256-row form's rows at 16,384 tokens (5% with it), 50% of the 128-row form's at 2,048
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF",
     dict(WGMMA=True, BLOCK_M=256, WG_STAGES=3, WG_WDEPTH=2, WG_WSTEPS=2, WG_V16=True, WG_HALF=True), True),
    ("moe_nvfp4_prefill wgmma relaid WG_WSTEPS=2 WG_ACOPY WG_HRES WG_V16 WG_HALF",
     dict(WGMMA=True, WG_WSTEPS=2, WG_ACOPY=True, WG_HRES=True, WG_V16=True, WG_HALF=True), True),
    # the 256-row form's load partition on 8 warps (64 registers each): if the decode and copies bound it
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_LOAD_WARPS=8",
     dict(WGMMA=True, BLOCK_M=256, WG_STAGES=3, WG_WDEPTH=2, WG_WSTEPS=2, WG_V16=True, WG_LOAD_WARPS=8,
          WG_LOAD_REGS=64), True),
    # ... on 8 load warps in stage 3 only (s31run1: stage 3 -3.8% with 8, stage 4 +11%)
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=8 (stage 3)",
     _LOAD8S3, True),
    # ... with ring slots of 4 K steps, a slot ahead (stage 4's 2): the words' copies on whole 32-byte sectors, two
    # lanes a run (ncu s32run4: the 2-step runs' copies 32 wavefronts each, ideal 4; half of each sector used)
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=1 WG_WSTEPS=4 WG_V16 WG_HALF WG_LOAD_WARPS=8 (stage 3)",
     dict(_LOAD8S3, **_WSTEPS4), True),
    # two load partitions of 4 warps on alternate 2-step runs (each one's bar.syncs its own; a ring slot ahead each),
    # and with the A rows as 32-bit offsets (the partitions spill ~60 / ~20 values each at 64 registers)
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=1 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_PARTS=2 (stage 3)",
     _PARTS2, True),
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=1 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_PARTS=2 WG_A32 (stage 3)",
     dict(_PARTS2, WG_A32=True), True),
    # ... with stage 3's words and scale bytes by TMA boxes (WG_WTMA: no word copies, no address arithmetic in the
    # load partition), and with the A rows by the A partition too (no cp.async left in the fencing threads)
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=8 WG_WTMA (wtma)",
     dict(_LOAD8S3, WG_WTMA=True), True),
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=8 WG_LOAD_REGS=56 WG_ACOPY WG_ACOPY_REGS=40 WG_A32 WG_WTMA (wtma)",
     dict(_LOAD8S3, WG_LOAD_REGS=56, WG_ACOPY=True, WG_ACOPY_REGS=40, WG_A32=True, WG_WTMA=True), True),
    # ... with stage 4's A rows by TMA too (s34run1: WG_WTMA -5.0%, WG_ATMA -3.9% alone), and WG_WTMA beside the A
    # partition with 4 load warps (s34run1: that form -3.8% alone)
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=8 WG_WTMA WG_ATMA (wtma2)",
     dict(_LOAD8S3, WG_WTMA=True, WG_ATMA=True), True),
    # ... and stage 4's MMA partition without its fence before each wgmma (WG_NOFENCE4; fence_probe's mode 6 asks
    # whether that fence waits for the wgmma in flight)
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=8 WG_WTMA WG_ATMA WG_NOFENCE4 (wtma2)",
     dict(_LOAD8S3, WG_WTMA=True, WG_ATMA=True, WG_NOFENCE4=True), True),
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=4 WG_ACOPY WG_ACOPY_REGS=40 WG_A32 WG_WTMA (wtma2)",
     dict(_LOAD8S3, WG_LOAD_WARPS=4, WG_ACOPY=True, WG_ACOPY_REGS=40, WG_A32=True, WG_WTMA=True), True),
    # ... the A partition in stage 3 only, stage 4's A rows by TMA (s35run1: stage 3 1,810 us beside the A partition,
    # stage 4 1,244 with WG_ATMA), and without stage 4's fence too
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=4 WG_ACOPY WG_ACOPY_REGS=40 WG_A32 WG_WTMA WG_ACOPY4=0 WG_ATMA (atma4)",
     dict(_LOAD8S3, WG_LOAD_WARPS=4, WG_ACOPY=True, WG_ACOPY_REGS=40, WG_A32=True, WG_WTMA=True, WG_ACOPY4=False,
          WG_ATMA=True), True),
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=4 WG_ACOPY WG_ACOPY_REGS=40 WG_A32 WG_WTMA WG_ACOPY4=0 WG_ATMA WG_NOFENCE4 (atma4)",
     dict(_LOAD8S3, WG_LOAD_WARPS=4, WG_ACOPY=True, WG_ACOPY_REGS=40, WG_A32=True, WG_WTMA=True, WG_ACOPY4=False,
          WG_ATMA=True, WG_NOFENCE4=True), True),
    # ... stage 4's stores deferred into the next tile's K steps (WG_DSTORE), in both candidate forms
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=8 WG_WTMA WG_ATMA WG_DSTORE (dstore)",
     dict(_LOAD8S3, WG_WTMA=True, WG_ATMA=True, WG_DSTORE=True), True),
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=4 WG_ACOPY WG_ACOPY_REGS=40 WG_A32 WG_WTMA WG_ACOPY4=0 WG_ATMA WG_DSTORE (dstore)",
     dict(_LOAD8S3, WG_LOAD_WARPS=4, WG_ACOPY=True, WG_ACOPY_REGS=40, WG_A32=True, WG_WTMA=True, WG_ACOPY4=False,
          WG_ATMA=True, WG_DSTORE=True), True),
    # ... the emitter's form (the last) with stages 0-2 as a binary of their own on 4 warps (SORT_ALONE: without it
    # they run in the binary of the Triton GEMM stages, 210 KB of shared memory, one program per SM), and on 8
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=4 WG_ACOPY WG_ACOPY_REGS=40 WG_A32 WG_WTMA WG_ACOPY4=0 WG_ATMA WG_DSTORE SORT_ALONE (sort)",
     dict(_LOAD8S3, WG_LOAD_WARPS=4, WG_ACOPY=True, WG_ACOPY_REGS=40, WG_A32=True, WG_WTMA=True, WG_ACOPY4=False,
          WG_ATMA=True, WG_DSTORE=True, SORT_ALONE=True), True),
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=4 WG_ACOPY WG_ACOPY_REGS=40 WG_A32 WG_WTMA WG_ACOPY4=0 WG_ATMA WG_DSTORE SORT_ALONE SORT_WARPS=8 (sort)",
     dict(_LOAD8S3, WG_LOAD_WARPS=4, WG_ACOPY=True, WG_ACOPY_REGS=40, WG_A32=True, WG_WTMA=True, WG_ACOPY4=False,
          WG_ATMA=True, WG_DSTORE=True, SORT_ALONE=True, SORT_WARPS=8), True),
    # ... the emitter's form (SORT_ALONE since s37) with each store chunk's pair indices loaded a K step ahead
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=4 WG_ACOPY WG_ACOPY_REGS=40 WG_A32 WG_WTMA WG_ACOPY4=0 WG_ATMA WG_DSTORE SORT_ALONE WG_DPAIRS (dpairs)",
     dict(_LOAD8S3, WG_LOAD_WARPS=4, WG_ACOPY=True, WG_ACOPY_REGS=40, WG_A32=True, WG_WTMA=True, WG_ACOPY4=False,
          WG_ATMA=True, WG_DSTORE=True, SORT_ALONE=True, WG_DPAIRS=True), True),
    # ... with the load partition's A-row copies of a step after its fence (WG_ALATE), alone and with WG_WTMA
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=8 WG_ALATE (wtma)",
     dict(_LOAD8S3, WG_ALATE=True), True),
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=8 WG_WTMA WG_ALATE (wtma)",
     dict(_LOAD8S3, WG_WTMA=True, WG_ALATE=True), True),
    # ... with stage 4's tiles stored by a partition of 4 warps through one 64 KB buffer (WG_STORE_BUFS 1), the next
    # tile's MMAs going on meanwhile (K = I = 320: 5 K steps a tile, then the epilogue); with the A rows copied by a
    # partition of their own (WG_ACOPY: its cp.async arrive tracks them only, not the weight words copied ahead).
    # s33run1, with the store partition on 128 registers / the A partition on 56 beside 8 load warps: 5,926 / 7,508
    # us against 3,349, the MMA partition left with 144 registers and its wgmma serialised by ptxas (a
    # WARPGROUP.DEPBAR after every HGMMA; the template now refuses that). Here the store partition on 64 (MMA 176),
    # the A partition on 40 with 32-bit offsets beside 4 load warps (MMA 200) or 8 on 56 (MMA 160)
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=8 WG_STORE WG_STORE_BUFS=1 WG_STORE_REGS=64 (regs256)",
     dict(_LOAD8S3, WG_STORE=True, WG_STORE_BUFS=1, WG_STORE_REGS=64), True),
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=4 WG_ACOPY WG_ACOPY_REGS=40 WG_A32 (regs256)",
     dict(_LOAD8S3, WG_LOAD_WARPS=4, WG_ACOPY=True, WG_ACOPY_REGS=40, WG_A32=True), True),
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=8 WG_LOAD_REGS=56 WG_ACOPY WG_ACOPY_REGS=40 WG_A32 (regs256)",
     dict(_LOAD8S3, WG_LOAD_REGS=56, WG_ACOPY=True, WG_ACOPY_REGS=40, WG_A32=True), True),
    # ... with stage 4's A rows (h's sorted rows) by one TMA copy a step instead of 16 cp.async a load thread (WG_ATMA),
    # and with the store partition too
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=8 WG_ATMA (regs256)",
     dict(_LOAD8S3, WG_ATMA=True), True),
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_LOAD_WARPS=8 WG_ATMA WG_STORE WG_STORE_BUFS=1 WG_STORE_REGS=64 (regs256)",
     dict(_LOAD8S3, WG_ATMA=True, WG_STORE=True, WG_STORE_BUFS=1, WG_STORE_REGS=64), True),
    # WG_AQ: the A rows copied only as far as WG_HALF's MMAs read them (an expert's last block: 64-row quarters)
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=2 WG_WSTEPS=2 WG_V16 WG_HALF WG_AQ WG_LOAD_WARPS=8 (stage 3)",
     dict(_LOAD8S3, WG_AQ=True), True),
    ("moe_nvfp4_prefill wgmma relaid BLOCK_M=256 stages=3 WG_WDEPTH=1 WG_WSTEPS=4 WG_V16 WG_HALF WG_AQ WG_LOAD_WARPS=8 (stage 3)",
     dict(_LOAD8S3, **_WSTEPS4, WG_AQ=True), True),
    ("moe_nvfp4_prefill wgmma relaid WG_WSTEPS=2 WG_ACOPY WG_HRES WG_V16 WG_HALF WG_AQ",
     dict(WGMMA=True, WG_WSTEPS=2, WG_ACOPY=True, WG_HRES=True, WG_V16=True, WG_HALF=True, WG_AQ=True), True),
    ("moe_nvfp4_prefill wgmma relaid WG_WSTEPS=2 WG_ACOPY WG_HRES WG_V16 WG_HALF WG_AQ WG_DSTORE (dstore)",
     dict(WGMMA=True, WG_WSTEPS=2, WG_ACOPY=True, WG_HRES=True, WG_V16=True, WG_HALF=True, WG_AQ=True, WG_DSTORE=True),
     True),
    ("moe_nvfp4_prefill wgmma relaid WG_WSTEPS=2 WG_ACOPY WG_HRES WG_V16 WG_HALF WG_AQ SORT_ALONE (sort)",
     dict(WGMMA=True, WG_WSTEPS=2, WG_ACOPY=True, WG_HRES=True, WG_V16=True, WG_HALF=True, WG_AQ=True,
          SORT_ALONE=True), True),
    ("moe_nvfp4_prefill wgmma relaid WG_WSTEPS=2 WG_ACOPY WG_HRES WG_V16 WG_HALF WG_AQ WG_ACOPY4=0 WG_ATMA (atma4)",
     dict(WGMMA=True, WG_WSTEPS=2, WG_ACOPY=True, WG_HRES=True, WG_V16=True, WG_HALF=True, WG_AQ=True, WG_ACOPY4=False,
          WG_ATMA=True), True),
    # 128-row blocks x 256 weight rows (m64n256): x re-read 3 times a row block instead of 5 (if stage 3 waits on the
    # L2's A traffic), twice the 256-row form's decode per FLOP
    ("moe_nvfp4_prefill wgmma relaid WG_BN=128 stages=3 WG_WDEPTH=1 WG_WSTEPS=2 WG_V16 WG_HRES WG_HALF",
     dict(WGMMA=True, WG_BN=128, WG_STAGES=3, WG_WDEPTH=1, WG_WSTEPS=2, WG_V16=True, WG_HRES=True, WG_HALF=True),
     True),
    ("moe_nvfp4_prefill wgmma relaid WG_HRES WG_STORE WG_WDEPTH=2", dict(WGMMA=True, WG_HRES=True, WG_STORE=True,
                                                                          WG_WDEPTH=2), True),
    ("moe_nvfp4_prefill wgmma modelopt (Triton stages, BLOCK_M 128)", dict(WGMMA=True), False),
    ("moe_nvfp4_prefill dequant relaid BLOCK_N=64 BLOCK_K=128", dict(DEQUANT=True, BLOCK_N=64, BLOCK_K=128), True),
    ("moe_nvfp4_prefill dequant relaid DQ_ROWS=64", dict(DEQUANT=True, DQ_ROWS=64), True),
    ("moe_nvfp4_prefill dequant relaid stages=4", dict(DEQUANT=True, NUM_STAGES=4), True),
    ("moe_nvfp4_prefill dequant relaid BLOCK_M2=128 SWAP2 warps2=8", dict(DEQUANT=True, BLOCK_M2=128, NUM_WARPS2=8),
     True),
    # the down GEMM's tiles in the DEQUANT render (its own binary): 128 columns of H per program, 32 values of I a step
    # (H200 2026-12-01 run 8: all slower than 256 x 64: 3.06 / 3.75 / 4.50 ms vs 2.88)
    ("moe_nvfp4_prefill dequant relaid down BLOCK_N2=128", dict(DEQUANT=True, BLOCK_N2=128), True),
    ("moe_nvfp4_prefill dequant relaid down BLOCK_N2=128 BLOCK_K2=32", dict(DEQUANT=True, BLOCK_N2=128, BLOCK_K2=32),
     True),
    ("moe_nvfp4_prefill dequant relaid down BLOCK_K2=32", dict(DEQUANT=True, BLOCK_K2=32), True),
    # the down GEMM walking DOWN_NT column tiles in one flattened loop (the pipeline kept full across its tiles), on
    # in-loop dequantised tiles or on down weights stage 5 dequantised too (DEQUANT_DOWN: its defaults are 128-row
    # blocks, 8 warps, no SWAP2, every column tile in one loop). H200 2026-12-01 s8run5 (after the store fix), us of
    # the down stage / all: DEQUANT 1,992 / 4,386; + DOWN_NT 4 / 20: 2,359 / 2,375; DEQUANT_DOWN at 64 rows SWAP2
    # 2,141, + DOWN_NT 4 / 20 1,706 / 1,473; at 128 rows 8 warps DOWN_NT 4 1,319 (SWAP2) / 1,295; the DEQUANT_DOWN
    # default 1,268 / 3,942
    ("moe_nvfp4_prefill dequant relaid down_nt=4", dict(DEQUANT=True, DOWN_NT=4), True),
    ("moe_nvfp4_prefill dequant relaid down_nt=20", dict(DEQUANT=True, DOWN_NT=20), True),
    ("moe_nvfp4_prefill dequant_down relaid", dict(DEQUANT=True, DEQUANT_DOWN=True), True),
    ("moe_nvfp4_prefill dequant_down relaid BLOCK_M2=64 swap2 warps2=4 down_nt=1",
     dict(DEQUANT=True, DEQUANT_DOWN=True, BLOCK_M2=64, SWAP2=True, NUM_WARPS2=4, DOWN_NT=1), True),
    ("moe_nvfp4_prefill dequant_down relaid BLOCK_M2=64 swap2 warps2=4 down_nt=20",
     dict(DEQUANT=True, DEQUANT_DOWN=True, BLOCK_M2=64, SWAP2=True, NUM_WARPS2=4, DOWN_NT=20), True),
    ("moe_nvfp4_prefill dequant_down relaid down_nt=4", dict(DEQUANT=True, DEQUANT_DOWN=True, DOWN_NT=4), True),
    ("moe_nvfp4_prefill dequant_down relaid down_nt=4 swap2", dict(DEQUANT=True, DEQUANT_DOWN=True, DOWN_NT=4,
                                                                   SWAP2=True), True),
    # DEQUANT_DOWN's down GEMM at other tiles (not yet measured; its 1.27 ms is 339 TFLOP/s): 128 columns (128
    # registers: two programs an SM where shared memory allows), K steps of 32, 3-deep pipelines
    ("moe_nvfp4_prefill dequant_down relaid BLOCK_N2=128", dict(DEQUANT=True, DEQUANT_DOWN=True, BLOCK_N2=128), True),
    ("moe_nvfp4_prefill dequant_down relaid BLOCK_N2=128 stages=3",
     dict(DEQUANT=True, DEQUANT_DOWN=True, BLOCK_N2=128, NUM_STAGES=3), True),
    ("moe_nvfp4_prefill dequant_down relaid BLOCK_K2=32", dict(DEQUANT=True, DEQUANT_DOWN=True, BLOCK_K2=32), True),
    ("moe_nvfp4_prefill dequant_down relaid stages=3", dict(DEQUANT=True, DEQUANT_DOWN=True, NUM_STAGES=3), True),
    # SCAN_PAR=False: the sort's stage 1 in one program (the default before s9run2: ~120 us at 16,384 tokens; SCAN_PAR,
    # stage 1 over expert columns in parallel, 7 us)
    ("moe_nvfp4_prefill dequant_down relaid scan_seq", dict(DEQUANT=True, DEQUANT_DOWN=True, SCAN_PAR=False), True),
    ("moe_nvfp4_prefill dequant relaid scan_seq", dict(DEQUANT=True, SCAN_PAR=False), True),
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _baseline(x, idx, gu, dn, I: int, y):
    """(fn, label): the torch route on bf16 weights gu [E, 2I, H], dn [E, H, I], writing y [T, k, H]."""
    T, k = idx.shape
    E, H = gu.shape[0], x.shape[1]
    flat = idx.flatten()
    ones = torch.ones_like(flat, dtype=torch.int32)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device)
    yf = y.view(T * k, H)
    gu_t, dn_t = gu.transpose(-2, -1), dn.transpose(-2, -1)  # [E, H, 2I], [E, I, H]: column-major, as _grouped_mm wants

    def grouped():
        order = torch.argsort(flat, stable=True)
        counts.zero_()
        counts.scatter_add_(0, flat, ones)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xs = x[order // k]
        h = torch._grouped_mm(xs, gu_t, offs=offs)
        a = (torch.nn.functional.silu(h[:, :I].float()) * h[:, I:].float()).to(x.dtype)
        yf[order] = torch._grouped_mm(a, dn_t, offs=offs)

    if hasattr(torch, "_grouped_mm"):
        try:
            grouped()
            torch.cuda.synchronize()
            return grouped, "torch._grouped_mm (bf16 dequantised weights) + SwiGLU + sort/gather/scatter, CUDA graph"
        except Exception as e:  # noqa: BLE001 - fall back to the per-expert loop
            print(f"torch._grouped_mm unavailable here ({type(e).__name__}: {e}); per-expert torch.mm instead")
    order = torch.argsort(flat, stable=True)
    cnt = torch.bincount(flat, minlength=E).tolist()  # host-known (outside the graph)
    bounds = [0]
    for c in cnt:
        bounds.append(bounds[-1] + c)
    xs_buf = torch.empty(T * k, H, dtype=x.dtype, device=x.device)
    out_buf = torch.empty_like(xs_buf)

    def loop():
        torch.index_select(x, 0, order // k, out=xs_buf)
        for e in range(E):
            a, b = bounds[e], bounds[e + 1]
            if a == b:
                continue
            h = xs_buf[a:b] @ gu[e].t()
            s = (torch.nn.functional.silu(h[:, :I].float()) * h[:, I:].float()).to(x.dtype)
            torch.mm(s, dn[e].t(), out=out_buf[a:b])
        yf[order] = out_buf

    return loop, "torch.mm per expert (bf16 dequantised weights) + SwiGLU + gather/scatter, CUDA graph"


def _stage_us(mod, x, idx, params, y, scratch, reps: int = 3) -> list[float]:
    """µs of each of the kernel's five launches in a full `launch` (torch.profiler's device times of the launches'
    kernels, in launch order; median over `reps` launches)."""
    from profile_step import launch_medians  # bench/profile_step.py

    n = len(mod.grids(x.shape[0]))
    per = launch_medians(lambda: mod.launch(x, idx, *params, y, scratch), x.device, n, reps)
    order = getattr(mod, "STAGES", tuple(range(n)))
    return dict(zip(order, per))  # by stage id (5: DEQUANT's dequantisation)


def bench_cases(graph_time, copy_bw: float | None = None, device: str = "cuda", tokens: int = TOKENS,
                only: str | None = None) -> list[dict]:
    """Every VARIANT (or those whose label contains one of the comma-separated words of `only`) at `tokens`."""
    import tempfile

    import triton

    from beamc.ir.reference import expert_weights
    from test_kernels_moe import distinct_idx, moe_constants, nvfp4_experts

    c = moe_constants(load_spec(ROOT / "models/beam.yaml"), 8, "bf16")
    E, H, I, k = c["E"], c["H"], c["I"], c["TOP_K"]
    kdir = tempfile.mkdtemp(prefix="beamc_bench_moe_prefill_")
    params = nvfp4_experts(E, H, I, torch.Generator().manual_seed(0), device=device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, H, generator=g).bfloat16().to(device)
    idx = distinct_idx(tokens, E, k, g).to(device)
    P = tokens * k
    flops = 2 * P * 3 * H * I
    nbytes = sum(p.numel() * p.element_size() for p in params) + x.numel() * 2 + P * H * 2

    pairs = [expert_weights(params, "nvfp4", e, torch.bfloat16) for e in range(E)]
    gu, dn = torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs])
    del pairs
    y_base = torch.full((tokens, k, H), float("nan"), dtype=torch.bfloat16, device=device)
    base_fn, base_label = _baseline(x, idx, gu, dn, I, y_base)
    tb = graph_time(base_fn, 3)
    assert torch.isfinite(y_base).all(), "baseline: unwritten outputs"

    out = []
    decode = load_kernel(KernelSpec("moe_nvfp4_decode", "moe_experts", c), kdir)
    relaid_params = decode.relayout(params)
    for label, extra, relaid in VARIANTS:
        words = (only or "").split(",")  # a word ending in "$": that label exactly
        if only and label != "moe_nvfp4_prefill relaid" and not any(
                label == w[:-1] if w.endswith("$") else w in label for w in words):
            continue
        rec = {"kernel": label, "op": "moe_experts", "tokens": tokens, "top_k": k, "shape": [E, H, I],
               "baseline": base_label, "baseline_us": tb * 1e6, "baseline_tflops": flops / tb / 1e12,
               "bytes": nbytes, "triton": triton.__version__, "relaid": relaid}
        try:
            mod = load_kernel(KernelSpec(TEMPLATE, "moe_experts", dict(c, **extra)), kdir)
            y = torch.full((tokens, k, H), float("nan"), dtype=torch.bfloat16, device=device)
            scratch = torch.empty(mod.scratch_numel(tokens), dtype=torch.bfloat16, device=device)
            p = relaid_params if relaid else params
            t = graph_time(lambda: mod.launch(x, idx, *p, y, scratch), 3)
            diag = extra.get("WG_DIAG", 0)  # (parts left out: wrong outputs, timing only)
            assert diag or torch.isfinite(y).all(), f"{label}: unwritten outputs"
            rec.update(us=t * 1e6, tb_s=nbytes / t / 1e12, tflops=flops / t / 1e12, rel_err_vs_baseline=_rel(y, y_base),
                       tiles=dict(BLOCK_M=mod.BLOCK_M, BLOCK_N=mod.BLOCK_N, BLOCK_K=mod.BLOCK_K,
                                  BLOCK_N2=mod.BLOCK_N2, BLOCK_K2=mod.BLOCK_K2, NUM_WARPS=mod.NUM_WARPS,
                                  NUM_STAGES=mod.NUM_STAGES, SWAP=mod.SWAP, DEQUANT=mod.DEQUANT, SWAP2=mod.SWAP2,
                                  BLOCK_M2=mod.BLOCK_M2, NUM_WARPS2=mod.NUM_WARPS2, DOWN_NT=mod.DOWN_NT,
                                  DEQUANT_DOWN=mod.DEQUANT_DOWN, WGMMA=mod.WGMMA,
                                  **({k: getattr(mod, k) for k in ("WG_BN", "WG_BN2", "WG_NT2", "WG_STAGES",
                                                                    "WG_LOAD_WARPS", "WG_LOAD_REGS", "WG_STORE",
                                                                    "WG_STORE_BUFS", "WG_WDEPTH", "WG_HRES",
                                                                    "WG_ACOPY", "WG_WSTEPS", "WG_V16")}
                                     if mod.WGMMA else {})),
                       blocks=int(mod.sizes(tokens)["NB"]), **({"diag": diag} if diag else {}))
            assert diag or rec["rel_err_vs_baseline"] < 1e-2, rec
            rec["stage_us"] = _stage_us(mod, x, idx, p, y, scratch)
            rec["stage_tflops"] = {3: 2 * P * 2 * I * H / rec["stage_us"][3] / 1e6,
                                   4: 2 * P * H * I / rec["stage_us"][4] / 1e6}
        except Exception as e:  # noqa: BLE001 - e.g. the native path needs Triton >= 3.9: say why, keep the run
            if not extra:  # the default must work; a variant says why it did not
                raise
            rec.update(us=None, tb_s=None, tflops=None, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        if copy_bw:
            rec["copy_tb_s"] = copy_bw
        out.append(rec)
    return out


def bench_combine(graph_time, copy_bw: float | None = None, device: str = "cuda", tokens: int = TOKENS,
                  reps: int = 2, name: str = "bm256") -> list[dict]:
    """The combine_experts pass's prefill MoE, the emitter's form `name` (MOE_WGMMA_FORMS): the experts into y in pair
    order then the
    `moe_combine` kernel (the route before COMBINE), against COMBINE (y in the sort's order, WG_YTMA's box stores,
    the combine as the module's stage 6), and COMBINE with WG_YTMA off (sorted rows by the threads' stores), and the
    experts alone (their TFLOP/s): each in one CUDA graph, `reps` times in turn (the drift between them), with the
    per-launch device times; out checked bit for bit between the three routes."""
    import tempfile

    import triton

    from beamc.codegen.emitters import moe_wgmma_form
    from profile_step import launch_medians  # bench/profile_step.py
    from test_kernels_moe import distinct_idx, moe_constants, nvfp4_experts

    c = moe_constants(load_spec(ROOT / "models/beam.yaml"), 8, "bf16")
    E, H, I, k = c["E"], c["H"], c["I"], c["TOP_K"]
    kdir = tempfile.mkdtemp(prefix="beamc_bench_moe_combine_")
    decode = load_kernel(KernelSpec("moe_nvfp4_decode", "moe_experts", c), kdir)
    params = decode.relayout(nvfp4_experts(E, H, I, torch.Generator().manual_seed(0), device=device))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, H, generator=g).bfloat16().to(device)
    idx = distinct_idx(tokens, E, k, g).to(device)
    w = torch.rand(tokens, k, generator=g).to(device)
    P = tokens * k
    flops = 2 * P * 3 * H * I
    form = moe_wgmma_form(name)  # (COMBINE is added below, beside the route before it)
    plain = load_kernel(KernelSpec(TEMPLATE, "moe_experts", dict(c, **form)), kdir)
    comb = load_kernel(KernelSpec("moe_combine", "boundary", dict(DTYPE="bf16", H=H, TOP_K=k, ROUTED_SCALE=2.5)), kdir)
    y = torch.empty(tokens, k, H, dtype=torch.bfloat16, device=device)
    scratch = torch.empty(plain.scratch_numel(tokens), dtype=torch.bfloat16, device=device)
    runs = {}
    out0 = torch.full((tokens, H), float("nan"), dtype=torch.bfloat16, device=device)

    def before():
        plain.launch(x, idx, *params, y, scratch)
        comb.launch(y, w, idx, out0)

    runs[f"emitter {name} + moe_combine"] = (before, out0, len(plain.grids(tokens)) + 1)
    # (the experts alone: the TFLOP/s figure, 2 x pairs x 3 x H x I / time)
    runs[f"emitter {name} alone"] = ((lambda: plain.launch(x, idx, *params, y, scratch)), None, len(plain.grids(tokens)))
    # (WG_YTMA needs WG_DSTORE: the 128-row form stores sorted rows by its threads only)
    for label, extra in (("COMBINE", {}), ("COMBINE WG_YTMA=0", dict(WG_YTMA=False)))[:2 if form.get("WG_DSTORE") else 1]:
        mod = load_kernel(KernelSpec(TEMPLATE, "moe_experts", dict(c, **form, COMBINE=True, ROUTED_SCALE=2.5,
                                                                   **extra)), kdir)
        sc = torch.empty(mod.scratch_numel(tokens), dtype=torch.bfloat16, device=device)
        out = torch.full((tokens, H), float("nan"), dtype=torch.bfloat16, device=device)
        runs[f"{name} {label}"] = ((lambda m=mod, s=sc, o=out: m.launch(x, idx, *params, y, w, o, s)), out, len(mod.grids(tokens)))
    recs = {label: {"kernel": f"moe_nvfp4_prefill combine {label}", "op": "moe_experts", "tokens": tokens,
                    "top_k": k, "shape": [E, H, I], "triton": triton.__version__, "us_runs": []}
            for label in runs}
    for _ in range(reps):
        for label, (fn, _, _) in runs.items():
            recs[label]["us_runs"].append(graph_time(fn, 3) * 1e6)
    for label, (fn, out, n) in runs.items():
        r = recs[label]
        r["us"] = min(r["us_runs"])
        r["tflops"] = flops / r["us"] / 1e6
        r["launch_us"] = launch_medians(fn, x.device, n)
        if out is not None:
            r["out_bitwise_equal_to_route_before"] = bool(torch.equal(out.view(torch.int16), out0.view(torch.int16)))
        if copy_bw:
            r["copy_tb_s"] = copy_bw
    assert torch.isfinite(out0).all(), "the route before: unwritten outputs"
    assert all(r.get("out_bitwise_equal_to_route_before", True) for r in recs.values()), recs
    return list(recs.values())


def ncu_launches(tokens: int, extra: dict) -> None:
    """The render (default: the model's at `tokens`, DEQUANT on re-laid-out weights) launched 3 times, nothing else
    on the GPU between them, no graphs, no timing: for `ncu --kernel-name regex:^kernel$` (6 launches per call)."""
    import tempfile

    from test_kernels_moe import distinct_idx, moe_constants, nvfp4_experts

    c = moe_constants(load_spec(ROOT / "models/beam.yaml"), 8, "bf16")
    E, H, I, k = c["E"], c["H"], c["I"], c["TOP_K"]
    kdir = tempfile.mkdtemp(prefix="beamc_ncu_moe_prefill_")
    mod = load_kernel(KernelSpec(TEMPLATE, "moe_experts", dict(c, DEQUANT=True, **extra)), kdir)
    decode = load_kernel(KernelSpec("moe_nvfp4_decode", "moe_experts", c), kdir)
    params = decode.relayout(nvfp4_experts(E, H, I, torch.Generator().manual_seed(0), device="cuda"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, H, generator=g).bfloat16().cuda()
    idx = distinct_idx(tokens, E, k, g).cuda()
    y = torch.empty(tokens, k, H, dtype=torch.bfloat16, device="cuda")
    scratch = torch.empty(mod.scratch_numel(tokens), dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        mod.launch(x, idx, *params, y, scratch)
    torch.cuda.synchronize()


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default=str(TOKENS), help="comma-separated token counts")
    ap.add_argument("--only", default=None, help="comma-separated words: the variants whose label holds one "
                    "(and the default on re-laid-out weights)")
    ap.add_argument("--out", default=None, help="write the records here as moe-prefill-DATE.json")
    ap.add_argument("--combine", default=None, metavar="FORMS", help="only `bench_combine` for these emitter forms "
                    "(comma-separated, e.g. bm256,bm128: the combine_experts pass's routes, the experts then "
                    "moe_combine against COMBINE)")
    ap.add_argument("--ncu", default=None, metavar="JSON", help="only launch this render (DEQUANT + these constants, "
                    "e.g. '{}') 3 times at the first of --tokens, for ncu; no timing")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    if args.ncu is not None:
        ncu_launches(int(args.tokens.split(",")[0]), json.loads(args.ncu))
        sys.exit(0)
    import datetime

    from kernels import graph_time

    recs = []
    for tok in map(int, args.tokens.split(",")):
        for r in ([r for f in args.combine.split(",") for r in bench_combine(graph_time, tokens=tok, name=f)]
                  if args.combine else bench_cases(graph_time, tokens=tok, only=args.only)):
            print(json.dumps(r), flush=True)
            recs.append(r)
        torch.cuda.empty_cache()
    if args.out:
        date = datetime.date.today().isoformat()
        facts = {"date": date, "device": torch.cuda.get_device_name(), "command": "python " + " ".join(sys.argv),
                 "records": recs}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"moe-prefill-{date}.json").write_text(json.dumps(facts, indent=1) + "\n")
    print(f"{'variant':<70} {'tokens':>6} {'us':>9} {'TFLOP/s':>8} stages (us)")
    for r in recs:
        st = " ".join(f"{k}:{v:.0f}" for k, v in (r.get("stage_us") or dict(enumerate(r.get("launch_us", [])))).items())
        print(f"{r['kernel']:<70} {r['tokens']:>6} {r['us'] or 0:>9.1f} {r['tflops'] or 0:>8.1f} {st} "
              f"{r.get('error', '')[:80]}")
