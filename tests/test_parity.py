"""The interpreter against transformers' Beam on the tiny spec, from one random HF checkpoint read by both."""
from __future__ import annotations

import pytest
import torch

from beamc.ir.dtypes import ir_dtype
from beamc.runtime.session import ReferenceSession
from conftest import hf_logits, hf_model, register_beamc_attention, rel_err, spec_variant

LENS = (57, 33, 70)  # ragged; 57 and 70 exceed three windows of 16


def _seqs(vocab: int, seed: int, lens=LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def test_fp32_ragged_prefill_matches_transformers(tiny_spec_bf16, tiny_ckpt):
    seqs = _seqs(tiny_spec_bf16.vocab_size, 0)
    sess = ReferenceSession.from_checkpoint(tiny_spec_bf16, tiny_ckpt, dtype="f32", max_len=128, max_chunk=80)
    outs = sess.prefill(list(enumerate(seqs)))
    model = hf_model(tiny_ckpt, torch.float32)
    for ids, out in zip(seqs, outs):
        assert rel_err(out, hf_logits(model, ids)) < 1e-5


def test_fp32_chunked_ragged_prefill_with_start_positions(tiny_spec_bf16, tiny_ckpt):
    """Sequences continue from different start positions in one ragged step (chunked prefill)."""
    a, b, c = _seqs(tiny_spec_bf16.vocab_size, 1)
    sess = ReferenceSession.from_checkpoint(tiny_spec_bf16, tiny_ckpt, dtype="f32", max_len=128, max_chunk=48)
    a1, b1 = sess.prefill([(0, a[:20]), (1, b[:9])])
    a2, b2, c1 = sess.prefill([(0, a[20:57]), (1, b[9:]), (2, c[:40])])
    model = hf_model(tiny_ckpt, torch.float32)
    assert rel_err(torch.cat([a1, a2]), hf_logits(model, a)) < 1e-5
    assert rel_err(torch.cat([b1, b2]), hf_logits(model, b)) < 1e-5
    assert rel_err(c1, hf_logits(model, c[:40])) < 1e-5


def test_bf16_bit_exact_when_attention_arithmetic_matches(tiny_spec_bf16, tiny_ckpt):
    """With transformers running beamc's attention reference, every other op rounds at the same points, so the
    bf16 logits are identical bit for bit."""
    seqs = _seqs(tiny_spec_bf16.vocab_size, 2, (57, 21))
    sess = ReferenceSession.from_checkpoint(tiny_spec_bf16, tiny_ckpt, dtype="bf16", max_len=128, max_chunk=80)
    outs = sess.prefill(list(enumerate(seqs)))
    model = hf_model(tiny_ckpt, torch.bfloat16, attn=register_beamc_attention())
    for ids, out in zip(seqs, outs):
        assert torch.equal(out, hf_logits(model, ids))


@pytest.mark.parametrize("act", ["bfloat16", "float16"])
def test_mixed_storage_dtypes_compute_in_the_activations_dtype_bit_exact(tiny_spec_bf16, tmp_path, act):
    """The weight groups' dtypes say how the checkpoint stores them; the model computes in dtypes.activations, as
    transformers loads a checkpoint in its model dtype (the fp32 router excepted): with the same attention
    arithmetic, the interpreter at the spec's dtypes (graphs with and without the passes) equals transformers bit
    for bit, and the residual stream stays in the activations dtype."""
    from beamc.checkpoint.init import init_weights
    from beamc.compiler import compile_graphs
    from beamc.passes.manager import select_passes

    spec = spec_variant(tiny_spec_bf16, {
        "dtypes.activations": act, "dtypes.attention_weights": "float32", "dtypes.norm_weights": "float32",
        "dtypes.dense_mlp_weights": "bfloat16", "dtypes.embeddings": "float16", "dtypes.lm_head": "float32",
        "dtypes.experts": "float16"})
    init_weights(spec, tmp_path, seed=8)
    seqs = _seqs(spec.vocab_size, 9, (23, 40))
    model = hf_model(tmp_path, getattr(torch, act), attn=register_beamc_attention())
    for passes in ("none", "all"):
        graphs = compile_graphs(spec, dtype=None, passes=select_passes(passes))
        assert {v.dtype for g in graphs["prefill"] for n in g.nodes if n.op not in ("param", "state")
                for v in n.outputs if v.shape[-1:] == (spec.hidden_size,)} == {ir_dtype(act)}
        sess = ReferenceSession.from_checkpoint(spec, tmp_path, dtype=None, max_len=64, max_chunk=80, graphs=graphs)
        for ids, out in zip(seqs, sess.prefill(list(enumerate(seqs)))):
            assert torch.equal(out, hf_logits(model, ids)), passes


def test_bf16_against_transformers_sdpa_statistically(tiny_spec_bf16, tiny_ckpt):
    """Against transformers' own (sdpa) attention the only difference is attention's internal rounding; random
    weights make bf16 chaotic, so compare log-probabilities of reference tokens and top-1 agreement."""
    seqs = _seqs(tiny_spec_bf16.vocab_size, 3, (64,))
    sess = ReferenceSession.from_checkpoint(tiny_spec_bf16, tiny_ckpt, dtype="bf16", max_len=128, max_chunk=80)
    out = sess.prefill([(0, seqs[0])])[0]
    ref = hf_logits(hf_model(tiny_ckpt, torch.bfloat16), seqs[0])
    lp, lr = out.log_softmax(-1), ref.log_softmax(-1)
    tgt = ref.argmax(-1)
    dlogp = (lp.gather(1, tgt[:, None]) - lr.gather(1, tgt[:, None])).abs().mean().item()
    top1 = (out.argmax(-1) == tgt).float().mean().item()
    print(f"bf16 vs transformers sdpa: mean |dlogprob| {dlogp:.4f}, top-1 agreement {top1:.3f}")
    assert dlogp < 0.2 and top1 > 0.8


def test_nvfp4_experts_reference_is_their_dequantised_values(tiny_spec, tiny_ckpt_nvfp4):
    """An NVFP4 checkpoint runs with its dequantised experts: the interpreter reads the stored codes and scales, and
    transformers given the dequantised weights (fp32) produces the same logits."""
    from transformers import BeamConfig, BeamForCausalLM

    from beamc.checkpoint.layout import expert_graph_params
    from beamc.checkpoint.loader import load_rank_weights
    from beamc.checkpoint.nvfp4 import dequantize_stacked
    from beamc.spec.hf import spec_to_hf_config

    weights = load_rank_weights(tiny_spec, tiny_ckpt_nvfp4, dtype=torch.float32)
    hf_weights = dict(weights)
    for L, kind in enumerate(tiny_spec.mlp_types):
        if kind == "sparse":
            names = [t.name for t in expert_graph_params(tiny_spec, L)]
            assert weights[names[0]].dtype == torch.uint8  # stored form, not dequantised
            for proj, (w, s, s2) in zip(("gate_up_proj", "down_proj"), (names[:3], names[3:])):
                for n in (w, s, s2):
                    hf_weights.pop(n)
                hf_weights[f"model.layers.{L}.mlp.experts.{proj}"] = dequantize_stacked(weights[w], weights[s],
                                                                                        weights[s2])
    cfg = spec_to_hf_config(tiny_spec)
    cfg.pop("quantization_config")
    model = BeamForCausalLM(BeamConfig(**cfg)).float().eval()
    model.load_state_dict(hf_weights, strict=False)
    missing = set(model.state_dict()) - set(hf_weights)
    assert not [k for k in missing if "rotary" not in k]
    seq = _seqs(tiny_spec.vocab_size, 4, (50,))[0]
    sess = ReferenceSession(tiny_spec, [weights], dtype="f32", max_len=64, max_chunk=64)
    assert rel_err(sess.prefill([(0, seq)])[0], hf_logits(model, seq)) < 1e-5


# Two specs far from the tiny one, each changing many fields at once (what config.json can carry), against
# transformers in fp32: the interpreter is built for any valid spec, not Beam's shape only.
VARIANTS = {
    "mqa-hd64-odd": {"hidden_size": 320, "vocab_size": 509, "attention.num_heads": 5, "attention.num_kv_heads": 1,
                     "attention.head_dim": 64, "attention.sliding.rope.rotary_dim": 64,
                     "attention.sliding.window": 7, "attention.sliding.window_includes_current": False,
                     "attention.sliding.rope.theta": 5e5, "layers.dense_first": 0, "mlp.moe.num_experts": 12,
                     "mlp.moe.n_group": 3, "mlp.moe.topk_group": 3, "mlp.moe.top_k": 3, "mlp.moe.d_ff": 48,
                     "mlp.moe.renormalize": False, "mlp.moe.routed_scaling": 1.0, "logits.softcap": None,
                     "logits.tie_word_embeddings": True, "norm.eps": 1e-5, "attention.qk_norm.eps": 1e-5},
    "mha-all-full-interleaved": {"num_layers": 5, "attention.num_kv_heads": 8, "layers.full_every": 1,
                                 "layers.mlp": ["sparse", "dense", "sparse", "sparse", "dense"],
                                 "mlp.moe.n_group": 1, "mlp.moe.topk_group": 1, "mlp.moe.top_k": 5,
                                 "mlp.dense.d_ff": 96, "dtypes.kv_cache": "fp8"},
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_fp32_prefill_matches_transformers_on_other_specs(tiny_spec_bf16, tmp_path, name):
    from beamc.checkpoint.init import init_weights
    from beamc.spec.hf import hf_unexpressed

    spec = spec_variant(tiny_spec_bf16, VARIANTS[name])
    assert not hf_unexpressed(spec)
    init_weights(spec, tmp_path, seed=21)
    seqs = _seqs(spec.vocab_size, 5, (29, 6))
    outs = ReferenceSession.from_checkpoint(spec, tmp_path, dtype="f32", max_len=64, max_chunk=64).prefill(
        list(enumerate(seqs)))
    model = hf_model(tmp_path, torch.float32)
    for ids, out in zip(seqs, outs):
        assert rel_err(out, hf_logits(model, ids)) < 1e-5
