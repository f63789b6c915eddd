"""The decode step's L2 prefetch plan (`beamc.codegen.prefetch`) and its kernel (`templates/l2_prefetch.py.j2`).

The plan is a schedule hint (no value changes): tested for where the prefetches go, what they name and the budget;
the kernel's chunking under Triton's interpreter (a subprocess: the interpreter is picked when triton is imported);
its sm_90a / sm_100a compile in test_codegen's AOT test; its effect on the H200 in bench/variants.py.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from beamc.codegen.package import compile_package, render_steps
from beamc.codegen.emitters import named_params
from beamc.codegen.prefetch import HIDE_OPS, MIN_BYTES
from beamc.ir.dtypes import nbytes
from beamc.errors import BeamcError
from beamc.passes.manager import select_passes
from beamc.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
ALL = select_passes("all")


@pytest.fixture(scope="module")
def full_tp8():
    return load_spec(ROOT / "models/beam.yaml")


def _prefetches(pkg, phase="decode"):
    lns = pkg.steps[phase].launches
    return [(i, node, ln) for i, (node, ln) in enumerate(lns)
            if ln.kernel is not None and ln.kernel.template == "l2_prefetch"]


def test_plan_prefetches_the_weights_after_each_latency_bound_op(full_tp8):
    """TP-8 rank 0 of the full spec, 24 MB: before each MoE layer's attention the o_proj, norm and router weights of
    its layer; before its experts the next layer's QKV+gate weight (and the norms between); each prefetch directly
    before the first launch of an attention or experts op, naming only params that the launches after it (up to the
    next such op) read, within the budget; the step's last launch is the join; prefill steps have none."""
    pkg = compile_package(full_tp8, tp=8, passes=ALL, l2_prefetch_mb=24)
    lns = pkg.steps["decode"].launches
    pf = _prefetches(pkg)
    joins = [i for i, _, ln in pf if ln.args == ()]
    assert joins == [len(lns) - 1]
    pf = [p for p in pf if p[2].args]
    assert len(pf) == 3 + 2 * 49 - 1  # dense layers: the attention's; MoE layers: both (not the last experts: norms only)
    for i, node, ln in pf:
        nxt, first = lns[i + 1][0], lns[i + 1][1]
        assert nxt is node and node.op in HIDE_OPS and lns[i - 1][0] is not node
        later, total = {}, 0
        for n2, l2 in lns[i + 1:]:
            if n2 is not node and n2.op in HIDE_OPS:
                break
            later.update({v.name: int(math.prod(v.shape) * nbytes(v.dtype)) for v in named_params(n2, l2)})
        assert set(ln.args) <= set(later)
        total = sum(later[a] for a in ln.args)
        assert MIN_BYTES <= total <= 24 << 20
    by_layer = {(node.layer, node.op): ln.args for _, node, ln in pf}
    att = by_layer[(7, "qk_attention")]
    assert att[0] == "model.layers.7.self_attn.o_proj.weight" and "model.layers.7.mlp.gate.weight" in att
    moe = by_layer[(7, "moe_experts")]
    assert moe[-1] == "model.layers.8.self_attn.qkvg_proj.weight"
    assert (51, "moe_experts") not in by_layer  # (after the last layer: the lm_head's 194 MB do not fit)
    assert by_layer[(0, "qk_attention")] == ("model.layers.0.self_attn.o_proj.weight",
                                             "model.layers.0.post_attention_layernorm.weight",
                                             "model.layers.0.pre_feedforward_layernorm.weight")
    assert _prefetches(pkg, "prefill") == []
    assert pkg.manifest()["l2_prefetch_mb"] == 24
    assert "K['l2_prefetch_" in render_steps(pkg)


def test_plan_budget_and_off(full_tp8):
    """A budget takes whole weights in launch order and stops at the first that does not fit (8 MB: the o_proj
    weight, 7.5 MiB, then nothing after the router's 5 MiB); 0 is off (the step as without the option); fp32
    packages (the CPU interpreter) never prefetch; a negative budget is an error naming the flag."""
    small = compile_package(full_tp8, tp=8, passes=ALL, l2_prefetch_mb=8)
    att = [ln.args for _, node, ln in _prefetches(small) if node.op == "qk_attention" and node.layer == 7]
    assert att == [("model.layers.7.self_attn.o_proj.weight", "model.layers.7.post_attention_layernorm.weight",
                    "model.layers.7.pre_feedforward_layernorm.weight")]
    moe = [ln.args for _, node, ln in _prefetches(small) if node.op == "moe_experts"]
    assert moe == []  # (the QKV+gate weight, 17.5 MiB, does not fit: the norms before it are under MIN_BYTES)
    off = compile_package(full_tp8, tp=8, passes=ALL, l2_prefetch_mb=0)
    assert _prefetches(off) == [] and off.manifest()["l2_prefetch_mb"] == 0
    f32 = compile_package(load_spec(ROOT / "models/beam-tiny.yaml"), passes=ALL, dtype="f32", l2_prefetch_mb=24)
    assert _prefetches(f32) == []
    with pytest.raises(BeamcError, match="--l2-prefetch-mb"):
        compile_package(full_tp8, tp=8, passes=ALL, l2_prefetch_mb=-1)


def test_plan_render_options_by_set(full_tp8):
    """The kernel's render options are `--set l2_prefetch.NAME=VALUE` overrides (recorded like any other); its
    launch arguments are not (MAX_RANGES is fixed by the template); an override without a prefetch is refused."""
    pkg = compile_package(full_tp8, tp=8, passes=ALL, l2_prefetch_mb=24,
                          template_overrides={"l2_prefetch": {"BULK": False, "EVICT_LAST": True}})
    (name,) = {ln.kernel.name for _, _, ln in _prefetches(pkg)}
    spec = pkg.kernels[name]
    assert spec.constants == {"BULK": False, "EVICT_LAST": True}
    assert "prefetch.global.L2::evict_last" in spec.source()
    with pytest.raises(BeamcError, match="reads no constant 'MAX_RANGES'|MAX_RANGES"):
        compile_package(full_tp8, tp=8, passes=ALL, l2_prefetch_mb=24,
                        template_overrides={"l2_prefetch": {"MAX_RANGES": 8}})
    with pytest.raises(BeamcError, match="no kernel of this package is rendered from this template"):
        compile_package(full_tp8, tp=8, passes=ALL, l2_prefetch_mb=0,
                        template_overrides={"l2_prefetch": {"BULK": False}})


_CHUNKS = r"""
import json, sys
from beamc.codegen.kernel import KernelSpec, load_kernel
out = {}
for c in ({}, {"BULK": False, "CHUNK": 4096}):
    mod = load_kernel(KernelSpec("l2_prefetch", "l2_prefetch", c))
    sizes = [100000, 16, 15, 15 * mod.CHUNK + 100, 2 * 32 * mod.CHUNK + 17]
    out[mod.CHUNK] = [sizes, mod.chunks(sizes[:4]), mod.chunks(sizes[4:])]
json.dump(out, sys.stdout)
"""


def test_kernel_chunks_cover_each_weight_once():
    """Under the interpreter: thread t of each weight's programs takes bytes [t * CHUNK, + CHUNK) cut to whole
    16-byte units, in order, so the chunks tile each weight once up to its last 16-byte unit (a tail under 16 bytes,
    and a weight under 16 bytes, skipped), over programs and weights of any size."""
    r = subprocess.run([sys.executable, "-c", _CHUNKS], env={**os.environ, "TRITON_INTERPRET": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for chunk, (sizes, first, second) in json.loads(r.stdout).items():
        chunk = int(chunk)
        for n, got in zip(sizes, first + second):
            want, o = [], 0
            while n - o >= 16:
                want.append([o, min(chunk, n - o) // 16 * 16])
                o += chunk
            assert got == want, (chunk, n)


_JIT_TYPES = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from beamc.codegen.kernel import KernelSpec, load_kernel
for c in ({}, {"BULK": False}, {"EVICT_LAST": True}):
    mod = load_kernel(KernelSpec("l2_prefetch", "l2_prefetch", c))
    sig = dict(mod.SIGNATURE, a1="i32", a2="i32", a3="i32", n0="i32", n1="i32", n2="i32", n3="i32")
    for arch in (90, 100):
        src = ASTSource(fn=mod.kernel, signature=sig, constexprs=mod.CONSTEXPRS)
        assert triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(mod.OPTIONS)).asm["cubin"]
print("ok")
"""


def test_kernel_compiles_as_the_jit_types_a_launch():
    """A launch with fewer weights than ranges passes 0s, and byte counts under 2^31, which Triton's JIT types as
    int32 (the AOT signature says int64): the kernel compiles either way (the first H200 run of the kernel failed
    on exactly this)."""
    r = subprocess.run([sys.executable, "-c", _JIT_TYPES], env={**os.environ, "TRITON_INTERPRET": "0"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
