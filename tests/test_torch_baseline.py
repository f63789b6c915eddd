"""bench/torch_baseline.py (the ablation's plain-PyTorch row) against beamc's IR interpreter, on the tiny spec in fp32.

The baseline gets the ablation's weights dict (random rank weights drawn from the unfused package's graphs) with the
experts dequantised exactly; its logits must equal the interpreter's (rel. err < 1e-5) through a ragged history:
a 20-token prefill (longer than the 16-token window), a 5-token chunk over that context, then decode steps at
different positions per sequence. TP 2: the rank-0 share against the rank-0 graph interpreted alone (its all-reduces
are copies of this rank's partial sums, its logits all-gather this rank's vocabulary share), which is what the
benchmark's one-rank simulation computes.
"""
from __future__ import annotations

import pytest
import torch

from beamc.codegen.package import compile_package
from beamc.compiler import compile_graphs
from beamc.runtime.random_weights import random_rank_weights
from beamc.runtime.session import ReferenceSession
from conftest import load_bench_module


tb = load_bench_module("torch_baseline")

TOL = 1e-5
MAX_CONTEXT = 48


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2-rank0"])
def setup(request, tiny_spec):
    """(tp, weights of rank 0, reference logits of every step, the steps' inputs)."""
    tp = request.param
    package = compile_package(tiny_spec, tp=tp, rank=0, passes=[], dtype="f32")  # what bench/ablation.py draws from
    w = random_rank_weights(tiny_spec, [st.graph for st in package.steps.values()], tp=tp, rank=0, device="cpu",
                            seed=11)
    graphs = compile_graphs(tiny_spec, tp=tp, ranks=[0], dtype="f32")  # rank 0 alone: collectives are copies
    sess = ReferenceSession(tiny_spec, [w], tp=tp, dtype="f32", max_seqs=2, max_len=MAX_CONTEXT, max_chunk=20,
                            graphs=graphs)
    assert tiny_spec.effective_window == 16
    g = torch.Generator().manual_seed(5)
    p1, p2 = torch.randint(0, 512, (2, 20), generator=g), torch.randint(0, 512, (2, 5), generator=g)
    steps = [("prefill", p1, 0), ("prefill", p2, 20),
             ("decode", torch.tensor([7]), torch.tensor([25])),  # slot 0 only: the sequences' lengths differ
             ("decode", torch.tensor([9, 11]), torch.tensor([26, 25]))]
    ref = []
    for kind, toks, where in steps:
        if kind == "prefill":
            ref.append(torch.stack([r[-1] for r in sess.prefill([(s, toks[s].tolist()) for s in range(2)])]))
        else:
            ref.append(sess.decode({s: int(t) for s, t in enumerate(toks)}))
    return tp, w, ref, steps


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_logits_equal_the_interpreter(setup, tiny_spec, impl):
    tp, w, ref, steps = setup
    model = tb.TorchBaseline(tiny_spec, w, tp, 0, "cpu", max_batch=2, max_context=MAX_CONTEXT, experts="exact",
                             decode_attention=impl)
    for (kind, toks, where), r in zip(steps, ref):
        out = model.prefill(toks, where) if kind == "prefill" else model.decode(toks, where)
        assert out.dtype == torch.float32 and out.shape == r.shape == (toks.shape[0], 512 // tp)
        assert rel(out, r) < TOL, (kind, where, rel(out, r))


def test_weights_are_used_in_place_and_experts_converted_once(setup, tiny_spec):
    tp, w, _, _ = setup
    model = tb.TorchBaseline(tiny_spec, w, tp, 0, "cpu", max_batch=2, max_context=MAX_CONTEXT)  # fp8 experts
    attn, moe = model.layers[5].attn, model.layers[5].mlp
    assert attn.wq.data_ptr() == w["model.layers.5.self_attn.q_proj.weight"].data_ptr()
    assert model.lm_head.data_ptr() == w["lm_head.weight"].data_ptr()
    assert moe.gu.dtype == moe.dn.dtype == torch.float8_e4m3fn
    E, ff = tiny_spec.mlp.moe.num_experts, tiny_spec.mlp.moe.d_ff // tp
    assert moe.gu.shape == (E, 2 * ff, 256) and moe.gu_s.shape == (E, 2 * ff) and moe.dn_s.shape == (E, 256)
    assert attn.kc.shape == (2, 2 // tp, MAX_CONTEXT, 32) and attn.kc.dtype == torch.float32
    assert not attn.sliding and model.layers[4].attn.sliding


def test_fp8_experts_are_within_a_few_percent_of_exact(setup):
    _, w, _, _ = setup
    for part in ("gate_up_proj", "down_proj"):
        q, s, owned = tb.convert_experts(w, "model.layers.3.mlp.experts", part, "fp8", torch.float32)
        exact, none, _ = tb.convert_experts(w, "model.layers.3.mlp.experts", part, "exact", torch.float32)
        assert owned and none is None and q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        deq = tb.dequant(q, s, torch.float32)
        assert rel(deq, exact) < 0.03, part  # e4m3: 3 mantissa bits, ~2% rms
        row_max = exact.abs().amax(-1, keepdim=True)
        assert float(((deq - exact).abs() / row_max).max()) < 0.04, part  # per-row scales: no row loses its range


def test_unquantized_experts_of_the_compute_dtype_are_not_copied(tiny_spec):
    from beamc.checkpoint.init import with_experts

    spec = with_experts(tiny_spec, "bf16")  # the ablation's --dry weights: stacked unquantized experts
    package = compile_package(spec, tp=1, rank=0, passes=[], dtype="f32")
    w = random_rank_weights(spec, [st.graph for st in package.steps.values()], device="cpu", seed=2)
    moe = tb.MoE(spec, w, 3, "exact", torch.float32)
    assert moe.gu.data_ptr() == w["model.layers.3.mlp.experts.gate_up_proj"].data_ptr() and moe.owned == 0
    moe8 = tb.MoE(spec, w, 3, "fp8", torch.float32)
    assert moe8.gu.dtype == torch.float8_e4m3fn and moe8.owned > 0


def test_fill_context_then_decode_sdpa_equals_math(setup, tiny_spec):
    """Decode over a filled (random) cache: full layers read the static length under a mask, sliding layers the
    gathered window; the SDPA and matmul forms agree, and only rows [0, length) were filled."""
    tp, w, _, _ = setup
    outs = []
    for impl in ("sdpa", "math"):
        model = tb.TorchBaseline(tiny_spec, w, tp, 0, "cpu", max_batch=2, max_context=MAX_CONTEXT, experts="exact",
                                 decode_attention=impl)
        model.fill_context(40, seed=3)
        kc = model.layers[0].attn.kc
        assert bool((kc[:, :, :40] != 0).all()) and bool((kc[:, :, 40:] == 0).all())
        outs.append(model.decode(torch.tensor([3, 4]), torch.tensor([40, 40])))
    assert rel(outs[1], outs[0]) < TOL


def test_run_baseline_on_cpu_and_its_errors(setup, tiny_spec):
    tp, w, _, _ = setup
    facts = tb.run_baseline(tiny_spec, w, tp, "cpu", context=40, chunk=4, batch=2, steps=2, reps=1)
    assert "error" not in facts, facts
    assert facts["decode_ms"] > 0 and facts["prefill_ms"] > 0 and facts["prefill_tokens"] == 8
    assert "eager (CPU" in facts["mode"] and facts["experts"] == "fp8 e4m3 per-row scales"
    assert facts["kv"] == "float32 contiguous" and facts["notes"]
    broken = {k: v for k, v in w.items() if k != "model.layers.3.mlp.gate.weight"}
    bad = tb.run_baseline(tiny_spec, broken, tp, "cpu", context=40, chunk=4, batch=2, steps=2, reps=1)
    assert bad["error"].startswith("KeyError") and "decode_ms" not in bad


def test_compiled_blocks_trace_whole_and_share_one_compilation_per_kind(setup, tiny_spec):
    """What run_baseline(compile="blocks") does on a GPU before capturing the step: each block's decode through
    torch.compile (here dynamo's tracing only, with a backend that runs the traced graph as it is: fullgraph means
    no graph break in any block kind); 8 layers of 3 kinds (sliding+dense, sliding+MoE, full+MoE) are 3
    compilations, and the logits are unchanged."""
    import torch._dynamo

    tp, w, _, _ = setup
    model = tb.TorchBaseline(tiny_spec, w, tp, 0, "cpu", max_batch=2, max_context=MAX_CONTEXT)
    model.fill_context(40, seed=1)
    tok, pos = torch.tensor([3]), torch.tensor([40])
    ref = model.decode(tok, pos)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        model.compile_blocks(backend=backend)
        out = model.decode(tok, pos)
        out = model.decode(tok, pos)  # every kind compiled: no new graph
    finally:
        model.uncompile_blocks()
        torch._dynamo.reset()
    assert len(graphs) == 3
    assert torch.equal(out, ref)
    assert "decode" not in model.layers[0].__dict__

