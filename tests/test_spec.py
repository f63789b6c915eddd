"""Spec loading: the shipped specs, and one located, readable BeamcError for every kind of malformed spec."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from beamc.errors import BeamcError
from beamc.spec import ModelSpec, load_spec, parse_spec

MODELS = Path(__file__).resolve().parents[1] / "models"


def load_error(tmp_path: Path, text: str) -> str:
    """Load `text` as a spec file, expect a BeamcError, return its message with the file path written as F."""
    p = tmp_path / "spec.yaml"
    p.write_text(textwrap.dedent(text).lstrip("\n"))
    with pytest.raises(BeamcError) as ei:
        load_spec(p)
    msg = str(ei.value)
    assert "Traceback" not in msg and "pydantic" not in msg and "validation error" not in msg
    return msg.replace(str(p), "F")


# ---- the shipped specs ----

def test_beam_spec_layer_pattern():
    spec = load_spec(MODELS / "beam.yaml")
    assert spec.name == "Beam-1.0-501B-A23B" and spec.num_layers == 52
    types = spec.attention_types
    assert types.count("sliding_attention") == 43 and types.count("full_attention") == 9
    assert [i for i, t in enumerate(types) if t == "full_attention"] == [5, 11, 17, 23, 29, 35, 41, 47, 51]
    assert spec.mlp_types == ["dense"] * 3 + ["sparse"] * 49


def test_beam_tiny_spec_loads():
    spec = load_spec(MODELS / "beam-tiny.yaml")
    assert [i for i, t in enumerate(spec.attention_types) if t == "full_attention"] == [5, 7]
    assert spec.mlp_types == ["dense"] * 3 + ["sparse"] * 5
    assert spec.dtypes.experts == "nvfp4"


def test_explicit_lists_equal_the_rule():
    rule = load_spec(MODELS / "beam-tiny.yaml")
    data = rule.model_dump()
    data["layers"] = {"attention": rule.attention_types, "mlp": rule.mlp_types}
    explicit = parse_spec(data)
    assert explicit.attention_types == rule.attention_types and explicit.mlp_types == rule.mlp_types


# ---- keys and types ----

def test_unknown_top_level_key(tmp_path):
    msg = load_error(tmp_path, """
        name: x
        num_layer: 4
    """)
    assert msg.startswith("F:2: num_layer: unknown key; did you mean 'num_layers'? (allowed here: name, vocab_size,")


def test_unknown_nested_key(tmp_path):
    msg = load_error(tmp_path, """
        name: x
        attention:
          sliding:
            windw: 128
    """)
    assert msg == ("F:4: attention.sliding.windw: unknown key; did you mean 'window'? "
                   "(allowed here: window, window_includes_current, rope)")


def test_wrong_type(tmp_path):
    assert load_error(tmp_path, "name: x\nnum_layers: fifty\n") == "F:2: num_layers: expected an integer, got 'fifty'"


def test_boolean_is_not_a_number(tmp_path):
    # YAML reads `yes` as true; pydantic alone would take it as num_layers = 1
    assert load_error(tmp_path, "name: x\nnum_layers: yes\n") == "F:2: num_layers: expected a number, got true"


def test_mapping_expected(tmp_path):
    assert load_error(tmp_path, "name: x\nattention: 5\n") == \
        "F:2: attention: expected a mapping (key: value entries), got 5"


@pytest.mark.parametrize("window", [0, -4])
def test_window_must_be_positive(tmp_path, window):
    msg = load_error(tmp_path, f"name: x\nattention:\n  sliding: {{window: {window}}}\n")
    assert msg == f"F:3: attention.sliding.window: must be > 0, got {window}"


def test_bad_literal_lists_allowed_values(tmp_path):
    msg = load_error(tmp_path, "name: x\ndtypes:\n  kv_cache: fp16\n")
    assert msg == "F:3: dtypes.kv_cache: expected one of 'bfloat16', 'fp8'; got 'fp16'"


def test_bad_literal_in_a_layer_list(tmp_path):
    msg = load_error(tmp_path, """
        name: x
        num_layers: 2
        layers:
          attention:
            - sliding_attention
            - global_attention
    """)
    assert msg == "F:6: layers.attention[1]: expected one of 'sliding_attention', 'full_attention'; got 'global_attention'"


def test_missing_name(tmp_path):
    assert load_error(tmp_path, "num_layers: 4\n") == "F: name: required key is missing; add `name: ...`"


def test_empty_name(tmp_path):
    assert load_error(tmp_path, "name: '  '\n") == "F:1: name: must be a non-empty string"


def test_duplicate_key(tmp_path):
    msg = load_error(tmp_path, "name: x\nnum_layers: 4\nnum_layers: 8\n")
    assert msg == "F:3: num_layers: duplicate key (first given at line 2); keep one"


def test_several_problems_one_line_each(tmp_path):
    msg = load_error(tmp_path, """
        name: x
        hidden_size: big
        attention:
          num_head: 8
        dtypes: {experts: int4}
    """)
    assert msg.splitlines() == [
        "F: 3 problems in the spec:",
        "  F:2: hidden_size: expected an integer, got 'big'",
        "  F:4: attention.num_head: unknown key; did you mean 'num_heads'? (allowed here: num_heads, num_kv_heads, "
        "head_dim, bias, softmax_scale, softmax_dtype, qk_norm, output_gate, sliding, full)",
        "  F:5: dtypes.experts: expected one of 'nvfp4', 'bfloat16', 'float16', 'float32'; got 'int4'",
    ]


# ---- cross-field checks (SpecError), located at the key they name ----

def test_heads_not_multiple_of_kv_heads(tmp_path):
    msg = load_error(tmp_path, """
        name: x
        attention:
          num_kv_heads: 8
          num_heads: 12
    """)
    assert msg == "F:4: attention.num_heads: num_heads (12) must be a multiple of num_kv_heads (8)"


def test_n_group_must_divide_experts(tmp_path):
    msg = load_error(tmp_path, """
        name: x
        mlp:
          moe:
            num_experts: 256
            n_group: 3
            topk_group: 2
    """)
    assert msg == "F:5: mlp.moe.n_group: n_group (3) must divide num_experts (256)"


def test_default_that_fails_points_to_the_written_parent(tmp_path):
    # n_group is not written (default 8), so the message points at `moe:`, the nearest key in the file
    msg = load_error(tmp_path, "name: x\nmlp:\n  moe:\n    num_experts: 12\n")
    assert msg == "F:3: mlp.moe.n_group: n_group (8) must divide num_experts (12)"


def test_topk_group_above_n_group(tmp_path):
    msg = load_error(tmp_path, "name: x\nmlp:\n  moe: {n_group: 8, topk_group: 9}\n")
    assert msg == "F:3: mlp.moe.topk_group: topk_group (9) must be <= n_group (8)"


def test_top_k_exceeds_chosen_groups(tmp_path):
    msg = load_error(tmp_path, """
        name: x
        mlp:
          moe:
            num_experts: 16
            n_group: 4
            topk_group: 1
            top_k: 5
    """)
    assert msg == ("F:7: mlp.moe.top_k: top_k (5) exceeds the experts in the chosen groups "
                   "(topk_group 1 x 4 experts per group)")


def test_attention_list_wrong_length(tmp_path):
    msg = load_error(tmp_path, """
        name: x
        num_layers: 4
        layers:
          dense_first: 1
          attention: [sliding_attention, full_attention, full_attention]
    """)
    assert msg == "F:5: layers.attention: has 3 entries, expected num_layers = 4"


def test_mlp_list_wrong_length(tmp_path):
    msg = load_error(tmp_path, "name: x\nnum_layers: 4\nlayers:\n  full_every: 2\n  mlp: [dense, sparse]\n")
    assert msg == "F:5: layers.mlp: has 2 entries, expected num_layers = 4"


def test_dense_first_exceeds_layers(tmp_path):
    msg = load_error(tmp_path, "name: x\nnum_layers: 2\n")
    assert msg == "F: layers.dense_first: (3) exceeds num_layers (2)"


def test_attention_bias_unsupported(tmp_path):
    msg = load_error(tmp_path, "name: x\nattention:\n  bias: true\n")
    assert msg.startswith("F:3: attention.bias: Beam's q/k/v/o projections have no bias")


def test_residual_n_must_be_positive(tmp_path):
    msg = load_error(tmp_path, "name: x\nresidual:\n  attn_n: {scale: 1, extra: -1}\n")
    assert msg == "F:3: residual.attn_n.extra: n = scale * (layer + 1) + extra must be >= 1; at layer 0 it is 0"


def test_initializer_range_positive(tmp_path):
    assert load_error(tmp_path, "name: x\ninitializer_range: -0.02\n") == \
        "F:2: initializer_range: must be > 0, got -0.02"


# ---- files and YAML ----

def test_yaml_syntax_error_reports_line(tmp_path):
    msg = load_error(tmp_path, """
        name: x
        attention:
          num_heads: [48
          head_dim: 128
    """)
    assert msg.startswith("F:4: not valid YAML: ")


def test_tab_indentation(tmp_path):
    msg = load_error(tmp_path, "name: x\nattention:\n\tnum_heads: 8\n")
    assert msg.startswith("F:3: not valid YAML: found character '\\t' that cannot start any token")


def test_file_not_found(tmp_path):
    with pytest.raises(BeamcError) as ei:
        load_spec(tmp_path / "nope.yaml")
    assert str(ei.value) == f"{tmp_path / 'nope.yaml'}: spec file not found (pass a path such as models/beam.yaml)"


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(BeamcError, match="is a directory, expected a spec YAML file"):
        load_spec(tmp_path)


def test_binary_file(tmp_path):
    (tmp_path / "spec.yaml").write_bytes(b"\xff\xfe\x00name")
    with pytest.raises(BeamcError, match="not a UTF-8 text file"):
        load_spec(tmp_path / "spec.yaml")


def test_top_level_list(tmp_path):
    msg = load_error(tmp_path, "- name: x\n- num_layers: 4\n")
    assert msg == "F:1: expected a YAML mapping (key: value lines) at the top level, got a list"


def test_top_level_scalar(tmp_path):
    msg = load_error(tmp_path, "beam\n")
    assert msg == "F:1: expected a YAML mapping (key: value lines) at the top level, got the scalar 'beam'"


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_empty_file(tmp_path, text):
    msg = load_error(tmp_path, text)
    assert msg == "F: the spec is empty; expected a YAML mapping with at least `name:` (see models/beam.yaml)"


def test_parse_spec_without_text_has_no_line():
    with pytest.raises(BeamcError) as ei:
        parse_spec({"name": "x", "vocab_size": 0})
    assert str(ei.value) == "<spec>: vocab_size: must be > 0, got 0"
    full = load_spec(MODELS / "beam-tiny.yaml").model_dump()
    assert isinstance(parse_spec(full), ModelSpec)


@pytest.mark.parametrize("path", [("vocab_size",), ("hidden_size",), ("attention", "num_heads"),
                                  ("mlp", "moe", "num_experts"), ("attention", "sliding", "window")])
def test_model_dimensions_are_never_implied(tmp_path, path):
    """A spec that leaves out a dimension is refused, not silently given the 501B model's value."""
    import yaml

    data = yaml.safe_load((MODELS / "beam-tiny.yaml").read_text())
    node = data
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    msg = load_error(tmp_path, yaml.safe_dump(data, sort_keys=False))
    assert f"{'.'.join(path)}: a model dimension, required (no default is implied); add `{path[-1]}: ...`" in msg
    assert msg.count("\n") == 0


def test_a_moe_free_spec_needs_no_expert_dimensions():
    data = load_spec(MODELS / "beam-tiny.yaml").model_dump()
    data["layers"]["dense_first"] = data["num_layers"]
    del data["mlp"]["moe"]
    assert parse_spec(data).mlp_types == ["dense"] * data["num_layers"]
