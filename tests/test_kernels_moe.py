"""Generated kernel `moe_nvfp4_decode` (IR op `moe_experts`, format "nvfp4", the decode path) on CPU.

1. fp32 instances under Triton's interpreter (a subprocess: see `interpreted`) against `REFS["moe_experts"]` (fp32 x:
   the NVFP4 weights dequantised to fp32, no bf16 rounding), max |y - ref| / max |ref| < 1e-5, and h (stage 0's
   scratch) against the reference's swiglu rows, both weight layouts (ModelOpt's and `relayout`'s): the tiny spec's
   shapes (E 16, H 256, top-k 4; I 64 at TP 1, 32 at TP 2), T in {1, 3, 8}, and odd ones (E 5 and 7, H 384, I 96:
   several K steps, several row blocks); weights quantised with `beamc.checkpoint.nvfp4.quantize` from random bf16
   weights per expert and part, stacked as the loader stacks them; routings with experts chosen by several tokens, a
   token routed to the same expert from two slots, every pair on one expert, ids outside [0, E) (zero rows, nothing
   read); the pair grouping at small IDX_CHUNK / MP_MAX (several idx chunks, several passes over an expert's pairs);
   strided x; y poisoned with NaN, the scratch with canaries past scratch_numel(T); one render with PDL on (the gdc
   calls are skipped in the interpreter); one bf16 instance against the reference's composition with exact weights
   and each bf16 rounding done as the interpreter converts (toward zero in Triton 3.9; a GPU rounds to nearest even).
2. The GPU-only decode (inline PTX, not run by the interpreter) emulated instruction by instruction in torch for
   both layouts, every nibble and scale value: the same weights as `nvfp4.dequantize` x 2^-7, at the positions the
   kernel's K permutation gives them; `relayout` is pure and keeps every weight.
3. The bf16 variants compile ahead of time for sm_90a and sm_100a at the full spec's TP-8 shapes (both layouts, MP 1
   and 8) and the tiny spec's (PDL on by default; the tiny spec's also without): griddepcontrol.launch_dependents
   first and one wait with no load or store before it exactly when PDL is on, no flush-to-zero arithmetic; tensor
   cores (mma m16n8k16), 16-byte cp.async copies, the decode PTX, no local memory (spills); one decode token gives
   >= 2 x 132 programs in each stage at TP 8.
GPU numerics (bf16, relative error, T up to 64, CUDA graphs) are tests/gpu/test_kernels_moe_gpu.py's.

Why a subprocess: see tests/test_kernels_attn_router.py (the interpreter is picked when triton is imported; this
process never imports triton).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import re
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

from beamc.checkpoint import nvfp4
from beamc.codegen.kernel import KernelSpec, aot_compile, launch_options, load_kernel
from beamc.ir.reference import REFS, expert_weights, swiglu_ref
from beamc.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
SMEM_LIMIT = 232448  # bytes of shared memory a block may use on sm_90 / sm_100
TEMPLATE = "moe_nvfp4_decode"
SMS = 132  # streaming multiprocessors of an H100 / H200


# ---------------------------------------------------------------- constants, weights, reference
def moe_constants(spec, tp: int, dtype: str = "bf16") -> dict:
    """The template's constants for the MoE layers of `spec` at tensor-parallel size tp (d_ff split over ranks)."""
    m = spec.mlp.moe
    return dict(DTYPE=dtype, E=m.num_experts, H=spec.hidden_size, I=m.d_ff // tp, TOP_K=m.top_k)


def nvfp4_experts(E: int, H: int, I: int, g: torch.Generator, device="cpu", std: float = 0.05) -> list[torch.Tensor]:
    """Random bf16 experts quantised per expert and part (gate, up, down: one ModelOpt file tensor each; up at twice
    the scale), stacked in the IR layout (`loader._stacked_experts`): gate_up codes [E, 2I, H/2] (gate rows then up
    rows), block scales [E, 2I, H/16], global scales [E, 2]; down codes [E, H, I/2], block scales [E, H, I/16],
    global scales [E, 1]."""
    gu_c, gu_s, gu_g, dn_c, dn_s, dn_g = [], [], [], [], [], []
    for _ in range(E):
        # up rows at twice gate's scale: the two parts' global scales differ
        gate, up = (nvfp4.quantize((torch.randn(I, H, generator=g) * s).bfloat16().to(device)) for s in (std, 2 * std))
        gu_c.append(torch.cat([gate[0], up[0]]))
        gu_s.append(torch.cat([gate[1], up[1]]))
        gu_g.append(torch.stack([gate[2], up[2]]))
        c, s, s2 = nvfp4.quantize((torch.randn(H, I, generator=g) * std).bfloat16().to(device))
        dn_c.append(c)
        dn_s.append(s)
        dn_g.append(s2[None])
    return [torch.stack(v) for v in (gu_c, gu_s, gu_g, dn_c, dn_s, dn_g)]


def distinct_idx(T: int, E: int, k: int, g: torch.Generator) -> torch.Tensor:
    """[T, k] int64 expert ids, distinct within each token."""
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.empty(0, k).long()


def h_reference(x, idx, params) -> torch.Tensor:
    """swiglu(gate, up) [T, k, I] per (token, choice), with the reference's rounding points (what stage 0 stores);
    rows of ids outside [0, E) are zero (the kernel's)."""
    T, k = idx.shape
    E, I2 = params[0].shape[:2]
    out = []
    for t in range(T):
        for j in range(k):
            e = int(idx[t, j])
            if not 0 <= e < E:
                out.append(torch.zeros(I2 // 2, dtype=x.dtype, device=x.device))
                continue
            w_gu, _ = expert_weights(params, "nvfp4", e, x.dtype)
            gate, up = torch.nn.functional.linear(x[t:t + 1], w_gu).chunk(2, dim=-1)
            out.append(swiglu_ref(gate, up)[0])
    return torch.stack(out).view(T, k, -1)


def y_reference(x, idx, params) -> torch.Tensor:
    """REFS["moe_experts"], with the rows of ids outside [0, E) zero (the reference has no such ids)."""
    E = params[0].shape[0]
    ok = (idx >= 0) & (idx < E)
    y = REFS["moe_experts"]([x, torch.where(ok, idx, 0), *params], {"format": "nvfp4"})[0]
    return torch.where(ok[..., None], y, torch.zeros_like(y))


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def tiny_spec_():
    return load_spec(ROOT / "models/beam-tiny.yaml")


def test_stacked_weights_dequantise_per_part():
    """The test weights' layout is the IR's: `expert_weights` (the reference's dequantisation) of the stack equals
    each part's own ModelOpt dequantisation, gate rows then up rows, each with its own global scale."""
    g = torch.Generator().manual_seed(0)
    E, H, I = 3, 64, 32
    params = nvfp4_experts(E, H, I, g)
    assert [tuple(p.shape) for p in params] == [(E, 2 * I, H // 2), (E, 2 * I, H // 16), (E, 2), (E, H, I // 2),
                                               (E, H, I // 16), (E, 1)]
    for e in range(E):
        w_gu, w_dn = expert_weights(params, "nvfp4", e, torch.float32)
        gate = nvfp4.dequantize(params[0][e, :I], params[1][e, :I], params[2][e, 0])
        up = nvfp4.dequantize(params[0][e, I:], params[1][e, I:], params[2][e, 1])
        assert torch.equal(w_gu, torch.cat([gate, up])) and not torch.equal(params[2][e, 0], params[2][e, 1])
        assert torch.equal(w_dn, nvfp4.dequantize(params[3][e], params[4][e], params[5][e, 0]))


# ---------------------------------------------------------------- the GPU decode, emulated
def _bf16_bits_to_float(b: torch.Tensor) -> torch.Tensor:
    return (b.to(torch.int32) << 16).view(torch.float32)


def _float_to_bf16_bits(f: torch.Tensor) -> torch.Tensor:
    return f.bfloat16().view(torch.int16).to(torch.int64) & 0xFFFF


def emulate_ptx(asm: str, ins: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run the decode PTX (its few instructions: mov.b32 pack / unpack, shl, shr, and, or, shf.l.wrap,
    mul.rn.bf16x2) on int64 tensors holding 32-bit (b32) or 16-bit (h) register values; ins: "$8", "$9"."""
    regs = dict(ins)
    m32 = (1 << 32) - 1

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else torch.tensor(int(tok, 0), dtype=torch.int64)

    body = asm.strip()
    assert body[0] == "{" and body[-1] == "}"
    for stmt in body[1:-1].split(";"):
        s = stmt.strip()
        if not s or s.startswith(".reg"):
            continue
        op, args = s.split(None, 1)
        if op == "mov.b32" and args.strip().startswith("{"):  # mov.b32 {a, b}, r: unpack
            lo, hi, src = re.match(r"\{\s*([$\w]+)\s*,\s*([$\w]+)\s*\}\s*,\s*([$\w]+)", args.strip()).groups()
            regs[lo], regs[hi] = val(src) & 0xFFFF, (val(src) >> 16) & 0xFFFF
            continue
        if op == "mov.b32":  # mov.b32 r, {a, b}: pack
            dst, lo, hi = re.match(r"([$\w]+)\s*,\s*\{\s*([$\w]+)\s*,\s*([$\w]+)\s*\}", args.strip()).groups()
            regs[dst] = (val(lo) & 0xFFFF) | ((val(hi) & 0xFFFF) << 16)
            continue
        a = [t.strip() for t in args.split(",")]
        d = a[0]
        if op == "shl.b32":
            regs[d] = (val(a[1]) << int(a[2])) & m32
        elif op == "shr.b32":
            regs[d] = (val(a[1]) & m32) >> int(a[2])
        elif op == "and.b32":
            regs[d] = val(a[1]) & val(a[2])
        elif op == "or.b32":
            regs[d] = val(a[1]) | val(a[2])
        elif op == "shf.l.wrap.b32":  # d = high 32 bits of {b, a} << (c & 31)
            c = int(a[3]) & 31
            regs[d] = (((val(a[2]) << c) | ((val(a[1]) & m32) >> (32 - c))) & m32) if c else val(a[2])
        elif op == "mul.rn.bf16x2":
            x, y = val(a[1]), val(a[2])
            halves = [_float_to_bf16_bits(_bf16_bits_to_float((x >> sh) & 0xFFFF)
                                          * _bf16_bits_to_float((y >> sh) & 0xFFFF)) for sh in (0, 16)]
            regs[d] = halves[0] | (halves[1] << 16)
        else:
            raise AssertionError(f"unknown PTX op {op}")
    return regs


def _decode_case(mod, relaid: bool, bk: int, g: torch.Generator):
    """One row of BK values covering every code and many scales: the PTX's 8 outputs per word against
    nvfp4.dequantize x 2^-7 at the kernel's logical k (32 G + 8 c + 2 q + h) for that word."""
    nb = bk // 16
    codes = torch.randint(0, 256, (1, 1, bk // 2), generator=g, dtype=torch.uint8)
    codes[0, 0, :8] = torch.arange(0, 256, 32, dtype=torch.uint8) + torch.arange(8, dtype=torch.uint8)  # all 16 codes
    scale = torch.rand(1, 1, nb, generator=g).mul(448).to(torch.float8_e4m3fn)
    scale[0, 0, 0] = 2.0 ** -9  # the smallest subnormal e4m3
    scale[0, 0, 1] = 448.0
    ref = nvfp4.dequantize(codes[0], scale[0], 2.0 ** -7)[0]  # [BK] natural order, exact in fp32
    ng = bk // 32
    if relaid:
        words = mod._relayout_codes(codes, scale, bk)[0, 0].to(torch.int64) & 0xFFFFFFFF
        sbyte = mod._relayout_scales(scale, bk)[0, 0].to(torch.int64)
        asm = mod._DECODE_RELAID.value
    else:
        words = codes[0, 0].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        asm = mod._DECODE_RAW.value
    for s in range(bk // 8):
        c, G = divmod(s, ng)
        if relaid:
            s2 = sbyte[(c // 2) * ng + G] * 16 + 0x7680  # the kernel: byte * 16 + 0x7680
        else:
            s2 = _float_to_bf16_bits(scale[0, 0, s // 2].float() * 2.0 ** 119)
        out = emulate_ptx(asm, {"$8": words[s], "$9": s2})
        for q in range(4):
            for h in range(2):
                got = _bf16_bits_to_float(out[f"${2 * q + h}"])
                k = (32 * G + 8 * c + 2 * q + h) if relaid else (8 * s + q + 4 * h)
                assert got.item() == ref[k].item(), (relaid, s, q, h, got.item(), ref[k].item())


def check_ptx(relaid: bool, tiny, kdir) -> dict:
    """The inline PTX the GPU runs (the interpreter runs the same bit operations written in Triton) yields
    E2M1 x scale x 2^-7 exactly, for every code, subnormal and largest scales, at the logical k the kernel's x
    permutation assumes, for both chunk sizes of the TP-8 shapes and the smallest one."""
    g = torch.Generator().manual_seed(1)
    mod = load_kernel(KernelSpec(TEMPLATE, "moe_experts", moe_constants(load_spec(ROOT / "models/beam.yaml"), 8)), kdir)
    assert (mod.BK0, mod.BK1) == (256, 64)
    for bk in (mod.BK0, mod.BK1, 32):
        _decode_case(mod, relaid, bk, g)
    return {}


def check_relayout(tiny, kdir) -> dict:
    """relayout: new tensors (inputs untouched), the documented dtypes and shapes, and, read back through its
    definition (MAG / SGN bit positions, the word and scale order, the scale byte), every weight of the original;
    blocks with a zero or a negative scale included."""
    mod = load_kernel(KernelSpec(TEMPLATE, "moe_experts", moe_constants(tiny, 2)), kdir)
    g = torch.Generator().manual_seed(2)
    E, H, I = mod.E, mod.H, mod.I
    params = nvfp4_experts(E, H, I, g)
    params[1][0, 0, 0] = 0.0  # a zero-scale block with nonzero codes: values 0
    params[4][1, 2, 1] = -params[4][1, 2, 1].float()  # a negative scale
    before = [p.clone() for p in params]
    out = mod.relayout(params)
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert [t.dtype for t in out] == [torch.int32, torch.uint8, torch.float32, torch.int32, torch.uint8, torch.float32]
    assert [tuple(t.shape) for t in out] == [(E, 2 * I, H // 8), (E, 2 * I, H // 16), (E, 2), (E, H, I // 8),
                                             (E, H, I // 16), (E, 1)]
    for codes, scale, words, enc, bk in ((params[0], params[1], out[0], out[1], mod.BK0),
                                         (params[3], params[4], out[3], out[4], mod.BK1)):
        n, k = codes.shape[1], codes.shape[2] * 2
        ng = bk // 32
        w = words.to(torch.int64) & 0xFFFFFFFF
        val = torch.zeros(E, n, k)
        for s in range(bk // 8):
            c, G = divmod(s, ng)
            for q in range(4):
                for h in range(2):
                    mag = (w[..., s::bk // 8] >> mod.MAG[q][h]) & 7
                    sg = (w[..., s::bk // 8] >> mod.SGN[q][h]) & 1
                    kk = torch.arange(k // bk) * bk + 32 * G + 8 * c + 2 * q + h
                    val[..., kk] = nvfp4.E2M1_TABLE[(mag | (sg << 3)).long()]
        sb = enc.to(torch.int32).view(E, n, k // bk, 2, ng).permute(0, 1, 2, 4, 3).reshape(E, n, k // 16)
        sv = ((sb * 16 + 0x7680) << 16).view(torch.float32) * 2.0 ** -119
        got = (val.view(E, n, k // 16, 16) * sv[..., None]).view(E, n, k)
        assert torch.equal(got, nvfp4.dequantize(codes, scale, 1.0))
    return {}


@pytest.mark.parametrize("case", ["ptx[raw]", "ptx[relaid]", "relayout"])
def test_gpu_decode_and_relayout(case, interpreted):
    """The GPU-only decode PTX, emulated (check_ptx), and relayout (check_relayout): run in the interpreter child,
    where the rendered module can be imported."""
    _check(interpreted, case)


# ---------------------------------------------------------------- interpreter cases
# (label, constants over the tiny spec's at tp, T, relaid, routing)
def _odd(E: int, H: int, I: int, k: int) -> dict:
    return dict(DTYPE="f32", E=E, H=H, I=I, TOP_K=k)


MOE_CASES = {
    "tp1-T1-raw": (1, None, 1, False, "distinct"),
    "tp2-T1-relaid": (2, None, 1, True, "distinct"),
    "tp1-T3-relaid": (1, None, 3, True, "shared"),
    "tp2-T3-raw": (2, None, 3, False, "shared"),
    "tp2-T8-relaid-chunks": (2, dict(IDX_CHUNK=8, MP_MAX=2), 8, True, "shared"),
    "E5-T3-relaid-bad-ids": (1, _odd(5, 384, 96, 3), 3, True, "bad"),
    "E7-T8-raw-one-expert": (1, _odd(7, 128, 32, 2), 8, False, "one"),
    # SCAN_T1 off: at one token each pair its own program (a repeated expert computed twice), bad ids read nothing
    "tp2-T1-relaid-solo": (2, dict(SCAN_T1=False), 1, True, "distinct"),
    "tp1-T1-raw-solo-shared": (1, dict(SCAN_T1=False), 1, False, "shared"),
    "E7-T1-relaid-solo-one-expert": (1, dict(_odd(7, 128, 32, 2), SCAN_T1=False), 1, True, "one"),
    "E5-T1-relaid-solo-bad-ids": (1, dict(_odd(5, 384, 96, 3), SCAN_T1=False), 1, True, "bad"),
    "tp1-T3-relaid-solo-shared": (1, dict(SCAN_T1=False), 3, True, "shared"),  # (T > 1: the scan as always)
    # KSPLIT 8: stage 0's dot in 8 batches (8 warps on a GPU), each stage a binary of its own (STAGE)
    "tp1-T1-relaid-ks8": (1, dict(KSPLIT=8), 1, True, "distinct"),
    "E5-T3-raw-bad-ids-ks8": (1, dict(_odd(5, 512, 96, 3), KSPLIT=8), 3, False, "bad"),
    "E7-T1-relaid-solo-one-expert-ks8": (1, dict(_odd(7, 256, 32, 2), KSPLIT=8, SCAN_T1=False), 1, True, "one"),
    # wider programs (the batch-decode candidates): 16 rows of I a stage-0 program, 64 rows of H a stage-1 warp
    "tp2-T8-relaid-bi16-rw64": (2, dict(BLOCK_I=16, RW=64), 8, True, "shared"),
    "E5-T3-raw-bad-ids-bi16-rw64": (1, dict(_odd(5, 384, 96, 3), BLOCK_I=16, RW=64), 3, False, "bad"),
    # the idx scan in steps wider than the pairs (one masked step), and of 16 over 24 pairs (two, the second masked)
    "tp2-T8-relaid-chunk128": (2, dict(IDX_CHUNK=128), 8, True, "shared"),
    "E5-T8-raw-bad-ids-chunk16": (1, dict(_odd(5, 384, 96, 3), IDX_CHUNK=16), 8, False, "bad"),
    # PLAN: the pairs grouped by expert by a first launch (a counting sort by atomics), each stage's program j on
    # item j: shared experts; bad ids (their own bucket, zero rows); every pair on one expert (items of MP, more
    # pairs than MP); and a step below PLAN_MIN_PAIRS (the scan, in the same render)
    "tp2-T8-relaid-plan": (2, dict(PLAN=True, PLAN_MIN_PAIRS=0), 8, True, "shared"),
    "E5-T8-raw-bad-ids-plan": (1, dict(_odd(5, 384, 96, 3), PLAN=True, PLAN_MIN_PAIRS=0), 8, False, "bad"),
    "E7-T8-relaid-one-expert-plan-mp2": (1, dict(_odd(7, 128, 32, 2), PLAN=True, PLAN_MIN_PAIRS=0, MP_MAX=2), 8,
                                         True, "one"),
    "tp1-T3-relaid-plan-below": (1, dict(PLAN=True, PLAN_MIN_PAIRS=64), 3, True, "shared"),
    # past the decode range before s50 (64; emitters.MOE_DECODE_MAX_TOKENS is 128 since) on the default
    # PLAN_MIN_PAIRS: more pairs than two of the plan's PLAN_CHUNK steps (288 at the tiny spec's top-4), bad ids
    "tp2-T72-relaid-bad-ids-plan": (2, dict(PLAN=True), 72, True, "bad"),
}
MOE_PDL_CASES = ["tp1-T3-relaid+pdl"]


def _idx(kind: str, T: int, E: int, k: int, g: torch.Generator) -> torch.Tensor:
    idx = distinct_idx(T, E, k, g)
    if kind == "shared":  # experts chosen by several tokens, a token routed to one expert from two slots
        idx[:, 0] = 3
        idx[0, 1] = 3
        if T > 1:
            idx[1, -1] = idx[0, -1]
    elif kind == "bad":  # ids outside [0, E): rows of zeros, nothing read
        idx[0, 1] = -1
        idx[T - 1, 0] = E
        if T > 1:
            idx[1, 2] = idx[0, 0]
    elif kind == "one":  # every pair on expert 2 (more pairs than MP)
        idx[:] = 2
    return idx


def check_moe(label: str, tiny, kdir, pdl: bool = False) -> dict:
    tp, extra, T, relaid, kind = MOE_CASES[label]
    c = moe_constants(tiny, tp, "f32")
    if extra:
        c.update(extra)
    if pdl:
        c["PDL"] = True
    mod = load_kernel(KernelSpec(TEMPLATE, "moe_experts", c), kdir)
    assert mod._interpreted(), "triton did not pick the interpreter"
    E, H, I, k = c["E"], c["H"], c["I"], c["TOP_K"]
    g = torch.Generator().manual_seed(len(label) + T)
    params = nvfp4_experts(E, H, I, g)
    wide = torch.randn(T, H + (3 if kind == "bad" else 32), generator=g)
    x = wide[:, :H] if T > 1 else wide[:, :H].contiguous()  # strided rows too (a stride % 8: the launcher's copy)
    idx = _idx(kind, T, E, k, g)
    y = torch.full((T, k, H), float("nan"))
    n = mod.scratch_numel(T)
    scratch = torch.full((n + 64,), float("nan"))  # 64 canaries past the end
    mod.launch(x, idx, *(mod.relayout(params) if relaid else params), y, scratch)
    assert torch.isnan(scratch[n:]).all(), "a write past scratch_numel(T)"
    assert torch.isfinite(y).all()
    h_err = rel_max(scratch[:T * k * I].view(T, k, I), h_reference(x, idx, params))  # (PLAN: the plan after h)
    err = rel_max(y, y_reference(x, idx, params))
    assert h_err < 1e-5 and err < 1e-5, (h_err, err)
    bad = (idx < 0) | (idx >= E)
    assert not bad.any() or (y[bad] == 0).all()
    return dict(rel_err=err, h_rel_err=h_err, mp=mod.constexprs(T, relaid)["MP"])


# COMBINE render (the combine_experts pass): (tp, constants over the tiny spec's, T, relaid, routing, routed scale)
MOE_COMBINE_CASES = {
    "tp1-T1-relaid-x2.5": (1, None, 1, True, "distinct", 2.5),
    "tp2-T3-raw-shared": (2, None, 3, False, "shared", None),
    "E5-T3-k3-relaid-bad-ids": (1, _odd(5, 384, 96, 3), 3, True, "bad", 2.5),
    "E7-T2-k2-relaid-one-expert": (1, _odd(7, 128, 32, 2), 2, True, "one", None),
    # EARLY1: stage 1's routing and first K steps' weights read before its (PDL) wait; all steps early, or 2 of 3
    # early and the loop for the rest; a PDL render (gdc calls compiled out in the interpreter)
    "tp1-T1-relaid-x2.5-early1": (1, dict(EARLY1=True), 1, True, "distinct", 2.5),
    "tp2-T3-raw-shared-early1": (2, dict(EARLY1=True), 3, False, "shared", None),
    "E5-T3-k3-relaid-bad-ids-early1-2of3": (1, dict(_odd(5, 384, 96, 3), EARLY1=True, EARLY1_CHUNKS=2), 3, True,
                                            "bad", 2.5),
    "E7-T2-k2-raw-one-expert-early1-pdl": (1, dict(_odd(7, 128, 64, 2), EARLY1=True, PDL=True), 2, False, "one",
                                           None),
    # COMBINE_R 64: 64 A rows per stage-1 warp (twice the rows of H per program, half the programs)
    "tp2-T3-raw-shared-r64": (2, dict(COMBINE_R=64), 3, False, "shared", None),
    "E5-T3-k3-relaid-bad-ids-r64": (1, dict(_odd(5, 384, 96, 3), COMBINE_R=64), 3, True, "bad", 2.5),
    # PERSIST: both stages' items walked by G programs (in the interpreter the walks as two launches): a few programs
    # walking many items, more programs than one stage's items, and one per item
    "tp2-T3-raw-shared-persist3": (2, dict(PERSIST=True, PERSIST_PROGRAMS=3), 3, False, "shared", None),
    "E5-T3-k3-relaid-bad-ids-persist7": (1, dict(_odd(5, 384, 96, 3), PERSIST=True, PERSIST_PROGRAMS=7), 3, True,
                                         "bad", 2.5),
    "tp1-T1-relaid-x2.5-persist": (1, dict(PERSIST=True), 1, True, "distinct", 2.5),
    "tp2-T1-raw-persist-noscan": (2, dict(PERSIST=True, SCAN_T1=False, PERSIST_PROGRAMS=5), 1, False, "distinct", 2.5),
    "E7-T2-k2-relaid-one-expert-persist-early1": (1, dict(_odd(7, 128, 64, 2), PERSIST=True, EARLY1=True,
                                                          PERSIST_PROGRAMS=4), 2, True, "one", None),
}


def test_early1_render_refuses_an_early_trigger(tmp_path):
    """EARLY1 reads idx before stage 1's wait: a PDL render whose stage 0 triggers before its own wait is refused."""
    c = dict(moe_constants(tiny_spec_(), 1, "bf16"), COMBINE=True, EARLY1=True, PDL=True, LATE_TRIGGER=False)
    with pytest.raises(AssertionError, match="LATE_TRIGGER=True"):
        load_kernel(KernelSpec(TEMPLATE, "moe_experts", c), tmp_path)


def combined_reference(x, idx, params, w, scale) -> torch.Tensor:
    """What a `moe_experts` with `combine` computes (REFS' order): y_reference's experts, `moe_combine_ref`, x scale."""
    from beamc.ir.reference import moe_combine_ref

    sub = moe_combine_ref(y_reference(x, idx, params), w, idx)
    return sub * scale if scale is not None else sub


def combine_constants(c: dict, scale) -> dict:
    """The `moe_combine` kernel's constants beside a moe_nvfp4_decode render's constants `c`."""
    return dict(DTYPE=c["DTYPE"], H=c["H"], TOP_K=c["TOP_K"], ROUTED_SCALE=scale,
                **({"PDL": c["PDL"]} if "PDL" in c else {}))


def check_moe_combine(label: str, tiny, kdir) -> dict:
    """The COMBINE render (stage 1 combines the token's choices) against the reference's experts, then
    `moe_combine_ref`, then the routed scale (what `REFS["moe_experts"]` does with `combine`); and against the
    plain render followed by the moe_combine kernel (the launches the emitter uses at larger T)."""
    tp, extra, T, relaid, kind, scale = MOE_COMBINE_CASES[label]
    c = dict(moe_constants(tiny, tp, "f32"), **(extra or {}))
    mod = load_kernel(KernelSpec(TEMPLATE, "moe_experts", dict(c, COMBINE=True, ROUTED_SCALE=scale)), kdir)
    plain = load_kernel(KernelSpec(TEMPLATE, "moe_experts", c), kdir)
    comb = load_kernel(KernelSpec("moe_combine", "moe_experts", combine_constants(c, scale)), kdir)
    E, H, I, k = c["E"], c["H"], c["I"], c["TOP_K"]
    g = torch.Generator().manual_seed(len(label) + T)
    params = nvfp4_experts(E, H, I, g)
    x = torch.randn(T, H, generator=g)
    idx = _idx(kind, T, E, k, g)
    w = torch.rand(T, k, generator=g) + 0.05
    ps = mod.relayout(params) if relaid else params
    out = torch.full((T, H), float("nan"))
    n = mod.scratch_numel(T)
    scratch = torch.full((n + 64,), float("nan"))  # 64 canaries past the end
    mod.launch(x, idx, *ps, w, out, scratch)
    assert torch.isnan(scratch[n:]).all(), "a write past scratch_numel(T)"
    ref = combined_reference(x, idx, params, w, scale)
    y = torch.full((T, k, H), float("nan"))
    plain.launch(x, idx, *ps, y)
    two = torch.full((T, H), float("nan"))
    comb.launch(y, w, idx, two)
    err, err_two = rel_max(out, ref), rel_max(out, two)
    assert torch.isfinite(out).all() and err < 1e-5 and err_two < 1e-5, (err, err_two)
    if mod.PERSIST:  # the same items' code as the two-launch COMBINE render: the same bits, h and out
        staged = load_kernel(KernelSpec(TEMPLATE, "moe_experts", dict(c, COMBINE=True, ROUTED_SCALE=scale,
                                                                      PERSIST=False)), kdir)
        out2, scratch2 = torch.full_like(out, float("nan")), torch.full_like(scratch, float("nan"))
        staged.launch(x, idx, *ps, w, out2, scratch2)
        assert torch.equal(out, out2) and torch.equal(scratch[:n], scratch2[:n])
        assert int(mod.counters(out.device, 2)[:2].abs().sum()) == 0, "the barrier's counters not left at 0"
    return dict(rel_err=err, rel_err_vs_two_launches=err_two)


def check_emitted_tp2(tiny, kdir) -> dict:
    """The launches the emitter gives a TP-2 `moe_experts` with `combine` (the combine_experts pass), on fresh random
    inputs against the op's reference (`beamc.codegen.check.check_node`): up to --moe-combine-max-tokens the COMBINE
    render alone, above it the plain render then moe_combine, and for bf16 experts the library loop then moe_combine."""
    from beamc.codegen.check import check_node
    from beamc.codegen.package import compile_package
    from beamc.passes.manager import PASSES
    from conftest import spec_variant

    out = {}
    for experts, most, T, want in (("nvfp4", 2, 1, ["moe_nvfp4_decode"]),
                                   ("nvfp4", 2, 3, ["moe_nvfp4_decode", "moe_combine"]),
                                   ("bfloat16", None, 3, ["moe_experts_dense", "moe_combine"])):
        spec = tiny if experts == "nvfp4" else spec_variant(tiny, {"dtypes.experts": experts})
        pkg = compile_package(spec, tp=2, passes=list(PASSES), phases=("decode",), dtype="f32",
                              moe_combine_max_tokens=most)
        node, lns = next((n, ls) for n, ls in pkg.steps["decode"].by_node() if n.op == "moe_experts")
        assert node.attrs["combine"] and [ln.kernel.template if ln.kernel else ln.library for ln in lns
                                          if ln.runs_for(T)] == want, lns
        sizes = {"T": T, "B": T, "R": 2, "S": 2, "E": spec.mlp.moe.num_experts, "V": spec.vocab_size}
        c = check_node(node, lns, sizes, kernel_dir=kdir)
        assert c.nan == 0 and c.max_rel < 1e-5, (experts, T, c)
        out[f"{experts}-T{T}"] = c.max_rel
    return out


def _interpreter_bf16_rounding():
    """How the interpreter converts fp32 to bf16 (Triton 3.9's rounds toward zero; cvt.rn on a GPU rounds to
    nearest even), probed with one value: a function applying the same rounding in torch."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(a_ptr, b_ptr):
        tl.store(b_ptr, tl.load(a_ptr).to(tl.bfloat16).to(tl.float32))

    a, b = torch.tensor([1.0 + 2.0 ** -8 + 2.0 ** -12]), torch.empty(1)  # nearest: 1 + 2^-7; toward zero: 1
    probe[(1,)](a, b)
    if b.item() == a.bfloat16().item():
        return lambda v: v.float().bfloat16().float()
    assert b.item() == 1.0, b.item()
    return lambda v: (v.float().contiguous().view(torch.int32) & -65536).view(torch.float32)


def check_moe_bf16(tp: int, T: int, tiny, kdir) -> dict:
    """The bf16 variant (re-laid-out weights) in the interpreter, against the reference's composition with exact
    weights (the kernel dequantises E2M1 x scale exactly and applies the global scale to the fp32 sums) and every
    rounding to bf16 done the interpreter's way (gate / up, h, y): checks the rounding points on CPU."""
    c = moe_constants(tiny, tp, "bf16")
    mod = load_kernel(KernelSpec(TEMPLATE, "moe_experts", c), kdir)
    E, H, I, k = c["E"], c["H"], c["I"], c["TOP_K"]
    g = torch.Generator().manual_seed(100 + tp + T)
    params = nvfp4_experts(E, H, I, g)
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = distinct_idx(T, E, k, g)
    y = torch.full((T, k, H), float("nan")).bfloat16()
    mod.launch(x, idx, *mod.relayout(params), y)
    return compare_rounding_points(y, x, idx, params, round_weights=False)


def compare_rounding_points(y, x, idx, params, round_weights: bool) -> dict:
    """y (a bf16 kernel's output under the interpreter) against the reference's composition with every rounding to
    bf16 done the interpreter's way: gate / up, h, y, and the dequantised weights when `round_weights` (the
    prefill kernel rounds them as the reference does; the decode kernel applies the global scale to the sums)."""
    T, k = idx.shape
    rnd = _interpreter_bf16_rounding()
    ref = []
    for t in range(T):
        for j in range(k):
            w_gu, w_dn = expert_weights(params, "nvfp4", int(idx[t, j]), torch.float32)
            if round_weights:
                w_gu, w_dn = rnd(w_gu), rnd(w_dn)
            gate, up = rnd(x[t].float() @ w_gu.T).chunk(2)
            ref.append(rnd(w_dn @ rnd(gate / (1 + torch.exp(-gate)) * up)))
    ref = torch.stack(ref).view(T, k, -1)
    err = ((y.float() - ref).norm() / ref.norm()).item()
    mismatch = (y.float() != ref).float().mean().item()  # sums in another order can move a rounding, rarely
    assert err < 1e-4 and mismatch < 1e-2, (err, mismatch)
    return dict(rel_err=err, mismatch=mismatch)


def _check(interpreted: dict, case: str) -> None:
    r = interpreted[case]
    assert r["ok"], f"{case}:\n{r['error']}"


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Results of every interpreter case, run in one child process (see the module docstring)."""
    from conftest import run_interpreted  # not at the top: this file is also the child's script

    d = tmp_path_factory.mktemp("interpreted_moe")
    return run_interpreted([__file__, str(d / "results.json"), str(d)], d / "results.json")


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_nvfp4_decode_matches_reference(case, interpreted):
    _check(interpreted, f"moe[{case}]")


@pytest.mark.parametrize("case", MOE_PDL_CASES)
def test_moe_nvfp4_decode_pdl_render_interpreted(case, interpreted):
    """A PDL render (gdc calls in the kernel, launch_pdl in OPTIONS) runs in the interpreter and still matches."""
    _check(interpreted, f"moe[{case}]")


@pytest.mark.parametrize("case", list(MOE_COMBINE_CASES))
def test_moe_nvfp4_decode_combine_render_matches_reference(case, interpreted):
    """COMBINE: the top-k combine (x routed scale) in stage 1 equals the reference's combine of the experts and the
    two-launch route (plain render, then moe_combine): odd expert counts, top-k 2 / 3, shared experts, a token routed
    to one expert from two slots, ids outside [0, E)."""
    _check(interpreted, f"combine[{case}]")


def test_emitted_moe_experts_with_combine_at_tp2_equal_the_reference(interpreted):
    """What the emitter launches for the combine_experts pass's op at TP 2 (COMBINE render; plain render + moe_combine;
    bf16 experts' library loop + moe_combine) equals the op's reference on fresh random inputs."""
    _check(interpreted, "emitted[tp2]")


def test_moe_nvfp4_decode_bf16_rounding_points_interpreted(interpreted):
    """bf16 in the interpreter equals the reference's rounding points (with the interpreter's bf16 conversion)."""
    _check(interpreted, "moe[tp2-T3-bf16]")


# ---------------------------------------------------------------- ahead-of-time compilation
def _variants() -> list[tuple[str, dict, tuple[int, bool]]]:
    """(label, constants, (T, relaid): the launch whose compile-time constants to use): bf16 at the full spec's TP-8
    shapes (re-laid-out weights at T 1, 8 and 64, ModelOpt's at T 1) and the tiny spec's (TP 1, 2) as rendered by
    default (PDL on), and the tiny spec's TP 1 again with PDL off; the register cap at T 64 (MAXNREG 128, as the
    emitter renders the plain kernel on sm90), the wider programs (16 rows of I, 64 of H a warp) and the scanning
    render (PLAN off) at T 64 (PLAN, the default: the planned binary first, then the scanning one and the plan's); the COMBINE (and its 64 A rows a stage-1 warp at T
    8) and SCAN_T1-off renders at TP 8, and
    the PDL trigger at once (LATE_TRIGGER off) and after both stages' K loops (LATE_TRIGGER1 on); stage 0 on 8 warps
    (KSPLIT 8: each stage its own binary)."""
    full, tiny = load_spec(ROOT / "models/beam.yaml"), tiny_spec_()
    return [("full-tp8", moe_constants(full, 8), (1, True)), ("full-tp8,raw", moe_constants(full, 8), (1, False)),
            ("full-tp8,T8", moe_constants(full, 8), (8, True)), ("full-tp8,T64", moe_constants(full, 8), (64, True)),
            ("full-tp8,maxnreg128,T64", dict(moe_constants(full, 8), MAXNREG=128), (64, True)),
            ("full-tp8,bi16-rw64,T64", dict(moe_constants(full, 8), BLOCK_I=16, RW=64), (64, True)),
            ("full-tp8,no-plan,T64", dict(moe_constants(full, 8), PLAN=False), (64, True)),
            ("tiny-tp1", moe_constants(tiny, 1), (1, True)), ("tiny-tp2", moe_constants(tiny, 2), (3, True)),
            ("tiny-tp1,no-pdl", dict(moe_constants(tiny, 1), PDL=False), (1, True)),
            ("full-tp8,combine", dict(moe_constants(full, 8), COMBINE=True, ROUTED_SCALE=2.5), (1, True)),
            ("full-tp8,combine-r64,T8", dict(moe_constants(full, 8), COMBINE=True, ROUTED_SCALE=2.5, COMBINE_R=64),
             (8, True)),
            ("full-tp8,no-scan-t1", dict(moe_constants(full, 8), SCAN_T1=False), (1, True)),
            ("full-tp8,trigger-at-once", dict(moe_constants(full, 8), LATE_TRIGGER=False), (1, True)),
            ("full-tp8,late-trigger-both", dict(moe_constants(full, 8), LATE_TRIGGER1=True), (1, True)),
            ("full-tp8,ksplit8", dict(moe_constants(full, 8), KSPLIT=8), (1, True)),
            ("full-tp8,combine-persist", dict(moe_constants(full, 8), COMBINE=True, ROUTED_SCALE=2.5, PERSIST=True),
             (1, True)),
            ("full-tp8,combine-persist-early1,T8", dict(moe_constants(full, 8), COMBINE=True, ROUTED_SCALE=2.5,
                                                       PERSIST=True, EARLY1=True), (8, True))]


def _local_bytes(cubin: bytes) -> int | None:
    """Per-thread local memory (the stack, where spills go, plus LOCAL) of the kernel: test_kernels_gemv's
    `local_bytes` (None without cuobjdump)."""
    import tempfile

    from test_kernels_gemv import local_bytes

    with tempfile.TemporaryDirectory() as d:
        return local_bytes(cubin, Path(d))


def _compile(args) -> dict:
    """One AOT compile in a worker process (the interpreter off); what the test asserts about its output."""
    label, constants, (T, relaid), arch, directory = args
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT / "tests"))
    from test_kernels_attn_router import pdl_facts

    mod = load_kernel(KernelSpec(TEMPLATE, "moe_experts", constants), directory)
    mod.CONSTEXPRS = dict(mod.constexprs(T, relaid), INTERPRET=False)  # what the launcher launches with
    ck = aot_compile(mod, arch, launch_options(mod)[0])  # (KSPLIT 8: stage 0's binary, its register cap)
    ptx = ck.asm["ptx"]
    # the other binaries the launcher launches (COMBINE, KSPLIT 8: stage 1's own): compiled too, no local memory
    others = [_local_bytes(aot_compile(mod, arch, o).asm["cubin"]) for o in launch_options(mod)[1:]]
    programs = [1 * mod.TOP_K * -(-mod.I // mod.BLOCK_I), 1 * mod.TOP_K * -(-mod.H // mod.BLOCK_N)]  # T = 1
    return dict(label=f"{label}@sm_{arch}", cubin=len(ck.asm["cubin"]), shared=ck.metadata.shared,
                pdl=constants.get("PDL", True), options=dict(mod.OPTIONS), launch_pdl=bool(ck.metadata.launch_pdl),
                programs=programs, full=label.startswith("full"), local=_local_bytes(ck.asm["cubin"]),
                mma=len(re.findall(r"mma\.sync\.aligned\.m16n8k16", ptx)),
                cp16=len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*, 0x10", ptx)),
                relaid=relaid, shf=ptx.count("shf.l.wrap.b32"), bf16x2=ptx.count("mul.rn.bf16x2"), others=others,
                late=bool(mod.LATE_TRIGGER or mod.LATE_TRIGGER1), late_pair=(mod.LATE_TRIGGER, mod.LATE_TRIGGER1),
                stage0_only=mod.KSPLIT != 4, regs=getattr(ck, "n_regs", None),
                persist=bool(getattr(mod, "PERSIST", False)), coop=bool(ck.metadata.launch_cooperative_grid),
                barrier=[m.start() if m else -1 for m in (re.search(x, ptx) for x in (
                    r"griddepcontrol\.wait", r"(red|atom)\.global\.gpu\.release\.add", r"ld\.relaxed\.gpu",
                    r"fence\.acq_rel\.gpu", r"atom\.global\.gpu\.relaxed\.add",
                    r"griddepcontrol\.launch_dependents"))],
                **pdl_facts(ptx))


def test_aot_compile_every_variant(tmp_path):
    """Every variant for sm_90a and sm_100a (2 processes), with the launcher's OPTIONS. PDL: launch_dependents
    (stage 0's after its K loop by default: LATE_TRIGGER), then one wait before any global load or store (the expert to read is only known from idx); none of it
    without PDL. Tensor-core MMAs, the decode PTX (4 bf16x2 multiplies per word; rotates for re-laid-out words), no
    local memory. At TP 8, 16-byte cp.async copies (the K loops' pipeline) and one decode token fills >= 2
    programs per SM in each stage."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_kernels_attn_router import check_pdl_ptx
    from test_kernels_gemv import SMALL_LOCAL

    jobs = [(label, c, tr, arch, str(tmp_path / f"sm{arch}")) for label, c, tr in _variants() for arch in (90, 100)]
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_compile, jobs))
    for r in results:
        assert r["cubin"] > 0 and r["shared"] <= SMEM_LIMIT, r
        want = dict(num_warps=8 if r["stage0_only"] else 4, enable_fp_fusion=False, enable_reflect_ftz=False,
                    launch_pdl=r["pdl"], **({"maxnreg": 128} if "maxnreg128" in r["label"] else {}))
        assert r["options"] == want and r["launch_pdl"] == r["pdl"], r
        check_pdl_ptx(r, r["pdl"], r["label"], r["late"])
        if r["pdl"]:
            assert r["waits"] == 1 and r["loads_before_wait"] == [0], r
            # LATE_TRIGGER (the default): stage 0 triggers after its K loop, stage 1 first (two in the PTX, each on
            # its stage's path); both late (LATE_TRIGGER1 too): neither first; off: one, first
            want = {(True, False): (2, True), (True, True): (2, False), (False, False): (1, True)}[r["late_pair"]]
            if r["stage0_only"]:  # (KSPLIT 8: stage 0's binary alone: its one trigger, after the wait and K loop)
                want = (1, not r["late_pair"][0])
            if r["persist"]:  # (PERSIST: one binary, its trigger in the grid barrier, which a program reaches in its
                want = (2, False)  # first stage-1 item or, with none, alone: two inlined copies)
            assert (r["launch_dependents"], r["launch_dependents_first"]) == want, r
        # 4 bf16x2 multiplies per decoded word; the re-laid-out words' rotates (shf.l.wrap) only there
        assert r["mma"] >= 2 and r["bf16x2"] >= 8 and r["bf16x2"] % 4 == 0, r
        assert (r["shf"] >= r["bf16x2"]) if r["relaid"] else r["shf"] == 0, r
        assert all((x or 0) <= SMALL_LOCAL for x in [r["local"], *r["others"]]), r
        if r["full"]:  # (the tiny spec's K loops run once: no pipeline, plain loads; the wide render is for T >= 16)
            assert (min(r["programs"]) >= 2 * SMS or "bi16" in r["label"]) and r["cp16"] >= 2, r
        # PERSIST: a cooperative launch; the wait, then the arrival (a release), the poll (relaxed loads, then an
        # acquire fence), the departure, and the trigger only after the barrier, in this order in the PTX
        assert r["coop"] == r["persist"], r
        if r["persist"]:
            assert min(r["barrier"]) > 0 and r["barrier"] == sorted(r["barrier"]), r
    assert len(results) == 2 * len(_variants()) == 36
    assert sum(r["pdl"] for r in results) == 34 and sum(r["persist"] for r in results) == 4
    capped = [r for r in results if "maxnreg128" in r["label"]]  # (the cap holds: 4 programs of 4 warps an SM)
    assert len(capped) == 2 and all(r["regs"] is None or r["regs"] <= 128 for r in capped), capped


# ---------------------------------------------------------------- the interpreter child: python THIS_FILE OUT.json DIR
def _interpreter_cases():
    yield from ((f"moe[{case}]", lambda *a, case=case: check_moe(case, *a), ()) for case in MOE_CASES)
    yield "moe[tp1-T3-relaid+pdl]", lambda *a: check_moe("tp1-T3-relaid", *a, pdl=True), ()
    yield "moe[tp2-T3-bf16]", check_moe_bf16, (2, 3)
    yield from ((f"combine[{case}]", lambda *a, case=case: check_moe_combine(case, *a), ()) for case in MOE_COMBINE_CASES)
    yield "emitted[tp2]", check_emitted_tp2, ()
    yield "ptx[raw]", check_ptx, (False,)
    yield "ptx[relaid]", check_ptx, (True,)
    yield "relayout", check_relayout, ()


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1" and "triton" not in sys.modules
    out, kdir = Path(sys.argv[1]), Path(sys.argv[2])
    tiny_spec = tiny_spec_()
    results = {}
    for case, fn, args in _interpreter_cases():
        try:
            results[case] = dict(ok=True, **fn(*args, tiny_spec, kdir))
        except Exception:  # noqa: BLE001 - reported by the test of that case
            results[case] = dict(ok=False, error=traceback.format_exc())
    out.write_text(json.dumps(results, indent=1))
