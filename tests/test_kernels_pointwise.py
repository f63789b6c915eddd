"""The norm and pointwise kernel templates (rmsnorm_boundary, embed_norm, sigmoid_gate, swiglu, softcap) on CPU.

1. Each template instantiated in fp32 for the tiny spec and odd shapes (hidden 320, head_dim 64, F 320, V 1000) runs
   under Triton's CPU interpreter and matches `beamc.ir.reference.REFS[op]` (relative error < 1e-5; outputs are
   poisoned with NaN first, so an unwritten element fails). The interpreter has no libdevice: the kernels fall
   back to tl.exp/tl.rsqrt there (bit-exactness is the GPU test's job, tests/gpu/test_kernels_pointwise_gpu.py).
   The odd shapes run a second time rendered with PDL on (its gdc calls do nothing in the interpreter).
2. Each template instantiated in bf16 at the full spec's TP-8 shapes and the tiny spec compiles ahead of time for
   sm_90a and sm_100a (no GPU needed), with IEEE divisions and libdevice's functions in the PTX, no flush-to-zero,
   and with PDL (the bf16 default) griddepcontrol.launch_dependents then griddepcontrol.wait, no store and (without
   parameters to load) no load before the wait; without PDL neither instruction.
3. The rendered modules keep the contract of `beamc.codegen.kernel` (OPTIONS, launched with **OPTIONS), and the
   emitters render PDL on for bf16 packages and off for fp32 ones.

Triton's interpreter runs in a subprocess (see `interpreted`): the compiled copies here, and any GPU test collected
in the same session, never see TRITON_INTERPRET.
"""
from __future__ import annotations

import inspect
import math
import os
from pathlib import Path

import pytest
import torch

from beamc.codegen.kernel import KernelSpec, aot_compile, load_kernel
from beamc.ir.reference import REFS, moe_combine_ref
from conftest import assert_template_contract, rel_err, run_interpreted_main
from test_kernels_attn_router import check_pdl_ptx, pdl_facts

ROOT = Path(__file__).resolve().parents[1]


def _load(spec: KernelSpec, directory: Path):
    return load_kernel(spec, directory)


@pytest.fixture(scope="module")
def kdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kernels")


# ---------------------------------------------------------------- the kernels' constants, from spec values
def _dims(spec_name: str, tp: int = 1) -> dict:
    """The shapes and IR attribute values one test instance uses: a spec's (TP rank 0) or the odd set."""
    from beamc.checkpoint.layout import rank_dims
    from beamc.spec import load_spec

    if spec_name == "odd":  # non-power-of-2 rows everywhere, 5 heads of 64, top-8 routing, the "1+w" weight form
        d = dict(H=320, heads=5, head_dim=64, F=320, V=1000, top_k=8, experts=24, eps=1e-5, w_offset=1.0, n=7,
                 routed=2.5, cap=30.0)
    else:
        s = load_spec(ROOT / "models" / f"{spec_name}.yaml")
        r = rank_dims(s, tp)
        d = dict(H=s.hidden_size, heads=r.heads, head_dim=s.attention.head_dim, F=r.moe_ff, F_dense=r.dense_ff,
                 V=r.vocab, top_k=s.mlp.moe.top_k, experts=s.mlp.moe.num_experts, eps=s.norm.eps,
                 w_offset=s.norm.offset, n=s.residual_n(3, "mlp"), routed=s.mlp.moe.routed_scaling,
                 cap=s.logits.softcap)
    d["s_sub"], d["s_res"] = 1.0 / math.sqrt(d["n"]), math.sqrt((d["n"] - 1) / d["n"])  # as the lowering computes
    return d


def boundary_attrs(d: dict, combine: bool) -> dict:
    return dict(combine=combine, routed_scale=d["routed"] if combine else None, allreduce=False, eps=d["eps"],
                eps_next=d["eps"], w_offset=d["w_offset"], s_sub=d["s_sub"], s_res=d["s_res"])


def kernel_spec(kind: str, d: dict, dtype: str, pdl: bool | None = None) -> tuple[KernelSpec, dict]:
    """(KernelSpec, IR attrs) of one kernel instance; kind: boundary | boundary_combine | embed_norm | sigmoid_gate
    | swiglu | swiglu_packed | softcap. pdl: the PDL render constant (None: the template's default, on for bf16/f16
    and off for f32)."""
    if pdl is not None:
        ks, attrs = kernel_spec(kind, d, dtype)
        return KernelSpec(ks.template, ks.op, {**ks.constants, "PDL": pdl}), attrs
    if kind.startswith("boundary"):
        a = boundary_attrs(d, kind == "boundary_combine")
        c = dict(H=d["H"], EPS=a["eps"], EPS_NEXT=a["eps_next"], W_OFFSET=a["w_offset"], S_SUB=a["s_sub"],
                 S_RES=a["s_res"], COMBINE=a["combine"], ROUTED_SCALE=a["routed_scale"], DTYPE=dtype)
        if a["combine"]:
            c["TOP_K"] = d["top_k"]
        return KernelSpec("rmsnorm_boundary", "boundary", c), a
    if kind == "embed_norm":
        a = dict(eps=d["eps"], w_offset=d["w_offset"])
        return KernelSpec("embed_norm", "embed_norm", dict(H=d["H"], EPS=a["eps"], W_OFFSET=a["w_offset"],
                                                           DTYPE=dtype)), a
    if kind == "sigmoid_gate":
        return KernelSpec("sigmoid_gate", "sigmoid_gate", dict(HEADS=d["heads"], HEAD_DIM=d["head_dim"],
                                                               DTYPE=dtype)), {}
    if kind.startswith("swiglu"):
        return KernelSpec("swiglu", "swiglu", dict(F=d["F"], PACKED=kind == "swiglu_packed", DTYPE=dtype)), {}
    if kind == "softcap":
        return KernelSpec("softcap", "softcap", dict(V=d["V"], CAP=d["cap"], DTYPE=dtype)), dict(cap=d["cap"])
    if kind == "moe_combine":  # the tp > 1 boundary's first part: one rank's combine x routed scale
        return KernelSpec("moe_combine", "boundary", dict(H=d["H"], TOP_K=d["top_k"], ROUTED_SCALE=d["routed"],
                                                          DTYPE=dtype)), dict(routed_scale=d["routed"])
    raise KeyError(kind)


def make_inputs(kind: str, d: dict, T: int, dtype: torch.dtype, device="cpu", gen=None):
    """(launch inputs, reference inputs, output shapes and dtypes), random at realistic scales."""
    H = d["H"]

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    if kind.startswith("boundary") or kind == "moe_combine":
        tail = [] if kind == "moe_combine" else [randn(T, H, scale=4.0), 1.0 + randn(H, scale=0.1), 1.0 + randn(H, scale=0.1)]  # res, w_post, w_next
        if kind in ("boundary_combine", "moe_combine"):
            k = d["top_k"]
            idx = torch.rand(T, d["experts"], generator=gen).topk(k, dim=-1).indices.to(device)  # distinct experts
            w = torch.rand(T, k, generator=gen)
            w = (w / w.sum(-1, keepdim=True)).to(device)  # fp32 routing weights
            ins = [randn(T, k, H, scale=0.5), w, idx] + tail
        else:
            ins = [randn(T, H, scale=2.0)] + tail
        return ins, ins, [((T, H), dtype)] * (1 if kind == "moe_combine" else 2)
    if kind == "embed_norm":
        V = 1000
        ins = [torch.randint(0, V, (T,), generator=gen).to(device), randn(V, H), 1.0 + randn(H, scale=0.1)]
        return ins, ins, [((T, H), dtype)] * 2
    if kind == "sigmoid_gate":
        shape = (T, d["heads"], d["head_dim"])
        ins = [randn(*shape), randn(*shape, scale=2.0), randn(d["heads"], 1, scale=0.5)]
        return ins, ins, [(shape, dtype)]
    if kind.startswith("swiglu"):
        gu = randn(T, 2 * d["F"], scale=2.0)
        gate, up = gu[:, :d["F"]].contiguous(), gu[:, d["F"]:].contiguous()
        return ([gu] if kind == "swiglu_packed" else [gate, up]), [gate, up], [((T, d["F"]), dtype)]
    if kind == "softcap":
        ins = [randn(T, d["V"], scale=15.0)]
        return ins, ins, [((T, d["V"]), torch.float32)]
    raise KeyError(kind)


KINDS = ("boundary", "boundary_combine", "embed_norm", "sigmoid_gate", "swiglu", "swiglu_packed", "softcap",
         "moe_combine")
# kinds that are a part of their IR op (the rest of the op runs in other launches): their own reference
PART_REFS = {"moe_combine": lambda t, a: ((moe_combine_ref(*t) * a["routed_scale"]).to(t[0].dtype),)}


# ---------------------------------------------------------------- 1. fp32 instances under the interpreter
SPECS_FP32 = ("beam-tiny", "odd", "odd+pdl")  # +pdl: rendered with PDL on (the fp32 default is off)


def _interpreted_main(out: str) -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: every fp32 case against its reference -> {case: [errors]}."""
    import json

    assert os.environ.get("TRITON_INTERPRET") == "1"
    results = {}
    directory = Path(out).parent / "interpreted"
    for spec_name in SPECS_FP32:
        d = _dims(spec_name.removesuffix("+pdl"))
        for kind in KINDS:
            ks, attrs = kernel_spec(kind, d, "f32", pdl=True if spec_name.endswith("+pdl") else None)
            mod = _load(ks, directory)
            gen = torch.Generator().manual_seed(7)
            errs = []
            for T in (1, 13):  # one row; several programs with a partial last one
                ins, ref_ins, outs = make_inputs(kind, d, T, torch.float32, gen=gen)
                got = [torch.full(shape, float("nan"), dtype=dt) for shape, dt in outs]
                mod.launch(*ins, *got)
                want = (PART_REFS.get(kind) or REFS[ks.op])(ref_ins, attrs)
                assert len(want) == len(got) and all(g.shape == w.shape and g.dtype == w.dtype
                                                     for g, w in zip(got, want)), (kind, spec_name)
                errs += [float("inf") if g.isnan().any() else rel_err(g, w) for g, w in zip(got, want)]
            results[f"{kind}-{spec_name}"] = errs
    Path(out).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Triton's interpreter runs in its own process: TRITON_INTERPRET is read when a module is imported, the
    interpreter imports parts of triton lazily during a launch, and its patches of triton.language do not all
    come undone; compiled kernels (the AOT tests below, GPU tests in the same session) must not see any of it."""
    return run_interpreted_main("test_kernels_pointwise", tmp_path_factory.mktemp("interpreted") / "results.json")


@pytest.mark.parametrize("spec_name", SPECS_FP32)
@pytest.mark.parametrize("kind", KINDS)
def test_interpreted_fp32_matches_reference(kind, spec_name, interpreted):
    """fp32 instance vs REFS[op] on random inputs, T = 1 and 13, outputs poisoned with NaN (an unwritten element
    reads as an infinite error)."""
    errs = interpreted[f"{kind}-{spec_name}"]
    assert errs and max(errs) < 1e-5, errs


# ---------------------------------------------------------------- 2. bf16 instances compile for sm_90a and sm_100a
PARAMS_BEFORE_WAIT = {"boundary": True, "boundary_combine": True, "embed_norm": True, "sigmoid_gate": True,
                      "swiglu": False, "swiglu_packed": False, "softcap": False, "moe_combine": False}  # a parameter to load before the wait


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no-pdl"])
@pytest.mark.parametrize("arch", [90, 100])
@pytest.mark.parametrize("spec_name", ["beam", "beam-tiny"])
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_aot_compiles(kind, spec_name, arch, pdl, kdir):
    """pdl: the default bf16 render (PDL on), or PDL=False."""
    d = _dims(spec_name, tp=8 if spec_name == "beam" else 1)
    ks, _ = kernel_spec(kind, d, "bf16", pdl=None if pdl else False)
    mod = _load(ks, kdir)
    ck = aot_compile(mod, arch)
    ptx = ck.asm["ptx"]
    assert f".target sm_{arch}a" in ptx
    assert "div.full" not in ptx and "div.approx" not in ptx  # every division is IEEE (div.rn)
    facts = pdl_facts(ptx)
    check_pdl_ptx(facts, pdl, ks.name)  # griddepcontrol exactly with PDL, no store before the wait, no FTZ
    assert bool(ck.metadata.launch_pdl) == pdl
    if pdl:
        assert facts["waits"] == 1 and (facts["loads_before_wait"][0] > 0) == PARAMS_BEFORE_WAIT[kind], facts
    if kind in ("boundary", "boundary_combine", "embed_norm"):
        assert "rsqrt.approx.f32" in ptx  # CUDA's rsqrtf, not flushing subnormals (enable_reflect_ftz=False)
        assert "fma" not in ptx  # no contraction of a separate multiply and add
    if kind in ("sigmoid_gate", "swiglu", "swiglu_packed"):
        assert "div.rn.f32" in ptx and "ex2.approx" in ptx  # 1 + expf(-x), IEEE division
    if kind == "softcap":
        assert "tanh.approx" not in ptx  # libdevice's accurate tanhf, not the hardware approximation


@pytest.mark.parametrize("kind", ["boundary", "boundary_combine", "moe_combine"])
def test_late_trigger_aot_compiles(kind, kdir):
    """LATE_TRIGGER (a render option, off by default): one launch_dependents, after the wait and the loads (before the
    first store), not first; the rest of the PDL facts as without it."""
    ks, _ = kernel_spec(kind, _dims("beam", tp=8), "bf16")
    ks = KernelSpec(ks.template, ks.op, {**ks.constants, "LATE_TRIGGER": True})
    mod = _load(ks, kdir)
    assert mod.LATE_TRIGGER is True
    facts = pdl_facts(aot_compile(mod, 90).asm["ptx"])
    check_pdl_ptx(facts, True, ks.name, late=True)
    assert facts["launch_dependents"] == 1 and not facts["launch_dependents_first"] and facts["waits"] == 1, facts
    assert (facts["loads_before_wait"][0] > 0) == PARAMS_BEFORE_WAIT[kind], facts


# ---------------------------------------------------------------- 3. the rendered modules keep the contract
IR_ARGS = {  # the IR op's inputs then outputs, as each launcher must take them
    "boundary": ["sub", "res", "w_post", "w_next", "h", "normed"],
    "boundary_combine": ["y", "w", "idx", "res", "w_post", "w_next", "h", "normed"],
    "embed_norm": ["ids", "table", "w", "h", "normed"],
    "sigmoid_gate": ["o", "g", "b", "out"],
    "swiglu": ["gate", "up", "out"],
    "swiglu_packed": ["gate_up", "out"],
    "softcap": ["x", "out"],
    "moe_combine": ["y", "w", "idx", "out"],
}


@pytest.mark.parametrize("kind", KINDS)
def test_rendered_module_contract(kind, kdir):
    ks, _ = kernel_spec(kind, _dims("odd"), "bf16")
    mod = _load(ks, kdir)
    assert mod.__doc__ and ks.op in mod.__doc__ and isinstance(mod.GRID, str)
    assert list(inspect.signature(mod.launch).parameters) == IR_ARGS[kind]
    assert_template_contract(mod)  # one options contract: the launcher launches with OPTIONS, nothing ad hoc
    off = _load(kernel_spec(kind, _dims("odd"), "bf16", pdl=False)[0], kdir)
    assert off.OPTIONS == dict(mod.OPTIONS, launch_pdl=False) and "gdc_" not in inspect.getsource(off)
    assert _load(kernel_spec(kind, _dims("odd"), "f32")[0], kdir).OPTIONS["launch_pdl"] is False  # fp32 default


def test_emitters_render_pdl_when_asked_for_gpu_dtypes_only():
    """compile_package(pdl=True): every kernel of a bf16 package is rendered with PDL on, of an fp32 package (the
    interpreter's) with it off; PDL is the default (verified on the H200); pdl=False turns every kernel's off."""
    from beamc.codegen.package import compile_package
    from beamc.passes.manager import PASSES
    from beamc.spec import load_spec

    spec = load_spec(ROOT / "models" / "beam-tiny.yaml")
    for dtype, want in (("bf16", True), ("f32", False)):
        pkg = compile_package(spec, passes=list(PASSES), phases=("decode",), dtype=dtype, pdl=True)
        assert pkg.kernels and all(k.constants["PDL"] is want for k in pkg.kernels.values()), dtype
    pkg = compile_package(spec, passes=list(PASSES), phases=("decode",))
    assert all(k.constants["PDL"] is True for k in pkg.kernels.values())
    pkg = compile_package(spec, passes=list(PASSES), phases=("decode",), pdl=False)
    assert all(k.constants["PDL"] is False for k in pkg.kernels.values())
