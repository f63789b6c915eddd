"""Generated kernel `moe_nvfp4_decode` (IR op `moe_experts`, format "nvfp4") on CPU.

fp32 instances run under Triton's interpreter against `REFS["moe_experts"]` (fp32 x: the NVFP4 weights dequantised
to fp32, no bf16 rounding) at the tiny spec's shapes (E 16, H 256, top-k 4; I 64 at TP 1, 32 at TP 2; T in {1, 3}),
on weights quantised with `beamc.checkpoint.nvfp4.quantize` from random bf16 weights per expert and part, stacked
as the loader stacks them; y poisoned with NaN, the scratch with canaries past scratch_numel(T); one case rendered
with PDL on (the gdc calls are skipped in the interpreter); one bf16 case against the reference's composition with
each bf16 rounding done as the interpreter converts (toward zero in Triton 3.9; a GPU rounds to nearest even).
The bf16 variants are compiled ahead of time for sm_90a and sm_100a at the full spec's TP-8 shapes and the tiny
spec's (PDL on by default; the tiny spec's also without): griddepcontrol.launch_dependents first and one wait with
no load or store before it exactly when PDL is on, no flush-to-zero arithmetic; and one decode token gives
>= 2 x 132 programs in each stage at TP 8.
GPU numerics (bf16, relative error) are tests/gpu/test_kernels_moe_gpu.py's.

Why a subprocess: see tests/test_kernels_attn_router.py (the interpreter is picked when triton is imported; this
process never imports triton).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

from beamc.checkpoint import nvfp4
from beamc.codegen.kernel import KernelSpec, aot_compile, load_kernel
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
    """swiglu(gate, up) [T, k, I] per (token, choice), with the reference's rounding points (what stage 0 stores)."""
    T, k = idx.shape
    out = []
    for t in range(T):
        for j in range(k):
            w_gu, _ = expert_weights(params, "nvfp4", int(idx[t, j]), x.dtype)
            gate, up = torch.nn.functional.linear(x[t:t + 1], w_gu).chunk(2, dim=-1)
            out.append(swiglu_ref(gate, up)[0])
    return torch.stack(out).view(T, k, -1)


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


# ---------------------------------------------------------------- interpreter cases
MOE_CASES = [(tp, T) for tp in (1, 2) for T in (1, 3)]
MOE_PDL_CASES = [(2, 3)]


def check_moe(tp: int, T: int, tiny, kdir, pdl: bool = False) -> dict:
    c = moe_constants(tiny, tp, "f32")
    if pdl:
        c["PDL"] = True
    mod = load_kernel(KernelSpec(TEMPLATE, "moe_experts", c), kdir)
    assert mod._interpreted(), "triton did not pick the interpreter"
    E, H, I, k = c["E"], c["H"], c["I"], c["TOP_K"]
    g = torch.Generator().manual_seed(10 * tp + T)
    params = nvfp4_experts(E, H, I, g)
    wide = torch.randn(T, H + 32, generator=g)
    x = wide[:, :H] if T > 1 else wide[:, :H].contiguous()  # strided rows too
    idx = distinct_idx(T, E, k, g)
    y = torch.full((T, k, H), float("nan"))
    n = mod.scratch_numel(T)
    scratch = torch.full((n + 64,), float("nan"))  # 64 canaries past the end
    mod.launch(x, idx, *params, y, scratch)
    assert torch.isnan(scratch[n:]).all(), "a write past scratch_numel(T)"
    assert torch.isfinite(y).all()

    h_err = rel_max(scratch[:n].view(T, k, I), h_reference(x, idx, params))
    y_ref = REFS["moe_experts"]([x, idx, *params], {"format": "nvfp4"})[0]
    err = rel_max(y, y_ref)
    assert h_err < 1e-5 and err < 1e-5, (h_err, err)
    return dict(rel_err=err, h_rel_err=h_err)


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
    """The bf16 variant in the interpreter, against the reference's composition with every rounding to bf16 done
    the interpreter's way: checks the rounding points (weights, gate / up, h, y) on CPU."""
    c = moe_constants(tiny, tp, "bf16")
    mod = load_kernel(KernelSpec(TEMPLATE, "moe_experts", c), kdir)
    E, H, I, k = c["E"], c["H"], c["I"], c["TOP_K"]
    g = torch.Generator().manual_seed(100 + tp + T)
    params = nvfp4_experts(E, H, I, g)
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = distinct_idx(T, E, k, g)
    y = torch.full((T, k, H), float("nan")).bfloat16()
    mod.launch(x, idx, *params, y)
    rnd = _interpreter_bf16_rounding()
    ref = []
    for t in range(T):
        for j in range(k):
            w_gu, w_dn = (rnd(w) for w in expert_weights(params, "nvfp4", int(idx[t, j]), torch.float32))
            gate, up = rnd(x[t].float() @ w_gu.T).chunk(2)
            ref.append(rnd(w_dn @ rnd(gate / (1 + torch.exp(-gate)) * up)))
    ref = torch.stack(ref).view(T, k, H)
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


@pytest.mark.parametrize("tp,T", MOE_CASES)
def test_moe_nvfp4_decode_matches_reference(tp, T, interpreted):
    _check(interpreted, f"moe[tp{tp}-T{T}]")


@pytest.mark.parametrize("tp,T", MOE_PDL_CASES)
def test_moe_nvfp4_decode_pdl_render_interpreted(tp, T, interpreted):
    """A PDL render (gdc calls in the kernel, launch_pdl in OPTIONS) runs in the interpreter and still matches."""
    _check(interpreted, f"moe[tp{tp}-T{T}+pdl]")


def test_moe_nvfp4_decode_bf16_rounding_points_interpreted(interpreted):
    """bf16 in the interpreter equals the reference's rounding points (with the interpreter's bf16 conversion)."""
    _check(interpreted, "moe[tp2-T3-bf16]")


# ---------------------------------------------------------------- ahead-of-time compilation
def _variants() -> list[tuple[str, dict]]:
    """bf16 at the full spec's TP-8 shapes and the tiny spec's (TP 1, 2) as rendered by default (PDL on), and the
    tiny spec's TP 1 again with PDL off."""
    full, tiny = load_spec(ROOT / "models/beam.yaml"), tiny_spec_()
    out = [("full-tp8", moe_constants(full, 8)), ("tiny-tp1", moe_constants(tiny, 1)),
           ("tiny-tp2", moe_constants(tiny, 2)), ("tiny-tp1,no-pdl", dict(moe_constants(tiny, 1), PDL=False))]
    return out


def _compile(args) -> dict:
    """One AOT compile in a worker process (the interpreter off); what the test asserts about its output."""
    label, constants, arch, directory = args
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT / "tests"))
    from test_kernels_attn_router import pdl_facts

    mod = load_kernel(KernelSpec(TEMPLATE, "moe_experts", constants), directory)
    ck = aot_compile(mod, arch)
    ptx = ck.asm["ptx"]
    programs = [1 * mod.TOP_K * -(-mod.I // mod.BLOCK_I), 1 * mod.TOP_K * -(-mod.H // mod.BLOCK_N)]  # T = 1
    return dict(label=f"{label}@sm_{arch}", cubin=len(ck.asm["cubin"]), shared=ck.metadata.shared,
                pdl=constants.get("PDL", True), options=dict(mod.OPTIONS), launch_pdl=bool(ck.metadata.launch_pdl),
                programs=programs, full=label.startswith("full"), **pdl_facts(ptx))


def test_aot_compile_every_variant(tmp_path):
    """Every variant for sm_90a and sm_100a (2 processes), with the launcher's OPTIONS. PDL: launch_dependents
    first, then one wait before any global load or store (the expert to read is only known from idx); none of it
    without PDL. At TP 8, one decode token fills >= 2 programs per SM in each stage."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_kernels_attn_router import check_pdl_ptx

    jobs = [(label, c, arch, str(tmp_path / f"sm{arch}")) for label, c in _variants() for arch in (90, 100)]
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_compile, jobs))
    for r in results:
        assert r["cubin"] > 0 and r["shared"] <= SMEM_LIMIT, r
        want = dict(num_warps=r["options"]["num_warps"], enable_fp_fusion=False, enable_reflect_ftz=False,
                    launch_pdl=r["pdl"])
        assert r["options"] == want and r["launch_pdl"] == r["pdl"], r
        check_pdl_ptx(r, r["pdl"], r["label"])
        if r["pdl"]:
            assert r["waits"] == 1 and r["loads_before_wait"] == [0], r
        if r["full"]:
            assert min(r["programs"]) >= 2 * SMS, r
    assert len(results) == 2 * len(_variants()) == 8
    assert sum(r["pdl"] for r in results) == 6


# ---------------------------------------------------------------- the interpreter child: python THIS_FILE OUT.json DIR
def _interpreter_cases():
    yield from ((f"moe[tp{tp}-T{T}]", check_moe, (tp, T)) for tp, T in MOE_CASES)
    yield from ((f"moe[tp{tp}-T{T}+pdl]", lambda *a: check_moe(*a, pdl=True), (tp, T)) for tp, T in MOE_PDL_CASES)
    yield "moe[tp2-T3-bf16]", check_moe_bf16, (2, 3)


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
