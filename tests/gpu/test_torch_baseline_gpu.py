"""The ablation's plain-PyTorch baseline (bench/torch_baseline.py) on the GPU, in fp32 on the tiny spec: its timed
decode form (each block torch.compile'd, the whole step captured into one CUDA graph by hand) computes what its eager
step computes, and both equal beamc's IR interpreter (rel. err < 1e-4). In bf16 at full size the ablation's own
check (compiled graph vs eager step) cannot separate error from chaos (a random-weight MoE flips routings); this
test is the fp32 check that can. Writes $BEAMC_GPU_OUT/torch_baseline.json."""
from __future__ import annotations

import pytest
import torch

from conftest import write_gpu_summary
from test_torch_baseline import rel, tb

pytestmark = pytest.mark.gpu
SUMMARY: dict = {}


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield from write_gpu_summary(SUMMARY, "torch_baseline.json")


@pytest.mark.parametrize("how", ["blocks", "none"])
def test_graphed_decode_equals_eager_and_the_interpreter(tiny_spec, how):
    from beamc.codegen.package import compile_package
    from beamc.compiler import compile_graphs
    from beamc.runtime.random_weights import random_rank_weights
    from beamc.runtime.session import ReferenceSession

    package = compile_package(tiny_spec, tp=1, rank=0, passes=[], dtype="f32")
    w = random_rank_weights(tiny_spec, [st.graph for st in package.steps.values()], tp=1, rank=0, device="cuda",
                            seed=3)
    model = tb.TorchBaseline(tiny_spec, w, 1, 0, "cuda", max_batch=1, max_context=48, experts="exact")
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 512, (1, 20), generator=g)
    model.prefill(prompt.cuda(), 0)
    tok, pos = torch.tensor([7], device="cuda"), torch.tensor([20], device="cuda")
    eager = model.decode(tok, pos).clone()
    fn, out, what = tb._decode_runner(model, tok, pos, torch.device("cuda"), how)
    fn()
    torch.cuda.synchronize()
    graphs = compile_graphs(tiny_spec, tp=1, ranks=[0], dtype="f32")
    sess = ReferenceSession(tiny_spec, [{k: v.cpu() for k, v in w.items()}], tp=1, dtype="f32", max_seqs=1,
                            max_len=48, max_chunk=20, graphs=graphs)
    sess.prefill([(0, prompt[0].tolist())])
    ref = sess.decode({0: 7})
    r = {"mode": what, "graph_vs_eager": rel(out, eager), "eager_vs_interpreter": rel(eager.cpu(), ref),
         "notes": list(tb.NOTES)}
    SUMMARY[how] = r
    assert r["graph_vs_eager"] < 1e-4 and r["eager_vs_interpreter"] < 1e-4, r
