"""Generated `moe_nvfp4_decode` (IR op `moe_experts`, format "nvfp4") on CUDA against `REFS["moe_experts"]` on CUDA.

Full spec at TP 8 (E 256, H 5120, I 320 per rank, top-k 8), bf16, T in {1, 4, 16}; NVFP4 weights quantised from
random bf16 weights per expert and part (`tests/test_kernels_moe.nvfp4_experts`), idx distinct per token. The
kernel sums in another order than cuBLAS's GEMMs, which moves bf16 roundings: judged by relative error,
||y - ref|| / ||ref|| < 1e-2 (and h, stage 0's output, against the reference's swiglu the same way). Rendered as by
default for bf16 (PDL on) and once with PDL off; a CUDA graph captured with a fixed scratch buffer replays new
inputs to the same bits as a direct launch.

One short line per case is printed; with BEAMC_GPU_OUT set, a JSON summary goes to $BEAMC_GPU_OUT/moe.json.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from beamc.codegen.kernel import KernelSpec, load_kernel
from beamc.ir.reference import REFS
from beamc.spec import load_spec
from conftest import write_gpu_summary
from test_kernels_moe import TEMPLATE, distinct_idx, h_reference, moe_constants, nvfp4_experts

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
SUMMARY: dict = {"moe_nvfp4_decode": []}
_CACHE: dict = {}


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield from write_gpu_summary(SUMMARY, "moe.json")


def _constants(pdl: bool | None = None) -> dict:
    c = moe_constants(load_spec(ROOT / "models/beam.yaml"), 8, "bf16")
    return c if pdl is None else dict(c, PDL=pdl)


def _module(pdl: bool | None, tmp_path_factory):
    key = ("mod", pdl)
    if key not in _CACHE:
        _CACHE[key] = load_kernel(KernelSpec(TEMPLATE, "moe_experts", _constants(pdl)),
                                  tmp_path_factory.mktemp("moe_kernels"))
    return _CACHE[key]


def _weights():
    """The TP-8 experts (quantised on the GPU: 256 experts x 3 parts), made once."""
    if "params" not in _CACHE:
        c = _constants()
        g = torch.Generator().manual_seed(0)
        _CACHE["params"] = nvfp4_experts(c["E"], c["H"], c["I"], g, device="cuda")
    return _CACHE["params"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("T", [1, 4, 16])
@pytest.mark.parametrize("pdl", [None, False])
def test_moe_nvfp4_decode_matches_reference(T, pdl, tmp_path_factory):
    if pdl is False and T != 4:
        pytest.skip("PDL off: one T")
    mod = _module(pdl, tmp_path_factory)
    c = _constants(pdl)
    params = _weights()
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, c["H"], generator=g).bfloat16().cuda()
    idx = distinct_idx(T, c["E"], c["TOP_K"], g).cuda()
    y = torch.full((T, c["TOP_K"], c["H"]), float("nan"), dtype=torch.bfloat16, device="cuda")
    scratch = torch.full((mod.scratch_numel(T) + 64,), float("nan"), dtype=torch.bfloat16, device="cuda")
    mod.launch(x, idx, *params, y, scratch)
    torch.cuda.synchronize()
    assert torch.isnan(scratch[mod.scratch_numel(T):]).all(), "a write past scratch_numel(T)"
    assert torch.isfinite(y).all()
    ref = REFS["moe_experts"]([x, idx, *params], {"format": "nvfp4"})[0]
    err = _rel(y, ref)
    h_err = _rel(scratch[:mod.scratch_numel(T)].view(T, c["TOP_K"], c["I"]), h_reference(x, idx, params))
    exact = (y == ref).float().mean().item()
    line = dict(T=T, pdl=mod.PDL, rel_err=err, h_rel_err=h_err, bitwise_equal_fraction=exact)
    SUMMARY["moe_nvfp4_decode"].append(line)
    print(f"moe_nvfp4_decode T={T} pdl={mod.PDL}: rel err {err:.2e}, h rel err {h_err:.2e}, {exact:.1%} bits equal")
    assert err < 1e-2 and h_err < 1e-2, line


def test_moe_nvfp4_decode_cuda_graph(tmp_path_factory):
    """Captured once with fixed buffers (x, idx, y, scratch), replayed with new x and idx copied in: the same bits
    as a direct launch."""
    mod = _module(None, tmp_path_factory)
    c = _constants()
    params = _weights()
    T = 4
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, c["H"], generator=g).bfloat16().cuda()
    idx = distinct_idx(T, c["E"], c["TOP_K"], g).cuda()
    y = torch.empty(T, c["TOP_K"], c["H"], dtype=torch.bfloat16, device="cuda")
    scratch = torch.empty(mod.scratch_numel(T), dtype=torch.bfloat16, device="cuda")
    mod.launch(x, idx, *params, y, scratch)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mod.launch(x, idx, *params, y, scratch)
    for seed in (8, 9):
        g = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(T, c["H"], generator=g).bfloat16())
        idx.copy_(distinct_idx(T, c["E"], c["TOP_K"], g))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        direct = torch.full_like(y, float("nan"))
        mod.launch(x, idx, *params, direct, torch.empty_like(scratch))
        torch.cuda.synchronize()
        assert torch.equal(y, direct)
        ref = REFS["moe_experts"]([x, idx, *params], {"format": "nvfp4"})[0]
        assert _rel(y, ref) < 1e-2
