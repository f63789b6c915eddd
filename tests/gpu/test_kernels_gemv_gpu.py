"""The small-M (decode) GEMM template `gemv` on CUDA, bf16, at the full spec's TP-8 shapes, vs its torch reference
(`beamc.ir.reference.REFS[op]`, cuBLAS) on the same inputs.

The partial sums are added in another order than cuBLAS's, so results are compared by relative error
(||out - ref|| / ||ref|| < 1e-2, the value printed per case), outputs poisoned with NaN, T in {1, 2, 4, 8, 16, 32, 64}:
T = 1 runs the CUDA-core path, T >= 2 the tensor-core path (token blocks 16, 32, 64); the caller's scratch is
poisoned too, with canaries past scratch_numel(T) that must stay NaN. Plus: a CUDA graph captured with a fixed
scratch replays to the same bits as an eager launch, on fresh inputs copied into the captured buffers (T = 1 and 4:
both paths).
"""
from __future__ import annotations

import pytest
import torch

from beamc.codegen.kernel import load_kernel
from beamc.ir.reference import REFS
from test_kernels_gemv import TP8, kernel_spec, make_inputs

pytestmark = pytest.mark.gpu

T_VALUES = (1, 2, 4, 8, 16, 32, 64)


@pytest.fixture(scope="module")
def kdir(tmp_path_factory):
    return tmp_path_factory.mktemp("gemv_gpu")


def _norm_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("T", T_VALUES)
@pytest.mark.parametrize("name", list(TP8))
def test_bf16_matches_reference(name, T, kdir):
    epi, K, N, splits = TP8[name]
    ks, attrs = kernel_spec(epi, K, N, "bf16", splits=splits)
    mod = load_kernel(ks, kdir)
    gen = torch.Generator().manual_seed(3 + T)
    ins, outs = make_inputs(epi, K, N, T, torch.bfloat16, device="cuda", gen=gen, attrs=attrs)
    got = [torch.full(shape, float("nan"), dtype=dt, device="cuda") for shape, dt in outs]
    n = mod.scratch_numel(T)
    scratch = torch.full((n + 256,), float("nan"), device="cuda")
    mod.launch(*ins, *got, scratch=scratch)
    torch.cuda.synchronize()
    assert scratch[n:].isnan().all(), f"{name} T={T}: a write past scratch_numel(T)"
    want = REFS[ks.op](ins, attrs)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        assert not g.isnan().any(), f"{name} T={T} output {i}: unwritten (NaN) elements"
        err = _norm_rel(g, w)
        print(f"gemv {name} T={T} output {i}: rel err {err:.3e}")
        assert err < 1e-2, (name, T, i, err)


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("name", ["qkvg", "gate_up", "lm_head"])
def test_cuda_graph_with_fixed_scratch(name, T, kdir):
    """Capture launch(..., scratch=fixed) in a CUDA graph; replay on new inputs == eager launch, bit for bit."""
    epi, K, N, splits = TP8[name]
    ks, attrs = kernel_spec(epi, K, N, "bf16", splits=splits)
    mod = load_kernel(ks, kdir)
    gen = torch.Generator().manual_seed(17)
    ins, outs = make_inputs(epi, K, N, T, torch.bfloat16, device="cuda", gen=gen, attrs=attrs)
    got = [torch.full(shape, float("nan"), dtype=dt, device="cuda") for shape, dt in outs]
    scratch = torch.empty(mod.scratch_numel(T), dtype=torch.float32, device="cuda")
    mod.launch(*ins, *got, scratch=scratch)  # warm-up: compiles outside the capture
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            mod.launch(*ins, *got, scratch=scratch)
    torch.cuda.synchronize()

    fresh, _ = make_inputs(epi, K, N, T, torch.bfloat16, device="cuda", gen=gen, attrs=attrs)
    ins[0].copy_(fresh[0])  # new activations in the captured buffer (weights stay)
    for g in got:
        g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()

    eager = [torch.full(shape, float("nan"), dtype=dt, device="cuda") for shape, dt in outs]
    mod.launch(*ins, *eager)
    torch.cuda.synchronize()
    for g, e in zip(got, eager):
        assert not g.isnan().any()
        assert torch.equal(g, e)
    want = REFS[ks.op](ins, attrs)
    assert all(_norm_rel(g, w) < 1e-2 for g, w in zip(got, want))


X_EARLY_TIMES: dict = {}


@pytest.mark.parametrize("name", list(TP8))
def test_x_early_is_bitwise_the_default_and_timed(name, kdir):
    """X_EARLY (the one-pass path's chunks of x all loaded right after the PDL wait; the default since s24run1): the
    same outputs bit for bit as the render without it at one token; both timed as a CUDA graph of 20 PDL launches in
    a row (each one's wait on the one before: the step's situation), µs per launch printed and, with BEAMC_GPU_OUT
    set, written to gemv_x_early.json."""
    import json
    import os
    from pathlib import Path

    from conftest import graph_us

    epi, K, N, splits = TP8[name]
    ks, attrs = kernel_spec(epi, K, N, "bf16", splits=splits)
    early = load_kernel(ks, kdir)  # the default
    base = load_kernel(kernel_spec(epi, K, N, "bf16", splits=splits, X_EARLY=False)[0], kdir)
    gen = torch.Generator().manual_seed(29)
    ins, outs = make_inputs(epi, K, N, 1, torch.bfloat16, device="cuda", gen=gen, attrs=attrs)
    got = {m: [torch.full(shape, float("nan"), dtype=dt, device="cuda") for shape, dt in outs] for m in (0, 1)}
    for m, mod in enumerate((base, early)):
        mod.launch(*ins, *got[m])
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got[0], got[1])), name
    us = [graph_us(lambda mod=mod, m=m: mod.launch(*ins, *got[m]), 20) for m, mod in enumerate((base, early))]
    X_EARLY_TIMES[name] = dict(default_us=us[0], x_early_us=us[1], chunks=base.N_KC1)
    print(f"gemv {name} T=1: default {us[0]:.2f} us, X_EARLY {us[1]:.2f} us ({base.N_KC1} chunks of x)")
    if os.environ.get("BEAMC_GPU_OUT"):
        Path(os.environ["BEAMC_GPU_OUT"], "gemv_x_early.json").write_text(json.dumps(X_EARLY_TIMES, indent=1))
