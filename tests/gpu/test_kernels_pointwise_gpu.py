"""The norm and pointwise kernels (rmsnorm_boundary, embed_norm, sigmoid_gate, swiglu, softcap) on CUDA, bf16,
compared BITWISE with their torch references (`beamc.ir.reference.REFS`) run on CUDA with the same inputs.

Shapes: the full spec at TP 8 and TP 1 and odd shapes (hidden 320, 5 heads of 64, F 1000, V 1000), T in {1, 7, 300},
fresh random inputs at realistic scales, outputs pre-filled with NaN. Plus every one of the 65536 bf16 values
through each pointwise formula, and random fp32 bit patterns (all magnitudes) through the fp32 instances.

Pointwise kernels must match exactly. The RMSNorm kernels (boundary, embed_norm's normed output) sum the squares
in another order than torch's CUDA reduction, so the fp32 mean may differ in its last bit and, rarely, flip a bf16
rounding: their mismatches are counted (with the largest distance in bf16 ulps) next to a baseline, the mismatches
between torch's own CPU and CUDA references on the same inputs, and only bounded loosely.

The kernels run as rendered for bf16, i.e. with Programmatic Dependent Launch (PDL: griddepcontrol in the kernel,
launch_pdl at the launch). PDL=False renders must give the same bits, and a chain of dependent launches (each
kernel reading what the one before wrote and overwriting what an earlier one read) must give the same bits with
PDL as launched serially, on a stream and in a CUDA graph.

A summary per case goes into $BEAMC_GPU_OUT/pointwise.json when BEAMC_GPU_OUT is set; one line per kernel is printed.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from beamc.codegen.kernel import KernelSpec, load_kernel
from beamc.ir.reference import REFS
from test_kernels_pointwise import KINDS, PART_REFS, _dims, kernel_spec, make_inputs

pytestmark = pytest.mark.gpu

SUMMARY: dict[str, dict] = {}
NORM_KINDS = ("boundary", "boundary_combine", "embed_norm")
T_VALUES = (1, 7, 300)


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield SUMMARY
    import triton

    per_kernel = defaultdict(lambda: defaultdict(int))
    for case, r in SUMMARY.items():
        k = per_kernel[case.split("/")[0]]
        k["cases"] += 1
        k["mismatch"] += r["mismatch"]
        k["numel"] += r["numel"]
        k["max_ulp"] = max(k["max_ulp"], r["max_ulp"])
        k["torch_cpu_vs_cuda"] += r.get("torch_cpu_vs_cuda", 0)
    for name, k in sorted(per_kernel.items()):
        base = f", torch CPU vs CUDA ref {k['torch_cpu_vs_cuda']}" if name.split(":")[0] in NORM_KINDS else ""
        print(f"{name}: {k['mismatch']} mismatches / {k['numel']} in {k['cases']} cases, max {k['max_ulp']} ulp{base}")
    out = os.environ.get("BEAMC_GPU_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        data = {"torch": torch.__version__, "triton": triton.__version__,
                "device": torch.cuda.get_device_name(), "cases": SUMMARY}
        (Path(out) / "pointwise.json").write_text(json.dumps(data, indent=1))


_MODULES: dict[str, object] = {}


def _kernel(ks: KernelSpec):
    if ks.name not in _MODULES:
        _MODULES[ks.name] = load_kernel(ks)
    return _MODULES[ks.name]


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Bits as integers ordered like the values (+0 and -0 both 0): distances between them are ulps."""
    if t.dtype == torch.bfloat16:
        i = t.view(torch.int16).to(torch.int64)
        return torch.where(i >= 0, i, -(i & 0x7FFF))
    i = t.view(torch.int32).to(torch.int64)
    return torch.where(i >= 0, i, -(i & 0x7FFFFFFF))


def compare(got: torch.Tensor, want: torch.Tensor, inputs: torch.Tensor | None = None) -> dict:
    """Bitwise comparison (NaN equals NaN): mismatch count, largest ulp distance, a few examples."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    g, w = got.flatten(), want.flatten()
    int_t = torch.int16 if g.dtype == torch.bfloat16 else torch.int32
    both_nan = g.isnan() & w.isnan()
    one_nan = g.isnan() ^ w.isnan()
    bad = (g.view(int_t) != w.view(int_t)) & ~both_nan  # any bit, the sign of a zero too
    ulp = (_ordered(g) - _ordered(w)).abs().masked_fill(both_nan | one_nan, 0)
    r = {"mismatch": int(bad.sum()), "numel": g.numel(), "max_ulp": int(ulp.max()) if g.numel() else 0,
         "nan_mismatch": int(one_nan.sum())}
    if r["mismatch"]:
        at = bad.nonzero().flatten()[:5]
        r["examples"] = [{"got": float(g[i]), "want": float(w[i]),
                          **({"input": float(inputs.flatten()[i])} if inputs is not None else {})} for i in at.tolist()]
    return r


def _spec_dims(shape: str) -> dict:
    if shape == "odd":
        d = _dims("odd")
        d["F"] = 1000
        return d
    d = _dims("beam", tp=8 if shape.startswith("tp8") else 1)
    if shape.endswith("dense"):
        d["F"] = d["F_dense"]
    return d


def _run_case(kind: str, shape: str, T: int, seed: int, pdl: bool | None = None) -> tuple[list[dict], list[dict]]:
    """Launch one kernel instance on fresh random bf16 inputs; compare each output with the CUDA reference and the
    CUDA reference with the CPU reference. Returns (kernel vs CUDA ref, CUDA ref vs CPU ref) per output.
    pdl: the PDL render constant (None: the bf16 default, on)."""
    d = _spec_dims(shape)
    ks, attrs = kernel_spec(kind, d, "bf16", pdl=pdl)
    mod = _kernel(ks)
    assert mod.OPTIONS["launch_pdl"] is (pdl is not False)
    gen = torch.Generator().manual_seed(seed)
    ins, ref_ins, outs = make_inputs(kind, d, T, torch.bfloat16, device="cuda", gen=gen)
    got = [torch.full(s, float("nan"), dtype=dt, device="cuda") for s, dt in outs]
    mod.launch(*ins, *got)
    want = (PART_REFS.get(kind) or REFS[ks.op])(ref_ins, attrs)
    torch.cuda.synchronize()
    vs_ref = [compare(g, w) for g, w in zip(got, want)]
    baseline = []
    if kind in NORM_KINDS:
        cpu = REFS[ks.op]([t.cpu() for t in ref_ins], attrs)
        baseline = [compare(w.cpu(), c) for w, c in zip(want, cpu)]
    return vs_ref, baseline


def _record(kind: str, case: str, outputs: tuple[str, ...], vs_ref: list[dict], baseline: list[dict]) -> None:
    """SUMMARY["<kind>:<output>/<case>"] = the comparison (+ torch's own CPU-vs-CUDA mismatches for norms)."""
    for i, (r, out) in enumerate(zip(vs_ref, outputs)):
        entry = dict(r)
        if baseline:
            entry["torch_cpu_vs_cuda"] = baseline[i]["mismatch"]
            entry["torch_cpu_vs_cuda_max_ulp"] = baseline[i]["max_ulp"]
        SUMMARY[f"{kind}:{out}/{case}"] = entry


# ---------------------------------------------------------------- norm kernels: counted, bounded loosely
@pytest.mark.parametrize("T", T_VALUES)
@pytest.mark.parametrize("shape", ["full", "odd"])  # hidden 5120 (the same at every TP) and 320 with "1+w" weights
@pytest.mark.parametrize("kind", NORM_KINDS)
def test_norm_kernels_vs_cuda_reference(kind, shape, T):
    vs_ref, baseline = _run_case(kind, "tp8" if shape == "full" else "odd", T, seed=T)
    outputs = ("h", "normed")
    _record(kind, f"{shape}/T{T}", outputs, vs_ref, baseline)
    for r, out in zip(vs_ref, outputs):
        if kind == "embed_norm" and out == "h":
            assert r["mismatch"] == 0, r  # a gather: exact
        assert r["nan_mismatch"] == 0, (out, r)  # every element written, nothing NaN that torch has finite
        assert r["max_ulp"] <= 2 and r["mismatch"] <= max(2, r["numel"] // 100), (out, r)


# ---------------------------------------------------------------- pointwise kernels: bit-exact
POINTWISE = [(kind, shape) for kind in ("sigmoid_gate", "swiglu", "swiglu_packed", "softcap")
             for shape in ("tp8", "tp1", "odd")] + [("swiglu", "tp8dense"), ("swiglu", "tp1dense"),
                                                    ("moe_combine", "tp8"), ("moe_combine", "odd")]


@pytest.mark.parametrize("T", T_VALUES)
@pytest.mark.parametrize("kind,shape", POINTWISE)
def test_pointwise_kernels_bit_exact(kind, shape, T):
    vs_ref, _ = _run_case(kind, shape, T, seed=100 + T)
    _record(kind, f"{shape}/T{T}", ("out",), vs_ref, [])
    assert vs_ref[0]["mismatch"] == 0, vs_ref[0]


def _all_bf16(rows: int = 256) -> torch.Tensor:
    """Every bf16 bit pattern once (NaNs, infinities, subnormals, both zeros), as [rows, 65536 / rows]."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(rows, -1)


def _random_f32_bits(n: int = 1 << 20) -> torch.Tensor:
    """Random fp32 bit patterns: every exponent, sign and mantissa, with subnormals, infinities and NaNs."""
    g = torch.Generator().manual_seed(5)
    return torch.randint(-(1 << 31), 1 << 31, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("kind", ["sigmoid_gate", "swiglu", "softcap"])
def test_pointwise_formulas_every_value(kind, dtype):
    """Each pointwise formula on every bf16 value (bf16 instances), or on 2^20 random fp32 bit patterns (fp32
    instances): the gate with bias 0 and o = 1 is round(sigmoid(x)), swiglu with up = 1 is round(silu(x))."""
    x = (_all_bf16() if dtype == "bf16" else _random_f32_bits().reshape(1024, -1)).cuda()
    T, N = x.shape
    if kind == "sigmoid_gate":
        ks = KernelSpec("sigmoid_gate", "sigmoid_gate", dict(HEADS=2, HEAD_DIM=N // 2, DTYPE=dtype))
        ins = [torch.ones_like(x).reshape(T, 2, -1), x.reshape(T, 2, -1), torch.zeros(2, 1, dtype=x.dtype).cuda()]
        attrs, out_dtype = {}, x.dtype
    elif kind == "swiglu":
        ks = KernelSpec("swiglu", "swiglu", dict(F=N, PACKED=False, DTYPE=dtype))
        ins, attrs, out_dtype = [x, torch.ones_like(x)], {}, x.dtype
    else:
        ks = KernelSpec("softcap", "softcap", dict(V=N, CAP=30.0, DTYPE=dtype))
        ins, attrs, out_dtype = [x], dict(cap=30.0), torch.float32
    got = torch.full(ins[0].shape, float("nan"), dtype=out_dtype, device="cuda")
    _kernel(ks).launch(*ins, got)
    want = REFS[ks.op](ins, attrs)[0]
    r = compare(got, want, inputs=x)
    SUMMARY[f"{kind}:every_value/{dtype}"] = r
    assert r["mismatch"] == 0, r


# ---------------------------------------------------------------- PDL
@pytest.mark.parametrize("kind", KINDS)
def test_pdl_off_same_bits_and_matches_reference(kind):
    """Each kernel rendered with PDL=False (no griddepcontrol, launched without launch_pdl) on the inputs of the
    default (PDL) render: the same bits, and the same comparison with the reference (odd shapes, T = 7 and 300)."""
    for T in (7, 300):
        runs = {}
        for pdl in (None, False):
            ks, attrs = kernel_spec(kind, _spec_dims("odd"), "bf16", pdl=pdl)
            gen = torch.Generator().manual_seed(1000 + T)
            ins, ref_ins, outs = make_inputs(kind, _spec_dims("odd"), T, torch.bfloat16, device="cuda", gen=gen)
            got = [torch.full(sh, float("nan"), dtype=dt, device="cuda") for sh, dt in outs]
            _kernel(ks).launch(*ins, *got)
            torch.cuda.synchronize()
            want = (PART_REFS.get(kind) or REFS[ks.op])(ref_ins, attrs)
            runs[pdl] = (got, [compare(g, w)["mismatch"] for g, w in zip(got, want)])
        for i, (a, b) in enumerate(zip(runs[None][0], runs[False][0])):
            r = compare(b, a)
            SUMMARY[f"{kind}:no_pdl_vs_pdl/odd/T{T}/{i}"] = r
            assert r["mismatch"] == 0, (kind, T, i, r)
        assert runs[None][1] == runs[False][1], runs  # (and so the same mismatches with the reference)


def pdl_chain(pdl: bool | None, T: int, layers: int = 8, device: str = "cuda", dt: str = "bf16", seed: int = 3):
    """One launch sequence of dependent kernels at the odd shapes (H = 320 = 5 heads x 64 = F = V):
        embed_norm(ids) -> h0, y;   then per layer i:
        boundary(sub=y, res=h[i%2]) -> h[(i+1)%2], n;  sigmoid_gate(o=n, g=h[(i+1)%2]) -> a;
        swiglu(gate=a, up=n) -> y;  softcap(y) -> capped[i]
    Every launch reads what the launch before wrote (RAW) and overwrites what an earlier one read (WAR: n, a, y, the
    h ping-pong); all buffers start as NaN. Returns (run: launches the whole sequence, {name: output buffer})."""
    d = dict(_dims("odd"), V=320)
    H, heads, hd = d["H"], d["heads"], d["head_dim"]
    assert heads * hd == H == d["F"]
    mods = {k: _kernel(kernel_spec(k, d, dt, pdl=pdl)[0])
            for k in ("embed_norm", "boundary", "sigmoid_gate", "swiglu", "softcap")}
    assert all(m.OPTIONS["launch_pdl"] is (pdl is None and dt != "f32" or pdl is True) for m in mods.values())
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[dt]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    def nan(*shape, dtype=dtype):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    ids = torch.randint(0, 50, (T,), generator=g).to(device)
    table, bias = rnd(50, H), rnd(heads, 1, scale=0.5)
    w_in, w_post, w_next = rnd(H, scale=0.1), rnd(H, scale=0.1), rnd(H, scale=0.1)  # weight form 1 + w
    h, n, a, y = [nan(T, H), nan(T, H)], nan(T, H), nan(T, heads, hd), nan(T, H)
    capped = [nan(T, H, dtype=torch.float32) for _ in range(layers)]

    def run():
        mods["embed_norm"].launch(ids, table, w_in, h[0], y)
        for i in range(layers):
            src, dst = h[i % 2], h[(i + 1) % 2]
            mods["boundary"].launch(y, src, w_post, w_next, dst, n)
            mods["sigmoid_gate"].launch(n.view(T, heads, hd), dst.view(T, heads, hd), bias, a)
            mods["swiglu"].launch(a.view(T, H), n, y)
            mods["softcap"].launch(y, capped[i])

    return run, {"h0": h[0], "h1": h[1], "n": n, "a": a, "y": y, **{f"capped{i}": c for i, c in enumerate(capped)}}


@pytest.mark.parametrize("graph", [False, True], ids=["stream", "cuda-graph"])
@pytest.mark.parametrize("T", [1, 300])
def test_pdl_chain_same_bits_as_serial(T, graph):
    """The dependent chain with PDL (every kernel lets the next start early, and waits before its first activation
    read and its first store) gives the bits of the same chain launched serially (PDL=False), five times over,
    launched on a stream or replayed from a CUDA graph (where PDL becomes programmatic graph edges)."""
    run_ref, ref = pdl_chain(False, T)
    run_ref()
    torch.cuda.synchronize()
    assert not any(t.isnan().any() for t in ref.values())
    run, got = pdl_chain(None, T)
    if graph:
        run()  # compile and warm up (and inv_freq-like first-launch work) outside the capture
        torch.cuda.synchronize()
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            run()
    for rep in range(5):
        for t in got.values():
            t.fill_(float("nan"))
        if graph:
            cg.replay()
        else:
            run()
        torch.cuda.synchronize()
        bad = {k: compare(got[k], ref[k])["mismatch"] for k in ref}
        SUMMARY[f"pdl_chain:all/T{T}/{'graph' if graph else 'stream'}/{rep}"] = dict(
            mismatch=sum(bad.values()), numel=sum(t.numel() for t in ref.values()), max_ulp=0)
        assert not any(bad.values()), (rep, bad)
