"""config.json <-> spec: round trips through transformers' BeamConfig, `beamc import-hf`, and its rejections."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from beamc.cli import main
from beamc.errors import BeamcError
from beamc.spec import ModelSpec, load_spec
from beamc.spec.hf import (HF_DEFAULTS, config_mismatches, hf_config_to_spec, import_hf, spec_to_hf_config,
                           spec_to_yaml)

MODELS = Path(__file__).resolve().parents[1] / "models"
SPECS = ["beam.yaml", "beam-tiny.yaml"]


def write_config(tmp_path: Path, cfg: dict, folder: str = "My-Beam") -> Path:
    p = tmp_path / folder / "config.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(cfg, indent=2))
    return p


def import_error(cfg: dict) -> str:
    with pytest.raises(BeamcError) as ei:
        hf_config_to_spec(cfg, "x")
    return str(ei.value)


# ---- round trips ----

@pytest.mark.parametrize("name", SPECS)
def test_spec_config_spec_round_trip(name):
    spec = load_spec(MODELS / name)
    assert hf_config_to_spec(spec_to_hf_config(spec), spec.name) == spec


@pytest.mark.parametrize("name", SPECS)
def test_yaml_reads_back_equal(tmp_path, name):
    spec = load_spec(MODELS / name)
    (tmp_path / "s.yaml").write_text(spec_to_yaml(spec))
    assert load_spec(tmp_path / "s.yaml") == spec


@pytest.mark.parametrize("name", SPECS)
def test_transformers_reads_our_config(name):
    transformers = pytest.importorskip("transformers")
    spec = load_spec(MODELS / name)
    cfg = transformers.BeamConfig(**spec_to_hf_config(spec))
    assert cfg.layer_types == spec.attention_types
    assert cfg.mlp_layer_types == spec.mlp_types
    # and back: what transformers writes imports to the same spec
    assert hf_config_to_spec(cfg.to_dict(), spec.name) == spec


def test_default_table_matches_beamconfig():
    transformers = pytest.importorskip("transformers")
    defaults = transformers.BeamConfig()
    for key, value in HF_DEFAULTS.items():
        if value is not None:  # None: derived in __post_init__, checked below through the imported spec
            assert getattr(defaults, key) == value, key


def test_beamconfig_defaults_import_to_the_default_model():
    transformers = pytest.importorskip("transformers")
    spec = hf_config_to_spec(transformers.BeamConfig().to_dict(), "Beam-1.0-501B-A23B")
    beam = load_spec(MODELS / "beam.yaml")
    assert spec.attention_types == beam.attention_types and spec.mlp_types == beam.mlp_types
    # BeamConfig() has no quantization_config, so its experts are bf16; everything else is the shipped spec
    assert spec == beam.model_copy(update={"dtypes": beam.dtypes.model_copy(update={"experts": "bfloat16"})})


def test_empty_config_takes_defaults_without_transformers():
    spec = hf_config_to_spec({}, "x")
    assert spec.layers.full_every == 6 and spec.layers.dense_first == 3 and spec.layers.attention is None
    assert spec.attention.sliding.window == 512 and spec.attention.sliding.rope.theta == 10000.0


def test_few_layers_default_dense_first():
    assert hf_config_to_spec({"num_hidden_layers": 2}, "x").mlp_types == ["dense", "dense"]  # min(3, layers)


# ---- field mapping ----

def test_field_mapping():
    cfg = {
        "rms_norm_eps": 1e-5, "final_logit_softcapping": None, "tie_word_embeddings": True, "dtype": "float16",
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e6}, "full_attention": None},
        "quantization_config": {"quant_method": "modelopt", "quant_algo": None, "kv_cache_quant_algo": "FP8"},
        "sliding_window": 1024, "num_experts_per_tok": 6, "norm_topk_prob": False, "routed_scaling_factor": 1.5,
    }
    spec = hf_config_to_spec(cfg, "x")
    assert spec.norm.eps == spec.attention.qk_norm.eps == 1e-5
    assert spec.logits.softcap is None and spec.logits.tie_word_embeddings
    assert spec.dtypes.activations == spec.dtypes.lm_head == spec.dtypes.embeddings == "float16"
    assert spec.dtypes.experts == "float16" and spec.dtypes.kv_cache == "fp8"  # unquantized: the checkpoint dtype
    assert spec.attention.sliding.rope.theta == 1e6 and spec.attention.sliding.window == 1024
    assert (spec.mlp.moe.top_k, spec.mlp.moe.renormalize, spec.mlp.moe.routed_scaling) == (6, False, 1.5)
    assert "softcap: null" in spec_to_yaml(spec)


@pytest.mark.parametrize("experts", ["nvfp4", "bfloat16"])
def test_fp8_kv_cache_round_trip(experts):
    """An FP8 KV cache is written to quantization_config even when the experts are not quantized."""
    tiny = load_spec(MODELS / "beam-tiny.yaml")
    spec = tiny.model_copy(update={"dtypes": tiny.dtypes.model_copy(update={"kv_cache": "fp8", "experts": experts})})
    cfg = spec_to_hf_config(spec)
    assert cfg["quantization_config"]["kv_cache_quant_algo"] == "FP8"
    assert cfg["quantization_config"]["quant_algo"] == ("NVFP4" if experts == "nvfp4" else None)
    assert hf_config_to_spec(cfg, spec.name) == spec


@pytest.mark.parametrize("cfg, experts, rest", [
    ({}, "bfloat16", "bfloat16"),
    ({"dtype": "float32"}, "float32", "float32"),
    ({"torch_dtype": "float16"}, "float16", "float16"),
    ({"dtype": "float32", "quantization_config": {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": [
            "lm_head", "model.embed_tokens", "model.layers.*.self_attn*", "model.layers.*.mlp.gate",
            "model.layers.[012].mlp*"]}},
     "nvfp4", "float32"),
])
def test_unquantized_experts_take_the_checkpoint_dtype(cfg, experts, rest):
    d = hf_config_to_spec(cfg, "x").dtypes
    assert d.experts == experts
    assert d.activations == d.embeddings == d.attention_weights == d.dense_mlp_weights == d.norm_weights == rest


def test_config_mismatches_of_own_config_are_none():
    """What spec_to_hf_config writes agrees with the spec, also for a spec config.json cannot fully describe
    (norms stored in fp32: config.json has one dtype, the loader checks each tensor's)."""
    for name in SPECS:
        spec = load_spec(MODELS / name)
        assert config_mismatches(spec, spec_to_hf_config(spec)) == []
        mixed = spec.model_copy(update={"dtypes": spec.dtypes.model_copy(update={"norm_weights": "float32"})})
        assert config_mismatches(mixed, spec_to_hf_config(spec)) == []


def test_layer_types_that_fit_a_rule_become_the_rule():
    # full at 2 and 5 of 8, last layer sliding: full_every 3 without last_is_full
    types = ["full_attention" if i in (2, 5) else "sliding_attention" for i in range(8)]
    mlp = ["dense"] + ["sparse"] * 7
    spec = hf_config_to_spec({"num_hidden_layers": 8, "layer_types": types, "mlp_layer_types": mlp}, "x")
    assert (spec.layers.full_every, spec.layers.last_is_full, spec.layers.dense_first) == (3, False, 1)
    assert spec.layers.attention is None and spec.layers.mlp is None
    assert spec.attention_types == types and spec.mlp_types == mlp
    assert "layers: {full_every: 3, last_is_full: false, dense_first: 1}" in spec_to_yaml(spec)


def test_irregular_layer_types_stay_explicit(tmp_path):
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    mlp = ["sparse", "dense", "sparse", "sparse"]
    spec = hf_config_to_spec({"num_hidden_layers": 4, "layer_types": types, "mlp_layer_types": mlp}, "x")
    assert spec.layers.attention == types and spec.layers.mlp == mlp
    text = spec_to_yaml(spec)
    assert "full_every" not in text and "dense_first" not in text  # rules the explicit lists override
    assert "    - full_attention     # layer 0" in text
    (tmp_path / "s.yaml").write_text(text)
    assert load_spec(tmp_path / "s.yaml") == spec


# ---- rejections: one BeamcError naming the config key and the fix ----

@pytest.mark.parametrize("override, expected", [
    ({"model_type": "llama"}, "model_type: is 'llama'; beamc compiles Beam checkpoints only"),
    ({"attention_bias": True}, "attention_bias: Beam's q/k/v/o projections have no bias"),
    ({"hidden_act": "gelu"}, "hidden_act: is 'gelu'; Beam's MLPs are SwiGLU: set it to \"silu\""),
    ({"sliding_window": None}, "sliding_window: is null; beamc needs the sliding layers' window size"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
                          "full_attention": None}},
     "rope_parameters.sliding_attention.rope_type: is 'yarn'; beamc implements only 'default' RoPE"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_parameters.full_attention: must be null"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters: expected a mapping by layer"),
    ({"rope_theta": 1e6}, "rope_theta: (1000000.0) differs from rope_parameters.sliding_attention.rope_theta"),
    ({"n_group": None}, "n_group: is null; beamc needs grouped routing"),
    ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}},
     "quantization_config.quant_algo: is 'FP8'; beamc reads NVFP4 routed experts or unquantized weights"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config.quant_method: is 'gptq'"),
    ({"quantization_config": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}},
     "quantization_config.exclude_modules: leaves model.embed_tokens (and 104 more) quantized"),
    ({"num_attention_heads": 12}, "num_attention_heads: num_heads (12) must be a multiple of num_kv_heads (8)"),
    ({"n_group": 3}, "n_group: n_group (3) must divide num_experts (256)"),
    ({"num_hidden_layers": "fifty"}, "num_hidden_layers: expected an integer, got 'fifty'"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types: has 3 entries, expected num_layers = 52"),
    ({"num_hidden_layers": 2, "layer_types": ["sliding_attention", "global"]},
     "layer_types[1]: expected one of 'sliding_attention', 'full_attention'; got 'global'"),
    ({"dtype": "float8_e4m3fn"}, "dtype: expected one of 'bfloat16', 'float16', 'float32'; got 'float8_e4m3fn'"),
])
def test_rejections(override, expected):
    msg = import_error(override)
    assert msg.startswith(f"config.json: {expected}"), msg
    assert "\n" not in msg  # one problem, one line


def test_several_rejections_in_one_error():
    msg = import_error({"model_type": "llama", "hidden_act": "gelu"})
    assert msg.splitlines() == [
        "config.json: 2 problems in the config:",
        "  config.json: model_type: is 'llama'; beamc compiles Beam checkpoints only (model_type \"beam\")",
        "  config.json: hidden_act: is 'gelu'; Beam's MLPs are SwiGLU: set it to \"silu\"",
    ]


# ---- import_hf and the CLI ----

def test_cli_import_hf_writes_yaml(tmp_path):
    spec = load_spec(MODELS / "beam.yaml")
    cfg = write_config(tmp_path, spec_to_hf_config(spec), folder="Beam-1.0-501B-A23B")
    out = tmp_path / "out.yaml"
    assert main(["import-hf", str(cfg), "-o", str(out)]) == 0
    text = out.read_text()
    assert load_spec(out) == spec  # the name comes from the config's directory
    assert "\nlayers: {full_every: 6, last_is_full: true, dense_first: 3}\n" in text
    assert "\nattention:\n  num_heads: 48\n" in text and "    - " not in text  # block style, no explicit lists


def test_import_hf_to_stdout_with_name(tmp_path, capsys):
    cfg = write_config(tmp_path, spec_to_hf_config(load_spec(MODELS / "beam-tiny.yaml")))
    spec = import_hf(cfg.parent, name="Tiny")  # a checkpoint directory works too
    out = capsys.readouterr().out
    assert spec.name == "Tiny" and "\nname: Tiny\n" in out
    (tmp_path / "s.yaml").write_text(out)
    assert load_spec(tmp_path / "s.yaml") == spec


def test_cli_bad_config_exit_code_and_one_message(tmp_path):
    cfg = write_config(tmp_path, {"model_type": "beam", "attention_bias": True})
    r = subprocess.run([sys.executable, "-m", "beamc.cli", "import-hf", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith(f"beamc: error: {cfg}: attention_bias: ") and len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize("content, expected", [
    ('{"model_type": "beam",\n  "hidden_size": }', ":2: not valid JSON: Expecting value (column 18)"),
    ("[1, 2]", ": expected a JSON object at the top level, got list"),
])
def test_cli_unreadable_config(tmp_path, capsys, content, expected):
    p = tmp_path / "config.json"
    p.write_text(content)
    assert main(["import-hf", str(p)]) == 2
    assert capsys.readouterr().err == f"beamc: error: {p}{expected}\n"


def test_cli_missing_config(tmp_path, capsys):
    assert main(["import-hf", str(tmp_path / "none.json")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_import_returns_model_spec(tmp_path, capsys):
    assert isinstance(import_hf(write_config(tmp_path, {})), ModelSpec)
    assert "name: My-Beam" in capsys.readouterr().out
