"""Spec <-> transformers `BeamConfig` (config.json).

`spec_to_hf_config` writes the config.json of a checkpoint (`beamc init-weights`); `hf_config_to_spec` turns any
real checkpoint's config.json into a spec (`beamc import-hf`). Facts that BeamConfig does not carry (the SSMax
constants, rounding points, NVFP4 layout) keep the values transformers' Beam code hard-codes, which are the spec's
defaults.
"""
from __future__ import annotations

from typing import Any

from beamc.errors import BeamcError
from beamc.spec.schema import ModelSpec


def spec_to_hf_config(spec: ModelSpec) -> dict[str, Any]:
    """The config.json transformers' `BeamConfig` reads for a checkpoint of this spec."""
    a, m = spec.attention, spec.mlp.moe
    if spec.norm.eps != a.qk_norm.eps:
        raise BeamcError("attention.qk_norm.eps", f"BeamConfig has one rms_norm_eps; the spec has {spec.norm.eps} "
                         f"(norm.eps) and {a.qk_norm.eps} (attention.qk_norm.eps)", "make them equal")
    cfg: dict[str, Any] = {
        "architectures": ["BeamForCausalLM"],
        "model_type": "beam",
        "dtype": spec.dtypes.activations,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.mlp.dense.d_ff,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim,
        "hidden_act": spec.mlp.dense.activation,
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": spec.initializer_range,
        "rms_norm_eps": spec.norm.eps,
        "tie_word_embeddings": spec.logits.tie_word_embeddings,
        "attention_bias": a.bias,
        "attention_dropout": 0.0,
        "sliding_window": a.sliding.window,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": a.sliding.rope.theta},
            "full_attention": None,
        },
        "layer_types": spec.attention_types,
        "mlp_layer_types": spec.mlp_types,
        "moe_intermediate_size": m.d_ff,
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "norm_topk_prob": m.renormalize,
        "n_group": m.n_group,
        "topk_group": m.topk_group,
        "routed_scaling_factor": m.routed_scaling,
        "final_logit_softcapping": spec.logits.softcap,
        "use_cache": True,
    }
    if spec.dtypes.experts == "nvfp4":
        cfg["quantization_config"] = nvfp4_quant_config(spec)
    return cfg


def nvfp4_quant_config(spec: ModelSpec) -> dict[str, Any]:
    """ModelOpt's quantization_config: only the routed experts are NVFP4, everything else is excluded."""
    exclude = ["lm_head", "model.embed_tokens"]
    for L, mlp in enumerate(spec.mlp_types):
        exclude.append(f"model.layers.{L}.self_attn*")
        exclude.append(f"model.layers.{L}.mlp.gate" if mlp == "sparse" else f"model.layers.{L}.mlp*")
    return {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": spec.nvfp4.group_size,
        "kv_cache_quant_algo": "FP8" if spec.dtypes.kv_cache == "fp8" else None,
        "exclude_modules": exclude,
    }
