"""The interpreter and the IR refuse what would be a silently wrong result: swapped state write-backs, cache
overruns (checked before anything is written), contexts past the spec's limit, non-finite activations; the spec
fields that change numerics really change them (as the matching transformers variant does)."""
from __future__ import annotations

import json

import pytest
import torch

from beamc.errors import BeamcError
from beamc.ir.lower import LowerOptions, lower
from beamc.ir.verify import VerifyError, verify
from beamc.runtime.interpret import Interpreter
from beamc.runtime.kv_cache import alloc_states
from beamc.runtime.session import ReferenceSession
from conftest import hf_logits, hf_model, rel_err, spec_variant


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _variant(spec, **changes):
    """The spec with nested fields changed: _variant(s, **{"attention.sliding.window": 5})."""
    return spec_variant(spec, changes)


@pytest.fixture(scope="module")
def weights(tiny_spec, tiny_ckpt_nvfp4):
    from beamc.checkpoint.loader import load_rank_weights

    return [load_rank_weights(tiny_spec, tiny_ckpt_nvfp4, dtype=torch.float32)]


# ---------------------------------------------------------------- verifier: state write-back
def test_verify_refuses_k_and_v_written_back_swapped(tiny_spec):
    g = lower(tiny_spec, LowerOptions(dtype="f32"))
    g.state_out["kv.0.k"], g.state_out["kv.0.v"] = g.state_out["kv.0.v"], g.state_out["kv.0.k"]
    with pytest.raises(VerifyError, match="state_out kv.0.k is .* which holds state kv.0.v, not kv.0.k"):
        verify(g)


def test_verify_refuses_a_cache_written_back_as_another_layers(tiny_spec):
    g = lower(tiny_spec, LowerOptions(dtype="f32"))
    g.state_out["kv.1.k"] = g.state_out["kv.2.k"]
    with pytest.raises(VerifyError, match="state_out kv.1.k .* holds state kv.2.k"):
        verify(g)


def test_verify_refuses_a_non_state_written_back(tiny_spec):
    g = lower(tiny_spec, LowerOptions(dtype="f32"))
    g.state_out["kv.0.k"] = g.outputs["logits"]
    with pytest.raises(VerifyError, match="not a state buffer"):
        verify(g)


# ---------------------------------------------------------------- caches
def test_a_too_small_cache_is_refused_before_anything_is_written(tiny_spec, weights):
    g = lower(tiny_spec, LowerOptions(dtype="f32"))
    states = [alloc_states(g, {"S": 1, "Cs": 20, "P": 4, "MP": 4})]
    for t in states[0].values():
        t.fill_(7.0)
    before = {k: v.clone() for k, v in states[0].items()}
    inputs = {"input_ids": torch.arange(30), "positions": torch.arange(30), "slots": torch.zeros(30, dtype=torch.long),
              "block_table": torch.arange(4, dtype=torch.int32).view(1, 4)}
    with pytest.raises(BeamcError, match="slot 0 needs positions 0..29 in one step but the cache holds 20"):
        Interpreter([g], weights).run(inputs, states)
    assert all(torch.equal(before[k], states[0][k]) for k in before)  # nothing was overwritten


def test_repeated_positions_in_one_step_are_refused(tiny_spec, weights):
    """Two tokens of one slot at one position would scatter to one cache row: nondeterministic on CUDA."""
    g = lower(tiny_spec, LowerOptions(dtype="f32"))
    states = [alloc_states(g, {"S": 1, "Cs": 40, "P": 4, "MP": 4})]
    inputs = {"input_ids": torch.arange(4), "positions": torch.tensor([0, 1, 1, 2]), "slots": torch.zeros(4, dtype=torch.long),
              "block_table": torch.arange(4, dtype=torch.int32).view(1, 4)}
    with pytest.raises(BeamcError, match="twice in one step"):
        Interpreter([g], weights).run(inputs, states)


def test_context_past_max_position_embeddings_is_refused(tiny_spec, weights):
    short = _variant(tiny_spec, max_position_embeddings=24)
    with pytest.raises(BeamcError, match="max_len: 64 exceeds the spec's max_position_embeddings"):
        ReferenceSession(short, weights, max_len=64)
    sess = ReferenceSession(short, weights, max_len=24, max_chunk=20)
    sess.prefill([(0, list(range(20)))])
    with pytest.raises(BeamcError, match=r"length 25 exceeds the spec's max_position_embeddings \(24\) \(raise "
                                         r"max_position_embeddings in the spec\)"):
        sess.prefill([(0, list(range(5)))])
    assert sess.lengths[0] == 20


def test_fp8_cache_scales_keep_values_past_448(tiny_spec):
    """A plain e4m3 cast saturates at +-448; with the layer's k/v scale the cache holds x / scale and reads back
    x to e4m3's precision."""
    from beamc.ir.reference import kv_load, kv_write_ref

    kc = torch.zeros(1, 8, 2, 32, dtype=torch.float8_e4m3fn)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, 2, 32) * 2000.0
    v = torch.randn(3, 2, 32) * 900.0
    ks, vs = k.abs().max() / 448.0, v.abs().max() / 448.0
    slot, pos = torch.zeros(3, dtype=torch.long), torch.arange(3)
    kv_write_ref(kc, vc, k, v, slot, pos, ks, vs)
    for cache, x, s in ((kc, k, ks), (vc, v, vs)):
        back = kv_load(cache[0, :3], s)
        assert x.abs().max() > 448 and ((back - x).abs() <= x.abs() * 2 ** -4 + s * 2 ** -9).all()


def test_fp8_graph_reads_the_layers_kv_scales(tiny_spec):
    fp8 = _variant(tiny_spec, **{"dtypes.kv_cache": "fp8"})
    g = lower(fp8, LowerOptions())
    node = next(n for n in g.nodes if n.op == "kv_write")
    assert [v.producer.attrs["name"] for v in node.inputs[6:]] == [
        "model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale"]
    attn = next(n for n in g.nodes if n.op == "attention")
    assert attn.inputs[5:] == node.inputs[6:]


# ---------------------------------------------------------------- the IR says what kernels read
def test_nvfp4_experts_enter_the_graph_as_stored(tiny_spec):
    g = lower(tiny_spec, LowerOptions())
    node = next(n for n in g.nodes if n.op == "moe_experts")
    assert node.attrs["format"] == "nvfp4"
    assert [v.dtype for v in node.inputs[2:]] == ["e2m1x2", "f8e4m3", "f32", "e2m1x2", "f8e4m3", "f32"]
    H, I, E = tiny_spec.hidden_size, tiny_spec.mlp.moe.d_ff, tiny_spec.mlp.moe.num_experts
    assert node.inputs[2].shape == (E, 2 * I, H // 2) and node.inputs[3].shape == (E, 2 * I, H // 16)


# ---------------------------------------------------------------- non-finite activations
def test_a_non_finite_activation_names_the_op_and_layer(tiny_spec, weights):
    w = {k: v.clone() for k, v in weights[0].items()}
    w["model.layers.2.post_attention_layernorm.weight"][5] = float("inf")
    sess = ReferenceSession(tiny_spec, [w], max_len=32, max_chunk=16)
    with pytest.raises(BeamcError, match=r"layer 2, op rmsnorm \(value L2.post_attn_norm.*non-finite"):
        sess.prefill([(0, list(range(8)))])
    assert sess.lengths[0] == 0


# ---------------------------------------------------------------- spec fields that change numerics
def test_weight_form_one_plus_w_matches_the_gemma_style_norm(tiny_spec, tiny_spec_bf16, tiny_ckpt, monkeypatch):
    """weight_form "1+w" everywhere: transformers' Beam with its RMSNorm computing (1 + w) * x_hat."""
    import transformers.models.beam.modeling_beam as mb

    spec = _variant(tiny_spec_bf16, **{"norm.weight_form": "1+w", "attention.qk_norm.weight_form": "1+w"})

    def gemma_norm(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return ((1.0 + self.weight.float()) * h).to(x.dtype)

    monkeypatch.setattr(mb.BeamRMSNorm, "forward", gemma_norm)
    ids = _ids(spec.vocab_size, 24, 11)
    ref = hf_logits(hf_model(tiny_ckpt, torch.float32), ids)
    ours = ReferenceSession.from_checkpoint(spec, tiny_ckpt, max_len=32, max_chunk=32).prefill([(0, ids)])[0]
    plain = ReferenceSession.from_checkpoint(tiny_spec_bf16, tiny_ckpt, max_len=32, max_chunk=32).prefill([(0, ids)])[0]
    assert rel_err(ours, ref) < 1e-5 and rel_err(plain, ref) > 1e-2


def test_window_excluding_current_sees_one_more_key(tiny_spec_bf16, tiny_ckpt, tmp_path):
    """window_includes_current: false means keys [pos - window, pos]: transformers with sliding_window + 1, which is
    what the spec's config.json says (spec_to_hf_config; the loader refuses the tiny checkpoint's own config.json,
    whose window is one key shorter)."""
    import json
    import shutil

    from beamc.spec.hf import spec_to_hf_config

    spec = _variant(tiny_spec_bf16, **{"attention.sliding.window_includes_current": False})
    assert spec.effective_window == tiny_spec_bf16.attention.sliding.window + 1
    with pytest.raises(BeamcError, match="sliding_window"):
        ReferenceSession.from_checkpoint(spec, tiny_ckpt)
    ckpt = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    (ckpt / "config.json").write_text(json.dumps(spec_to_hf_config(spec)))
    assert json.loads((ckpt / "config.json").read_text())["sliding_window"] == spec.effective_window
    ids = _ids(spec.vocab_size, 40, 12)
    ours = ReferenceSession.from_checkpoint(spec, ckpt, max_len=48, max_chunk=40).prefill([(0, ids)])[0]
    same = ReferenceSession.from_checkpoint(tiny_spec_bf16, tiny_ckpt, max_len=48, max_chunk=40).prefill([(0, ids)])[0]
    ref = hf_logits(hf_model(ckpt, torch.float32), ids)
    assert rel_err(ours, ref) < 1e-5 and rel_err(same, ref) > 1e-4


@pytest.mark.parametrize("path,value", [("residual.round_operands", False),
                                        ("attention.sliding.rope.table_dtype", "bfloat16"),
                                        ("mlp.dense.act_dtype", "bfloat16"), ("mlp.moe.act_dtype", "float16"),
                                        ("norm.compute_dtype", "bfloat16"), ("logits.softcap_dtype", "bfloat16")])
def test_unsupported_numerics_fields_are_refused_not_ignored(tiny_spec, path, value):
    with pytest.raises(BeamcError, match=path.replace(".", r"\.")):
        _variant(tiny_spec, **{path: value})


def test_a_vocabulary_tp_does_not_divide_is_padded_and_cut(tiny_spec, tmp_path):
    """vocab 509 at TP 2: each rank holds 255 lm_head rows (the last one zero on rank 1); the gathered logits are cut
    back to 509 columns and equal TP 1's."""
    from beamc.checkpoint.init import init_weights

    spec = _variant(tiny_spec, vocab_size=509)
    init_weights(spec, tmp_path / "ck", seed=3)
    g = lower(spec, LowerOptions(tp=2, rank=1))
    assert next(n for n in g.nodes if n.op == "param" and n.attrs["name"] == "lm_head.weight").out.shape[0] == 255
    ids = _ids(509, 20, 4)
    one = ReferenceSession.from_checkpoint(spec, tmp_path / "ck", max_len=32, max_chunk=20).prefill([(0, ids)])[0]
    two = ReferenceSession.from_checkpoint(spec, tmp_path / "ck", tp=2, max_len=32, max_chunk=20).prefill([(0, ids)])[0]
    assert one.shape == two.shape == (20, 509) and rel_err(two, one) < 1e-5


def test_compile_plans_without_torch(tmp_path):
    """Op signatures are apart from their torch references: `beamc compile` (planning, report, package) never
    imports torch or triton."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = (
        "import builtins, sys\n"
        "real = builtins.__import__\n"
        "def imp(name, *a, **k):\n"
        "    if name.split('.')[0] in ('torch', 'triton'):\n"
        "        raise ImportError('blocked ' + name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = imp\n"
        "from beamc.cli import main\n"
        f"sys.exit(main(['compile', {str(root / 'models/beam.yaml')!r}, '--tp', '8', '--report']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "in launch order: 7 ops" in r.stdout  # (attention_gate: the gate in attention; qk_attention: the norms)


def test_logits_refuses_a_batch_longer_than_the_spec_allows(tmp_path, capsys):
    import json
    from pathlib import Path

    from beamc.cli import main

    root = Path(__file__).resolve().parents[1]
    batch = tmp_path / "b.json"
    batch.write_text(json.dumps({"sequences": [[7] * 1000], "decode_steps": 30}))
    assert main(["logits", str(root / "models/beam-tiny.yaml"), "--checkpoint", str(tmp_path), "--input", str(batch),
                 "-o", str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("1000 tokens + 30 decode steps exceed the spec's max_position_embeddings (1024) (shorten the "
                        "input or raise max_position_embeddings in the spec)") and "\n" not in err


# ---------------------------------------------------------------- paged full-layer caches
def _paged_step(spec, weights, block_table, positions, pages=4):
    g = lower(spec, LowerOptions(dtype="f32"))
    S, MP = block_table.shape
    states = [alloc_states(g, {"S": S, "Cs": 40, "P": pages, "MP": MP})]
    for t in states[0].values():
        t.fill_(3.0)
    before = {k: v.clone() for k, v in states[0].items()}
    T = len(positions)
    inputs = {"input_ids": torch.arange(T), "positions": torch.tensor(positions), "slots": torch.zeros(T, dtype=torch.long),
              "block_table": block_table}
    return Interpreter([g], weights), inputs, states, before


def test_full_layers_keep_their_cache_in_pages_of_a_pool(tiny_spec, weights):
    """Full layers' K/V [P, page, kv, d] addressed through the block table: a sequence given pages 3 and 1 (in that
    order) writes positions 0..15 into page 3 and 16..19 into page 1, and nothing else."""
    g = lower(tiny_spec, LowerOptions(dtype="f32"))
    full = [L for L, t in enumerate(tiny_spec.attention_types) if t == "full_attention"][0]
    assert g.leaves("state")[f"kv.{full}.k"].out.shape[:2] == ("P", 16)
    interp, inputs, states, before = _paged_step(tiny_spec, weights, torch.tensor([[3, 1]], dtype=torch.int32),
                                                 list(range(20)))
    interp.run(inputs, states)
    k, k0 = states[0][f"kv.{full}.k"], before[f"kv.{full}.k"]
    assert not torch.equal(k[3], k0[3]) and not torch.equal(k[1, :4], k0[1, :4])
    assert torch.equal(k[1, 4:], k0[1, 4:]) and torch.equal(k[0], k0[0]) and torch.equal(k[2], k0[2])


@pytest.mark.parametrize("table,positions,match", [
    ([[0, 1]], list(range(40)), "position 32 needs page 2 of its block table, which has 2"),
    ([[0, 9]], list(range(20)), "its block table points at page 9, outside the pool of 4 pages"),
    ([[0, -1]], list(range(20)), "points at page -1"),
])
def test_a_bad_block_table_is_refused_before_anything_is_written(tiny_spec, weights, table, positions, match):
    interp, inputs, states, before = _paged_step(tiny_spec, weights, torch.tensor(table, dtype=torch.int32), positions)
    with pytest.raises(BeamcError, match=match):
        interp.run(inputs, states)
    assert all(torch.equal(before[k], states[0][k]) for k in before)


def test_routing_margin_measures_the_distance_to_a_tie():
    """moe_select_margin: the gap at the group cut and at the expert cut (in choice values), inf with nothing left to
    choose; the tests' guard for fp32 kernels that may break a near-tie the other way."""
    from beamc.ir.reference import moe_select_margin, moe_select_ref

    a = dict(n_group=2, topk_group=1, top_k=1, renormalize=True, eps=1e-20)
    bias = torch.zeros(4)
    logit = lambda p: torch.logit(torch.tensor(p, dtype=torch.float64)).float()  # noqa: E731 - choice value p
    # groups {0, 1} and {2, 3}: group scores 0.9 + 0.5 vs 0.8 + 0.7 (gap ~0.1); in the kept group 0.8 vs 0.7
    x = torch.stack([logit(0.9), logit(0.5), logit(0.8), logit(0.7)])[None]
    m = moe_select_margin(x, bias, a)
    assert moe_select_ref(x, bias, a)[1].tolist() == [[2]]
    assert abs(float(m) - 0.1) < 1e-6
    x2 = torch.stack([logit(0.9), logit(0.6), logit(0.8), logit(0.7)])[None]  # groups tie (1.5 / 1.5)
    assert float(moe_select_margin(x2, bias, a)) < 1e-6
    every = dict(a, topk_group=2, top_k=4)  # every expert chosen: nothing to flip
    assert moe_select_margin(x, bias, every).isinf().all()


def test_tp_checks_skip_the_experts_of_a_spec_without_moe_layers(tiny_spec):
    """A spec whose layers are all dense holds no experts: their d_ff / NVFP4 group split does not limit --tp."""
    from beamc.checkpoint.layout import check_tp

    with pytest.raises(BeamcError, match="NVFP4"):
        check_tp(tiny_spec, 8)  # the tiny spec's experts: d_ff 64 / 8 = 8, less than one group of 16
    dense = _variant(tiny_spec, **{"layers.dense_first": 8})
    assert "sparse" not in dense.mlp_types
    check_tp(dense, 8)


def test_tied_embeddings_at_tp2_compute_every_logit_on_each_rank(tiny_spec, tmp_path):
    """Tied embeddings at --tp > 1: the replicated embedding matrix is each rank's lm_head (no vocabulary gather);
    the tp-2 logits equal tp 1's (fp32)."""
    from beamc.checkpoint.init import init_weights

    tied = _variant(tiny_spec, **{"logits.tie_word_embeddings": True})
    g = lower(tied, LowerOptions(tp=2, dtype="f32"))
    assert not [n for n in g.nodes if n.op == "all_gather"]
    init_weights(tied, tmp_path, seed=5, experts="nvfp4")
    seqs = [(0, list(range(3, 12))), (1, [7, 8, 9])]
    out = [ReferenceSession.from_checkpoint(tied, tmp_path, tp=tp, max_seqs=2, max_len=64, max_chunk=64)
           .prefill(seqs) for tp in (1, 2)]
    for a, b in zip(*out):
        assert float((a - b).norm() / b.norm()) < 1e-5


def test_a_renorm_eps_transformers_does_not_use_is_named_as_unexpressed(tiny_spec_bf16):
    """transformers' Beam divides the renormalised top-k weights by (sum + 1e-20), a constant config.json cannot
    change: a spec with another renorm_eps is reported (the init-weights warning), the schema's value is not."""
    from beamc.spec.hf import hf_unexpressed

    assert hf_unexpressed(tiny_spec_bf16) == []
    spec = _variant(tiny_spec_bf16, **{"mlp.moe.renorm_eps": 1e-6})
    assert hf_unexpressed(spec) == ["mlp.moe.renorm_eps = 1e-06 (transformers' Beam hard-codes 1e-20)"]


def test_a_qk_norm_eps_apart_from_norm_eps_writes_a_checkpoint_and_is_named(tiny_spec_bf16, tmp_path):
    """BeamConfig has one rms_norm_eps: a spec whose q / k norms use another eps still gets its checkpoint (beamc
    reads the spec; config.json carries norm.eps), and the difference is named as unexpressed, not an error."""
    from beamc.checkpoint.init import init_weights
    from beamc.checkpoint.loader import load_rank_weights
    from beamc.spec.hf import hf_unexpressed

    spec = _variant(tiny_spec_bf16, **{"norm.eps": 1e-6, "attention.qk_norm.eps": 1e-5})
    assert hf_unexpressed(spec) == ["attention.qk_norm.eps = 1e-05 (transformers' Beam uses rms_norm_eps, "
                                    "norm.eps = 1e-06, for the q / k norms too)"]
    init_weights(spec, tmp_path, seed=3)
    assert json.loads((tmp_path / "config.json").read_text())["rms_norm_eps"] == 1e-6
    assert load_rank_weights(spec, tmp_path, dtype=torch.float32)  # the loader's config check accepts it


def test_q_scale_and_residual_indices_match_transformers_with_those_constants(tiny_spec_bf16, tiny_ckpt, monkeypatch):
    """The SSMax constants and the depth-scaled residual's indices, which transformers' Beam hard-codes (config.json
    cannot carry them: `beamc init-weights` warns): transformers with its two functions re-parametrised the same way
    equals the interpreter, and both differ from the defaults."""
    import transformers.models.beam.modeling_beam as mb

    spec = _variant(tiny_spec_bf16, **{"attention.full.q_scale.length": 512.0, "attention.full.q_scale.offset": 2.0,
                                       "attention.full.q_scale.exponent": 0.3, "residual.attn_n.scale": 3,
                                       "residual.attn_n.extra": 1, "residual.mlp_n.scale": 3, "residual.mlp_n.extra": 2})
    from beamc.spec.hf import hf_unexpressed

    assert [x.split(" = ")[0] for x in hf_unexpressed(spec)] == ["attention.full.q_scale", "residual.attn_n",
                                                                  "residual.mlp_n"]
    add = mb.depth_scaled_residual_add

    def residual(h, r, n):  # transformers' n: 2 (L + 1) for attention, 2 (L + 1) + 1 for the MLP
        return add(h, r, 3 * (n // 2) + (2 if n % 2 else 1))

    monkeypatch.setattr(mb, "depth_scaled_residual_add", residual)
    monkeypatch.setattr(mb, "compute_attention_scaling",
                        lambda pos: torch.exp(0.3 * torch.log1p((pos.float() + 2) / 512))[:, None, :, None])
    ids = _ids(spec.vocab_size, 24, 13)
    ref = hf_logits(hf_model(tiny_ckpt, torch.float32), ids)
    ours = ReferenceSession.from_checkpoint(spec, tiny_ckpt, max_len=32, max_chunk=32).prefill([(0, ids)])[0]
    plain = ReferenceSession.from_checkpoint(tiny_spec_bf16, tiny_ckpt, max_len=32, max_chunk=32).prefill([(0, ids)])[0]
    assert rel_err(ours, ref) < 1e-5 and rel_err(plain, ref) > 1e-3
