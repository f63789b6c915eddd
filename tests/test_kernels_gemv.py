"""The small-M (decode) GEMM template `gemv` (IR ops linear, linear_packed, gate_up_swiglu, linear_softcap) on CPU.

1. fp32 instances of each EPILOGUE (none, split, swiglu, softcap) at tiny shapes (K 256, N 96; and K 200, N 90 for
   a masked K tail and partial row blocks) run under Triton's CPU interpreter, T in {1, 3}, outputs poisoned with
   NaN, and match `beamc.ir.reference.REFS[op]` on the same inputs (max relative error < 1e-5). Each is run with PDL
   off (the fp32 default) and on (its gdc calls do nothing in the interpreter), and once with a caller's scratch.
2. bf16 instances at the full spec's TP-8 shapes compile ahead of time for sm_90a and sm_100a (no GPU needed):
   packed QKVG K 5120 -> [768, 128, 128, 768], o_proj K 768 -> 5120, gate_up K 5120 -> F 2560 (swiglu),
   down K 2560 -> 5120, lm_head K 5120 -> 18992 (softcap). With PDL, launch_dependents first, no store before a
   wait, and the W tile loaded before stage 0's wait; no flush-to-zero; IEEE divisions.
3. The rendered modules keep the contract of `beamc.codegen.kernel` (launcher args = IR inputs, outputs, scratch).

Triton's interpreter runs in a subprocess (see `interpreted`): the compiled copies here never see TRITON_INTERPRET.
"""
from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest
import torch

from beamc.codegen.kernel import KernelSpec, aot_compile, load_kernel
from beamc.ir.reference import REFS
from conftest import assert_template_contract, rel_err, run_interpreted_main
from test_kernels_attn_router import check_pdl_ptx, pdl_facts

ROOT = Path(__file__).resolve().parents[1]

OPS = {"none": "linear", "split": "linear_packed", "swiglu": "gate_up_swiglu", "softcap": "linear_softcap"}
IR_ARGS = {"none": ["x", "w", "out"], "split": ["x", "w", "q", "k", "v", "gate"],
           "swiglu": ["x", "wg", "wu", "out"], "softcap": ["x", "w", "out"]}
CAP = 30.0


def kernel_spec(epi: str, K: int, N: int, dtype: str, splits=None, pdl: bool | None = None) -> tuple[KernelSpec, dict]:
    """(KernelSpec, IR attrs) of one gemv instance: N is the output columns (F for swiglu, sum(splits) for split)."""
    c = dict(EPILOGUE=epi, K=K, N=N, DTYPE=dtype)
    attrs = {}
    if epi == "split":
        splits = splits or [N // 3, N // 6, N // 6, N - N // 3 - 2 * (N // 6)]
        assert sum(splits) == N
        c["SPLITS"] = list(splits)
        attrs["splits"] = list(splits)
    if epi == "softcap":
        c["CAP"] = CAP
        attrs["cap"] = CAP
    if pdl is not None:
        c["PDL"] = pdl
    return KernelSpec("gemv", OPS[epi], c), attrs


def make_inputs(epi: str, K: int, N: int, T: int, dtype: torch.dtype, device="cpu", gen=None, attrs=None):
    """(IR inputs, output (shape, dtype)s), x ~ N(0, 1), W ~ N(0, 1/K) (outputs ~ N(0, 1))."""
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    x = randn(T, K)
    if epi == "swiglu":
        ins = [x, randn(N, K, scale=2.0 / K ** 0.5), randn(N, K, scale=K ** -0.5)]
    elif epi == "softcap":
        ins = [x, randn(N, K, scale=40.0 / K ** 0.5)]  # logits ~ N(0, 40): the cap (30) matters
    else:
        ins = [x, randn(N, K, scale=K ** -0.5)]
    if epi == "split":
        outs = [((T, n), dtype) for n in attrs["splits"]]
    else:
        outs = [((T, N), torch.float32 if epi == "softcap" else dtype)]
    return ins, outs


# ---------------------------------------------------------------- 1. fp32 instances under the interpreter
SHAPES_FP32 = ((256, 96), (200, 90))  # (K, N): aligned; a masked K tail and partial row and column blocks
CASES = [(epi, K, N, pdl) for epi in OPS for K, N in SHAPES_FP32 for pdl in (False, True)]


def _case_id(epi, K, N, pdl) -> str:
    return f"{epi}-K{K}-N{N}-{'pdl' if pdl else 'nopdl'}"


def _interpreted_main(out: str) -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: every fp32 case against its reference -> {case: [errors]}."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    results = {}
    directory = Path(out).parent / "interpreted"
    for epi, K, N, pdl in CASES:
        ks, attrs = kernel_spec(epi, K, N, "f32", pdl=pdl)
        mod = load_kernel(ks, directory)
        gen = torch.Generator().manual_seed(11)
        errs = []
        for T in (1, 3):
            ins, outs = make_inputs(epi, K, N, T, torch.float32, gen=gen, attrs=attrs)
            for fixed in (False, True):  # the launcher's own scratch, then a caller's (poisoned) one
                got = [torch.full(shape, float("nan"), dtype=dt) for shape, dt in outs]
                scratch = torch.full((mod.scratch_numel(T) + 5,), float("nan")) if fixed else None
                mod.launch(*ins, *got, scratch=scratch)
                want = REFS[ks.op](ins, attrs)
                assert len(want) == len(got) and all(g.shape == w.shape and g.dtype == w.dtype
                                                     for g, w in zip(got, want)), _case_id(epi, K, N, pdl)
                errs += [float("inf") if g.isnan().any() else rel_err(g, w) for g, w in zip(got, want)]
        results[_case_id(epi, K, N, pdl)] = errs
    Path(out).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Triton's interpreter in its own process (see tests/test_kernels_pointwise.py: `interpreted`)."""
    return run_interpreted_main("test_kernels_gemv", tmp_path_factory.mktemp("interpreted_gemv") / "results.json")


@pytest.mark.parametrize("case", CASES, ids=[_case_id(*c) for c in CASES])
def test_interpreted_fp32_matches_reference(case, interpreted):
    """fp32 instance vs REFS[op], T = 1 and 3, outputs (and a caller's scratch) poisoned with NaN."""
    errs = interpreted[_case_id(*case)]
    assert errs and max(errs) < 1e-5, errs


# ---------------------------------------------------------------- 2. bf16 at the full spec's TP-8 shapes, AOT
def _tp8_shapes() -> dict:
    """{name: (epilogue, K, N, splits)} of rank 0 at TP 8, from the full spec."""
    from beamc.checkpoint.layout import rank_dims
    from beamc.spec import load_spec

    s = load_spec(ROOT / "models" / "beam.yaml")
    r = rank_dims(s, 8)
    H, d = s.hidden_size, s.attention.head_dim
    q = r.heads * d
    kv = r.kv_heads * d
    return dict(H=H, q=q, kv=kv, F=r.dense_ff, V=r.vocab, cap=s.logits.softcap)


# the task's shapes (rank 0 at TP 8); test_tp8_shapes_match_spec checks them against the spec
TP8 = {
    "qkvg": ("split", 5120, 1792, [768, 128, 128, 768]),
    "o_proj": ("none", 768, 5120, None),
    "gate_up": ("swiglu", 5120, 2560, None),
    "down": ("none", 2560, 5120, None),
    "lm_head": ("softcap", 5120, 18992, None),
}


def test_tp8_shapes_match_spec():
    d = _tp8_shapes()
    assert (d["H"], d["q"], d["kv"], d["F"], d["V"]) == (5120, 768, 128, 2560, 18992), d
    assert TP8["qkvg"][3] == [d["q"], d["kv"], d["kv"], d["q"]] and TP8["lm_head"][2] == d["V"]


@pytest.fixture(scope="module")
def kdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gemv_kernels")


@pytest.mark.parametrize("arch", [90, 100])
@pytest.mark.parametrize("name", list(TP8))
def test_bf16_aot_compiles(name, arch, kdir):
    """The bf16 (PDL on) instance compiles for sm_<arch>a; PDL facts; grid rule; PDL off has no griddepcontrol."""
    epi, K, N, splits = TP8[name]
    ks, _ = kernel_spec(epi, K, N, "bf16", splits=splits)
    mod = load_kernel(ks, kdir)
    assert mod.PDL is True
    # the split rule: at least 2 x 132 stage-0 programs, each W tile at most TILE elements
    assert mod.WEIGHTS * triton_cdiv(N, mod.BLOCK_N) * mod.SPLIT_K >= 2 * 132
    assert mod.BLOCK_N * mod.K_CHUNK <= mod.TILE and mod.SPLIT_K * mod.K_CHUNK >= K
    ck = aot_compile(mod, arch)
    ptx = ck.asm["ptx"]
    assert f".target sm_{arch}a" in ptx
    assert "div.full" not in ptx and "div.approx" not in ptx
    facts = pdl_facts(ptx)
    check_pdl_ptx(facts, True, ks.name)
    assert bool(ck.metadata.launch_pdl)
    assert facts["waits"] == 2 and max(facts["loads_before_wait"]) > 0, facts  # stage 0: W loaded before its wait
    if epi == "swiglu":
        assert "div.rn.f32" in ptx and "ex2.approx" in ptx
    if epi == "softcap":
        assert "tanh.approx" not in ptx
    if epi in ("none", "split"):  # (libdevice's expf and tanhf use fma themselves)
        assert "fma.rn.f32" not in ptx  # no contraction of the products into the sums
    if arch == 90 and name in ("qkvg", "o_proj"):  # PDL off: no griddepcontrol (two shapes: CPU time)
        off = load_kernel(kernel_spec(epi, K, N, "bf16", splits=splits, pdl=False)[0], kdir)
        ck_off = aot_compile(off, arch)
        check_pdl_ptx(pdl_facts(ck_off.asm["ptx"]), False, ks.name)
        assert not ck_off.metadata.launch_pdl


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------- 3. the rendered modules keep the contract
@pytest.mark.parametrize("epi", list(OPS))
def test_rendered_module_contract(epi, kdir):
    ks, _ = kernel_spec(epi, 256, 96, "bf16")
    mod = load_kernel(ks, kdir)
    assert mod.__doc__ and ks.op in mod.__doc__ and isinstance(mod.GRID, str)
    assert list(inspect.signature(mod.launch).parameters) == IR_ARGS[epi] + ["scratch"]
    assert inspect.signature(mod.launch).parameters["scratch"].default is None
    assert_template_contract(mod)
    assert mod.scratch_numel(3) == mod.SPLIT_K * 3 * mod.N_W
    off = load_kernel(kernel_spec(epi, 256, 96, "bf16", pdl=False)[0], kdir)
    assert off.OPTIONS == dict(mod.OPTIONS, launch_pdl=False) and "gdc_" not in inspect.getsource(off)
    assert load_kernel(kernel_spec(epi, 256, 96, "f32")[0], kdir).OPTIONS["launch_pdl"] is False
