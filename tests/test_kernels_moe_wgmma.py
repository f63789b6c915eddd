"""moe_nvfp4_prefill's WGMMA render (stages 3 and 4 as one warp-specialised Gluon kernel on Hopper's wgmma, the NVFP4
weights decoded by a load partition; `--set moe_nvfp4_prefill.WGMMA=true`) on the CPU: its binaries compile ahead of
time for sm_90a at the full spec's TP-8 shapes, an odd shape and the tiny spec's TP-1 shapes, in every tile form the
bench times (at most a kilobyte of local memory a thread; the PTX has the wgmma tiles, the 16-byte cp.async gathers
arriving on the stage barriers, the decode, the register split of the two partitions, PDL's wait); the tiles the load
partition decodes meet the relayout's definition and the natural k order of the A rows they are multiplied with; shapes it cannot
take are refused with the reason, and the fp32 instances ignore it. A Gluon kernel does not run in Triton's CPU
interpreter: its numerics are checked on the H200 (tests/gpu/test_kernels_moe_prefill_gpu.py::test_wgmma_render)."""
from __future__ import annotations

import multiprocessing
import os
import re
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

from beamc.checkpoint.nvfp4 import E2M1_VALUES
from beamc.codegen.kernel import KernelSpec, aot_compile, launch_options, load_kernel
from beamc.codegen.package import compile_package
from beamc.errors import BeamcError
from beamc.spec import load_spec
from conftest import assert_template_contract
from test_kernels_gemv import cuobjdump_text, local_bytes, SMALL_LOCAL

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"full-tp8": dict(E=256, H=5120, I=320, TOP_K=8), "odd": dict(E=7, H=768, I=192, TOP_K=3),
          "tiny-tp1": dict(E=16, H=256, I=64, TOP_K=4)}
# the 128-row form with WG_HALF; the 256-row one with stage 3's load partition on 8 warps (stage 4's on 4), and with
# two load partitions of 4 warps in stage 3 (WG_LOAD_PARTS); ring slots of 4 K steps, a slot ahead (stage 4's 2)
_HALF128 = dict(WG_ACOPY=True, WG_HRES=True, WG_WSTEPS=2, WG_V16=True, WG_HALF=True)
_LOAD8S3 = dict(BLOCK_M=256, WG_STAGES=3, WG_WDEPTH=2, WG_WSTEPS=2, WG_V16=True, WG_HALF=True, WG_LOAD_WARPS=8,
                WG_LOAD_REGS=64, WG_LOAD_WARPS4=4, WG_LOAD_REGS4=96)
_PARTS2 = dict(_LOAD8S3, WG_WDEPTH=1, WG_WDEPTH4=2, WG_LOAD_WARPS=4, WG_LOAD_PARTS=2)
_WSTEPS4 = dict(WG_WDEPTH=1, WG_WDEPTH4=2, WG_WSTEPS=4)
# the renders bench/moe_prefill.py times (tile forms of the WGMMA render)
FORMS = {"default": {}, "wdepth8": dict(WG_WDEPTH=8), "bn128": dict(WG_BN=128, WG_STAGES=3),
         "bn2-256": dict(WG_BN2=256, WG_STAGES=2), "bm256": dict(BLOCK_M=256, WG_STAGES=3, WG_WDEPTH=2),
         "load8": dict(WG_LOAD_WARPS=8), "store": dict(WG_STORE=True), "hres": dict(WG_HRES=True),
         "hres-store": dict(WG_HRES=True, WG_STORE=True, WG_WDEPTH=2), "acopy": dict(WG_ACOPY=True),
         "acopy-hres": dict(WG_ACOPY=True, WG_HRES=True), "wsteps2": dict(WG_WSTEPS=2),
         "wsteps4": dict(WG_WSTEPS=4, WG_WDEPTH=2), "wsteps2-acopy": dict(WG_WSTEPS=2, WG_ACOPY=True),
         "bm256-wsteps2": dict(BLOCK_M=256, WG_STAGES=3, WG_WDEPTH=2, WG_WSTEPS=2),
         # the emitter's 128-row default form (emitters.MOE_WGMMA_FORMS["bm128"])
         "acopy-hres-wsteps2": dict(WG_ACOPY=True, WG_HRES=True, WG_WSTEPS=2),
         # WG_V16: stage 4's words (chunks of one K step) in 16-byte copies
         "bm256-wsteps2-v16": dict(BLOCK_M=256, WG_STAGES=3, WG_WDEPTH=2, WG_WSTEPS=2, WG_V16=True),
         "acopy-hres-wsteps2-v16": dict(WG_ACOPY=True, WG_HRES=True, WG_WSTEPS=2, WG_V16=True),
         # WG_HALF: the experts' last blocks on 64 rows (at most 64 real ones) or 128 (at most 128, BLOCK_M 256)
         "bm256-wsteps2-v16-half": dict(BLOCK_M=256, WG_STAGES=3, WG_WDEPTH=2, WG_WSTEPS=2, WG_V16=True,
                                        WG_HALF=True),
         "acopy-hres-wsteps2-v16-half": _HALF128,
         # the 256-row form with a load partition of 8 warps (64 registers each: the MMA partition keeps its 128 of
         # accumulator): half the decode and copies a warp
         "bm256-wsteps2-v16-load8": dict(BLOCK_M=256, WG_STAGES=3, WG_WDEPTH=2, WG_WSTEPS=2, WG_V16=True,
                                         WG_LOAD_WARPS=8, WG_LOAD_REGS=64),
         # ... on 8 in stage 3 only (stage 4 slower with them, s31run1)
         "bm256-wsteps2-v16-half-load8s3": _LOAD8S3,
         # ... with ring slots of 4 K steps (32-byte runs: the words' copies on whole sectors, two lanes a run), a
         # slot ahead (the same 4 K steps of look-ahead as 2 slots of 2; 197 KB), stage 4's ring 2 slots ahead still
         "bm256-wsteps4-v16-half-load8s3": dict(_LOAD8S3, **_WSTEPS4),
         # two load partitions of 4 warps in stage 3 (64 registers each), on alternate 2-step runs, a ring slot
         # ahead each (4 slots in all against 3)
         "bm256-wsteps2-v16-half-parts2": _PARTS2,
         # ... with the A rows as 32-bit offsets (16 registers a thread fewer: the partitions spill without)
         "bm256-wsteps2-v16-half-parts2-a32": dict(_PARTS2, WG_A32=True),
         # the emitter's 256-row form with the A rows as 32-bit offsets
         "bm256-wsteps2-v16-half-load8s3-a32": dict(_LOAD8S3, WG_A32=True),
         # ... with stage 4's tiles stored by a partition of their own (64 registers) through one 64 KB buffer
         # (WG_STORE_BUFS 1: where the epilogue's layout change took its scratch), the next tile's MMAs going on
         # meanwhile (with the store partition on 128 registers the MMA partition had 144 and ptxas serialised its
         # wgmma: s33run1, 3x slower)
         "bm256-wsteps2-v16-half-load8s3-store1": dict(_LOAD8S3, WG_STORE=True, WG_STORE_BUFS=1, WG_STORE_REGS=64),
         # ... with the A rows copied by a partition of 4 warps of their own (WG_ACOPY: a stage's barrier no longer
         # waits for the weight words the load partition copied ahead, each thread's cp.async arrive tracking all of
         # its earlier copies), on 40 registers with 32-bit offsets, beside 8 load warps on 56 (MMA 160) or 4 (MMA
         # 200); and with WG_AQ
         "bm256-wsteps2-v16-half-load8s3-acopy": dict(_LOAD8S3, WG_LOAD_REGS=56, WG_ACOPY=True, WG_ACOPY_REGS=40,
                                                      WG_A32=True),
         "bm256-wsteps2-v16-half-load4-acopy-aq": dict(_LOAD8S3, WG_LOAD_WARPS=4, WG_ACOPY=True, WG_ACOPY_REGS=40,
                                                       WG_A32=True, WG_AQ=True),
         # ... with stage 4's A rows (h, sorted rows) by one TMA copy a step (WG_ATMA), and with the store partition
         "bm256-wsteps2-v16-half-load8s3-atma": dict(_LOAD8S3, WG_ATMA=True),
         "bm256-wsteps2-v16-half-load8s3-atma-store1": dict(_LOAD8S3, WG_ATMA=True, WG_STORE=True, WG_STORE_BUFS=1,
                                                            WG_STORE_REGS=64),
         # ... with stage 3's weight words and scale bytes by TMA boxes (WG_WTMA), and with the A rows by the A
         # partition too (no cp.async left in the load partition, whose fence may wait for its copies in flight)
         "bm256-wsteps2-v16-half-load8s3-wtma": dict(_LOAD8S3, WG_WTMA=True),
         "bm256-wsteps2-v16-half-load8s3-wtma-acopy": dict(_LOAD8S3, WG_LOAD_REGS=56, WG_ACOPY=True,
                                                           WG_ACOPY_REGS=40, WG_A32=True, WG_WTMA=True),
         # ... with the load partition's A-row copies issued after its fence (WG_ALATE), alone and with WG_WTMA
         "bm256-wsteps2-v16-half-load8s3-alate": dict(_LOAD8S3, WG_ALATE=True),
         "bm256-wsteps2-v16-half-load8s3-wtma-alate": dict(_LOAD8S3, WG_WTMA=True, WG_ALATE=True),
         # ... with stage 4's A rows by TMA too (WG_ATMA: s34run1 -3.9% alone, WG_WTMA -5.0%), and with the A rows by
         # the A partition beside 4 load warps instead (WG_ACOPY on 40 registers: s34run1 -3.8% alone)
         "bm256-wsteps2-v16-half-load8s3-wtma-atma": dict(_LOAD8S3, WG_WTMA=True, WG_ATMA=True),
         # ... and stage 4's MMA partition without its fence (WG_NOFENCE4: nothing it reads written by cp.async)
         "bm256-wsteps2-v16-half-load8s3-wtma-atma-nofence4": dict(_LOAD8S3, WG_WTMA=True, WG_ATMA=True,
                                                                   WG_NOFENCE4=True),
         "bm256-wsteps2-v16-half-load4-acopy-wtma": dict(_LOAD8S3, WG_LOAD_WARPS=4, WG_ACOPY=True, WG_ACOPY_REGS=40,
                                                        WG_A32=True, WG_WTMA=True),
         # ... the A partition in stage 3 only, stage 4's A rows by TMA (WG_ACOPY4 off, WG_ATMA: s35run1, stage 3
         # 1,810 us beside the A partition, stage 4 1,244 with WG_ATMA), and without stage 4's fence too
         "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4": dict(_LOAD8S3, WG_LOAD_WARPS=4, WG_ACOPY=True,
                                                              WG_ACOPY_REGS=40, WG_A32=True, WG_WTMA=True,
                                                              WG_ACOPY4=False, WG_ATMA=True),
         "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-nofence4": dict(_LOAD8S3, WG_LOAD_WARPS=4, WG_ACOPY=True,
                                                                       WG_ACOPY_REGS=40, WG_A32=True, WG_WTMA=True,
                                                                       WG_ACOPY4=False, WG_ATMA=True,
                                                                       WG_NOFENCE4=True),
         # ... stage 4's stores deferred into the next tile's K steps (WG_DSTORE), in both forms
         "bm256-wsteps2-v16-half-load8s3-wtma-atma-dstore": dict(_LOAD8S3, WG_WTMA=True, WG_ATMA=True,
                                                                 WG_DSTORE=True),
         "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore": dict(_LOAD8S3, WG_LOAD_WARPS=4, WG_ACOPY=True,
                                                                      WG_ACOPY_REGS=40, WG_A32=True, WG_WTMA=True,
                                                                      WG_ACOPY4=False, WG_ATMA=True, WG_DSTORE=True),
         "acopy-hres-wsteps2-v16-half-aq-dstore": dict(_HALF128, WG_AQ=True, WG_DSTORE=True),
         # ... the 128-row form with stage 4's resident h rows by TMA instead of its A partition (WG_ACOPY4 off)
         "acopy-hres-wsteps2-v16-half-aq-atma4": dict(_HALF128, WG_AQ=True, WG_ACOPY4=False, WG_ATMA=True),
         # ... the emitter's 256-row form (s35) where the shapes refuse WG_WTMA (odd shapes, the tiny spec), and above
         # the steps WG_A32's offsets take (emitters.a32_max_tokens)
         "bm256-wsteps2-v16-half-load4-acopy-atma4-dstore": dict(_LOAD8S3, WG_LOAD_WARPS=4, WG_ACOPY=True,
                                                                 WG_ACOPY_REGS=40, WG_A32=True, WG_ACOPY4=False,
                                                                 WG_ATMA=True, WG_DSTORE=True),
         "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-a64": dict(_LOAD8S3, WG_LOAD_WARPS=4, WG_ACOPY=True,
                                                                          WG_ACOPY_REGS=40, WG_WTMA=True,
                                                                          WG_ACOPY4=False, WG_ATMA=True,
                                                                          WG_DSTORE=True),
         # ... and the emitter's 128-row form with WG_WTMA (its A rows already by the A partition)
         "acopy-hres-wsteps2-v16-half-aq-wtma": dict(_HALF128, WG_AQ=True, WG_WTMA=True),
         # WG_AQ: the A rows copied only as far as WG_HALF's MMAs read them (64-row quarters)
         "bm256-wsteps2-v16-half-load8s3-aq": dict(_LOAD8S3, WG_AQ=True),
         "bm256-wsteps4-v16-half-load8s3-aq": dict(_LOAD8S3, **_WSTEPS4, WG_AQ=True),
         "acopy-hres-wsteps2-v16-half-aq": dict(_HALF128, WG_AQ=True),
         # 128-row blocks x 256 weight rows (m64n256): x re-read 3 times a block instead of 5 (the A side's L2 traffic
         # -40% against the 256-row form), the decode per FLOP twice the 256-row form's; a ring slot ahead (217 KB)
         "bn128-wsteps2-v16-hres": dict(WG_BN=128, WG_STAGES=3, WG_WDEPTH=1, WG_WSTEPS=2, WG_V16=True, WG_HRES=True,
                                        WG_HALF=True)}
# ... and the emitter's forms with SORT_ALONE (the sort's stages 0-2 as a binary of their own: stages 3 and 4, the Gluon
# kernel compiled here, are the same source, so these are compiled by test_kernels_moe_prefill's AOT cases instead)
SORT_FORMS = {f"{name}-sort": dict(FORMS[name], SORT_ALONE=True)
              for name in ("bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore",
                           "bm256-wsteps2-v16-half-load4-acopy-atma4-dstore",
                           "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-a64", "acopy-hres-wsteps2-v16-half-aq")}
FORMS.update(SORT_FORMS)
# ... the emitter's 256-row form with each store chunk's pair indices loaded a K step ahead (WG_DPAIRS)
FORMS["bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-dpairs"] = dict(
    FORMS["bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore"], WG_DPAIRS=True)
# ... and with stage 4's words by TMA boxes, its scale words by loads a tile ahead (WG_WTMA4); without stage 3's
# WG_WTMA too (the odd GPU shape's RK0 64)
FORMS["bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-wtma4"] = dict(
    FORMS["bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore"], WG_WTMA4=True)
FORMS["bm256-wsteps2-v16-half-load4-acopy-atma4-dstore-wtma4"] = dict(
    FORMS["bm256-wsteps2-v16-half-load4-acopy-atma4-dstore"], WG_WTMA4=True)
# ... and with y's stores evict-first (WG_YSTREAM)
FORMS["bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-wtma4-ystream"] = dict(
    FORMS["bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-wtma4"], WG_YSTREAM=True)
# ... and COMBINE (y in the sort's order: stage 4's chunks of real rows by TMA box stores, WG_YTMA, or without them);
# the 128-row form's stores (no WG_DSTORE) of sorted rows
FORMS["bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-combine"] = dict(
    FORMS["bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore"], COMBINE=True, ROUTED_SCALE=2.5)
FORMS["bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-combine-noytma"] = dict(
    FORMS["bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-combine"], WG_YTMA=False)
FORMS["acopy-hres-wsteps2-v16-half-aq-combine"] = dict(FORMS["acopy-hres-wsteps2-v16-half-aq"], COMBINE=True)
# ... the emitter's 256-row form as the combine_experts pass renders it (COMBINE with SORT_ALONE: compiled as above)
SORT_FORMS["bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-sort-combine"] = FORMS[
    "bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-sort-combine"] = dict(
    FORMS["bm256-wsteps2-v16-half-load4-acopy-wtma-atma4-dstore-sort"], COMBINE=True, ROUTED_SCALE=2.5)


def _constants(shape: str, **extra) -> dict:
    return dict(DTYPE="bf16", WGMMA=True, **SHAPES[shape], **extra)


def _compile(args) -> list[dict]:
    """The WGMMA stages' binaries of one render for sm_90a, in a worker process: what the test asserts about them."""
    label, constants = args
    os.environ.pop("TRITON_INTERPRET", None)
    directory = tempfile.mkdtemp()
    mod = load_kernel(KernelSpec("moe_nvfp4_prefill", "moe_experts", constants), directory)
    out = []
    for opts in launch_options(mod):
        if opts.get("fn") != "wg_kernel":
            continue
        stage = opts["constexprs"]["STAGE"]
        ck = aot_compile(mod, 90, opts)
        ptx = ck.asm["ptx"]
        wait = ptx.index("griddepcontrol.wait")
        out.append(dict(
            label=f"{label}/stage{stage}", stage=stage, shared=ck.metadata.shared,
            launch_pdl=bool(ck.metadata.launch_pdl),
            local=local_bytes(ck.asm["cubin"], Path(directory)), num_warps=ck.metadata.num_warps,
            sass=_wgmma_sass(ck.asm["cubin"], Path(directory)),
            wgmma=re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)\.f32\.bf16\.bf16", ptx),
            cp_async16=len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 0x10", ptx)),
            cp_async8=len(re.findall(r"cp\.async\.ca\.shared\.global \[[^]]+\], \[[^]]+\], 0x8", ptx)),
            cp_async4=len(re.findall(r"cp\.async\.ca\.shared\.global \[[^]]+\], \[[^]]+\], 0x4", ptx)),
            wait_group=re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx),
            wdepth=mod.WG_WDEPTH if stage == 3 else mod.WG_WDEPTH4,
            wsteps=mod.WG_WSTEPS if stage == 3 else 1, rk=mod.RK0 if stage == 3 else mod.RK1, wv16=mod.WG_V16,
            cp_async_arrive=ptx.count("cp.async.mbarrier.arrive"), decode_muls=ptx.count("mul.rn.bf16x2"),
            setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))),
            loads_before_wait=len(re.findall(r"\bld\.global", ptx[:wait])),
            st_v4=len(re.findall(r"st\.global(?:\.[\w:]+)*\.v4\.b32", ptx)),  # (WG_YSTREAM's with a cache hint)
            rows=(2 * mod.WG_BN if stage == 3 else mod.WG_BN2), block_m=mod.BLOCK_M, stages=mod.WG_STAGES,
            load_warps=mod.WG_LOAD_WARPS if stage == 3 else mod.WG_LOAD_WARPS4,
            load_regs=mod.WG_LOAD_REGS if stage == 3 else mod.WG_LOAD_REGS4, store=mod.WG_STORE and stage == 4,
            acopy=mod.WG_ACOPY if stage == 3 else mod.WG_ACOPY4,
            acopy_regs=mod.WG_ACOPY_REGS, mma_regs=mod.WG_MMA_REGS[stage], atma=mod.WG_ATMA and stage == 4,
            wtma=mod.WG_WTMA and stage == 3, wtma4=mod.WG_WTMA4 and stage == 4, ksteps=(mod.H if stage == 3 else mod.I) // 64,
            tma=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared", ptx)),  # (TMA loads; stores below)
            tma_st=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global", ptx)),
            ytma=mod.WG_YTMA and stage == 4, expect_tx=ptx.count("mbarrier.arrive.expect_tx"),
            stmatrix=ptx.count("stmatrix"), half=mod.WG_HALF, I=mod.I, fences=ptx.count("fence.proxy.async"),
            nofence=mod.WG_NOFENCE4 and stage == 4, dstore=mod.WG_DSTORE and stage == 4,
            parts=mod.WG_LOAD_PARTS if stage == 3 else 1))
    return out


def _wgmma_sass(cubin: bytes, tmp: Path) -> dict | None:
    """HGMMA and WARPGROUP.DEPBAR counts of a cubin's SASS (None without cuobjdump): ptxas serialises the wgmma
    (a DEPBAR after every HGMMA, ptxas info C7512) where the MMA partition's registers cannot hold the pipeline."""
    sass = cuobjdump_text(cubin, tmp)
    if sass is None:
        return None
    return dict(hgmma=len(re.findall(r"\bHGMMA\.", sass)), depbar=len(re.findall(r"WARPGROUP\.DEPBAR", sass)))


def test_wgmma_renders_compile_for_sm90a():
    """Every shape as by default, and the full spec's shapes in each tile form the bench times: two binaries (stages
    3 and 4) of 8 MMA warps + the load partition's 4 (or 8), PDL launches waiting before any load, local memory under
    a kilobyte a thread, within Hopper's 227 KB of shared memory; per K step 4 wgmma instructions (m64 x weight rows x 16) per 64 rows of
    a warpgroup, the A rows by 16-byte cp.async that arrive on the stage's barrier, 4 bf16x2 scale multiplies per
    decoded word (8 words a weight row a step, shared by the load warps), the output stored 16 bytes a thread (with
    WG_STORE by a store partition of 4 more warps in stage 4, the tile handed over by stmatrix; WG_HRES: stage 4's
    h rows resident, one buffer a K step); the load partition's registers given back to the MMA partition
    (setmaxnreg: its share as the template's WG_MMA_REGS computes it), whose wgmma ptxas did not serialise."""
    jobs = [(s, _constants(s)) for s in SHAPES] + [(f"full-tp8-{f}", _constants("full-tp8", **kw))
                                                   for f, kw in FORMS.items() if kw and f not in SORT_FORMS]
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        rows = [r for rs in pool.map(_compile, jobs) for r in rs]
    assert len(rows) == 2 * len(jobs)
    fences4 = {r["label"]: r["fences"] for r in rows if r["stage"] == 4}  # (WG_NOFENCE4's twin: the same form with them)
    for r in rows:
        lw, parts = r["load_warps"], r["parts"]
        # (WG_ACOPY: the A partition's 4; WG_LOAD_PARTS: each load partition's lw, and its copies, decode and wait)
        assert r["num_warps"] == 8 + lw * parts + 4 * (r["store"] or r["acopy"]), r
        assert r["launch_pdl"] and r["loads_before_wait"] == 0, r
        # (WG_STORE: the tile handed over through shared memory; WG_DSTORE: kept there for the next tile's steps)
        assert (r["stmatrix"] > 0) == (r["store"] or r["dstore"]), r
        # (COMBINE's WG_YTMA: stage 4's chunks of real rows by TMA box stores, the rest by the threads' stores)
        assert (r["tma_st"] > 0) == r["ytma"], r
        # (local memory: the partitions' register limits (setmaxnreg) leave frames of 48-520 bytes a thread in the
        # forms, ~140 MB of an H100 reserved at most; SMALL_LOCAL x 4 keeps a kilobytes spill out)
        assert (r["local"] or 0) <= 4 * SMALL_LOCAL and r["shared"] <= 232448, r
        # the wgmma not serialised (one stage in flight: a DEPBAR per loop, not per HGMMA)
        assert r["sass"] is None or r["sass"]["depbar"] < r["sass"]["hgmma"], r
        per_step = 4 * r["block_m"] // 128  # (k16 x 4 a step; m64 twice a warpgroup at BLOCK_M 256)
        def loops(n):  # the full loop, and with WG_HALF the tail blocks' (64 rows: n halved a warpgroup; 128: m64 once)
            out = [f"m64n{n}k16"] * per_step
            if r["half"]:
                out += [f"m64n{n // 2}k16"] * 4 + [f"m64n{n}k16"] * (4 if r["block_m"] == 256 else 0)
            return out

        on = r["rows"] // 2  # (gate_up: I's last tile on half the weight rows where at most half of it is real)
        ntail = r["half"] and r["stage"] == 3 and r["I"] % on != 0 and r["I"] % on <= on // 2
        wgmma = loops(r["rows"]) + (loops(r["rows"] // 2) if ntail else [])
        wgmma *= r["ksteps"] if r["dstore"] else 1  # (WG_DSTORE: stage 4's K steps unrolled)
        assert sorted(r["wgmma"]) == sorted(wgmma), r
        # the A rows by 16-byte copies (the loop's body unrolled over the WG_WSTEPS steps of a ring slot); the
        # weight words (8 WG_WSTEPS bytes a (row, c): one 8-byte copy, or 16-byte ones; WG_V16 with chunks of one
        # K step, RK 64, and WG_WSTEPS 1: the 4 words of a (row, c // 2) in one 16-byte copy) and the scale words (4 bytes a
        # (row, c // 2), max(WG_WSTEPS / 2, 1) of them) by cp.async, WG_WDEPTH slots ahead: copied in the prologue's
        # WG_WDEPTH slots and once in the loop, waited for WG_WDEPTH groups on
        w, slots = r["wsteps"], r["wdepth"] + 1
        per_row = 4 * r["rows"] // (32 * lw)
        a_unroll = 1 if r["acopy"] else w  # (WG_ACOPY: the A partition's loop, step by step)
        a16 = r["block_m"] * 4 // (16 * (4 if r["acopy"] else lw)) * a_unroll  # (WG_ACOPY: its 4 warps copy them)
        if r["wtma4"]:  # (WG_WTMA4: stage 4's load loop unrolled over a tile's K steps, each with its A box and the
            # words' box WG_WDEPTH steps ahead; the prologue's WG_WDEPTH boxes; no cp.async, no wait_group)
            a16, a_unroll, slots, per_row = 0, 0, 0, 0
            assert r["tma"] == r["expect_tx"] == 2 * r["ksteps"] + r["wdepth"], r
        elif r["atma"]:  # (WG_ATMA: stage 4's A rows by one TMA copy a step, its bytes expected on the stage's barrier)
            a16, a_unroll = 0, 0
            assert r["tma"] == r["expect_tx"] == 1, r
        if r["wtma"]:  # (WG_WTMA: a run's words by one TMA box, with the scale bytes' box at each 256 values of K: in
            # the prologue's runs as the K offset decides, in the loop under a branch; no word copy, no wait_group)
            first = [s for s in range(r["wdepth"]) if s < r["ksteps"] // w]
            assert r["expect_tx"] == len(first) + 2, r
            assert r["tma"] == sum(1 + (s * w * 64 % 256 == 0) for s in first) + 2, r
            slots = per_row = 0
        else:
            assert r["atma"] or r["wtma4"] or r["tma"] == r["expect_tx"] == 0, r
        v16 = r["wv16"] and r["rk"] == 64 and w == 1
        assert r["cp_async16"] == parts * (a16 + (slots * per_row * w // 2 if w > 1 or v16 else 0)), r
        assert r["cp_async8"] == parts * (slots * per_row if w == 1 and not v16 else 0), r
        assert r["cp_async_arrive"] == parts * a_unroll, r
        assert r["cp_async4"] == parts * slots * per_row // 2 * max(w // 2, 1), r
        assert r["wait_group"] == ([] if r["wtma"] or r["wtma4"] else [str(r["wdepth"])] * parts), r
        unrolled = r["ksteps"] if r["wtma4"] else r["wsteps"]  # (each step unrolled: a slot's, WG_WTMA4 a tile's)
        assert r["decode_muls"] == parts * 4 * 8 * r["rows"] // (32 * lw) * unrolled, r
        assert ("inc", str(r["load_regs"])) in r["setmaxnreg"] and r["st_v4"] > 0, r
        assert not r["acopy"] or ("inc", str(r["acopy_regs"])) in r["setmaxnreg"], r  # (the A partition's registers)
        assert ("dec", str(r["mma_regs"])) in r["setmaxnreg"], r  # (the MMA partition's, as the template computes)
        # the fences before the MMA partition's wgmma (one per MMA loop render: full, and WG_HALF's tails) and the
        # load partition's after its stores; WG_NOFENCE4: stage 4's MMA loops without theirs
        assert r["fences"] >= 1 and (not r["nofence"] or r["fences"] < fences4[r["label"].replace("-nofence4", "")]), r


def _words(codes, scales, rows, ks, K: int, RK: int, W: int = 1, v16: bool = False):
    """The words and block-scale bytes the load partition copies and reads for K step ks (the index arithmetic of
    `_wg_word_copies` and `_wg_ring_words`, moe_wgmma.inc.j2, with runs of W steps: the run's first step ks - ks % W
    copied, step ks its sub-step ks % W): words [R, c // 2, c % 2, G'] (of the run's 2 W words a (row, c)), and the
    scale bytes [R, c // 2, G'] taken out of the run's 4-byte words (row r's at r K / 64 + (base_s + (c // 2) NG) // 4
    + j) by shifts of 8 ((base_s + (c // 2) NG) % 4 + G') bits (W 1) or 8 (2 (sub % 2) + G') bits of word sub // 2
    (little-endian bytes)."""
    NG = RK // 32
    sub = ks % W
    k0 = 64 * (ks - sub)
    base_w = (k0 // RK) * (RK // 8) + (k0 % RK) // 32
    base_s = (k0 // RK) * (RK // 16) + (k0 % RK) // 32
    ch, cl, gp = torch.meshgrid(torch.arange(2), torch.arange(2), torch.arange(2 * W), indexing="ij")
    run = codes.view(-1, K // 8)[rows][:, base_w + (2 * ch + cl) * NG + gp]  # [R, c // 2, c % 2, 2 W] (the copy)
    words = run[..., 2 * sub:2 * sub + 2]
    if v16 and RK == 64 and W == 1:  # WG_V16's [R, 2, 4] slot: a (row, c // 2)'s 4 words, read as [R, 2, 2, 2]
        j = torch.arange(4)
        slot = codes.view(-1, K // 8)[rows][:, base_w + torch.arange(2)[:, None] * 4 + j[None, :]]  # the copy
        assert torch.equal(slot.view(len(rows), 2, 2, 2), words)  # (the same words where the decode reads them)
        words = slot.view(len(rows), 2, 2, 2)
    sch, sgp = torch.arange(2)[:, None], torch.arange(2)[None, :]
    first = (base_s + sch[:, 0] * NG) // 4 + sub // 2  # the word read (per c // 2)
    swords = scales.contiguous().view(torch.int32).view(-1, K // 64)[rows][:, first]
    shift = ((base_s + sch * NG) % 4 + sgp) * 8 if W == 1 else (2 * (sub % 2) + sgp + 0 * sch) * 8  # [c // 2, G']
    sbytes = (swords.to(torch.int64)[:, :, None] & 0xFFFFFFFF) >> shift[None] & 0xFF
    return words, sbytes


def _decode(words: torch.Tensor, sbytes: torch.Tensor, mod) -> torch.Tensor:
    """A re-laid-out word's 8 values (value (q, h) = k0 + 2 q + h: magnitude bits at MAG[q][h], sign at SGN[q][h])
    times its block scale (the byte decoded as the kernel does: bf16 bits byte * 16 + 0x7680 = |scale| x 2^119)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    e2m1 = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    vals = []
    for q in range(4):
        for h in range(2):
            mag = (w >> mod.MAG[q][h]) & 7
            sgn = (w >> mod.SGN[q][h]) & 1
            vals.append(e2m1[mag] * (1 - 2 * sgn.double()))
    bits = (sbytes.to(torch.int32) * 16 + 0x7680) << 16
    scale = bits.view(torch.float32).double() * 2.0 ** -119
    return torch.stack(vals, dim=-1) * scale[:, :, None, :, None]  # [R, c // 2, c % 2, G', 8]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_decoded_tiles_meet_the_relayout_and_the_a_rows(shape):
    """The load partition's weight tiles against the relayout's definition (moe_nvfp4_decode.relayout of random
    ModelOpt experts): for every K step of both GEMMs, the words and scale bytes the load partition reads, decoded
    and put at the columns `_wg_decode` gives them ([row, G', c // 2, c % 2, value] flattened), are the dequantised
    weights E2M1 x block scale of values 64 ks .. 64 ks + 63 in natural order: the k order of the A rows' 64 values
    (one contiguous cp.async run per row), so every product meets its x (or h)."""
    from test_kernels_moe import nvfp4_experts

    c = SHAPES[shape]
    mod = load_kernel(KernelSpec("moe_nvfp4_prefill", "moe_experts", _constants(shape)), None)
    decode = load_kernel(KernelSpec("moe_nvfp4_decode", "moe_experts", dict(DTYPE="bf16", **c)), None)
    E, H, I = c["E"], c["H"], c["I"]
    params = nvfp4_experts(E, H, I, torch.Generator().manual_seed(3))
    relaid = decode.relayout(params)
    assert (mod.RK0, mod.RK1) == (decode.BK0, decode.BK1)
    for codes, scales, raw_codes, raw_scales, K, N, RK in ((relaid[0], relaid[1], params[0], params[1], H, 2 * I,
                                                             mod.RK0),
                                                            (relaid[3], relaid[4], params[3], params[4], I, H,
                                                             mod.RK1)):
        rows = torch.randperm(E * N, generator=torch.Generator().manual_seed(K))[:64]
        # the reference: E2M1 x block scale in natural k order (ModelOpt: even element in the low nibble)
        nib = raw_codes.view(-1, K // 2)[rows]
        nib = torch.stack([nib & 15, nib >> 4], dim=-1).view(len(rows), K).long()
        e2m1 = torch.tensor(E2M1_VALUES, dtype=torch.float64)
        want = e2m1[nib & 7] * (1 - 2 * (nib >> 3).double())
        want = want * raw_scales.view(-1, K // 16)[rows].double().repeat_interleave(16, dim=1)
        for W in (1, 2, 4):  # (WG_WSTEPS: runs of W steps a ring slot, where W divides K / 64 and RK / 64)
            if (K // 64) % W or RK % (64 * W):
                continue
            for ks in range(K // 64):
                for v16 in (False, True):
                    wd, sb = _words(codes, scales, rows, ks, K, RK, W, v16)
                    tile = _decode(wd, sb, mod).permute(0, 3, 1, 2, 4).reshape(len(rows), 64)
                    assert torch.equal(tile, want[:, 64 * ks:64 * ks + 64]), (shape, K, ks, W, v16)


def _tma_box(t: torch.Tensor, shape, strides, box, coord) -> torch.Tensor:
    """What a TMA copy of a tiled tensor map writes to shared memory: the box (dims outermost first) from coord on,
    row-major, elements of t's storage at offset sum((coord + i) stride) per dim, zeros where a coordinate is past
    its dim's extent."""
    grids = torch.meshgrid(*[torch.arange(b) + c for b, c in zip(box, coord)], indexing="ij")
    inside = torch.ones(box, dtype=torch.bool)
    off = torch.zeros(box, dtype=torch.int64)
    for g, n, st in zip(grids, shape, strides):
        inside &= g < n
        off += g.clamp(max=n - 1) * st
    return torch.where(inside, t.reshape(-1)[off], torch.zeros((), dtype=t.dtype))


# (E, H, I) with relayout chunks RK0 of 256 (the full spec's TP-8 rank) and 128, I not a multiple of the tile
WTMA_SHAPES = {"full-tp8": (6, 5120, 320), "rk128": (5, 512, 192)}


@pytest.mark.parametrize("shape", sorted(WTMA_SHAPES))
def test_word_boxes_of_wtma_hold_what_the_copies_did(shape):
    """WG_WTMA (stage 3's words and scale bytes by TMA): with the launcher's views (`wtma_views`) and the kernel's
    box coordinates (`_wg_word_tma`: [e, 0, c0, 0, base_w] for a run's words, [e, c0, 0, 16 (k0 // 256)] for the
    scale bytes of 256 values), the ring slot read as the cp.async ring ([c][row][word] -> [row, c // 2, c % 2,
    word]) and the scale word picked as `_wg_ring_words` does with TMA, every K step of every tile gives the words
    and scale bytes the cp.async copies gave (`_words`), and zeros for rows past I."""
    from test_kernels_moe import nvfp4_experts

    E, H, I = WTMA_SHAPES[shape]
    decode = load_kernel(KernelSpec("moe_nvfp4_decode", "moe_experts", dict(DTYPE="bf16", E=E, H=H, I=I, TOP_K=2)),
                         None)
    codes, scales = decode.relayout(nvfp4_experts(E, H, I, torch.Generator().manual_seed(5)))[:2]
    for W in (2, 4):
        mod = load_kernel(KernelSpec("moe_nvfp4_prefill", "moe_experts", dict(
            DTYPE="bf16", WGMMA=True, E=E, H=H, I=I, TOP_K=2, WG_WSTEPS=W, WG_WDEPTH=2, WG_WTMA=True)), None)
        RK, BN = mod.RK0, mod.WG_BN
        if mod.WG_WSTEPS != W:  # (W 4 needs RK0 256)
            assert RK < 64 * W
            continue
        (cs, cst), (ss, sst) = mod.wtma_views()
        NG = RK // 32
        for e in (0, E - 1):
            for c0 in range(0, I, BN):
                m = torch.arange(2 * BN)
                real = c0 + m // 2 < I
                rows = e * 2 * I + (m % 2) * I + (c0 + m // 2).clamp(max=I - 1)  # (tile row 2 j + g)
                for run in range(H // 64 // W):
                    k0 = run * W * 64
                    base_w = (k0 // RK) * (RK // 8) + (k0 % RK) // 32
                    slot = _tma_box(codes, cs, cst, mod.WG_WC_BOX, [e, 0, c0, 0, base_w])  # [1, c, j, g, word]
                    ring = slot.reshape(4, 2 * BN, 2 * W).permute(1, 0, 2).reshape(2 * BN, 2, 2, 2 * W)
                    unit = _tma_box(scales, ss, sst, mod.WG_WS_BOX, [e, c0, 0, (k0 // 256) * 16])
                    swords = unit.reshape(2 * BN, 16).contiguous().view(torch.int32)  # [row, 4 words]
                    base_s = (k0 // RK) * (RK // 16) + (k0 % RK) // 32
                    assert not ring[~real].any() and not swords[~real].any()
                    for sub in range(W):
                        want_w, want_s = _words(codes, scales, rows, run * W + sub, H, RK, W)
                        words = ring[..., 2 * sub:2 * sub + 2]
                        pick = (base_s % 16) // 4 + torch.arange(2) * (NG // 4) + sub // 2  # [c // 2]
                        sw = swords[:, pick].to(torch.int64) & 0xFFFFFFFF
                        shift = (2 * (sub % 2) + torch.arange(2)) * 8  # [G']
                        sb = sw[:, :, None] >> shift[None, None] & 0xFF
                        assert torch.equal(words[real], want_w[real]), (shape, W, e, c0, run, sub)
                        assert torch.equal(sb[real], want_s[real]), (shape, W, e, c0, run, sub)


def test_wgmma_refuses_what_it_cannot_take_and_fp32_ignores_it():
    """K steps of 64 values must lie within the relayout's chunks: the tiny spec's TP-2 experts (I 32) are refused
    with the reason when WGMMA is pinned (`--set`), before anything runs; WG_WSTEPS falls back to what the chunks
    take; the render keeps the template contract
    (its second kernel typed in SIGNATURES, its stage option sets naming it) and supersedes DEQUANT; the fp32
    instances (the CPU runtime's) render without it; the emitter picks its two forms by default from 2,048 tokens
    (emitters.MOE_WGMMA_FORMS, the 256-row one as two renders: with WG_A32 up to the steps its offsets take, without
    above; none with moe_wgmma=False), and pinned it takes every prefill size (no DEQUANT renders beside it)."""
    with pytest.raises(Exception, match="WGMMA: K steps of 64"):
        load_kernel(KernelSpec("moe_nvfp4_prefill", "moe_experts", {**_constants("tiny-tp1"), "I": 32}), None)
    # WG_WSTEPS: the most <= the one asked for that the relayout's chunks take (the odd shape's RK0 64: 1), else refused
    odd = load_kernel(KernelSpec("moe_nvfp4_prefill", "moe_experts", _constants("odd", WG_WSTEPS=4)), None)
    full = load_kernel(KernelSpec("moe_nvfp4_prefill", "moe_experts", _constants("full-tp8", WG_WSTEPS=4, WG_WDEPTH=2)),
                       None)
    assert (odd.RK0, odd.WG_WSTEPS, full.RK0, full.WG_WSTEPS) == (64, 1, 256, 4)
    with pytest.raises(Exception, match="WG_WSTEPS 1, 2 or 4"):
        load_kernel(KernelSpec("moe_nvfp4_prefill", "moe_experts", _constants("full-tp8", WG_WSTEPS=3)), None)
    # WG_WTMA: 16-byte boxes need runs of 2 or 4 K steps and relayout chunks of >= 128 (the odd shape's RK0 is 64)
    for bad in (_constants("odd", WG_WSTEPS=2, WG_WTMA=True), _constants("full-tp8", WG_WTMA=True)):
        with pytest.raises(Exception, match="WG_WTMA"):
            load_kernel(KernelSpec("moe_nvfp4_prefill", "moe_experts", bad), None)
    mod = load_kernel(KernelSpec("moe_nvfp4_prefill", "moe_experts", dict(_constants("full-tp8"), PDL=True)), None)
    assert_template_contract(mod)  # (with the second kernel's option sets)
    assert list(mod.SIGNATURE_WG) == mod.wg_kernel.arg_names and mod.DEQUANT is False and mod.BLOCK_M == 128
    f32 = load_kernel(KernelSpec("moe_nvfp4_prefill", "moe_experts", dict(_constants("tiny-tp1"), DTYPE="f32")), None)
    assert f32.WGMMA is False and not hasattr(f32, "wg_kernel")
    spec = load_spec(ROOT / "models/beam-tiny.yaml")
    pkg = compile_package(spec, dtype="bf16", tp=1)
    forms = sorted((k.constants.get("BLOCK_M"), bool(k.constants.get("WG_ACOPY")), bool(k.constants.get("WG_A32")))
                   for k in pkg.kernels.values() if k.constants.get("WGMMA"))
    # (the 256-row form twice: with 32-bit A-row offsets up to emitters.a32_max_tokens, without above)
    assert forms == [(128, True, False), (256, True, False), (256, True, True)], forms
    off = compile_package(spec, dtype="bf16", tp=1, moe_wgmma=False)
    assert not any(k.constants.get("WGMMA") for k in off.kernels.values())
    assert any(k.constants.get("DEQUANT") for k in off.kernels.values())
    # shapes without K steps of 64 (the tiny spec at TP 2: I = 32 a rank) keep the DEQUANT renders, and every prefill
    # kernel of the package renders (no template refusal for a valid spec)
    from beamc.codegen.emitters import wgmma_shapes

    assert wgmma_shapes(5120, 320) and wgmma_shapes(768, 192) and not wgmma_shapes(256, 32)
    assert not wgmma_shapes(5120, 96) and not wgmma_shapes(5120 + 32, 320)
    tp2 = compile_package(spec, dtype="bf16", tp=2)
    prefill2 = [k for k in tp2.kernels.values() if k.template == "moe_nvfp4_prefill"]
    assert prefill2 and not any(k.constants.get("WGMMA") for k in prefill2)
    assert any(k.constants.get("DEQUANT") for k in prefill2)
    for k in prefill2 + [k for k in pkg.kernels.values() if k.template == "moe_nvfp4_prefill"]:
        load_kernel(k, None)
    # the full spec at every TP degree: the WGMMA forms render (stage 4's resident h rows only where they fit: I / 64 <=
    # MOE_WGMMA_HRES_MAX_STEPS)
    full = load_spec(ROOT / "models/beam.yaml")
    for tp in (1, 2, 4, 8):
        ks = [k for k in compile_package(full, tp=tp, phases=("prefill",)).kernels.values()
              if k.template == "moe_nvfp4_prefill"]
        assert sum(bool(k.constants.get("WGMMA")) for k in ks) == 3, tp  # (bm128; bm256 with / without WG_A32)
        for k in ks:
            mod = load_kernel(k, None)
            assert not mod.WGMMA or mod.WG_HRES == (mod.BLOCK_M == 128 and mod.I // 64 <= 6), (tp, mod.I)
    pinned = compile_package(spec, dtype="bf16", tp=1, template_overrides={"moe_nvfp4_prefill": {"WGMMA": True}})
    prefill = [k for k in pinned.kernels.values() if k.template == "moe_nvfp4_prefill"]
    assert len(prefill) == 1 and prefill[0].constants["WGMMA"]  # (every prefill size: no DEQUANT render beside it)
    assert sum(k.template == "moe_nvfp4_prefill" for k in pkg.kernels.values()) == 4
    with pytest.raises(BeamcError, match="WGMMA"):
        compile_package(spec, dtype="bf16", tp=2, template_overrides={"moe_nvfp4_prefill": {"WGMMA": True}})


class _Recorder:
    """Stands in for a kernel object: `k[grid](*args, **kw)` records the launch."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kw: self.log.append((self.name, grid, args, kw))


def test_launcher_runs_the_sort_then_the_gluon_stages_on_relaid_weights():
    """The WGMMA render's launcher (no GPU: both kernels stood in for): with re-laid-out weights the sort's three
    launches of the Triton kernel, then stages 3 and 4 as `wg_kernel` on (NB x cdiv(I, WG_BN)) and (NB x
    cdiv(H, WG_BN2 x WG_NT2)) programs with the binaries' pinned constants and options (8 MMA warps, PDL, no FMA);
    with the ModelOpt bytes all five launches of the Triton kernel, on the same sorted blocks."""
    from test_kernels_moe import nvfp4_experts

    c = SHAPES["odd"]
    mod = load_kernel(KernelSpec("moe_nvfp4_prefill", "moe_experts", dict(_constants("odd"), PDL=True)), None)
    decode = load_kernel(KernelSpec("moe_nvfp4_decode", "moe_experts", dict(DTYPE="bf16", **c)), None)
    E, H, I, k = c["E"], c["H"], c["I"], c["TOP_K"]
    params = nvfp4_experts(E, H, I, torch.Generator().manual_seed(0))
    T = 300
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    idx = torch.randint(0, E, (T, k))
    y = torch.empty(T, k, H, dtype=torch.bfloat16)
    s = mod.sizes(T)
    for weights, relaid in ((decode.relayout(params), True), (params, False)):
        log: list = []
        mod.kernel, mod.wg_kernel = _Recorder("kernel", log), _Recorder("wg_kernel", log)
        mod.launch(x, idx, *weights, y, torch.empty(mod.scratch_numel(T), dtype=torch.bfloat16))
        names = [n for n, *_ in log]
        if not relaid:
            assert names == ["kernel"] * 5 and [a[14] for _, _, a, _ in log] == [0, 1, 2, 3, 4]
            continue
        assert names == ["kernel"] * 3 + ["wg_kernel"] * 2, names
        (_, g3, a3, kw3), (_, g4, a4, kw4) = log[3:]
        assert g3 == (s["NB"] * -(-I // mod.WG_BN),) and g4 == (s["NB"] * -(-H // (mod.WG_BN2 * mod.WG_NT2)),)
        for a, kw, stage in ((a3, kw3, 3), (a4, kw4, 4)):
            assert len(a) == 12 and a[0] is x and a[1] is weights[0] and a[10] == T and a[11] == H
            assert kw["STAGE"] == stage and kw["num_warps"] == 8 and kw["launch_pdl"] is True
            assert kw["enable_fp_fusion"] is False and "fn" not in kw
            assert {n for n, t in mod.SIGNATURE_WG.items() if t == "constexpr"} == {
                n for n in kw if n not in ("num_warps", "launch_pdl", "enable_fp_fusion", "enable_reflect_ftz")}
    # WG_WTMA: stage 3's two tensor maps of the re-laid-out gate_up weights (`wtma_views`), built here on the CPU
    E, H, I = WTMA_SHAPES["rk128"]
    mod = load_kernel(KernelSpec("moe_nvfp4_prefill", "moe_experts", dict(
        DTYPE="bf16", WGMMA=True, E=E, H=H, I=I, TOP_K=k, WG_WSTEPS=2, WG_WTMA=True)), None)
    decode = load_kernel(KernelSpec("moe_nvfp4_decode", "moe_experts", dict(DTYPE="bf16", E=E, H=H, I=I, TOP_K=k)),
                         None)
    weights = decode.relayout(nvfp4_experts(E, H, I, torch.Generator().manual_seed(1)))
    log = []
    mod.kernel, mod.wg_kernel = _Recorder("kernel", log), _Recorder("wg_kernel", log)
    x, idx = torch.zeros(T, H, dtype=torch.bfloat16), torch.randint(0, E, (T, k))
    mod.launch(x, idx, *weights, torch.empty(T, k, H, dtype=torch.bfloat16),
               torch.empty(mod.scratch_numel(T), dtype=torch.bfloat16))
    assert [n for n, *_ in log] == ["kernel"] * 3 + ["wg_kernel"] * 2 and list(mod.SIGNATURE_WG)[10:12] == [
        "wc_desc", "ws_desc"]
    wc, ws = log[3][2][10:12]
    assert wc.base is weights[0] and ws.base is weights[1]
    assert (wc.shape, wc.strides) == (list(mod.wtma_views()[0][0]), list(mod.wtma_views()[0][1]))
    assert wc.shape == [E, 4, I, 2, H // 8] and wc.strides == [2 * I * H // 8, mod.RK0 // 32, H // 8, I * H // 8, 1]
    assert ws.shape == [E, I, 2, H // 16] and ws.block_shape == [1, mod.WG_BN, 2, 16] and wc.block_shape == [
        1, 4, mod.WG_BN, 2, 4]


def test_the_emitters_forms_are_forms_tested_here():
    """The emitter's default WGMMA forms (emitters.MOE_WGMMA_FORMS) are forms this file compiles and the GPU tests
    run (tests/gpu/test_kernels_moe_prefill_gpu.py takes FORMS from here): a change to one must show in the other."""
    from beamc.codegen.emitters import MOE_WGMMA_FORMS, moe_wgmma_form

    tested = list(FORMS.values())
    for name, form in MOE_WGMMA_FORMS.items():
        # the route without the combine_experts pass, less the template's defaults
        plain = {k: v for k, v in moe_wgmma_form(name).items() if k != "WGMMA" and (k, v) != ("BLOCK_M", 128)}
        assert plain in tested, (name, plain)
        if form.get("COMBINE"):  # (as the pass renders it: the node's routed scale, Beam's 2.5 in these forms)
            assert dict(plain, COMBINE=True, ROUTED_SCALE=2.5) in tested, (name, form)
