"""Random checkpoints (init_weights), the per-rank loader, and the errors for checkpoints that do not fit the spec."""
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from beamc.checkpoint import nvfp4
from beamc.checkpoint.init import init_weights, with_experts
from beamc.checkpoint.layout import expert_graph_params, kv_scale_params, rank_dims, rank_shape, shard_range
from beamc.checkpoint.loader import load_rank_weights, take_rank_slice
from beamc.errors import BeamcError
from beamc.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "beam-tiny.yaml"
FULL = ROOT / "models" / "beam.yaml"
SHARD = 1 << 20  # 1 MiB: the tiny checkpoint (~14 MB) spreads over many files


@pytest.fixture(scope="session")
def spec_nvfp4():
    return load_spec(TINY)


@pytest.fixture(scope="session")
def spec_bf16(spec_nvfp4):
    return with_experts(spec_nvfp4, "bf16")


@pytest.fixture(scope="session")
def ckpt_bf16(tmp_path_factory):
    return init_weights(TINY, tmp_path_factory.mktemp("bf16"), seed=0, experts="bf16")


@pytest.fixture(scope="session")
def ckpt_nvfp4(tmp_path_factory):
    return init_weights(TINY, tmp_path_factory.mktemp("nvfp4"), seed=0)


@pytest.fixture(scope="session")
def full_bf16(spec_bf16, ckpt_bf16):
    return load_rank_weights(spec_bf16, ckpt_bf16)


@pytest.fixture(scope="session")
def full_nvfp4(spec_nvfp4, ckpt_nvfp4):
    return load_rank_weights(spec_nvfp4, ckpt_nvfp4)


def _moe_layers(spec):
    return [L for L, m in enumerate(spec.mlp_types) if m == "sparse"]


# ---------------------------------------------------------------- init_weights


def test_transformers_loads_bf16_checkpoint(spec_bf16, ckpt_bf16):
    from transformers import BeamForCausalLM

    model, info = BeamForCausalLM.from_pretrained(ckpt_bf16, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    sd = model.state_dict()
    ours = load_rank_weights(spec_bf16, ckpt_bf16, dtype=torch.float32)
    assert set(ours) == set(sd)
    for name, v in ours.items():
        assert torch.equal(v, sd[name]), name
    L = _moe_layers(spec_bf16)[0]
    assert ours[f"model.layers.{L}.mlp.experts.gate_up_proj"].shape == (16, 128, 256)


def test_init_values_are_not_trivial_and_deterministic(ckpt_bf16, tmp_path):
    t = load_file(ckpt_bf16 / "model.safetensors")
    assert not torch.all(t["model.norm.weight"] == 1)
    assert not torch.all(t["model.layers.0.self_attn.q_norm.weight"] == 1)
    assert torch.all(t["model.layers.0.self_attn.gate_bias"] != 0)
    assert torch.all(t["model.layers.3.mlp.gate.e_score_correction_bias"] != 0)
    assert t["model.layers.3.mlp.gate.weight"].dtype == torch.float32
    std = t["model.layers.0.self_attn.q_proj.weight"].float().std().item()
    assert 0.018 < std < 0.022  # initializer_range
    again = load_file(init_weights(TINY, tmp_path / "again", seed=0, experts="bf16") / "model.safetensors")
    other = load_file(init_weights(TINY, tmp_path / "other", seed=1, experts="bf16") / "model.safetensors")
    assert all(torch.equal(t[k], again[k]) for k in t)
    assert not torch.equal(t["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_nvfp4_checkpoint_files(ckpt_nvfp4):
    cfg = json.loads((ckpt_nvfp4 / "config.json").read_text())
    assert cfg["quantization_config"]["quant_algo"] == "NVFP4"
    q = json.loads((ckpt_nvfp4 / "hf_quant_config.json").read_text())
    assert q["producer"]["name"] == "modelopt"
    assert q["quantization"]["quant_algo"] == "NVFP4" and q["quantization"]["group_size"] == 16
    assert "lm_head" in q["quantization"]["exclude_modules"]
    t = load_file(ckpt_nvfp4 / "model.safetensors")
    p = "model.layers.3.mlp.experts.0.gate_proj"
    assert t[f"{p}.weight"].dtype == torch.uint8 and t[f"{p}.weight"].shape == (64, 128)
    assert t[f"{p}.weight_scale"].dtype == torch.float8_e4m3fn and t[f"{p}.weight_scale"].shape == (64, 16)
    assert t[f"{p}.weight_scale_2"].shape == () and t[f"{p}.input_scale"].item() > 0
    # the packed weight is the ModelOpt quantisation of its own dequantisation (a genuine quantised matrix)
    d = nvfp4.dequantize(t[f"{p}.weight"], t[f"{p}.weight_scale"], t[f"{p}.weight_scale_2"])
    assert torch.equal(nvfp4.quantize(d)[0], t[f"{p}.weight"])


def test_sharded_checkpoint_loads_identically(spec_bf16, ckpt_bf16, full_bf16, tmp_path):
    from transformers import BeamForCausalLM

    d = init_weights(TINY, tmp_path / "sharded", seed=0, experts="bf16", shard_bytes=SHARD)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(d.glob("model-*.safetensors"))
    assert len(files) > 3 and not (d / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {f.name for f in files}
    loaded = load_rank_weights(spec_bf16, d)
    assert set(loaded) == set(full_bf16)
    assert all(torch.equal(loaded[k], full_bf16[k]) for k in loaded)
    model, info = BeamForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_rewriting_a_directory_drops_old_shards(spec_bf16, full_bf16, tmp_path):
    init_weights(TINY, tmp_path, seed=0, experts="bf16", shard_bytes=SHARD)
    init_weights(TINY, tmp_path, seed=0, experts="bf16", overwrite=True)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert torch.equal(load_rank_weights(spec_bf16, tmp_path)["lm_head.weight"], full_bf16["lm_head.weight"])


def test_refuses_full_model_without_force_quickly(tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(BeamcError) as e:
        init_weights(FULL, tmp_path / "big")
    assert time.perf_counter() - t0 < 5  # sizes come from shapes: nothing is allocated
    assert "GiB" in str(e.value) and "--force" in str(e.value)
    assert not (tmp_path / "big").exists()


# ---------------------------------------------------------------- loader: dtypes and tensor parallelism


NVFP4_STORAGE = {"weight": torch.uint8, "weight_scale": torch.float8_e4m3fn, "weight_scale_2": torch.float32}


def test_dtypes(spec_bf16, ckpt_bf16, spec_nvfp4, ckpt_nvfp4):
    router = ("mlp.gate.weight", "e_score_correction_bias")
    for spec, d in ((spec_bf16, ckpt_bf16), (spec_nvfp4, ckpt_nvfp4)):
        as_file = load_rank_weights(spec, d)
        bf16 = load_rank_weights(spec, d, dtype=torch.bfloat16)
        fp32 = load_rank_weights(spec, d, dtype=torch.float32)
        for k in as_file:
            if ".experts." in k and spec is spec_nvfp4:  # storage format whatever the compute dtype
                want = NVFP4_STORAGE[k.rsplit(".", 1)[1]]
                assert as_file[k].dtype == bf16[k].dtype == fp32[k].dtype == want, k
                assert torch.equal(bf16[k].view(torch.uint8), as_file[k].view(torch.uint8)), k
                continue
            is_router = k.endswith(router)
            assert fp32[k].dtype == torch.float32, k
            assert bf16[k].dtype == (torch.float32 if is_router else torch.bfloat16), k
            assert as_file[k].dtype == (torch.float32 if is_router else torch.bfloat16), k
            assert torch.equal(fp32[k], as_file[k].float()), k


def _expected_split(name: str) -> int | None:
    """The dim tensor parallelism splits a graph param along (None: replicated), written out from the TP plan."""
    if name.endswith(("q_proj.weight", "self_attn.gate_proj.weight", "gate_bias", "mlp.gate_proj.weight",
                      "mlp.up_proj.weight", "lm_head.weight", "k_proj.weight", "v_proj.weight")):
        return 0
    if name.endswith(("o_proj.weight", "mlp.down_proj.weight")) and ".experts." not in name:
        return 1
    if name.endswith(("experts.down_proj", "experts.down_proj.weight", "experts.down_proj.weight_scale")):
        return 2
    return None


def _check_ranks(spec, d, full, tp):
    ranks = [load_rank_weights(spec, d, tp=tp, rank=r) for r in range(tp)]
    I = spec.mlp.moe.d_ff // tp
    for name, want in full.items():
        parts = [r[name] for r in ranks]
        if name.endswith(("experts.gate_up_proj", "gate_up_proj.weight", "gate_up_proj.weight_scale")):
            # each rank: its gate rows, then its up rows
            assert all(p.shape[1] == 2 * I for p in parts)
            got = torch.cat([torch.cat([p[:, :I] for p in parts], 1), torch.cat([p[:, I:] for p in parts], 1)], 1)
        elif name.endswith(("k_proj.weight", "v_proj.weight")) and tp > spec.attention.num_kv_heads:
            copies = tp // spec.attention.num_kv_heads  # ranks sharing a kv head hold copies of it
            for r in range(tp):
                assert torch.equal(parts[r], parts[r - r % copies]), (name, r)
            got = torch.cat(parts[::copies], 0)
        elif (dim := _expected_split(name)) is not None:
            assert all(p.shape[dim] == want.shape[dim] // tp for p in parts), name
            got = torch.cat(parts, dim)
        else:
            assert all(torch.equal(p, want) for p in parts), name
            got = want
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want), (name, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_slices_concatenate_to_full_bf16(spec_bf16, ckpt_bf16, full_bf16, tp):
    _check_ranks(spec_bf16, ckpt_bf16, full_bf16, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_slices_concatenate_to_full_nvfp4(spec_nvfp4, ckpt_nvfp4, full_nvfp4, tp):
    _check_ranks(spec_nvfp4, ckpt_nvfp4, full_nvfp4, tp)


def test_nvfp4_experts_stay_packed(spec_nvfp4, ckpt_nvfp4, full_nvfp4):
    """The six stacked NVFP4 params of a MoE layer are the file tensors stacked, bit for bit, and dequantise (with
    `nvfp4.dequantize_stacked`) to each expert's own dequantisation."""
    t = load_file(ckpt_nvfp4 / "model.safetensors")
    E, I, H = spec_nvfp4.mlp.moe.num_experts, spec_nvfp4.mlp.moe.d_ff, spec_nvfp4.hidden_size
    for L in _moe_layers(spec_nvfp4):
        p = f"model.layers.{L}.mlp.experts"
        got = {k[len(p) + 1:]: v for k, v in full_nvfp4.items() if k.startswith(p + ".")}
        assert [(k, tuple(v.shape), v.dtype) for k, v in got.items()] == [
            ("gate_up_proj.weight", (E, 2 * I, H // 2), torch.uint8),
            ("gate_up_proj.weight_scale", (E, 2 * I, H // 16), torch.float8_e4m3fn),
            ("gate_up_proj.weight_scale_2", (E, 2), torch.float32),
            ("down_proj.weight", (E, H, I // 2), torch.uint8),
            ("down_proj.weight_scale", (E, H, I // 16), torch.float8_e4m3fn),
            ("down_proj.weight_scale_2", (E, 1), torch.float32)]

        def file(e, proj, part):
            return t[f"{p}.{e}.{proj}.{part}"]

        for e in range(E):
            for part in ("weight", "weight_scale"):
                gu = torch.cat([file(e, "gate_proj", part), file(e, "up_proj", part)])
                assert torch.equal(got[f"gate_up_proj.{part}"][e].view(torch.uint8), gu.view(torch.uint8))
                assert torch.equal(got[f"down_proj.{part}"][e].view(torch.uint8),
                                   file(e, "down_proj", part).view(torch.uint8))
            assert got["gate_up_proj.weight_scale_2"][e].tolist() == [file(e, "gate_proj", "weight_scale_2").item(),
                                                                      file(e, "up_proj", "weight_scale_2").item()]
            assert got["down_proj.weight_scale_2"][e].tolist() == [file(e, "down_proj", "weight_scale_2").item()]

        def deq(e, proj):
            q = f"{p}.{e}.{proj}"
            return nvfp4.dequantize(t[f"{q}.weight"], t[f"{q}.weight_scale"], t[f"{q}.weight_scale_2"])

        gate_up = torch.stack([torch.cat([deq(e, "gate_proj"), deq(e, "up_proj")]) for e in range(E)])
        down = torch.stack([deq(e, "down_proj") for e in range(E)])
        assert torch.equal(nvfp4.dequantize_stacked(*(got[f"gate_up_proj.{k}"] for k in NVFP4_STORAGE)), gate_up)
        assert torch.equal(nvfp4.dequantize_stacked(*(got[f"down_proj.{k}"] for k in NVFP4_STORAGE)), down)


def test_expert_graph_params_are_the_loaded_params(spec_nvfp4, spec_bf16, full_nvfp4, full_bf16):
    """expert_graph_params (what lowering declares) names exactly what the loader returns, in the same dtypes."""
    for spec, full in ((spec_nvfp4, full_nvfp4), (spec_bf16, full_bf16)):
        L = _moe_layers(spec)[0]
        infos = expert_graph_params(spec, L)
        assert [t.name for t in infos] == [k for k in full if k.startswith(f"model.layers.{L}.mlp.experts.")]
        for t in infos:
            assert (tuple(full[t.name].shape), str(full[t.name].dtype)) == (t.shape, f"torch.{t.dtype}"), t.name


def test_bad_tp(spec_bf16, ckpt_bf16):
    with pytest.raises(BeamcError, match="does not divide"):
        load_rank_weights(spec_bf16, ckpt_bf16, tp=3)


# ---------------------------------------------------------------- loader: checkpoints that do not fit


def _variant(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    """A copy of a single-file checkpoint with its tensors and/or config.json edited."""
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _load_error(spec, d) -> str:
    with pytest.raises(BeamcError) as e:
        load_rank_weights(spec, d)
    assert "Traceback" not in str(e.value)
    return str(e.value)


def test_every_tensor_problem_in_one_message(spec_bf16, ckpt_bf16, tmp_path):
    def edit(t):
        del t["model.layers.2.mlp.up_proj.weight"]
        t["model.layers.0.self_attn.extra.weight"] = torch.zeros(3)
        t["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(255, 256, dtype=torch.bfloat16)
        t["model.norm.weight"] = t["model.norm.weight"].float()

    msg = _load_error(spec_bf16, _variant(ckpt_bf16, tmp_path / "bad", edit))
    assert "missing tensors (1)" in msg and "model.layers.2.mlp.up_proj.weight" in msg
    assert "unexpected tensors (1)" in msg and "model.layers.0.self_attn.extra.weight" in msg
    assert "model.layers.1.self_attn.q_proj.weight: expected [256, 256], found [255, 256]" in msg
    assert "model.norm.weight: expected bfloat16, found float32" in msg


@pytest.mark.parametrize("kind", ["missing", "unexpected", "shape", "dtype"])
def test_single_tensor_problem(spec_bf16, ckpt_bf16, tmp_path, kind):
    name = "model.layers.4.self_attn.o_proj.weight"
    edits = {
        "missing": lambda t: t.pop(name),
        "unexpected": lambda t: t.update({"model.layers.4.self_attn.o_proj.bias": torch.zeros(256)}),
        "shape": lambda t: t.update({name: t[name][:, :128].contiguous()}),
        "dtype": lambda t: t.update({name: t[name].half()}),
    }
    msg = _load_error(spec_bf16, _variant(ckpt_bf16, tmp_path / kind, edits[kind]))
    want = {"missing": f"missing tensors (1):\n    {name}",
            "unexpected": "unexpected tensors (1):\n    model.layers.4.self_attn.o_proj.bias",
            "shape": f"{name}: expected [256, 256], found [256, 128]",
            "dtype": f"{name}: expected bfloat16, found float16"}[kind]
    assert want in msg


def test_long_lists_are_truncated(spec_bf16, ckpt_bf16, tmp_path):
    def edit(t):
        for k in [k for k in t if ".experts." in k][:25]:
            del t[k]

    msg = _load_error(spec_bf16, _variant(ckpt_bf16, tmp_path / "many", edit))
    assert "missing tensors (25)" in msg and "... and 15 more" in msg
    assert len(msg.splitlines()) < 20


def test_config_mismatch(spec_bf16, ckpt_bf16, tmp_path):
    d = _variant(ckpt_bf16, tmp_path / "cfg", edit_config=lambda c: c.update(hidden_size=512))
    msg = _load_error(spec_bf16, d)
    assert "hidden_size: spec has 256, config.json has 512" in msg
    assert f"beamc import-hf {d / 'config.json'}" in msg


def test_expert_format_mismatch_is_a_config_error(spec_nvfp4, ckpt_bf16):
    msg = _load_error(spec_nvfp4, ckpt_bf16)
    assert "quantization_config.quant_algo: spec has dtypes.experts = 'nvfp4', config.json has None" in msg
    assert "import-hf" in msg


def test_missing_dir_and_no_files(spec_bf16, tmp_path):
    assert "checkpoint directory not found" in _load_error(spec_bf16, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    assert "no safetensors files" in _load_error(spec_bf16, tmp_path / "empty")


def test_index_pointing_at_missing_file(spec_bf16, tmp_path):
    d = init_weights(TINY, tmp_path / "sharded", seed=0, experts="bf16", shard_bytes=SHARD)
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    msg = _load_error(spec_bf16, d)
    assert "model.safetensors.index.json" in msg and victim.name in msg


# ---------------------------------------------------------------- loader: non-finite values


def _poke(t: dict, name: str, idx: tuple, value: float) -> None:
    """Set one element of file tensor `name` (e4m3 NaN written as its bit pattern)."""
    v = t[name].clone()
    if v.dtype == torch.float8_e4m3fn:
        v.view(torch.uint8)[idx] = 0x7F
    else:
        v[idx] = value
    t[name] = v


def test_nonfinite_values_in_one_message(spec_nvfp4, ckpt_nvfp4, tmp_path):
    e = "model.layers.3.mlp.experts.5"

    def edit(t):
        _poke(t, "model.layers.1.self_attn.q_proj.weight", (3, 17), float("nan"))
        _poke(t, "model.layers.2.post_attention_layernorm.weight", (7,), float("inf"))
        t[f"{e}.up_proj.weight_scale_2"] = torch.tensor(float("nan"))
        _poke(t, f"{e}.down_proj.weight_scale", (4, 2), float("nan"))

    msg = _load_error(spec_nvfp4, _variant(ckpt_nvfp4, tmp_path / "nan", edit))
    assert "bad values (4):" in msg
    for line in ["model.layers.1.self_attn.q_proj.weight[3, 17] is nan (model.safetensors)",
                 "model.layers.2.post_attention_layernorm.weight[7] is inf (model.safetensors)",
                 f"{e}.up_proj.weight_scale_2 is nan (model.safetensors)",
                 f"{e}.down_proj.weight_scale[4, 2] is nan (model.safetensors)"]:
        assert f"\n    {line}" in msg, (line, msg)


def test_nonfinite_index_is_the_file_index_on_every_rank(spec_bf16, ckpt_bf16, tmp_path):
    """A rank checks its own slice and names the element in file coordinates; a rank without it loads."""
    def edit(t):
        _poke(t, "model.layers.1.self_attn.q_proj.weight", (200, 5), float("nan"))  # rows 128.. are rank 1's
        _poke(t, "model.layers.4.mlp.experts.2.up_proj.weight", (40, 3), float("-inf"))  # rows 32.. are rank 1's
        _poke(t, "model.layers.6.self_attn.o_proj.weight", (0, 0), float("inf"))  # column 0: rank 0's

    d = _variant(ckpt_bf16, tmp_path / "tp", edit)
    with pytest.raises(BeamcError) as e:
        load_rank_weights(spec_bf16, d, tp=2, rank=1)
    msg = str(e.value)
    assert "bad values (2):" in msg
    assert "model.layers.1.self_attn.q_proj.weight[200, 5] is nan" in msg
    assert "model.layers.4.mlp.experts.2.up_proj.weight[40, 3] is -inf" in msg
    with pytest.raises(BeamcError) as e:
        load_rank_weights(spec_bf16, d, tp=2, rank=0)
    assert "bad values (1):\n    model.layers.6.self_attn.o_proj.weight[0, 0] is inf" in str(e.value)


def test_many_nonfinite_tensors_are_capped(spec_bf16, ckpt_bf16, tmp_path):
    def edit(t):
        for k in [k for k in t if k.endswith("q_norm.weight") or k.endswith("k_norm.weight")]:
            _poke(t, k, (0,), float("nan"))

    msg = _load_error(spec_bf16, _variant(ckpt_bf16, tmp_path / "many", edit))
    assert "bad values (16):" in msg and "... and 6 more" in msg


# ---------------------------------------------------------------- loader: config.json against the spec


_ROPE_1E6 = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e6}, "full_attention": None}
_FULL_AT_0 = ["full_attention"] + ["sliding_attention"] * 4 + ["full_attention", "sliding_attention", "full_attention"]


@pytest.mark.parametrize("key, value, line", [
    ("routed_scaling_factor", 1.5, "routed_scaling_factor: spec has mlp.moe.routed_scaling = 2.5, config.json has 1.5"),
    ("rope_parameters", _ROPE_1E6, "rope_parameters.sliding_attention.rope_theta: spec has "
                                   "attention.sliding.rope.theta = 10000.0, config.json has 1000000.0"),
    ("sliding_window", 32, "sliding_window: spec has attention.sliding.window = 16, config.json has 32"),
    ("rms_norm_eps", 1e-5, "rms_norm_eps: spec has attention.qk_norm.eps = 1e-06, config.json has 1e-05"),
    ("num_experts_per_tok", 2, "num_experts_per_tok: spec has mlp.moe.top_k = 4, config.json has 2"),
    ("n_group", 2, "n_group: spec has mlp.moe.n_group = 4, config.json has 2"),
    ("topk_group", 1, "topk_group: spec has mlp.moe.topk_group = 2, config.json has 1"),
    ("norm_topk_prob", False, "norm_topk_prob: spec has mlp.moe.renormalize = True, config.json has False"),
    ("final_logit_softcapping", None, "final_logit_softcapping: spec has logits.softcap = 30.0, config.json has None"),
    ("max_position_embeddings", 4096, "max_position_embeddings: spec has 1024, config.json has 4096"),
    ("dtype", "float16", "dtype: spec has dtypes.activations = 'bfloat16', config.json has 'float16'"),
    ("layer_types", _FULL_AT_0, "layer_types[0]: spec has 'sliding_attention', config.json has 'full_attention'"),
    ("mlp_layer_types", ["dense"] * 4 + ["sparse"] * 4,
     "mlp_layer_types[3]: spec has 'sparse', config.json has 'dense'"),
    ("tie_word_embeddings", True,
     "tie_word_embeddings: spec has logits.tie_word_embeddings = False, config.json has True"),
])
def test_config_key_mismatch(spec_bf16, ckpt_bf16, tmp_path, key, value, line):
    msg = _load_error(spec_bf16, _variant(ckpt_bf16, tmp_path / "cfg", edit_config=lambda c: c.update({key: value})))
    assert f"keys that differ (1):\n    {line}" in msg, msg


def test_config_mismatches_all_in_one_error(spec_bf16, ckpt_bf16, tmp_path):
    edits = {"routed_scaling_factor": 1.0, "sliding_window": 8, "num_experts_per_tok": 3, "hidden_size": 512,
             "final_logit_softcapping": 50.0}
    msg = _load_error(spec_bf16, _variant(ckpt_bf16, tmp_path / "cfg", edit_config=lambda c: c.update(edits)))
    assert "keys that differ (5):" in msg
    assert all(f"\n    {k}: spec has" in msg for k in edits), msg


@pytest.mark.parametrize("edit, expected", [
    ({"hidden_act": "gelu"}, "hidden_act: is 'gelu'; Beam's MLPs are SwiGLU"),
    ({"attention_bias": True}, "attention_bias: Beam's q/k/v/o projections have no bias"),
    ({"rope_theta": 1e6}, "rope_theta: (1000000.0) differs from rope_parameters.sliding_attention.rope_theta"),
    ({"model_type": "llama"}, "model_type: is 'llama'"),
])
def test_config_import_hf_rejects_is_a_load_error(spec_bf16, ckpt_bf16, tmp_path, edit, expected):
    d = _variant(ckpt_bf16, tmp_path / "cfg", edit_config=lambda c: c.update(edit))
    assert f"{d / 'config.json'}: {expected}" in _load_error(spec_bf16, d)


def test_config_differences_that_do_not_matter(spec_bf16, ckpt_bf16, full_bf16, tmp_path):
    """initializer_range (only draws random weights), an FP8 KV cache (the server's choice), keys beamc does not
    read, and a config.json without dtype (the tensors' dtypes are checked one by one) all load."""
    def edit(c):
        c.update(initializer_range=0.5, use_cache=False, attention_dropout=0.1, architectures=["X"],
                 quantization_config={"quant_method": "modelopt", "quant_algo": None, "kv_cache_quant_algo": "FP8"})
        del c["dtype"]

    loaded = load_rank_weights(spec_bf16, _variant(ckpt_bf16, tmp_path / "cfg", edit_config=edit))
    assert torch.equal(loaded["lm_head.weight"], full_bf16["lm_head.weight"])
    (tmp_path / "cfg" / "config.json").unlink()  # no config.json at all: the tensor check alone
    assert set(load_rank_weights(spec_bf16, tmp_path / "cfg")) == set(full_bf16)


# ---------------------------------------------------------------- loader: TP rule of the stacked experts' gate_up


@pytest.fixture(scope="session")
def hf_bf16(ckpt_bf16):
    from transformers import BeamForCausalLM

    return BeamForCausalLM.from_pretrained(ckpt_bf16, dtype=torch.bfloat16)


def test_tp_expert_gate_up_is_split_halves_of_transformers_weight(spec_bf16, ckpt_bf16, hf_bf16):
    """transformers' BeamExperts.gate_up_proj is [E, 2I, H] with the gate rows first (its forward chunks the output
    in two: gate, up). A TP-2 rank holds its share of the gate rows, then its share of the up rows: the
    "split_halves" rule, element for element."""
    tp, I = 2, spec_bf16.mlp.moe.d_ff
    step = I // tp
    for L in _moe_layers(spec_bf16)[:2]:
        info = expert_graph_params(spec_bf16, L)[0]
        assert info.name == f"model.layers.{L}.mlp.experts.gate_up_proj" and info.shard.kind == "split_halves"
        full = hf_bf16.model.layers[L].mlp.experts.gate_up_proj.detach()
        assert full.shape == info.shape
        for r in range(tp):
            got = load_rank_weights(spec_bf16, ckpt_bf16, tp=tp, rank=r)[info.name]
            want = torch.cat([full[:, r * step:(r + 1) * step], full[:, I + r * step:I + (r + 1) * step]], dim=1)
            assert got.shape == rank_shape(spec_bf16, info, tp, r) == (16, 2 * step, 256)
            assert torch.equal(got, want)
            assert torch.equal(take_rank_slice(full, shard_range(spec_bf16, info, tp, r)), want)


# ---------------------------------------------------------------- loader: fp8 KV cache scales


def _with_dtypes(spec, name: str, **dtypes):
    data = spec.model_dump()
    data["dtypes"].update(dtypes)
    return parse_spec(data, name)


@pytest.fixture(scope="session")
def spec_fp8kv(spec_nvfp4):
    return _with_dtypes(spec_nvfp4, "fp8-kv", kv_cache="fp8")


@pytest.fixture(scope="session")
def ckpt_fp8kv(spec_fp8kv, tmp_path_factory):
    return init_weights(spec_fp8kv, tmp_path_factory.mktemp("fp8kv"), seed=0)


def _kv_names(spec):
    return [t.name for L in range(spec.num_layers) for t in kv_scale_params(spec, L)]


def test_fp8_kv_scales_are_written_and_loaded(spec_fp8kv, ckpt_fp8kv, spec_nvfp4, full_nvfp4):
    t = load_file(ckpt_fp8kv / "model.safetensors")
    q = json.loads((ckpt_fp8kv / "hf_quant_config.json").read_text())["quantization"]
    assert q["kv_cache_quant_algo"] == "FP8" and q["quant_algo"] == "NVFP4"
    names = _kv_names(spec_fp8kv)
    assert len(names) == 2 * spec_fp8kv.num_layers and names[:2] == ["model.layers.0.self_attn.k_scale",
                                                                     "model.layers.0.self_attn.v_scale"]
    w = load_rank_weights(spec_fp8kv, ckpt_fp8kv, tp=2, rank=1, dtype=torch.bfloat16)
    for n in names:
        assert w[n].shape == () and w[n].dtype == torch.float32 and torch.equal(w[n], t[n]), n
        assert 2 / 448 <= w[n].item() <= 20 / 448, n  # amax / 448 with amax 2..20
    # other tensors are those of the same seed without KV scales
    assert torch.equal(load_rank_weights(spec_fp8kv, ckpt_fp8kv)["lm_head.weight"], full_nvfp4["lm_head.weight"])
    # a bf16 cache ignores them (not unexpected, not returned)
    assert kv_scale_params(spec_nvfp4, 0) == []
    assert set(load_rank_weights(spec_nvfp4, ckpt_fp8kv)) == set(full_nvfp4)


def test_kv_scales_missing_or_under_the_projection_names(spec_fp8kv, ckpt_fp8kv, tmp_path):
    p0, p1 = "model.layers.0.self_attn", "model.layers.1.self_attn"
    t = load_file(ckpt_fp8kv / "model.safetensors")

    def edit(t):
        del t[f"{p0}.k_scale"], t[f"{p0}.v_scale"]
        t[f"{p1}.k_proj.k_scale"] = t.pop(f"{p1}.k_scale")
        t[f"{p1}.v_proj.v_scale"] = t.pop(f"{p1}.v_scale").reshape(1).bfloat16()

    w = load_rank_weights(spec_fp8kv, _variant(ckpt_fp8kv, tmp_path / "kv", edit))
    assert w[f"{p0}.k_scale"].item() == w[f"{p0}.v_scale"].item() == 1.0
    assert torch.equal(w[f"{p1}.k_scale"], t[f"{p1}.k_scale"])
    assert w[f"{p1}.v_scale"].shape == () and w[f"{p1}.v_scale"] == t[f"{p1}.v_scale"].bfloat16().float()


def test_bad_kv_scales(spec_fp8kv, ckpt_fp8kv, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_scale"] = torch.tensor(0.0)
        t["model.layers.1.self_attn.v_scale"] = torch.tensor(-0.5)
        t["model.layers.2.self_attn.k_scale"] = torch.tensor(float("nan"))

    msg = _load_error(spec_fp8kv, _variant(ckpt_fp8kv, tmp_path / "kv", edit))
    assert "bad values (3):" in msg
    assert "model.layers.2.self_attn.k_scale is nan (model.safetensors)" in msg
    assert "model.layers.0.self_attn.k_scale is 0.0; a KV cache scale must be > 0" in msg
    assert "model.layers.1.self_attn.v_scale is -0.5; a KV cache scale must be > 0" in msg
    shaped = _variant(ckpt_fp8kv, tmp_path / "shape",
                      lambda t: t.update({"model.layers.3.self_attn.v_scale": torch.ones(2)}))
    assert "model.layers.3.self_attn.v_scale: expected a scalar ([] or [1]), found [2]" in _load_error(spec_fp8kv,
                                                                                                       shaped)


# ---------------------------------------------------------------- float32 / float16 checkpoints


_ALL_WEIGHTS = ("activations", "embeddings", "attention_weights", "dense_mlp_weights", "norm_weights", "lm_head",
                "experts")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_unquantized_checkpoint_in_any_float_dtype_matches_transformers(spec_nvfp4, tmp_path, dtype):
    from transformers import BeamForCausalLM

    from beamc.spec.hf import hf_config_to_spec

    spec = _with_dtypes(spec_nvfp4, f"tiny-{dtype}", **{k: dtype for k in _ALL_WEIGHTS})
    d = init_weights(spec, tmp_path / dtype, seed=0)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["dtype"] == dtype and "quantization_config" not in cfg
    assert hf_config_to_spec(cfg, spec.name).dtypes == spec.dtypes  # import-hf gives the experts that dtype too
    ours = load_rank_weights(spec, d)
    L = _moe_layers(spec)[0]
    assert ours[f"model.layers.{L}.mlp.experts.gate_up_proj"].dtype == getattr(torch, dtype)
    model, info = BeamForCausalLM.from_pretrained(d, dtype=getattr(torch, dtype), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    sd = model.state_dict()
    assert set(ours) == set(sd)
    for name, v in ours.items():
        assert v.dtype == sd[name].dtype and torch.equal(v, sd[name]), name


def test_with_experts_accepts_fp16_fp32(spec_nvfp4):
    assert with_experts(spec_nvfp4, "fp32").dtypes.experts == "float32"
    assert with_experts(spec_nvfp4, "fp16").dtypes.experts == "float16"
    with pytest.raises(BeamcError, match="must be nvfp4, bf16, fp16 or fp32"):
        with_experts(spec_nvfp4, "int8")


# ---------------------------------------------------------------- vocab padding for TP


@pytest.fixture(scope="session")
def spec_v1000(spec_bf16):
    """A tiny spec whose dims split 3 ways except the vocab (1000 = 3 * 333 + 1)."""
    data = spec_bf16.model_dump()
    data.update(vocab_size=1000, hidden_size=96, num_layers=4)
    data["attention"].update(num_heads=6, num_kv_heads=3, head_dim=16)
    data["attention"]["sliding"]["rope"]["rotary_dim"] = 16
    data["mlp"]["dense"]["d_ff"] = 192
    data["mlp"]["moe"]["d_ff"] = 48
    return parse_spec(data, "vocab-1000")


def test_vocab_not_divisible_by_tp_is_padded(spec_v1000, tmp_path):
    d = init_weights(spec_v1000, tmp_path / "v1000", seed=0)
    full = load_rank_weights(spec_v1000, d)
    ranks = [load_rank_weights(spec_v1000, d, tp=3, rank=r) for r in range(3)]
    for r, w in enumerate(ranks):
        dims = rank_dims(spec_v1000, 3, r)
        assert (dims.vocab, dims.vocab_valid, dims.vocab_size) == (334, [334, 334, 332][r], 1000)
        assert w["lm_head.weight"].shape == (334, 96)
        assert torch.equal(w["model.embed_tokens.weight"], full["model.embed_tokens.weight"])  # replicated
    heads = torch.cat([w["lm_head.weight"] for w in ranks])
    assert torch.equal(heads[:1000], full["lm_head.weight"])
    assert torch.all(heads[1000:] == 0) and heads.shape == (1002, 96)
    assert (rank_dims(spec_v1000, 1).vocab, rank_dims(spec_v1000, 1).vocab_valid) == (1000, 1000)


# ---------------------------------------------------------------- CLI


def _beamc(*args):
    exe = shutil.which("beamc")
    assert exe, "beamc is not on PATH (pip install -e .)"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_cli_init_weights(tmp_path, spec_bf16, full_bf16):
    r = _beamc("init-weights", "models/beam-tiny.yaml", "-o", tmp_path / "ck", "--experts", "bf16")
    assert r.returncode == 0, r.stderr
    loaded = load_rank_weights(spec_bf16, tmp_path / "ck")
    assert torch.equal(loaded["model.embed_tokens.weight"], full_bf16["model.embed_tokens.weight"])


def test_cli_bad_input_exits_2(tmp_path, capsys, monkeypatch):
    from beamc.cli import main

    monkeypatch.chdir(ROOT)  # in-process: an uncaught exception would fail the test with its traceback
    assert main(["init-weights", "models/no-such.yaml", "-o", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert "not found" in err and "Traceback" not in err
    assert main(["init-weights", "models/beam.yaml", "-o", str(tmp_path / "big")]) == 2
    err = capsys.readouterr().err
    assert "GiB" in err and "--force" in err and "Traceback" not in err


def test_progress_bar_counts_every_byte_of_the_rank(spec_nvfp4, ckpt_nvfp4, monkeypatch):
    """`progress=True`: a rich bar (stderr) advanced by each tensor read; it ends at the rank's total bytes."""
    from beamc.checkpoint import loader

    seen = {}
    real_exit = loader._Progress.__exit__

    def record(self, *exc):
        seen.update(total=self.total, done=self.bar.tasks[0].completed)
        real_exit(self, *exc)

    monkeypatch.setattr(loader._Progress, "__exit__", record)
    w = load_rank_weights(spec_nvfp4, ckpt_nvfp4, tp=2, rank=1, progress=True)
    assert seen["total"] > 0 and seen["done"] == seen["total"] == sum(t.numel() * t.element_size()
                                                                         for t in w.values())
