"""Prefill/decode consistency, simulated tensor parallelism and runtime-call errors of the reference session."""
from __future__ import annotations

import pytest
import torch

from beamc.checkpoint.loader import load_rank_weights
from beamc.errors import BeamcError
from beamc.runtime.session import ReferenceSession
from conftest import rel_err


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def weights_f32(tiny_spec, tiny_ckpt_nvfp4):
    return {tp: [load_rank_weights(tiny_spec, tiny_ckpt_nvfp4, tp=tp, rank=r, dtype=torch.float32) for r in range(tp)]
            for tp in (1, 2, 4)}


def test_prefill_then_decode_equals_one_long_prefill(tiny_spec, weights_f32):
    """10-token prefill, then 50 single-token decode steps for two sequences at different positions, equals one
    60-token prefill; the sliding rings (capacity 15 + 10) wrap around several times."""
    a, b = _ids(tiny_spec.vocab_size, 60, 0), _ids(tiny_spec.vocab_size, 60, 1)
    long = ReferenceSession(tiny_spec, weights_f32[1], max_len=64, max_chunk=64).prefill([(0, a), (1, b)])
    step = ReferenceSession(tiny_spec, weights_f32[1], max_len=64, max_chunk=10)
    assert step.states[0]["kv.0.k"].shape[1] == tiny_spec.attention.sliding.window - 1 + 10
    pa, pb = step.prefill([(0, a[:10]), (1, b[:4])])
    rows_a, rows_b = [pa], [pb]
    for i in range(10, 14):
        rows_a.append(step.decode({0: a[i]}))
    rows_b.append(step.prefill([(1, b[4:10])])[0])
    for i in range(14, 60):  # b runs 4 positions behind a, in the same decode batch
        out = step.decode({0: a[i], 1: b[i - 4]})
        rows_a.append(out[:1])
        rows_b.append(out[1:])
    rows_b.append(step.prefill([(1, b[56:])])[0])
    assert rel_err(torch.cat(rows_a), long[0]) < 1e-5
    assert rel_err(torch.cat(rows_b), long[1]) < 1e-5


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_ranks_sum_to_the_unsharded_model(tiny_spec, weights_f32, tp):
    """tp=4 on the tiny spec (2 kv heads) also exercises kv-head replication across ranks."""
    seqs = [(0, _ids(tiny_spec.vocab_size, 40, 2)), (1, _ids(tiny_spec.vocab_size, 23, 3))]
    ref = ReferenceSession(tiny_spec, weights_f32[1], max_len=64, max_chunk=40)
    par = ReferenceSession(tiny_spec, weights_f32[tp], tp=tp, max_len=64, max_chunk=40)
    for x, y in zip(ref.prefill(seqs), par.prefill(seqs)):
        assert rel_err(y, x) < 1e-5
    for t in range(3):
        toks = {0: 7 + t, 1: 300 + t}
        assert rel_err(par.decode(toks), ref.decode(toks)) < 1e-5


def test_tp_rank_graphs_carry_their_collectives(tiny_spec):
    from beamc.ir.lower import LowerOptions, lower

    g = lower(tiny_spec, LowerOptions(tp=2))
    ops = [n.op for n in g.nodes]
    assert ops.count("all_reduce") == 2 * tiny_spec.num_layers
    assert ops.count("all_gather") == 1
    assert "all_reduce" not in [n.op for n in lower(tiny_spec).nodes]


@pytest.mark.parametrize("call, message", [
    (lambda s: s.prefill([(9, [1, 2])]), "slot: 9 is outside [0, 4)"),
    (lambda s: s.prefill([(0, list(range(20)))]), "chunk of 20 tokens exceeds max_chunk=16"),
    (lambda s: s.prefill([(0, [1, 100000])]), "token id 100000 outside the vocabulary [0, 512)"),
    (lambda s: s.prefill([(0, [])]), "empty token list"),
    (lambda s: s.prefill([(0, [1]), (0, [2])]), "a slot appears twice"),
])
def test_bad_runtime_calls_raise_one_clear_error(tiny_spec, weights_f32, call, message):
    sess = ReferenceSession(tiny_spec, weights_f32[1], max_seqs=4, max_len=32, max_chunk=16)
    with pytest.raises(BeamcError, match=None) as e:
        call(sess)
    assert message in str(e.value)


def test_context_longer_than_max_len_is_refused(tiny_spec, weights_f32):
    sess = ReferenceSession(tiny_spec, weights_f32[1], max_len=20, max_chunk=16)
    sess.prefill([(0, list(range(16)))])
    with pytest.raises(BeamcError, match="length 21 exceeds max_len=20"):
        sess.prefill([(0, list(range(5)))])


def test_fp8_kv_cache_stores_e4m3_within_its_precision(tiny_spec, tiny_ckpt_nvfp4):
    """dtypes.kv_cache: fp8 stores K/V as float8_e4m3fn (half the bytes) and reads them back in fp32. Layer 0's
    cache (same inputs in both runs) holds the bf16 cache's values to e4m3's precision (3 mantissa bits)."""
    from beamc.spec import parse_spec

    data = tiny_spec.model_dump()
    data["dtypes"]["kv_cache"] = "fp8"
    fp8 = parse_spec(data)
    ids = _ids(tiny_spec.vocab_size, 40, 5)
    caches, logits = {}, {}
    for name, spec in (("bf16", tiny_spec), ("fp8", fp8)):
        sess = ReferenceSession.from_checkpoint(spec, tiny_ckpt_nvfp4, dtype="bf16", max_len=48, max_chunk=40)
        logits[name] = torch.cat([sess.prefill([(0, ids[:30])])[0], sess.decode({0: ids[30]})])
        caches[name] = [sess.states[0][f"kv.0.{kv}"][0, :31].float() for kv in "kv"]
    assert sess.states[0]["kv.0.k"].dtype == torch.float8_e4m3fn
    for q, ref in zip(caches["fp8"], caches["bf16"]):
        assert ((q - ref).abs() <= ref.abs() * 2 ** -4 + 2 ** -10).all()
    assert torch.isfinite(logits["fp8"]).all()


def test_last_row_logits_graph_equals_the_rows_of_the_full_one(tiny_spec, weights_f32):
    """LowerOptions(logits="last"): only the rows named by `logit_rows` (a serving step's last tokens) reach lm_head."""
    from beamc.runtime.interpret import Interpreter
    from beamc.runtime.kv_cache import alloc_states
    from beamc.ir.lower import LowerOptions, lower

    ids = _ids(tiny_spec.vocab_size, 30, 9)
    inputs = {"input_ids": torch.tensor(ids), "positions": torch.tensor(list(range(20)) + list(range(10))),
              "slots": torch.tensor([0] * 20 + [1] * 10)}
    outs = {}
    for mode in ("all", "last"):
        g = lower(tiny_spec, LowerOptions(dtype="f32", logits=mode))
        states = [alloc_states(g, {"S": 2, "Cs": 64, "P": 8, "MP": 4})]
        extra = {"logit_rows": torch.tensor([19, 29])} if mode == "last" else {}
        extra["block_table"] = torch.arange(8, dtype=torch.int32).view(2, 4)
        outs[mode] = Interpreter([g], weights_f32[1]).run({**inputs, **extra}, states)[0]["logits"]
    # equal up to the lm_head GEMM's rounding, which depends on how many rows it multiplies (2 vs 30)
    assert rel_err(outs["last"], outs["all"][[19, 29]]) < 1e-6


def test_list_capacity_check_equals_the_tensor_one():
    """The runtime's small-step check (`check_kv_capacity_lists`, int lists) passes and fails exactly where the
    reference's tensor check does, with the same message: rings (sliding and full) and paged caches, random steps
    with repeated positions, spans past the ring, pages past the table or the pool, shared rows."""
    from beamc.errors import BeamcError
    from beamc.ir.reference import check_kv_capacity, check_kv_capacity_lists

    g = torch.Generator().manual_seed(0)

    def outcome(fn, *args):
        try:
            fn(*args)
            return None
        except BeamcError as e:
            return str(e)

    seen = {None: 0, "err": 0}
    for trial in range(400):
        n = int(torch.randint(1, 9, (), generator=g))
        slot = torch.randint(0, 4, (n,), generator=g)
        pos = torch.randint(0, 40, (n,), generator=g)
        paged = trial % 2 == 1
        if paged:
            table = torch.randint(-1, 12, (5, 3), generator=g, dtype=torch.int32)
            args = (8, None, table, 10)
        else:
            args = (int(torch.randint(4, 48, (), generator=g)), [None, 8][trial % 4 // 2], None, 0)
        a = outcome(check_kv_capacity, slot, pos, *args)
        b = outcome(check_kv_capacity_lists, slot.tolist(), pos.tolist(), *args)
        assert a == b, (trial, a, b)
        seen[None if a is None else "err"] += 1
    assert seen[None] > 20 and seen["err"] > 20, seen
