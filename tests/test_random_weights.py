"""Random rank weights made on the device (`runtime.random_weights`) and `Model.fill_context`, on the tiny spec.

In-process (no kernel imported): the dict has exactly the params of the rank's graphs, at the shapes and dtypes the
loader gives a real checkpoint (after the load-time packing), with sensible magnitudes, deterministic per seed.
In a child under TRITON_INTERPRET=1: `Model.load(pkg, None, weights=...)` runs a prefill, and after
`fill_context(seq, 20)` a decode step runs and writes position 20 (bf16 experts, fp8 KV cache, fp32 package)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_interpreted


def _graphs(spec, tp=1, rank=0, dtype=None):
    from beamc.codegen.package import compile_package
    from beamc.passes.manager import select_passes

    pkg = compile_package(spec, tp=tp, rank=rank, passes=select_passes("all"), dtype=dtype)
    return [st.graph for st in pkg.steps.values()]


def _with(spec, **dtypes):
    from beamc.spec.load import parse_spec

    d = spec.model_dump()
    d["dtypes"].update(dtypes)
    return parse_spec(d, f"{spec.name} {dtypes}")


@pytest.mark.parametrize("tp, rank", [(1, 0), (2, 1)])
def test_weights_match_what_the_loader_gives(tiny_spec, tiny_ckpt_nvfp4, tp, rank):
    from beamc.checkpoint.loader import load_rank_weights
    from beamc.runtime.interpret import _bind, with_packed_weights
    from beamc.runtime.random_weights import rank_params, random_rank_weights

    graphs = _graphs(tiny_spec, tp, rank)
    w = random_rank_weights(tiny_spec, graphs, tp=tp, rank=rank, device="cpu", seed=3)
    params = rank_params(graphs)
    assert set(w) == set(params)
    for name, node in params.items():
        _bind(node.out, w[name], {}, name)  # the graph's shape and dtype
        assert w[name].is_contiguous() and w[name].device.type == "cpu"
    loaded = with_packed_weights(graphs[0], load_rank_weights(tiny_spec, tiny_ckpt_nvfp4, tp=tp, rank=rank,
                                                               dtype=torch.bfloat16))
    for name in params:
        assert (loaded[name].shape, loaded[name].dtype) == (w[name].shape, w[name].dtype), name


def test_magnitudes_and_seed(tiny_spec):
    from beamc.checkpoint.nvfp4 import dequantize_stacked
    from beamc.runtime.random_weights import random_rank_weights

    spec = _with(tiny_spec, kv_cache="fp8")
    graphs = _graphs(spec, 2, 0)
    w = random_rank_weights(spec, graphs, tp=2, rank=0, device="cpu", seed=0)
    H, I = spec.hidden_size, spec.mlp.moe.d_ff
    p = "model.layers.3.mlp.experts"
    gu = dequantize_stacked(w[f"{p}.gate_up_proj.weight"], w[f"{p}.gate_up_proj.weight_scale"],
                            w[f"{p}.gate_up_proj.weight_scale_2"])
    down = dequantize_stacked(w[f"{p}.down_proj.weight"], w[f"{p}.down_proj.weight_scale"],
                              w[f"{p}.down_proj.weight_scale_2"])
    assert gu.std().item() == pytest.approx(1 / math.sqrt(H), rel=0.15)
    assert down.std().item() == pytest.approx(1 / math.sqrt(I), rel=0.15)
    assert torch.isfinite(gu).all() and torch.isfinite(down).all()
    qkvg = w["model.layers.0.self_attn.qkvg_proj.weight"].float()
    assert qkvg.std().item() == pytest.approx(1 / math.sqrt(H), rel=0.1)
    o = w["model.layers.0.self_attn.o_proj.weight"].float()  # a column share: fan-in is the full width
    assert o.std().item() == pytest.approx(1 / math.sqrt(spec.attention.num_heads * spec.attention.head_dim), rel=0.1)
    assert w["model.layers.0.input_layernorm.weight"].float().mean().item() == pytest.approx(1.0, abs=0.02)
    assert w["model.layers.5.self_attn.k_scale"].item() == 1.0 and w["model.layers.5.self_attn.v_scale"].item() == 1.0
    again = random_rank_weights(spec, graphs, tp=2, rank=0, device="cpu", seed=0)
    other = random_rank_weights(spec, graphs, tp=2, rank=0, device="cpu", seed=1)
    assert all(torch.equal(w[k].view(torch.uint8) if w[k].dtype.itemsize == 1 else w[k],
                           again[k].view(torch.uint8) if w[k].dtype.itemsize == 1 else again[k]) for k in w)
    assert not torch.equal(w["lm_head.weight"], other["lm_head.weight"])


def test_padded_lm_head_rows_are_zero(tiny_spec):
    """A vocabulary tp does not divide: the last rank's rows past it are zeros, as the loader pads them."""
    from beamc.runtime.random_weights import random_rank_weights
    from beamc.spec.load import parse_spec

    d = tiny_spec.model_dump()
    d["vocab_size"] = 497
    spec = parse_spec(d, "vocab 497")
    w = random_rank_weights(spec, _graphs(spec, 2, 1), tp=2, rank=1, device="cpu")
    head = w["lm_head.weight"]
    assert head.shape[0] == 249 and (head[248:] == 0).all() and (head[:248] != 0).any(1).all()


# ---------------------------------------------------------------- the child: runs under TRITON_INTERPRET=1
def _interpreted_main(out: str, spec_yaml: str) -> None:
    from beamc.codegen.package import compile_package
    from beamc.passes.manager import select_passes
    from beamc.runtime.model import Model
    from beamc.runtime.random_weights import random_rank_weights
    from beamc.spec import load_spec

    spec = load_spec(spec_yaml)
    package = compile_package(spec, passes=select_passes("all"), dtype="f32")
    pkg = package.write(Path(out).parent / "pkg")
    w = random_rank_weights(spec, [st.graph for st in package.steps.values()], device="cpu", seed=0)
    m = Model.load(pkg, None, device="cpu", weights=w, kv_dtype="fp8", max_batch=2, max_context=40,
                   max_prefill_tokens=16)
    r: dict = {}
    r["prefill_finite"] = bool(torch.isfinite(m.prefill(["a"], [[1, 2, 3, 4, 5]])).all())
    m.fill_context("f", 20, seed=1)
    r["lengths_after_fill"] = m.lengths
    snap = {k: t.clone().view(torch.uint8) for k, t in m.states.items()}
    r["decode_finite"] = bool(torch.isfinite(m.decode(["f"], [7])).all())
    r["lengths_after_decode"] = m.lengths
    slot, ps = m.seqs["f"].slot, m.page_size
    written = {}
    for name, node in m.bufs["decode"].graph.leaves("state").items():
        diff = m.states[name].view(torch.uint8) != snap[name]
        if node.out.shape[0] == "P":
            page = int(m.block_table_cpu[slot][20 // ps])
            rows = diff[page].flatten(1).any(1).nonzero().flatten().tolist()
            written[name] = ("paged", rows, [20 % ps])
        else:
            rows = diff[slot].flatten(1).any(1).nonzero().flatten().tolist()
            written[name] = ("ring", rows, [20 % m.states[name].shape[1]])
    r["written"] = written
    # the filled rows are not zeros: every page covering [0, 20) and the ring hold random values
    r["filled_nonzero"] = all(bool(snap[n][int(p)].any()) for n, node in m.bufs["decode"].graph.leaves("state").items()
                              if node.out.shape[0] == "P" for p in m.block_table_cpu[slot][:2])
    Path(out).write_text(json.dumps(r))


@pytest.fixture(scope="module")
def interpreted(tiny_spec_bf16, tmp_path_factory) -> dict:
    from beamc.spec.hf import spec_to_yaml

    d = tmp_path_factory.mktemp("random_weights")
    spec_yaml = d / "beam-tiny-bf16-fp8kv.yaml"
    spec_yaml.write_text(spec_to_yaml(_with(tiny_spec_bf16, kv_cache="fp8")))
    out = d / "result.json"
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_random_weights as t; "
            f"t._interpreted_main({str(out)!r}, {str(spec_yaml)!r})")
    return run_interpreted(["-c", code], out)


def test_model_loads_random_weights_without_a_checkpoint(interpreted):
    assert interpreted["prefill_finite"]


def test_fill_context_then_decode_writes_position_length(interpreted):
    assert interpreted["lengths_after_fill"] == {"a": 5, "f": 20}
    assert interpreted["decode_finite"]
    assert interpreted["lengths_after_decode"] == {"a": 5, "f": 21}
    assert interpreted["filled_nonzero"]
    for name, (kind, rows, want) in interpreted["written"].items():
        assert rows == want, (name, kind, rows, want)
