"""The compiled runtime on the GPU (tiny spec, NVFP4 experts): compiled vs the interpreter in fp32 (< 1e-4) and in
bf16 (statistically: mean |delta logprob| of the reference's tokens < MAX_MEAN_DLOGPROB over a 64-token continuation
of a ragged batch of 4, greedy tokens equal on MIN_GREEDY_AGREEMENT of those where the reference's top-2 margin
exceeds 1e-2; and each bf16 model's deviation from the fp32 one: the compiled within 1.5x the interpreter's); every
decode batch bucket; CUDA-graph decode equal to eager decode bit for bit, through a long ragged decode where sequences
join and leave and pages are reused (BEAMC_RUNTIME_STEPS steps, default 10,000); the fp8 KV cache. Writes
$BEAMC_GPU_OUT/runtime.json.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from conftest import rel_err, routing_margins, write_gpu_summary

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
STEPS = int(os.environ.get("BEAMC_RUNTIME_STEPS", "10000"))  # the issue: a 10,000-step ragged decode


@pytest.fixture(scope="module")
def summary():
    yield from write_gpu_summary({}, "runtime.json")


def _ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _package(spec, tmp_path_factory, dtype: str | None, **options) -> Path:
    """The spec's package with every pass (`options`: compile_package's, e.g. attention_mirror_pages), written."""
    from beamc.codegen.package import compile_package
    from beamc.passes.manager import select_passes

    d = tmp_path_factory.mktemp(f"pkg_{dtype or 'bf16'}")
    compile_package(spec, passes=select_passes("all"), dtype=dtype, **options).write(d)
    return d


@pytest.fixture(scope="module")
def pkg_bf16(tiny_spec, tmp_path_factory):
    return _package(tiny_spec, tmp_path_factory, None)


@pytest.fixture(scope="module")
def pkg_f32(tiny_spec, tmp_path_factory):
    return _package(tiny_spec, tmp_path_factory, "f32")


def _load(pkg, ckpt, **kw):
    from beamc.runtime.model import Model

    return Model.load(pkg, ckpt, device="cuda", **{"max_batch": 8, "max_context": 256, "max_prefill_tokens": 256,
                                                    **kw})


def _ref(spec, ckpt, dtype, **kw):
    from beamc.runtime.session import ReferenceSession

    return ReferenceSession.from_checkpoint(spec, ckpt, dtype=dtype, device="cuda",
                                            **{"max_seqs": 8, "max_len": 256, "max_chunk": 256, **kw})


def test_fp32_compiled_equals_the_interpreter(tiny_spec, tiny_ckpt_nvfp4, pkg_f32, summary):
    m, ref = _load(pkg_f32, tiny_ckpt_nvfp4), _ref(tiny_spec, tiny_ckpt_nvfp4, "f32")
    seqs = [_ids(n, i) for i, n in enumerate((40, 7, 90, 1))]
    errs = [rel_err(g, w) for g, w in zip(m.prefill(list(range(4)), seqs, all_logits=True),
                                          ref.prefill(list(enumerate(seqs))))]
    for t in range(8):
        toks = _ids(4, 100 + t)
        errs.append(rel_err(m.decode(list(range(4)), toks), ref.decode(dict(enumerate(toks)))))
    summary["fp32_max_rel_err"] = max(errs)
    summary["graphs_f32"] = m.graphs.summary()
    assert max(errs) < 1e-4


@pytest.mark.parametrize("lens,down", [((1000,) * 5, False), ((1024,) * 16, True), ((1024,) * 16, False)],
                         ids=["dequant", "dequant-down", "dequant-16k"])
def test_long_prefill_dequant_render_equals_the_interpreter(tiny_spec, tiny_ckpt_nvfp4, pkg_f32, summary, lens, down,
                                                            tmp_path_factory, monkeypatch):
    """A prefill of MOE_DEQUANT_MIN_TOKENS tokens or more (5 sequences, 5,000 tokens) takes the MoE kernel's DEQUANT
    render (the gate_up experts dequantised once per step); of MOE_DEQUANT_DOWN_MIN_TOKENS or more (16 x 1,024) its
    DEQUANT_DOWN render (the down experts too); "dequant-16k": the same 16 x 1,024 through DEQUANT alone (the
    threshold raised for this package), which tells the render's share from the size's: fp32, equal to the
    interpreter (< 1e-4) on every sequence whose tokens all route decisively. (2026-12-01 s9run1: dequant-down and
    dequant-16k give the same errors, 1e-6 but 2.3e-4 on sequence 9, whose token 508 has a routing margin of 1.2e-7 in
    layer 2: a near-tie, not the render.)"""
    import beamc.codegen.emitters as emitters

    T = sum(lens)
    pkg = pkg_f32
    if T >= emitters.MOE_DEQUANT_DOWN_MIN_TOKENS and not down:
        monkeypatch.setattr(emitters, "MOE_DEQUANT_DOWN_MIN_TOKENS", T + 1)
        pkg = _package(tiny_spec, tmp_path_factory, "f32")
    assert T >= emitters.MOE_DEQUANT_MIN_TOKENS and (T >= emitters.MOE_DEQUANT_DOWN_MIN_TOKENS) == down
    m = _load(pkg, tiny_ckpt_nvfp4, max_batch=len(lens), max_context=1024, max_prefill_tokens=T)
    ref = _ref(tiny_spec, tiny_ckpt_nvfp4, "f32", max_seqs=len(lens), max_len=1024, max_chunk=T)
    launches = m.package.steps["prefill"].launches
    assert any(ln.kernel is not None and ln.kernel.constants.get("DEQUANT") and ln.runs_for(T)
               and bool(ln.kernel.constants.get("DEQUANT_DOWN")) == down for _, ln in launches), \
        "no DEQUANT render in the prefill step at this size"
    seqs = [_ids(n, 50 + i) for i, n in enumerate(lens)]
    with routing_margins() as rm:
        want = [x[-1] for x in ref.prefill(list(enumerate(seqs)))]
    errs = [rel_err(g, w) for g, w in zip(m.prefill(list(range(len(lens))), seqs), want)]
    # a sequence with a routing near-tie (some token's margin below 1e-6: four ulps of a choice value in [1, 2); the
    # fp32 router's noise is ~1e-7) may route differently in the kernels' summation order: judged only where every
    # token of the sequence routes decisively (16 x 1,024: 12 of 16 sequences; 5 x 1,000: all)
    margin = [float(x.min()) for x in rm.per_row().split(list(lens))]
    decisive = [e for e, g in zip(errs, margin) if g > 1e-6]
    name = f"long_prefill_{'dequant_down' if down else 'dequant'}_{T}_f32"
    summary[name + "_rel_errs"], summary[name + "_routing_margins"] = errs, margin
    assert len(decisive) >= len(lens) // 2 and max(decisive) < 1e-4


# Whole-model bf16 is compared statistically (a random-weight MoE is chaotic in bf16: one routing flip moves the
# logits by 10%+). Measured on the H200 (2026-11-30, bench/results/2026-11-30-run3-runtime-gpu.json): mean |delta
# logprob| 0.024 and greedy agreement 223 / 245 decisive tokens for compiled vs interpreter, both bf16; the
# interpreter's own bf16 CUDA-vs-CPU figure is 0.0086 / 0.963 (tests/gpu/test_interpreter_cuda.py). The compiled
# kernels round elsewhere than torch (online softmax, split-K sums, the NVFP4 decode kernel's unrounded dequantised
# weights: 5e-3 relative per MoE output), so the bounds are set at about twice the measured deviation.
MAX_MEAN_DLOGPROB = 0.05
MIN_GREEDY_AGREEMENT = 0.85


def _track(m, ref, seqs, steps: int) -> dict:
    """Teacher-forced on the reference's greedy tokens so both runs see the same context."""
    got = m.prefill(list(range(len(seqs))), seqs)
    want = torch.stack([x[-1] for x in ref.prefill(list(enumerate(seqs)))]).float()
    dlp, agree, decisive = [], 0, 0
    for _ in range(steps):
        lp_g, lp_w = got.log_softmax(-1), want.log_softmax(-1)
        tok = want.argmax(-1)
        dlp.append((lp_g.gather(1, tok[:, None]) - lp_w.gather(1, tok[:, None])).abs().flatten())
        top2 = want.topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > 1e-2
        decisive += int(sure.sum())
        agree += int((got.argmax(-1) == tok)[sure].sum())
        got = m.decode(list(range(len(seqs))), tok.tolist())
        want = ref.decode(dict(enumerate(tok.tolist()))).float()
    return {"mean_abs_dlogprob": torch.cat(dlp).mean().item(), "greedy_agree": agree, "greedy_decisive": decisive}


def test_bf16_compiled_tracks_the_interpreter(tiny_spec, tiny_ckpt_nvfp4, pkg_bf16, summary):
    m, ref = _load(pkg_bf16, tiny_ckpt_nvfp4), _ref(tiny_spec, tiny_ckpt_nvfp4, "bf16")
    seqs = [_ids(n, 10 + i) for i, n in enumerate((33, 5, 120, 64))]
    r = _track(m, ref, seqs, 64)
    summary["bf16"] = {**r, "graphs": m.graphs.summary()}
    assert r["mean_abs_dlogprob"] < MAX_MEAN_DLOGPROB, r
    assert r["greedy_agree"] >= MIN_GREEDY_AGREEMENT * r["greedy_decisive"], r


def test_f16_model_with_mixed_storage_tracks_its_interpreter(tiny_spec, tmp_path_factory, summary):
    """A float16 model whose checkpoint stores its weight groups in three dtypes (attention and norms fp32,
    embeddings fp16, dense MLPs bf16): the package computes in float16 like the interpreter at the spec's dtypes
    (the loader converts every float weight to the activations dtype), within the bf16 test's statistics."""
    from beamc.checkpoint.init import init_weights
    from conftest import spec_variant

    spec = spec_variant(tiny_spec, {"dtypes.activations": "float16", "dtypes.embeddings": "float16",
                                    "dtypes.lm_head": "float16", "dtypes.attention_weights": "float32",
                                    "dtypes.norm_weights": "float32", "dtypes.dense_mlp_weights": "bfloat16"})
    ckpt = init_weights(spec, tmp_path_factory.mktemp("ckpt_f16"), seed=4)
    m, ref = _load(_package(spec, tmp_path_factory, None), ckpt), _ref(spec, ckpt, None)
    seqs = [_ids(n, 20 + i) for i, n in enumerate((33, 5, 120, 64))]
    r = _track(m, ref, seqs, 64)
    summary["f16_mixed_storage"] = r
    assert r["mean_abs_dlogprob"] < MAX_MEAN_DLOGPROB, r
    assert r["greedy_agree"] >= MIN_GREEDY_AGREEMENT * r["greedy_decisive"], r


class _SessionAsModel:
    """A ReferenceSession behind the runtime's prefill / decode calls (last-token logits), for `_track`."""

    def __init__(self, ref):
        self.ref = ref

    def prefill(self, ids, seqs):
        return torch.stack([x[-1] for x in self.ref.prefill(list(zip(ids, seqs)))])

    def decode(self, ids, toks):
        return self.ref.decode(dict(zip(ids, toks)))


def test_bf16_compiled_is_as_close_to_fp32_as_the_bf16_interpreter(tiny_spec, tiny_ckpt_nvfp4, pkg_bf16, summary):
    """Chaos or error? The compiled bf16 model and the bf16 interpreter, each teacher-forced on the fp32
    interpreter's greedy tokens: the compiled model's mean |delta logprob| from fp32 within 1.5x the interpreter's
    own (+0.005). (Both round to bf16 at other points than fp32; the compiled kernels keep some values in fp32 that
    the interpreter rounds: neither is the fp32 model, and a random-weight MoE amplifies any rounding.)"""
    seqs = [_ids(n, 10 + i) for i, n in enumerate((33, 5, 120, 64))]
    f32 = lambda: _ref(tiny_spec, tiny_ckpt_nvfp4, "f32")  # noqa: E731 - a fresh teacher per follower
    rc = _track(_load(pkg_bf16, tiny_ckpt_nvfp4), f32(), seqs, 64)
    ri = _track(_SessionAsModel(_ref(tiny_spec, tiny_ckpt_nvfp4, "bf16")), f32(), seqs, 64)
    summary["bf16_vs_fp32"] = {"compiled": rc, "interpreter": ri}
    assert rc["mean_abs_dlogprob"] <= 1.5 * ri["mean_abs_dlogprob"] + 0.005, summary["bf16_vs_fp32"]


def test_every_decode_bucket(tiny_spec, tiny_ckpt_nvfp4, pkg_f32, summary):
    """Batches of 1..8 sequences (buckets 1, 2, 4, 8, padded), each equal to the reference's decode."""
    m, ref = _load(pkg_f32, tiny_ckpt_nvfp4), _ref(tiny_spec, tiny_ckpt_nvfp4, "f32")
    seqs = [_ids(5 + i, 200 + i) for i in range(8)]
    m.prefill(list(range(8)), seqs)
    ref.prefill(list(enumerate(seqs)))
    errs = {}
    for b in range(1, 9):
        toks = _ids(b, 300 + b)
        errs[b] = rel_err(m.decode(list(range(b)), toks), ref.decode(dict(enumerate(toks))))
    summary["decode_buckets"] = errs
    assert max(errs.values()) < 1e-4


def _ragged_run(m, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """Sequences join (prefill) and leave (release) while the others decode; slots and pages are reused."""
    g = torch.Generator().manual_seed(seed)
    live: dict[int, int] = {}  # seq id -> length
    nxt, out = 0, []
    for step in range(steps):
        if len(live) < m.max_batch and (not live or torch.rand((), generator=g) < 0.05):
            n = int(torch.randint(1, 40, (), generator=g))
            out.append(m.prefill([nxt], [torch.randint(0, 512, (n,), generator=g).tolist()]))
            live[nxt] = n
            nxt += 1
        done = [s for s, n in live.items() if n >= m.max_context - 1 or torch.rand((), generator=g) < 0.01]
        for s in done:
            m.release(s)
            del live[s]
        if not live:
            continue
        ids = list(live)
        logits = m.decode(ids, torch.randint(0, 512, (len(ids),), generator=g).tolist())
        out.append(logits)
        for s in ids:
            live[s] += 1
    return out


def test_graph_decode_equals_eager_decode_bitwise(tiny_ckpt_nvfp4, pkg_bf16, summary):
    graphs = _load(pkg_bf16, tiny_ckpt_nvfp4, max_context=128, max_prefill_tokens=64)
    eager = _load(pkg_bf16, tiny_ckpt_nvfp4, max_context=128, max_prefill_tokens=64, eager=True)
    a, b = _ragged_run(graphs, STEPS), _ragged_run(eager, STEPS)
    same = [bool(torch.equal(x, y)) for x, y in zip(a, b)]
    summary["graphs_vs_eager"] = {"steps": STEPS, "outputs": len(same), "bitwise_equal": sum(same),
                                  "first_difference": same.index(False) if not all(same) else None,
                                  "graphs": graphs.graphs.summary()}
    assert len(a) == len(b) and all(same)


def test_planned_moe_equals_the_scanning_one_bitwise(tiny_spec, tiny_ckpt_nvfp4, tmp_path_factory, summary):
    """moe_nvfp4_decode's PLAN (the default from 65 pairs) on every step (`--set moe_nvfp4_decode.PLAN_MIN_PAIRS=0`:
    the tiny spec's steps have at most 8 x 4 pairs in decode) against the scanning render (`PLAN=false`): a ragged
    run of min(BEAMC_RUNTIME_STEPS, 300) steps (prefill chunks of 1-39 tokens, decode of 1-8 sequences), graph
    replays and eager steps, every output bitwise equal (a pair's MMA column changes none of its bits)."""
    pkgs = {name: _package(tiny_spec, tmp_path_factory, None, template_overrides={"moe_nvfp4_decode": pin})
            for name, pin in (("plan", {"PLAN_MIN_PAIRS": 0}), ("scan", {"PLAN": False}))}
    steps, kw = min(STEPS, 300), dict(max_context=128, max_prefill_tokens=64)
    runs = {label: _ragged_run(_load(pkgs[name], tiny_ckpt_nvfp4, **kw, **extra), steps)
            for label, name, extra in (("plan", "plan", {}), ("plan_eager", "plan", {"eager": True}),
                                       ("scan", "scan", {}))}
    same = {k: [bool(torch.equal(x, y)) for x, y in zip(runs["plan"], runs[k])] for k in ("plan_eager", "scan")}
    summary["planned_moe"] = {"steps": steps, "outputs": len(runs["plan"]),
                              **{f"bitwise_equal_{k}": sum(v) for k, v in same.items()}}
    assert all(len(r) == len(runs["plan"]) for r in runs.values()) and all(torch.isfinite(x).all() for x in runs["plan"])
    assert all(same["plan_eager"]) and all(same["scan"]), summary["planned_moe"]


def _tp2_rank_runs(spec, ckpt, tmp_path_factory, monkeypatch, options: dict, check, runs: tuple,
                   models: dict | None = None):
    """One TP-2 rank's share on one GPU (collectives skipped, the all-gather then a copy): a package for each
    {name: compile_package options} (`check(name, package)` asserts what it launches), then for each (label, package
    name, load options) a ragged decode of min(BEAMC_RUNTIME_STEPS, 300) steps; ({label: outputs}, steps). `models`:
    a dict that receives each label's loaded model."""
    from beamc.codegen.package import compile_package
    from beamc.passes.manager import select_passes
    from beamc.runtime import graphs as rt_graphs
    from beamc.runtime.model import SKIP_COLLECTIVES_ENV

    monkeypatch.setenv(SKIP_COLLECTIVES_ENV, "1")
    monkeypatch.delitem(rt_graphs.HOST_SYNC, "all_gather", raising=False)
    pkgs = {}
    for name, opts in options.items():
        pk = compile_package(spec, tp=2, rank=0, passes=select_passes("all"), **opts)
        check(name, pk)
        pkgs[name] = pk.write(tmp_path_factory.mktemp(f"pkg_tp2_{name}"))
    kw = dict(tp=2, rank=0, max_context=128, max_prefill_tokens=64)
    steps = min(STEPS, 300)
    out = {}
    for label, name, extra in runs:
        m = _load(pkgs[name], ckpt, **kw, **extra)
        out[label] = _ragged_run(m, steps)
        if models is not None:
            models[label] = m
    return out, steps


def test_tp2_rank_graphs_equal_eager_and_the_combine_render_its_two_launches(tiny_spec, tiny_ckpt_nvfp4,
                                                                             tmp_path_factory, summary, monkeypatch):
    """One TP-2 rank's share on one GPU (collectives skipped, as bench/full_model.py does), where the combine_experts
    pass applies: decode steps of 1-8 tokens run the MoE decode kernel's COMBINE render (the top-k combine in its down
    epilogue). Through a ragged decode (min(BEAMC_RUNTIME_STEPS, 300) steps): graph replays equal eager steps bit for
    bit, and equal a package without the COMBINE render (moe_combine_max_tokens=0: the plain render, then the
    moe_combine kernel; the same rounding points and the same MMAs along K, bitwise equal in the GPU kernel tests; in
    fp32 under the CPU interpreter numpy sums the two renders' dot shapes in other orders: 3e-7 apart there)."""
    def check(name, pk):
        combine = [ln.kernel.constants.get("COMBINE", False) for _, ln in pk.steps["decode"].launches
                   if ln.kernel is not None and ln.kernel.template == "moe_nvfp4_decode"]
        assert combine and any(combine) == (name == "combine"), (name, combine)  # (T > 8: the plain render in both)

    runs, steps = _tp2_rank_runs(tiny_spec, tiny_ckpt_nvfp4, tmp_path_factory, monkeypatch,
                                 {"combine": {}, "two_launches": dict(moe_combine_max_tokens=0)}, check,
                                 (("graphs", "combine", {}), ("eager", "combine", {"eager": True}),
                                  ("two_launches", "two_launches", {})))
    same = {k: [bool(torch.equal(x, y)) for x, y in zip(runs["graphs"], runs[k])] for k in ("eager", "two_launches")}
    summary["tp2_rank"] = {"steps": steps, "outputs": len(runs["graphs"]),
                           **{f"bitwise_equal_{k}": sum(v) for k, v in same.items()},
                           "max_abs_diff_two_launches": max((x - y).abs().max().item() for x, y in
                                                            zip(runs["graphs"], runs["two_launches"]))}
    assert all(len(r) == len(runs["graphs"]) for r in runs.values())
    assert all(torch.isfinite(x).all() for x in runs["graphs"])
    assert all(same["eager"]) and all(same["two_launches"]), summary["tp2_rank"]


def test_tp2_rank_with_the_persistent_moe(tiny_spec, tiny_ckpt_nvfp4, tmp_path_factory, summary, monkeypatch):
    """`--set moe_nvfp4_decode.PERSIST=true`: one TP-2 rank's share (collectives skipped) whose decode steps of 1-8
    tokens run the MoE decode kernel's COMBINE render as one cooperative launch with a grid barrier between its
    stages (PDL on: the next kernel released only after the barrier). Through a ragged decode
    (min(BEAMC_RUNTIME_STEPS, 300) steps, each layer's launch reusing the barrier's counters): graph replays equal
    eager steps and the two-launch COMBINE render's package bit for bit (the same per-item code)."""
    def check(name, pk):
        persist = [ln.kernel.constants.get("PERSIST", False) for _, ln in pk.steps["decode"].launches
                   if ln.kernel is not None and ln.kernel.constants.get("COMBINE")]
        assert persist and all(persist) == (name == "persist"), (name, persist)

    pin = {"moe_nvfp4_decode": {"PERSIST": True}}
    models: dict = {}
    runs, steps = _tp2_rank_runs(tiny_spec, tiny_ckpt_nvfp4, tmp_path_factory, monkeypatch,
                                 {"persist": dict(template_overrides=pin), "combine": {}}, check,
                                 (("graphs", "persist", {}), ("eager", "persist", {"eager": True}),
                                  ("combine", "combine", {})), models)
    same = {k: [bool(torch.equal(x, y)) for x, y in zip(runs["graphs"], runs[k])] for k in ("eager", "combine")}
    summary["tp2_persistent_moe"] = {"steps": steps, "outputs": len(runs["graphs"]),
                                     **{f"bitwise_equal_{k}": sum(v) for k, v in same.items()},
                                     "capture": models["graphs"].graphs.summary()}
    # (a capture the driver refuses turns the phase eager: the comparison above would then hold trivially)
    assert not models["graphs"].graphs.failed and any(k[0] == "decode" for k in models["graphs"].graphs.graphs), (
        summary["tp2_persistent_moe"])
    assert all(len(r) == len(runs["graphs"]) for r in runs.values())
    assert all(torch.isfinite(x).all() for x in runs["graphs"])
    assert all(same["eager"]) and all(same["combine"]), summary["tp2_persistent_moe"]


def test_tp2_rank_with_moe_frag(tiny_spec, tiny_ckpt_nvfp4, tmp_path_factory, summary, monkeypatch):
    """`--moe-frag-max-tokens 2`: one TP-2 rank's share (collectives skipped) whose decode steps of 1-2 tokens run the
    MoE experts as moe_nvfp4_frag (Gluon), 3-8 tokens the COMBINE render. Through a ragged decode
    (min(BEAMC_RUNTIME_STEPS, 300) steps, batches of 1 and more): graph replays equal eager steps bit for bit; against
    the package without the option, the steps' logits close (median relative difference < 5e-2: the frag kernel sums
    in another fp32 order, one bf16 rounding apart where they differ, and bf16 differences grow through the layers and
    the caches; the kernel's own accuracy is tests/gpu/test_kernels_moe_gpu.py::test_moe_nvfp4_frag's)."""
    def check(name, pk):
        used = any(ln.kernel is not None and ln.kernel.template == "moe_nvfp4_frag"
                   for _, ln in pk.steps["decode"].launches)
        assert used == (name == "frag"), name

    runs, steps = _tp2_rank_runs(tiny_spec, tiny_ckpt_nvfp4, tmp_path_factory, monkeypatch,
                                 {"frag": dict(moe_frag_max_tokens=2), "plain": {}}, check,
                                 (("graphs", "frag", {}), ("eager", "frag", {"eager": True}), ("plain", "plain", {})))
    same = [bool(torch.equal(x, y)) for x, y in zip(runs["graphs"], runs["eager"])]
    rel = [((x.float() - y.float()).norm() / y.float().norm()).item() for x, y in zip(runs["graphs"], runs["plain"])]
    summary["tp2_moe_frag"] = {"steps": steps, "outputs": len(same), "bitwise_equal_eager": sum(same),
                               "max_rel_vs_plain": max(rel), "median_rel_vs_plain": sorted(rel)[len(rel) // 2]}
    assert all(len(r) == len(runs["graphs"]) for r in runs.values())
    assert all(torch.isfinite(x).all() for x in runs["graphs"]) and all(same), summary["tp2_moe_frag"]
    assert summary["tp2_moe_frag"]["median_rel_vs_plain"] < 5e-2, summary["tp2_moe_frag"]


@pytest.mark.parametrize("form", ["plain", "bm128", "bm256"])
def test_prefill_with_the_wgmma_moe(form, tiny_spec, tiny_ckpt_nvfp4, tmp_path_factory, pkg_bf16, summary):
    """`--set moe_nvfp4_prefill.WGMMA=true` (plain), or pinned to one of the forms the emitter takes from 2,048 tokens
    on (emitters.MOE_WGMMA_FORMS): prefills of more than 64 tokens run the MoE GEMMs as the warp-specialised Gluon
    kernel (the weights decoded by its load partition; tests/gpu/test_kernels_moe_prefill_gpu.py checks the kernel). A
    ragged prefill of 4 sequences (250 tokens): graph replay equal to eager bit for bit; then teacher-forced on the
    bf16 interpreter's greedy tokens for 16 decode steps, the package tracks it as the default package does (mean
    |delta logprob| < MAX_MEAN_DLOGPROB, or within 1.5x the default package's)."""
    from beamc.codegen.emitters import moe_wgmma_form, wtma_shapes
    from test_kernels_moe import moe_constants

    pin = {"WGMMA": True} if form == "plain" else moe_wgmma_form(form)  # (a pin is every render's: no COMBINE)
    c = moe_constants(tiny_spec, 1)
    if not wtma_shapes(c["H"], c["I"]):  # (as the emitter does: the tiny spec's relayout chunks are too short for it)
        pin.pop("WG_WTMA", None)
    pkg = _package(tiny_spec, tmp_path_factory, None, template_overrides={"moe_nvfp4_prefill": pin})
    lens = (100, 80, 50, 20)
    seqs = [_ids(n, 70 + i) for i, n in enumerate(lens)]
    graphs, eager = _load(pkg, tiny_ckpt_nvfp4), _load(pkg, tiny_ckpt_nvfp4, eager=True)
    assert any(ln.kernel is not None and ln.kernel.constants.get("WGMMA") and ln.runs_for(sum(lens))
               for _, ln in graphs.package.steps["prefill"].launches), "no WGMMA render in the prefill step"
    a = graphs.prefill(list(range(len(lens))), seqs)
    b = eager.prefill(list(range(len(lens))), seqs)
    assert torch.isfinite(a).all() and torch.equal(a, b)
    t_wg = _track(_load(pkg, tiny_ckpt_nvfp4), _ref(tiny_spec, tiny_ckpt_nvfp4, "bf16"), seqs, 16)
    t_default = _track(_load(pkg_bf16, tiny_ckpt_nvfp4), _ref(tiny_spec, tiny_ckpt_nvfp4, "bf16"), seqs, 16)
    summary[f"prefill_wgmma_moe_{form}"] = {"graphs_bitwise_eager": True, "wgmma": t_wg, "default": t_default}
    assert t_wg["mean_abs_dlogprob"] < max(MAX_MEAN_DLOGPROB, 1.5 * t_default["mean_abs_dlogprob"]), summary


def test_decode_buckets_are_captured(tiny_ckpt_nvfp4, pkg_bf16, summary):
    m = _load(pkg_bf16, tiny_ckpt_nvfp4)
    summary["decode_capture"] = m.graphs.summary()
    captured = [k for k in m.graphs.graphs if k[0] == "decode"]
    if not captured:
        pytest.xfail(f"decode runs eagerly: {m.graphs.summary()['decode']}")
    assert sorted(k[1] for k in captured) == m.decode_buckets


def test_fp8_kv_cache(tiny_spec, tiny_ckpt_nvfp4, tmp_path_factory, summary):
    from beamc.spec import parse_spec

    data = tiny_spec.model_dump()
    data["dtypes"]["kv_cache"] = "fp8"
    fp8 = parse_spec(data)
    pkg = _package(fp8, tmp_path_factory, None)
    m = _load(pkg, tiny_ckpt_nvfp4, spec=fp8, kv_dtype="fp8")
    ref = _ref(fp8, tiny_ckpt_nvfp4, "bf16")
    assert m.states["kv.0.k"].dtype == torch.float8_e4m3fn
    # bf16 activations: statistically, as above (the 2026-11-30 run's logits-rel-err check measured 0.05-0.47 per
    # step: chaos, not logic — the fp8 cache writes are bit-exact on the H200 (tests/gpu/test_kernels_attn_router_gpu.py)
    # and fp8 attention within 1e-2 of the reference fed the same cache; Triton's CPU interpreter rounds fp32 -> e4m3
    # differently from CUDA for ~2% of values, so the fp32 CPU checks cannot pin fp8 caches bit for bit)
    # e4m3 rounding amplifies the upstream bf16 differences (a value that crosses a rounding boundary moves by one
    # e4m3 ulp, ~6%): measured 0.036 and 48 / 57 decisive tokens (run 4, 2026-11-30), hence the looser agreement bound
    r = _track(m, ref, [_ids(30, 400), _ids(9, 401)], 32)
    summary["fp8"] = r
    assert r["mean_abs_dlogprob"] < MAX_MEAN_DLOGPROB, r
    assert r["greedy_agree"] >= 0.75 * r["greedy_decisive"], r


def test_fp8_kv_cache_attention_mirror(tiny_spec, tiny_ckpt_nvfp4, tmp_path_factory, summary):
    """A package compiled with --attention-mirror (full-attention prefill through a bf16 mirror of the step's fp8 K/V;
    20 pages: room for some sequences of the batch, the others read the cache) tracks the interpreter as the plain
    fp8 package does (test_fp8_kv_cache's bounds). Its kernel gives the plain render's bits at equal tiles
    (tests/gpu/test_kernels_attention_prefill_gpu.py); its default tiles differ (BLOCK_N 64 vs 128: another order of
    the softmax sums), so whole-model logits are compared statistically; the distance to the plain package is recorded."""
    from beamc.spec import parse_spec

    data = tiny_spec.model_dump()
    data["dtypes"]["kv_cache"] = "fp8"
    fp8 = parse_spec(data)
    seqs = [_ids(n, 500 + i) for i, n in enumerate((200, 37, 250, 5))]
    d = _package(fp8, tmp_path_factory, None, attention_mirror_pages=20)
    m = _load(d, tiny_ckpt_nvfp4, spec=fp8, kv_dtype="fp8", max_context=512, max_prefill_tokens=512)
    assert any(k.constants.get("MIRROR") for k in m.package.kernels.values()), "no MIRROR render in the package"
    r = _track(m, _ref(fp8, tiny_ckpt_nvfp4, "bf16", max_len=512, max_chunk=512), seqs, 16)  # (492 tokens a step)
    del m
    plain = _load(_package(fp8, tmp_path_factory, None, attention_mirror_pages=0), tiny_ckpt_nvfp4, spec=fp8,
                  kv_dtype="fp8", max_context=512, max_prefill_tokens=512)
    summary["attention_mirror"] = dict(r, without_mirror=_track(
        plain, _ref(fp8, tiny_ckpt_nvfp4, "bf16", max_len=512, max_chunk=512), seqs, 16))
    assert r["mean_abs_dlogprob"] < MAX_MEAN_DLOGPROB, summary["attention_mirror"]
    assert r["greedy_agree"] >= 0.75 * r["greedy_decisive"], summary["attention_mirror"]


def test_fp8_mirror_prefill_on_wgmma(tiny_spec, tmp_path_factory, summary):
    """The mirrored prefill passes as the WGMMA render (the sm90 bf16 default for head dims of 64 or 128,
    emitters.ATTENTION_WGMMA_TILES: the full layers over the pool's mirror, and with emitters.ATTENTION_RING_MIRROR
    (off by default) the sliding layers over the ring's; the tiny spec at head dim 64 here, its own checkpoint) inside the runtime's prefill steps, graphs and all: tracks the
    interpreter as the mirrored package does (test_fp8_kv_cache's bounds); the distance to the same package with
    `--set attention_prefill.WGMMA=false` (the Triton passes) is recorded."""
    import beamc.codegen.emitters as em
    from beamc.checkpoint.init import init_weights
    from beamc.spec import parse_spec

    data = tiny_spec.model_dump()
    data["dtypes"]["kv_cache"] = "fp8"
    data["attention"]["head_dim"] = 64
    data["attention"]["sliding"]["rope"]["rotary_dim"] = 64
    spec = parse_spec(data)
    ckpt = tmp_path_factory.mktemp("tiny64_nvfp4")
    init_weights(spec, ckpt, seed=98, experts="nvfp4")
    seqs = [_ids(n, 700 + i) for i, n in enumerate((200, 37, 250, 5))]
    runs = {}
    for name, pins in (("wgmma", None), ("triton", {"attention_prefill": {"WGMMA": False}})):
        d = _package(spec, tmp_path_factory, None, attention_mirror_pages=20, template_overrides=pins)
        m = _load(d, ckpt, spec=spec, kv_dtype="fp8", max_context=512, max_prefill_tokens=512)
        wg = [k for k in m.package.kernels.values() if k.template == "attention_prefill" and k.constants.get("WGMMA")]
        assert bool(wg) is (name == "wgmma") and all(k.constants.get("MIRROR") for k in wg), name
        assert {k.constants["WINDOW"] > 0 for k in wg} <= {False, em.ATTENTION_RING_MIRROR}, name  # (sliding: if on)
        runs[name] = _track(m, _ref(spec, ckpt, "bf16", max_len=512, max_chunk=512), seqs, 16)
        del m
    r = runs["wgmma"]
    summary["attention_mirror_wgmma"] = runs
    assert r["mean_abs_dlogprob"] < MAX_MEAN_DLOGPROB, runs
    assert r["greedy_agree"] >= 0.75 * r["greedy_decisive"], runs


def test_l2_prefetch_changes_no_value(tiny_spec, tiny_ckpt_nvfp4, tmp_path_factory, pkg_bf16, summary, monkeypatch):
    """The decode step's L2 prefetches (`codegen.prefetch`; the tiny spec's weights are under the plan's MIN_BYTES,
    lowered to 0 here so that every attention and MoE op gets one) run on a side stream that a CUDA graph captures as
    a branch: decode with them is captured, and its outputs are bitwise those of the package without them, with and
    without graphs, over a ragged run."""
    import beamc.codegen.prefetch as prefetch

    monkeypatch.setattr(prefetch, "MIN_BYTES", 0)  # (the runtime rebuilds the package: patched for both)
    pkg = _package(tiny_spec, tmp_path_factory, None, l2_prefetch_mb=24)
    assert "l2_prefetch_" in (pkg / "step.py").read_text()
    steps = min(STEPS, 300)
    runs = {}
    for name, p, eager in (("plain", pkg_bf16, False), ("prefetch", pkg, False), ("prefetch_eager", pkg, True)):
        m = _load(p, tiny_ckpt_nvfp4, max_context=128, max_prefill_tokens=64, eager=eager)
        runs[name] = (_ragged_run(m, steps), m.graphs.summary()["decode"])
        del m
    same = {k: sum(bool(torch.equal(x, y)) for x, y in zip(runs["plain"][0], runs[k][0])) for k in runs}
    summary["l2_prefetch"] = {"steps": steps, "outputs": len(runs["plain"][0]), "bitwise_equal_to_plain": same,
                              "decode": {k: v[1] for k, v in runs.items()}}
    assert runs["prefetch"][1] == "graphs", runs["prefetch"][1]
    assert all(n == len(runs["plain"][0]) for n in same.values()), same
