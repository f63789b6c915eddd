"""Spec variants beyond Beam's own values through the whole generated runtime: `beamc logits --backend compiled`
(fp32, the generated kernels under Triton's CPU interpreter, in a child process) against the interpreter backend on
the same random checkpoint, a ragged prefill and one decode step: logits within 1e-5, greedy tokens equal. Each
variant changes fields no other runtime test changes together (the project is checked against configurations it
does not see: any valid spec must compile and run, not only Beam's)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import rel_err, spec_variant

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
VARIANTS = {
    # tied embeddings, no soft-cap, an fp8 KV cache
    "tied-nocap-fp8": {"logits.tie_word_embeddings": True, "logits.softcap": None, "dtypes.kv_cache": "fp8"},
    # as many KV heads as query heads, head_dim 64, no dense layer
    "mha-hd64-all-moe": {"attention.num_kv_heads": 8, "attention.head_dim": 64, "layers.dense_first": 0,
                         "attention.sliding.rope.rotary_dim": 64},
    # every layer full attention (no RoPE layer at all), 4 layers
    "all-full": {"layers.full_every": 1, "num_layers": 4},
    # explicit per-layer lists: a full first layer, dense MLPs between MoE ones (not only the first layers)
    "explicit-mixed": {"layers.attention": ["full_attention", "sliding_attention", "sliding_attention",
                                            "full_attention", "sliding_attention", "sliding_attention",
                                            "full_attention", "sliding_attention"],
                       "layers.mlp": ["sparse", "dense", "sparse", "dense", "sparse", "sparse", "dense", "sparse"]},
    # one expert a token from one group of four (widths a bitonic top-k cannot take: found by a random-spec sweep),
    # unquantized bf16 experts, the residual's other depth scales
    "top1-one-group-bf16-experts": {"mlp.moe.top_k": 1, "mlp.moe.topk_group": 1, "mlp.moe.n_group": 4,
                                    "dtypes.experts": "bfloat16", "residual.attn_n.extra": 1,
                                    "mlp.moe.routed_scaling": 1.0},
    # a head dim that is not a power of 2 (the prefill attention's tiles padded to 32, masked), 3 query heads a KV head
    "hd24": {"attention.head_dim": 24, "attention.sliding.rope.rotary_dim": 24, "attention.num_heads": 6},
    # (1 + w) norm weights, the window not counting the current token, 12 experts in 3 groups, top-3, no renorm
    "gemma-norms-odd-router": {"norm.weight_form": "1+w", "attention.sliding.window_includes_current": False,
                               "mlp.moe.num_experts": 12, "mlp.moe.n_group": 3, "mlp.moe.topk_group": 2,
                               "mlp.moe.top_k": 3, "mlp.moe.renormalize": False, "hidden_size": 192,
                               "mlp.moe.d_ff": 48},
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_compiled_runtime_equals_the_interpreter(name, tiny_spec_bf16, tmp_path):
    from beamc.checkpoint.init import init_weights
    from beamc.spec.hf import spec_to_yaml

    spec = spec_variant(tiny_spec_bf16, VARIANTS[name])
    (tmp_path / "spec.yaml").write_text(spec_to_yaml(spec))
    init_weights(spec, tmp_path / "ckpt", seed=7)
    batch = tmp_path / "b.json"
    batch.write_text(json.dumps({"sequences": [[1, 2, 3, 9, 11, 30, 4, 5, 6, 7], [400, 5]], "decode_steps": 1}))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (the CLI sets it itself on a CPU)
    out = {}
    for backend in ("interpreter", "compiled"):
        p = subprocess.run([sys.executable, "-m", "beamc.cli", "logits", str(tmp_path / "spec.yaml"), "--checkpoint",
                            str(tmp_path / "ckpt"), "--input", str(batch), "--passes", "all", "-o",
                            str(tmp_path / f"{backend}.st"), "--backend", backend],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, (backend, p.stderr[-2000:])
        out[backend] = load_file(tmp_path / f"{backend}.st")
    want, got = out["interpreter"], out["compiled"]
    assert set(got) == set(want)
    for k in want:
        assert got[k].shape == want[k].shape, k
        assert (got[k] == want[k]).all() if "tokens" in k else rel_err(got[k], want[k]) < TOL, (name, k)


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_every_bf16_kernel_renders_for_every_variant(target, tiny_spec):
    """The bf16 packages (the GPU's; the runtime tests above run fp32 instances) of every variant above with NVFP4
    experts, of the tiny spec at TP 1 and 2 and of the full spec at TP 1, 2, 4 and 8: every generated kernel renders
    and imports (its template's checks pass: a valid spec must not meet a template refusal on the GPU path, e.g. a
    tile form the emitter picks by default that the shapes of another TP degree cannot take)."""
    import tempfile

    from beamc.codegen.kernel import load_kernel
    from beamc.codegen.package import compile_package
    from beamc.passes.manager import select_passes
    from beamc.spec import load_spec

    full = load_spec(ROOT / "models/beam.yaml")
    cases = [(f"{name}", spec_variant(tiny_spec, VARIANTS[name]), 1) for name in sorted(VARIANTS)]
    cases += [("tiny", tiny_spec, tp) for tp in (1, 2)] + [("full", full, tp) for tp in (1, 2, 4, 8)]
    with tempfile.TemporaryDirectory() as d:
        for name, spec, tp in cases:
            pkg = compile_package(spec, target=target, tp=tp, passes=select_passes("all"))
            assert pkg.dtype == "bf16", (name, pkg.dtype)
            for kname, k in pkg.kernels.items():
                try:
                    load_kernel(k, Path(d))
                except Exception as e:  # noqa: BLE001 - named with the case, then failed
                    pytest.fail(f"{name} TP {tp} ({target}): kernel {kname} does not render: {e}")
