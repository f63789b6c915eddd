"""The full Beam spec's TP-8 rank-0 share on one GPU: batch-1 decode and 8 x 2,048-token prefill over 100K context.

    python bench/full_model.py [--out bench/results] [--context 102400] [--chunk 2048] [--steps 40]
    TRITON_INTERPRET=1 python bench/full_model.py --dry      # the same code path: tiny spec, CPU, context 40

What it does (no checkpoint files):
1. the spec (models/beam.yaml) with an fp8 KV cache and max_position_embeddings raised to the context asked
   (the shipped spec stops at 8,192), compiled for TP 8, rank 0, every pass, and written to a temporary package;
2. random weights for that rank made on the GPU (`runtime.random_weights`: bf16 dense, NVFP4 experts, fp32
   router, KV scales 1.0), loaded with `Model.load(pkg, None, weights=...)`, max_batch 8,
   max_context = context + chunk (at least), max_prefill_tokens = 8 * chunk;
3. one GPU holds one rank: the all-reduces run as copies (`library.all_reduce` without torch.distributed) and the
   logits all-gather is replaced by a copy of this rank's vocabulary share (`library.all_gather` needs
   torch.distributed, and would keep the step out of CUDA graphs); the output says so;
4. decode: one sequence started at `context` tokens by `Model.fill_context` (random fp8 cache rows, no prefill
   computed); the decode step's CUDA graph replayed `--steps` times (CUDA events, median ms), and the public
   `model.decode` call timed the same way (host planning and copies included);
5. prefill: 8 sequences filled to `context`, one ragged step of 8 x chunk tokens appended after it (the first call
   captures the bucket's graph), then replayed `--reps` times; also the public `model.prefill` call, rewound to
   `context` each time (start_positions);
6. where the time goes: one decode and one prefill step issued eagerly under torch.profiler (`profile_step.py`),
   device time by layer kind and op, printed as tables;
7. the kernels and library calls of one decode step, and the roofline: bytes a batch-1 decode step must read
   (every weight of the rank but the embedding table, whose one row counts, and top_k / num_experts of the expert
   weights; K and V of the context in the full layers, of the window in the sliding ones) over the read bandwidth
   measured in the same run (`bench/kernels.py::read_bandwidth`).
Writes OUT/full-model-<date>.json and prints a short table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from beamc.codegen.overrides import parse_overrides  # noqa: E402
from beamc.codegen.package import compile_package  # noqa: E402
from beamc.errors import BeamcError  # noqa: E402
from beamc.passes.manager import select_passes  # noqa: E402
from beamc.spec import load_spec  # noqa: E402
from beamc.spec.load import parse_spec  # noqa: E402

GB = 1e9
SKIPPED = ("tensor parallelism simulated: one GPU holds one rank's share (rank 0); the all-reduces (in place) are "
           "skipped (no torch.distributed; the ablation's rows without allreduce_norm copy instead) and the logits "
           "all-gather is a copy of this rank's vocabulary share, so the times exclude all communication")


def bench_spec(path: Path, context: int, chunk: int, experts: str | None):  # chunk: the positions after context
    """The spec with an fp8 KV cache and room for context + chunk positions (and `experts` dtype if given)."""
    d = load_spec(path).model_dump()
    d["dtypes"]["kv_cache"] = "fp8"
    d["max_position_embeddings"] = max(d["max_position_embeddings"], context + chunk)  # >= max_context
    if experts:
        d["dtypes"]["experts"] = experts
    return parse_spec(d, f"{path.name} (fp8 KV, {context + chunk} positions)")


def load_rank_model(a: argparse.Namespace, spec, device, prefix: str, load: dict, **compile_opts):
    """Rank 0 of --tp's package of `spec` (every pass; fp32 under --dry; `compile_opts`: compile_package's), written to
    a temporary folder and loaded (`load`: Model.load's sizes) with random weights made on the device, fp8 KV.
    Returns (package, model, tmp): keep tmp (the folder) alive while the model runs."""
    from beamc.runtime.model import Model
    from beamc.runtime.random_weights import random_rank_weights

    package = compile_package(spec, tp=a.tp, rank=0, passes=select_passes("all"), dtype="f32" if a.dry else None,
                              nvfp4_relayout=a.nvfp4_relayout, **compile_opts)
    tmp = tempfile.TemporaryDirectory(prefix=prefix)
    pkg = package.write(Path(tmp.name) / "pkg")
    w = random_rank_weights(spec, [st.graph for st in package.steps.values()], tp=a.tp, rank=0, device=device,
                            seed=a.seed)
    model = Model.load(pkg, None, device=str(device), spec=spec, tp=a.tp, rank=0, kv_dtype="fp8", weights=w,
                       take_weights=True, **load)
    return package, model, tmp


def single_rank_collectives() -> None:
    """One process holds one rank: the logits all-gather becomes a copy of this rank's share (rest zeros), with no
    host synchronisation, so the step can be captured (`library.all_reduce` already copies without a process
    group)."""
    import os

    import torch.distributed as dist

    from beamc.runtime import graphs
    from beamc.runtime.model import SKIP_COLLECTIVES_ENV

    if dist.is_available() and dist.is_initialized():
        raise SystemExit("run this benchmark without torch.distributed: it simulates one rank on one GPU")
    os.environ[SKIP_COLLECTIVES_ENV] = "1"  # Model.load accepts tp > 1 alone; library.all_gather copies this share
    graphs.HOST_SYNC.pop("all_gather", None)  # which then allocates nothing per call


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int) -> list[float]:
    """ms of each of `reps` calls of fn(): CUDA events on a GPU, wall time on a CPU."""
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def wall(fn, device, reps: int) -> list[float]:
    """ms of each call including the host's work (synchronised before and after)."""
    out = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def replay(model, key: tuple, phase: str, sizes: dict):
    """A function running one bucket's step as the runtime does (its CUDA graph when captured)."""
    v = model.buffers(phase, sizes)
    return lambda: model.graphs.run(key, v)


def decode_bytes(model, spec, context: int) -> dict[str, int]:
    """Bytes one batch-1 decode step at `context` must read: weights (experts: top_k of num_experts; the
    embedding: one row) and K/V (full layers: the context; sliding: the window)."""
    m = spec.mlp.moe
    w = e = 0
    for name, t in model.weights.items():
        n = t.numel() * t.element_size()
        if ".mlp.experts." in name:
            e += n * m.top_k // m.num_experts
        elif name == "model.embed_tokens.weight":
            w += t[0].numel() * t.element_size()
        else:
            w += n
    kv = 0
    g = model.bufs["decode"].graph
    for name, node in g.leaves("state").items():
        t = model.states[name]
        row = t[0, 0].numel() * t.element_size()  # one position of one slot / page
        kv += row * (context if node.out.shape[0] == "P" else min(spec.effective_window, context))
    return {"weights": w, "experts": e, "kv": kv, "total": w + e + kv}


def add_common_args(ap: argparse.ArgumentParser, steps: int, reps: int) -> None:
    """The flags full_model.py and ablation.py share (one TP rank's share of a spec, long context)."""
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    ap.add_argument("--spec", default=str(ROOT / "models/beam.yaml"))
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--context", type=int, default=102_400)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill tokens per sequence")
    ap.add_argument("--batch", type=int, default=8, help="max_batch and the prefill's sequences")
    ap.add_argument("--steps", type=int, default=steps, help="timed decode steps (median)")
    ap.add_argument("--reps", type=int, default=reps, help="timed prefill steps (median)")
    ap.add_argument("--experts", default=None, help="override dtypes.experts (e.g. bf16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nvfp4-relayout", action=argparse.BooleanOptionalAction, default=True,
                    help="compile with the NVFP4 relayout at load (the default; --no-nvfp4-relayout: ModelOpt bytes)")
    ap.add_argument("--attention-mirror", action=argparse.BooleanOptionalAction, default=True,
                    help="compile with --attention-mirror auto (the default: pages for 8 sequences of the spec's "
                         "max_position_embeddings, i.e. of --context + --chunk); --no-attention-mirror: off")
    ap.add_argument("--dry", action="store_true", help="the same code path on the tiny spec on a CPU (set "
                    "TRITON_INTERPRET=1): bf16 experts, TP 2, context 40, 2 x 4-token prefill, 2 decode steps")


def add_set_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--set", action="append", default=[], metavar="TEMPLATE.CONSTANT=VALUE",
                    help="compile with `beamc compile --set ...` (a template constant pinned; repeatable)")


def set_overrides(a: argparse.Namespace, prog: str) -> dict:
    """--set's template overrides; a misspelt template or constant: one line, before the GPU is touched."""
    try:
        return parse_overrides(a.set)
    except BeamcError as e:
        raise SystemExit(f"{prog}: {e}") from None


def device_for(a: argparse.Namespace) -> torch.device:
    """--dry: the tiny spec's settings on the CPU (under Triton's interpreter); else the GPU. Also points
    bench/kernels.py's timing helpers at that device."""
    if a.dry:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--dry runs the generated kernels on the CPU: set TRITON_INTERPRET=1")
        a.spec, a.tp, a.context, a.chunk, a.batch, a.steps, a.reps = \
            str(ROOT / "models/beam-tiny.yaml"), 2, 40, 4, 2, 2, 1
        a.experts = a.experts or "bfloat16"  # the NVFP4 decode kernel takes minutes under the interpreter
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (or --dry under TRITON_INTERPRET=1)")
        device = torch.device("cuda")
    import kernels as kb  # bench/kernels.py: read_bandwidth

    kb.DEVICE = device.type
    return device


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, steps=40, reps=5)
    ap.add_argument("--moe-combine-max-tokens", type=int, default=None, metavar="N",
                    help="compile with `beamc compile --moe-combine-max-tokens N` (the MoE decode kernel's COMBINE "
                         "render up to N tokens; default: the compiler's)")
    add_set_arg(ap)
    ap.add_argument("--l2-prefetch-mb", type=int, default=None, metavar="MB",
                    help="compile with `beamc compile --l2-prefetch-mb MB` (default: the compiler's)")
    ap.add_argument("--profile", choices=("all", "decode"), default="all",
                    help="which steps to profile by layer kind (the prefill profile takes ~40 s on an H200)")
    a = ap.parse_args(argv)
    overrides = set_overrides(a, "full_model.py")
    device = device_for(a)
    import kernels as kb  # bench/kernels.py: read_bandwidth

    from profile_step import breakdown_table, profile_replay, profile_step

    from beamc.runtime.model import Model
    from beamc.runtime.random_weights import random_rank_weights, weights_nbytes

    single_rank_collectives()
    t0 = time.perf_counter()
    facts: dict = {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
                   "dry": a.dry, "note": SKIPPED, "tp": a.tp, "rank": 0,
                   "context": a.context, "chunk": a.chunk, "batch": a.batch, "kv_cache": "fp8",
                   "env": {"torch": torch.__version__,
                           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"}}
    spec = bench_spec(Path(a.spec), a.context, max(a.chunk, a.steps + 4), a.experts)
    facts["spec"] = {"name": spec.name, "experts": spec.dtypes.experts,
                     "max_position_embeddings": spec.max_position_embeddings}
    package = compile_package(spec, tp=a.tp, rank=0, passes=select_passes("all"),
                              dtype="f32" if a.dry else None, nvfp4_relayout=a.nvfp4_relayout,
                              attention_mirror_pages=None if a.attention_mirror else 0,
                              moe_combine_max_tokens=a.moe_combine_max_tokens,
                              template_overrides=overrides, l2_prefetch_mb=a.l2_prefetch_mb)
    facts["l2_prefetch_mb"] = package.l2_prefetch_mb
    facts["attention_mirror_pages"] = package.attention_mirror_pages
    facts["template_overrides"] = package.template_overrides
    facts["moe_combine_max_tokens"] = a.moe_combine_max_tokens
    tmp = tempfile.TemporaryDirectory(prefix="beam-full-")
    pkg = package.write(Path(tmp.name) / "pkg")
    facts["compile_s"] = round(time.perf_counter() - t0, 1)
    t = time.perf_counter()
    w = random_rank_weights(spec, [st.graph for st in package.steps.values()], tp=a.tp, rank=0, device=device,
                            seed=a.seed)
    sync(device)
    facts["weights_gb"] = round(weights_nbytes(w) / GB, 2)
    facts["weights_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    max_context = a.context + max(a.chunk, a.steps + 4)  # the decode steps (3 warm-ups) fit too
    model = Model.load(pkg, None, device=str(device), spec=spec, tp=a.tp, rank=0, kv_dtype="fp8", weights=w,
                       take_weights=True, max_batch=a.batch, max_context=max_context, max_prefill_tokens=a.batch * a.chunk)
    del w
    sync(device)
    facts["load_s"] = round(time.perf_counter() - t, 1)
    facts["arena_gb"] = round(model.arena_bytes / GB, 2)
    facts["kv_gb"] = round(sum(t.numel() * t.element_size() for t in model.states.values()) / GB, 2)
    gen = torch.Generator().manual_seed(a.seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist()

    # ---- decode: batch 1 at `context`
    model.fill_context("d", a.context, seed=a.seed)
    for tok in tokens(3):  # warm up (the decode graphs were captured at load)
        model.decode(["d"], [tok])
    key = ("decode", 1, 1)
    dec_replay = timed(replay(model, key, "decode", {"B": 1, "R": 1}), device, a.steps)
    dec_api = wall(lambda: model.decode(["d"], tokens(1)), device, a.steps)
    launches = model.phases["decode"].launches
    facts["decode"] = {
        "ms": statistics.median(dec_replay), "ms_api": statistics.median(dec_api), "steps": a.steps,
        "runs_as": model.graphs.status.get(key, "?"),
        "kernels": sum(1 for _, ln in launches if ln.kernel is not None and ln.runs_for(1)),
        "library_calls": dict(Counter(ln.library for _, ln in launches if ln.library and ln.runs_for(1))),
        "distinct_kernels": len(model.manifest.get("kernels", {})),
    }
    prof = profile_step(model, "decode", {"B": 1, "R": 1}, reps=3)  # which kernel holds the time
    facts["decode"]["profile"] = prof
    # (the launch -> kernel-count map only serves the replay's mapping: not written, ~5,000 lines of JSON)
    facts["decode"]["replay_profile"] = profile_replay(replay(model, key, "decode", {"B": 1, "R": 1}), device,
                                                       launch_kernels=prof.pop("launch_kernels", None))
    model.release("d")
    # ---- roofline of the decode step
    bw = kb.read_bandwidth()  # TB/s
    nbytes = decode_bytes(model, spec, a.context)
    roof_ms = nbytes["total"] / (bw * 1e12) * 1e3
    facts["roofline"] = {"bytes": nbytes, "read_tb_s": round(bw, 3), "ms": roof_ms,
                         "fraction": roof_ms / facts["decode"]["ms"]}
    # ---- prefill: batch x chunk tokens after `context` each
    seqs = [f"p{i}" for i in range(a.batch)]
    for i, s in enumerate(seqs):
        model.fill_context(s, a.context, seed=a.seed + 1 + i)
    chunks = [tokens(a.chunk) for _ in seqs]
    starts = [a.context] * a.batch
    t = time.perf_counter()
    model.prefill(seqs, chunks, start_positions=starts)  # captures the bucket's graph
    sync(device)
    first_s = time.perf_counter() - t
    pkey = next(k for k in model.graphs.status if k[0] == "prefill")
    pre_replay = timed(replay(model, pkey, "prefill", {"T": pkey[1], "R": pkey[2]}), device, a.reps)
    pre_api = wall(lambda: model.prefill(seqs, chunks, start_positions=starts), device, a.reps)
    facts["prefill"] = {"ms": statistics.median(pre_replay), "ms_api": statistics.median(pre_api), "reps": a.reps,
                        "tokens": a.batch * a.chunk, "bucket": pkey[1], "first_call_s": round(first_s, 2),
                        "runs_as": model.graphs.status.get(pkey, "?"),
                        "tokens_per_s": a.batch * a.chunk / (statistics.median(pre_replay) / 1e3)}
    pprof = None
    if a.profile == "all":
        facts["prefill"]["profile"] = pprof = profile_step(model, "prefill", {"T": pkey[1], "R": pkey[2]}, reps=1)
        # the replayed graph's timeline: where its time goes besides its kernels (idle gaps, by neighbours)
        facts["prefill"]["replay_profile"] = profile_replay(
            replay(model, pkey, "prefill", {"T": pkey[1], "R": pkey[2]}), device, 1,
            launch_kernels=pprof.pop("launch_kernels", None))
    facts["graphs"] = model.graphs.summary()
    if device.type == "cuda":
        facts["max_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / GB, 2)
    facts["total_s"] = round(time.perf_counter() - t0, 1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"full-model-{facts['date']}{'-dry' if a.dry else ''}.json"
    path.write_text(json.dumps(facts, indent=1) + "\n")
    d, p, r = facts["decode"], facts["prefill"], facts["roofline"]
    print(f"{spec.name}: TP-{a.tp} rank 0 on one {facts['env']['device']}; {SKIPPED}")
    print(f"weights {facts['weights_gb']} GB (made in {facts['weights_s']} s), KV {facts['kv_gb']} GB, "
          f"arena {facts['arena_gb']} GB" + (f", peak {facts['max_memory_gb']} GB" if "max_memory_gb" in facts else ""))
    print(f"{'step':<34}{'ms (graph)':>12}{'ms (API)':>12}  runs as")
    print(f"{f'decode, batch 1 @ {a.context}':<34}{d['ms']:>12.3f}{d['ms_api']:>12.3f}  {d['runs_as']}")
    print(f"{f'prefill {a.batch} x {a.chunk} @ {a.context}':<34}{p['ms']:>12.2f}{p['ms_api']:>12.2f}  {p['runs_as']}")
    print(f"decode: {d['kernels']} kernels + {sum(d['library_calls'].values())} library calls "
          f"{d['library_calls']}; roofline {r['ms']:.3f} ms ({nbytes['total'] / GB:.2f} GB at {bw:.2f} TB/s read) "
          f"= {r['fraction']:.0%} of the measured step")
    for name, step in (("decode", d), ("prefill", p)):
        rp = step.get("replay_profile")
        if rp and "span_us" in rp:
            gaps = ", ".join(f"{k} {us / 1e3:.2f}" for k, us in list(rp["idle_us_by_neighbours"].items())[:4])
            print(f"{name} graph replay: {rp['kernels']:.0f} kernels in a {step['ms']:.3f} ms step; under the "
                  f"profiler a {rp['span_us'] / 1e3:.3f} ms span, kernels busy {rp['busy_us'] / 1e3:.3f}, idle "
                  f"{rp['idle_us'] / 1e3:.3f} (ms; by neighbours: {gaps})")
            ops = rp.get("graph_us_by_op")
            if isinstance(ops, dict):
                top = defaultdict(float)
                for label, us in ops.items():
                    top[label.split(": ", 1)[1]] += us
                print(f"  {name} replay by op (us/step, each launch's own span): " + ", ".join(
                    f"{o} {us:.0f}" for o, us in sorted(top.items(), key=lambda x: -x[1])[:8]))
            elif ops:
                print(f"  {name} replay by op: {ops}")
    print(breakdown_table(prof))
    if pprof is not None:
        print(breakdown_table(pprof))
    print(f"wrote {path} ({facts['total_s']} s)")
    return facts


if __name__ == "__main__":
    main()
