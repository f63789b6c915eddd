"""Fusion passes: the rewrite engine on hand-built graphs, match and op counts, idempotence, subsets, and bit-identical
interpretation before/after each pass (fp32 and bf16, prefill and decode, TP 1 and TP 2)."""
from __future__ import annotations

import itertools
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from beamc.checkpoint.loader import load_rank_weights
from beamc.errors import BeamcError
from beamc.ir.graph import Graph
from beamc.ir.lower import LowerOptions, lower
from beamc.ir.printer import to_text
from beamc.runtime.session import ReferenceSession
from beamc.ir.verify import verify
from beamc.compiler import compile_graphs
from beamc.passes.manager import PASSES, run_passes, select_passes
from beamc.passes.rewrite import Pat, Rule, rewrite
from beamc.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
ALL = list(PASSES)


# ---------------------------------------------------------------- the engine on a tiny hand-built graph
def test_rewrite_fuses_a_hand_built_chain_and_keeps_shared_values():
    g = Graph("hand")
    x = g.input("x", (4, 8), "f32")
    y = g.add("sigmoid", x)
    z = g.add("scale", y, s=2.0)
    w = g.add("sigmoid", x)
    g.outputs["z"], g.outputs["w"] = z, w
    rule = Rule("sig_scale", Pat("scale", Pat("sigmoid", Pat.any("x")), name="s"),
                lambda g, m: {m["s"].out: g.add("cast", g.add("sigmoid", m["x"]), dtype="f32")})
    counts = Counter()
    assert rewrite(g, [rule], counts) == 1
    verify(g)
    assert [n.op for n in g.compute_nodes()] == ["sigmoid", "cast", "sigmoid"]
    assert counts == Counter({("sig_scale", "head"): 1})


def test_rewrite_refuses_a_match_whose_interior_value_is_used_elsewhere():
    g = Graph("hand")
    x = g.input("x", (4,), "f32")
    y = g.add("sigmoid", x)
    g.outputs["z"], g.outputs["y"] = g.add("scale", y, s=2.0), y  # y escapes: fusing would recompute it
    rule = Rule("r", Pat("scale", Pat("sigmoid", Pat.any("x")), name="s"), lambda g, m: {m["s"].out: m["x"]})
    assert rewrite(g, [rule]) == 0


# ---------------------------------------------------------------- counts on the full model
@pytest.fixture(scope="module")
def full_tp8():
    spec = load_spec(ROOT / "models/beam.yaml")
    g = lower(spec, LowerOptions(phase="decode", tp=8))
    before = Counter(n.op for n in g.compute_nodes())
    rep = run_passes([g], ALL)
    return spec, g, rep, before


def test_match_counts_on_the_full_model_at_tp8(full_tp8):
    _, g, rep, _ = full_tp8
    assert rep.matches("norm_residual_norm") == 104
    assert rep.matches("qk_norm_pos", "qk_norm_rope") == 43
    assert rep.matches("qk_norm_pos", "qk_norm_ssmax") == 9
    assert rep.matches("qk_norm_pos", "sigmoid_gate") == 52
    assert rep.matches("allreduce_norm", "allreduce_into_norm") == 104
    assert rep.matches("allreduce_norm", "moe_combine_into_norm") == 49
    assert rep.matches("fp32_router") == 49
    assert rep.matches("pack_qkv_gate") == 52
    assert rep.matches("kv_write") == 52
    assert rep.matches("dense_swiglu") == 3
    assert rep.matches("fold_small") == 2
    assert rep.matches("attention_gate") == 52
    assert rep.matches("qk_attention") == 52


def test_op_counts_before_and_after(full_tp8):
    _, g, rep, before = full_tp8
    after = Counter(n.op for n in g.compute_nodes())
    assert before["rmsnorm"] == 6 * 52 + 1 and after["rmsnorm"] == 0
    assert before["all_reduce"] == 104 and after["all_reduce"] == 0
    assert after["boundary"] == 104 and after["qk_attention"] == 52 and after["moe_experts"] == 49
    assert after["attention"] == 0 and after["sigmoid_gate"] == 0  # the gate in attention's epilogue
    assert after["attention_gate"] == 0 and after["qk_norm_pos_kv"] == 0  # the norms in its prologue (decode)
    assert before["linear"] == 5 * 52 + 3 * 3 + 1 and after["linear"] == 52 + 3  # o_proj, dense down_proj
    assert rep.ops_after["input"]["sliding+sparse"] == 31
    assert all(n < 13 for n in rep.ops_after["fold_small"].values())  # the seed had 13 per MoE layer
    assert all(rep.ops_after["attention_gate"][k] == n - 1 for k, n in rep.ops_after["fold_small"].items()
               if k != "head")  # one op less in every layer
    assert all(rep.ops_after["qk_attention"][k] == n - 1 for k, n in rep.ops_after["combine_experts"].items()
               if k != "head")  # and one more: 7 per layer


def test_passes_are_idempotent_and_keep_graphs_verified(tiny_spec):
    for tp in (1, 2):
        g = lower(tiny_spec, LowerOptions(tp=tp))
        run_passes([g], ALL)
        text = to_text(g)
        again = run_passes([g], ALL)
        assert all(sum(c.values()) == 0 for c in again.counts.values())
        assert to_text(g) == text


def test_every_subset_of_passes_gives_a_verified_graph(tiny_spec):
    """All 2^9 subsets of the first nine passes on the decode graph at TP 2 (run_passes verifies after every pass),
    every second one (by the itertools order) with the tenth, combine_experts, which builds on allreduce_norm's
    boundaries, and every other pair with the eleventh, qk_attention, which builds on kv_write (so each both with
    and without what it builds on: 2^9 runs, not 2^11, for the test's time); a sample on prefill, whose graph
    differs only in the names of its symbolic dims (and where qk_attention matches nothing)."""
    later = ("combine_experts", "qk_attention")
    first = [p for p in ALL if p not in later]
    subsets = [list(c) + (["combine_experts"] if i % 2 else []) + (["qk_attention"] if i // 2 % 2 else [])
               for i, c in enumerate(c for r in range(len(first) + 1) for c in itertools.combinations(first, r))]
    assert len(subsets) == 2 ** len(first) and len(ALL) == len(first) + 2
    for base, later_pass in (("allreduce_norm", "combine_experts"), ("kv_write", "qk_attention")):
        pairs = {(base in s, later_pass in s) for s in subsets}
        assert pairs == {(a, b) for a in (False, True) for b in (False, True)}
    for names in subsets:
        run_passes([lower(tiny_spec, LowerOptions(phase="decode", tp=2))], names)
    for names in random.Random(0).sample(subsets, 16):
        run_passes([lower(tiny_spec, LowerOptions(phase="prefill", tp=2))], names)


def test_pass_flags_select_and_reject():
    assert select_passes("all", ["kv_write"]) == [p for p in ALL if p != "kv_write"]
    assert select_passes("none") == []
    assert select_passes("fp32_router,norm_residual_norm") == ["norm_residual_norm", "fp32_router"]
    with pytest.raises(BeamcError, match="unknown pass 'fuse_everything'"):
        select_passes("fuse_everything")
    with pytest.raises(BeamcError, match="--disable: unknown pass 'x'"):
        select_passes("all", ["x"])


def test_packing_is_recorded_in_the_plan(tiny_spec):
    g = lower(tiny_spec, LowerOptions(tp=2))
    run_passes([g], ["pack_qkv_gate"])
    packed = {k: n for k, n in g.leaves("param").items() if "pack" in n.attrs}
    assert len(packed) == tiny_spec.num_layers
    n = packed["model.layers.0.self_attn.qkvg_proj.weight"]
    assert n.attrs["pack"][0].endswith("q_proj.weight") and n.out.shape == (128 + 32 + 32 + 128, 256)


# ---------------------------------------------------------------- bit-identical interpretation
@pytest.fixture(scope="module")
def rank_weights(tiny_spec, tiny_ckpt_nvfp4):
    out = {}
    for dt, tdt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        for tp in (1, 2):
            out[dt, tp] = [load_rank_weights(tiny_spec, tiny_ckpt_nvfp4, tp=tp, rank=r, dtype=tdt) for r in range(tp)]
    return out


def _run(spec, weights, tp, dtype, passes) -> list[torch.Tensor]:
    """A ragged prefill across the window (24 > 16 tokens) followed by two decode steps."""
    graphs = compile_graphs(spec, tp=tp, dtype=dtype, passes=passes)
    sess = ReferenceSession(spec, weights, tp=tp, dtype=dtype, max_len=32, max_chunk=24, graphs=graphs)
    g = torch.Generator().manual_seed(7)
    a, b = (torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in (24, 13))
    outs = sess.prefill([(0, a), (1, b)])
    outs.append(sess.decode({0: 5, 1: 6}))
    outs.append(sess.decode({0: 7, 1: 8}))
    return outs


_REF: dict = {}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("passes", [[p] for p in ALL] + [["qk_norm_pos", "attention_gate"], ALL],
                         ids=ALL + ["qk_norm_pos+attention_gate", "all"])
def test_each_pass_and_all_passes_are_bit_identical(tiny_spec, rank_weights, passes, dtype, tp):
    w = rank_weights[dtype, tp]
    if (dtype, tp) not in _REF:
        _REF[dtype, tp] = _run(tiny_spec, w, tp, dtype, [])
    fused = _run(tiny_spec, w, tp, dtype, passes)
    for x, y in zip(_REF[dtype, tp], fused):
        assert torch.equal(x, y)


def test_attention_gate_fuses_only_a_gate_of_an_attention_output(tiny_spec):
    """attention_gate (after qk_norm_pos made the sigmoid_gate): every layer's sigmoid_gate whose o is an attention
    output becomes one attention_gate with attention's inputs, then gate and bias (attrs kept); without qk_norm_pos
    there is no sigmoid_gate and nothing matches; a gate whose o is read elsewhere too stays."""
    g = lower(tiny_spec, LowerOptions(tp=1))
    rep = run_passes([g], ["qk_norm_pos", "attention_gate"])
    ops = Counter(n.op for n in g.compute_nodes())
    L = tiny_spec.num_layers
    assert rep.matches("attention_gate") == L and ops["attention_gate"] == L
    assert ops["attention"] == 0 and ops["sigmoid_gate"] == 0
    n = next(n for n in g.compute_nodes() if n.op == "attention_gate")
    assert [v.shape for v in n.inputs[-2:]] == [n.out.shape, (n.out.shape[1], 1)] and "scale" in n.attrs
    assert run_passes([lower(tiny_spec, LowerOptions(tp=1))], ["attention_gate"]).matches("attention_gate") == 0
    # an attention output with a second reader: the match would drop it, so the rule refuses
    h = lower(tiny_spec, LowerOptions(tp=1))
    run_passes([h], ["qk_norm_pos"])
    gate = next(n for n in h.compute_nodes() if n.op == "sigmoid_gate")
    h.outputs["extra_attention_out"] = gate.inputs[0]
    assert run_passes([h], ["attention_gate"]).matches("attention_gate") == L - 1


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_qk_attention_fuses_the_norms_into_decode_attention(tiny_spec, rank_weights, dtype):
    """qk_attention (after kv_write and attention_gate): in the decode graph every layer's qk_norm_pos_kv and
    attention_gate become one qk_attention on the raw q, k, v (qk_norm_pos_kv's inputs, then gate and bias; both ops'
    attributes; the cache outputs carried on as the layer's cache state); nothing matches on the prefill graph,
    without kv_write, or when q has another reader; idempotent; the interpretation bit for bit the same as with the
    passes before it only (a prefill then decode steps, TP 1 and 2)."""
    before = [p for p in ALL if p != "qk_attention"]
    g = lower(tiny_spec, LowerOptions(phase="decode", tp=1))
    run_passes([g], before)
    ops0 = Counter(n.op for n in g.compute_nodes())
    rep = run_passes([g], ["qk_attention"])
    ops1 = Counter(n.op for n in g.compute_nodes())
    L = tiny_spec.num_layers
    assert rep.matches("qk_attention") == L and ops1["qk_attention"] == L
    assert ops0["qk_norm_pos_kv"] == ops0["attention_gate"] == L and ops1["qk_norm_pos_kv"] == ops1["attention_gate"] == 0
    assert sum(ops1.values()) == sum(ops0.values()) - L
    n = next(n for n in g.compute_nodes() if n.op == "qk_attention")
    assert n.attrs["gate"] and "scale" in n.attrs and "eps" in n.attrs and "mode" in n.attrs
    assert len(n.outputs) == 3 and set(g.state_out.values()) >= set(n.outputs[1:])
    assert run_passes([g], ["qk_attention"]).matches("qk_attention") == 0  # idempotent
    pre = lower(tiny_spec, LowerOptions(phase="prefill", tp=1))
    assert run_passes([pre], ALL).matches("qk_attention") == 0
    assert run_passes([lower(tiny_spec, LowerOptions(phase="decode", tp=1))],
                      [p for p in ALL if p != "kv_write"]).matches("qk_attention") == 0
    h = lower(tiny_spec, LowerOptions(phase="decode", tp=1))  # a q with a second reader: the rule refuses
    run_passes([h], before)
    qk = next(n for n in h.compute_nodes() if n.op == "qk_norm_pos_kv")
    h.outputs["extra_q"] = qk.outputs[0]
    assert run_passes([h], ["qk_attention"]).matches("qk_attention") == L - 1
    for tp in (1, 2):
        w = rank_weights[dtype, tp]
        for x, y in zip(_run(tiny_spec, w, tp, dtype, before), _run(tiny_spec, w, tp, dtype, ALL)):
            assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_combine_experts_moves_the_combine_into_the_experts_at_tp2(tiny_spec, rank_weights, dtype):
    """combine_experts (after allreduce_norm made boundaries with combine + all-reduce): at TP 2 every MoE layer's
    moe_experts takes the routing weights and returns the rank's combined [T, H] (x routed_scale); its boundary
    keeps only the all-reduce and the norms. Op counts before / after, the attributes moved, nothing matched at
    TP 1 (the boundary combines in its own kernel there) or without allreduce_norm; and the interpretation bit for
    bit the same as with the passes before it only."""
    before = [p for p in ALL if p != "combine_experts"]
    g = lower(tiny_spec, LowerOptions(tp=2))
    run_passes([g], before)
    ops0 = Counter(n.op for n in g.compute_nodes())
    rep = run_passes([g], ["combine_experts"])
    ops1 = Counter(n.op for n in g.compute_nodes())
    moe_layers = sum(1 for n in g.compute_nodes() if n.op == "moe_router")
    assert moe_layers >= 1 and rep.matches("combine_experts") == moe_layers
    assert ops0 == ops1  # the same ops (moe_experts and boundary rebuilt with other attributes)
    ex = [n for n in g.compute_nodes() if n.op == "moe_experts"]
    assert all(n.attrs["combine"] and n.attrs["routed_scale"] == float(tiny_spec.mlp.moe.routed_scaling) for n in ex)
    assert all(n.out.shape == (n.inputs[0].shape[0], n.inputs[0].shape[1]) and n.inputs[-1].dtype == "f32"
               for n in ex)
    b = [n for n in g.compute_nodes() if n.op == "boundary" and n.inputs[0].producer in ex]
    assert len(b) == moe_layers and all(n.attrs["allreduce"] and not n.attrs["combine"]
                                        and n.attrs["routed_scale"] is None for n in b)
    assert run_passes([g], ["combine_experts"]).matches("combine_experts") == 0  # idempotent
    one = lower(tiny_spec, LowerOptions(tp=1))
    assert run_passes([one], before + ["combine_experts"]).matches("combine_experts") == 0
    bare = lower(tiny_spec, LowerOptions(tp=2))
    assert run_passes([bare], ["combine_experts"]).matches("combine_experts") == 0
    w = rank_weights[dtype, 2]
    for x, y in zip(_run(tiny_spec, w, 2, dtype, before), _run(tiny_spec, w, 2, dtype, ALL)):
        assert torch.equal(x, y)
