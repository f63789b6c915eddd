"""LATE_TRIGGER renders on CUDA: where a kernel lets the next launch start (griddepcontrol.launch_dependents: first,
or once its results are computed) must change no bit of any output. For rmsnorm_boundary, moe_combine and the
gemv (one pass at T = 1; the split-K partials and reduction at T = 8) at one TP-8 rank's shapes, bf16: the late
render and the default one, launched back to back as a PDL chain (each launch behind the one before, both renders
in one CUDA graph as well), on the same fresh random inputs, outputs poisoned with NaN first, are bitwise equal.
(The MoE experts' and the decode attention's late renders: tests/gpu/test_kernels_moe_gpu.py and the QKN test of
tests/gpu/test_kernels_attention_decode_gpu.py.)
"""
from __future__ import annotations

import pytest
import torch

from beamc.codegen.kernel import KernelSpec, load_kernel
from conftest import captured_graph
from test_kernels_gemv import TP8, kernel_spec as gemv_spec, make_inputs as gemv_inputs
from test_kernels_pointwise import _dims, kernel_spec as pointwise_spec, make_inputs as pointwise_inputs

pytestmark = pytest.mark.gpu


def _late(ks: KernelSpec) -> KernelSpec:
    return KernelSpec(ks.template, ks.op, {**ks.constants, "LATE_TRIGGER": True})


def _check(run, outs_of) -> None:
    """run(module, outputs) launches one render; eager: default then late; then both in one captured graph."""
    default, late = outs_of(), outs_of()
    run("default", default)
    run("late", late)
    torch.cuda.synchronize()
    for d, g in zip(default, late):
        assert not d.isnan().any() and torch.equal(d, g)
    replay = outs_of(), outs_of()
    graph = captured_graph(lambda: (run("default", replay[0]), run("late", replay[1])))
    graph.replay()
    torch.cuda.synchronize()
    for d, a, b in zip(default, *replay):
        assert torch.equal(a, d) and torch.equal(b, d)


@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("kind", ["boundary", "moe_combine"])
def test_pointwise_late_trigger_same_bits(kind, T, tmp_path):
    d = _dims("beam", tp=8)
    ks, _ = pointwise_spec(kind, d, "bf16")
    mods = {"default": load_kernel(ks, tmp_path), "late": load_kernel(_late(ks), tmp_path)}
    assert mods["late"].LATE_TRIGGER and not mods["default"].LATE_TRIGGER
    ins, _, outs = pointwise_inputs(kind, d, T, torch.bfloat16, device="cuda", gen=torch.Generator().manual_seed(T))

    def outs_of():
        return [torch.full(s, float("nan"), dtype=dt, device="cuda") for s, dt in outs]

    _check(lambda which, got: mods[which].launch(*ins, *got), outs_of)


@pytest.mark.parametrize("T", [1, 8])
def test_gemv_late_trigger_same_bits(T, tmp_path):
    epi, K, N, splits = TP8["qkvg"]
    ks, attrs = gemv_spec(epi, K, N, "bf16", splits=splits)
    mods = {"default": load_kernel(ks, tmp_path), "late": load_kernel(_late(ks), tmp_path)}
    assert mods["late"].LATE_TRIGGER and not mods["default"].LATE_TRIGGER
    ins, outs = gemv_inputs(epi, K, N, T, torch.bfloat16, device="cuda", gen=torch.Generator().manual_seed(5 + T),
                            attrs=attrs)
    scratch = {w: torch.empty(mods[w].scratch_numel(T), dtype=torch.float32, device="cuda") for w in mods}

    def outs_of():
        return [torch.full(s, float("nan"), dtype=dt, device="cuda") for s, dt in outs]

    _check(lambda which, got: mods[which].launch(*ins, *got, scratch=scratch[which]), outs_of)
