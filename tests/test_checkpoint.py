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
from beamc.checkpoint.loader import load_rank_weights
from beamc.errors import BeamcError
from beamc.spec import load_spec

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
    init_weights(TINY, tmp_path, seed=0, experts="bf16")
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


def test_dtypes(spec_bf16, ckpt_bf16, spec_nvfp4, ckpt_nvfp4):
    router = ("mlp.gate.weight", "e_score_correction_bias")
    for spec, d in ((spec_bf16, ckpt_bf16), (spec_nvfp4, ckpt_nvfp4)):
        as_file = load_rank_weights(spec, d)
        bf16 = load_rank_weights(spec, d, dtype=torch.bfloat16)
        fp32 = load_rank_weights(spec, d, dtype=torch.float32)
        for k in as_file:
            is_router = k.endswith(router)
            assert fp32[k].dtype == torch.float32, k
            assert bf16[k].dtype == (torch.float32 if is_router else torch.bfloat16), k
            if "experts" in k:
                assert as_file[k].dtype == (torch.bfloat16 if spec is spec_bf16 else torch.float32), k
            else:
                assert as_file[k].dtype == (torch.float32 if is_router else torch.bfloat16), k
            assert torch.equal(fp32[k], as_file[k].float()), k


def _expected_split(name: str) -> int | None:
    """The dim tensor parallelism splits a graph param along (None: replicated), written out from the TP plan."""
    if name.endswith(("q_proj.weight", "self_attn.gate_proj.weight", "gate_bias", "mlp.gate_proj.weight",
                      "mlp.up_proj.weight", "lm_head.weight", "k_proj.weight", "v_proj.weight")):
        return 0
    if name.endswith(("o_proj.weight", "mlp.down_proj.weight")):
        return 1
    if name.endswith("experts.down_proj"):
        return 2
    return None


def _check_ranks(spec, d, full, tp):
    ranks = [load_rank_weights(spec, d, tp=tp, rank=r) for r in range(tp)]
    I = spec.mlp.moe.d_ff // tp
    for name, want in full.items():
        parts = [r[name] for r in ranks]
        if name.endswith("experts.gate_up_proj"):  # each rank: its gate rows, then its up rows
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
        assert torch.equal(got, want), (name, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_slices_concatenate_to_full_bf16(spec_bf16, ckpt_bf16, full_bf16, tp):
    _check_ranks(spec_bf16, ckpt_bf16, full_bf16, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_slices_concatenate_to_full_nvfp4(spec_nvfp4, ckpt_nvfp4, full_nvfp4, tp):
    _check_ranks(spec_nvfp4, ckpt_nvfp4, full_nvfp4, tp)


def test_nvfp4_experts_are_dequantised_file_tensors(spec_nvfp4, ckpt_nvfp4, full_nvfp4):
    t = load_file(ckpt_nvfp4 / "model.safetensors")
    for L in _moe_layers(spec_nvfp4):
        p = f"model.layers.{L}.mlp.experts"

        def deq(e, proj):
            q = f"{p}.{e}.{proj}"
            return nvfp4.dequantize(t[f"{q}.weight"], t[f"{q}.weight_scale"], t[f"{q}.weight_scale_2"])

        E = spec_nvfp4.mlp.moe.num_experts
        gate_up = torch.stack([torch.cat([deq(e, "gate_proj"), deq(e, "up_proj")]) for e in range(E)])
        down = torch.stack([deq(e, "down_proj") for e in range(E)])
        assert torch.equal(full_nvfp4[f"{p}.gate_up_proj"], gate_up)
        assert torch.equal(full_nvfp4[f"{p}.down_proj"], down)
    assert full_nvfp4[f"{p}.gate_up_proj"].dtype == torch.float32


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
    assert "dtypes.experts = nvfp4" in msg and "import-hf" in msg


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
