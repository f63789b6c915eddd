"""Decode by batch size: the full spec's TP-8 rank-0 share with B sequences at `--context` each, ms a step, tokens/s,
the step's bytes over the read rate of the same run, and the replay's time by op, for each batch bucket.

    python bench/decode_batch.py [--out bench/results] [--context 102400] [--batches 1,2,4,8,16,32,64] [--steps 30]
    TRITON_INTERPRET=1 python bench/decode_batch.py --dry      # the same code path: tiny spec, CPU

The model is bench/full_model.py's (random weights, fp8 KV, one GPU holds one rank: collectives skipped), loaded
once with max_batch = the largest batch; its decode buckets are captured at load. Every sequence gets `--context`
tokens of random cache (`Model.fill_context`), then for each batch B the first B sequences take 2 decode steps
through the API (warm-up) and the bucket's graph is replayed `--steps` times (CUDA events, median).
Bytes a step reads: the rank's weights but the experts and the embedding table (one row a token), the experts
touched (E x (1 - (1 - k / E)^B) of them expected under uniform routing: random weights route about uniformly),
and each sequence's K / V (full layers: the context; sliding: the window). Writes OUT/decode-batch-<date>.json and
prints a table last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from full_model import (SKIPPED, add_common_args, add_set_arg, bench_spec, decode_bytes, device_for,  # noqa: E402
                        load_rank_model, replay, set_overrides, single_rank_collectives, timed)


# options that set an emitter constant before the compile: flag -> (constant, file-name tag, what it does)
EMITTER_OPTIONS = {
    "moe_decode_max_tokens": ("MOE_DECODE_MAX_TOKENS", "moe", "steps of more tokens run the MoE experts on the grouped "
                              "(sorted-by-expert) kernel instead of moe_nvfp4_decode (default: the emitter's)"),
    "router_large_min_tokens": ("ROUTER_DECODE_LARGE_MIN_TOKENS", "router", "decode steps of N tokens or more run "
                                "the router's large (tensor-core) path instead of its small-M one (default: the emitter's, "
                                "16; a bound past the largest bucket keeps the small path)"),
    "moe_combine_max_tokens": ("MOE_COMBINE_MAX_TOKENS", "combine", "steps of up to N tokens run the MoE decode "
                               "kernel's COMBINE render, larger ones its plain render then moe_combine (default: the "
                               "emitter's)"),
    "gemv_min_tokens": ("GEMV_MIN_TOKENS", "gemv", "decode GEMMs run the generated gemv up to at least N tokens "
                        "(default: the measured choices, codegen/measured)"),
    "attention_batch_min_tokens": ("ATTENTION_DECODE_BATCH_MIN_TOKENS", "attnb", "decode steps of N tokens or more "
                                   "run the decode attention with emitters.ATTENTION_DECODE_BATCH_TILES (default: "
                                   "none)")}


def step_bytes(model, spec, context: int, batch: int) -> dict[str, float]:
    """Bytes a decode step of `batch` sequences at `context` reads (experts: the expected distinct ones)."""
    one = decode_bytes(model, spec, context)  # batch 1: top_k of the experts, one embedding row, one sequence's K / V
    m = spec.mlp.moe
    all_experts = one["experts"] * m.num_experts / m.top_k if m is not None else 0
    touched = 1 - (1 - m.top_k / m.num_experts) ** batch if m is not None else 0
    out = {"weights": one["weights"], "experts": all_experts * touched, "kv": one["kv"] * batch}
    out["total"] = sum(out.values())
    return out


def by_op(replay_profile: dict) -> dict[str, float]:
    """us a step by op (`profile_replay`'s spans by launch, summed over layers)."""
    ops = replay_profile.get("graph_us_by_op")
    top: dict[str, float] = defaultdict(float)
    if isinstance(ops, dict):
        for label, us in ops.items():
            top[label.split(": ", 1)[1]] += us
    return dict(sorted(top.items(), key=lambda x: -x[1]))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, steps=30, reps=1)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64", help="decode batch sizes (each a bucket)")
    for flag, (const, _, what) in EMITTER_OPTIONS.items():
        ap.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None, metavar="N",
                        help=f"compile with emitters.{const} = N: {what}")
    add_set_arg(ap)
    a = ap.parse_args(argv)
    overrides = set_overrides(a, "decode_batch.py")
    device = device_for(a)
    batches = sorted({int(b) for b in a.batches.split(",")})
    if a.dry:
        batches = [1, 2]
    import kernels as kb  # bench/kernels.py: read_bandwidth
    from profile_step import profile_replay, profile_step

    from beamc.codegen import emitters

    chosen = {flag: getattr(a, flag) for flag in EMITTER_OPTIONS if getattr(a, flag) is not None}
    for flag, n in chosen.items():
        setattr(emitters, EMITTER_OPTIONS[flag][0], n)
    single_rank_collectives()
    t0 = time.perf_counter()
    room = 2 * a.steps + 8
    spec = bench_spec(Path(a.spec), a.context, room, a.experts)
    package, model, tmp = load_rank_model(a, spec, device, "beam-batch-", dict(
        max_batch=max(batches), max_context=a.context + room, max_prefill_tokens=16, decode_buckets=batches),
        attention_mirror_pages=0, template_overrides=overrides)
    facts: dict = {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
                   "dry": a.dry, "note": SKIPPED, "tp": a.tp, "context": a.context, "steps": a.steps,
                   **{const.lower(): getattr(emitters, const) for const, _, _ in EMITTER_OPTIONS.values()},
                   "template_overrides": package.template_overrides,
                   "env": {"torch": torch.__version__,
                           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"},
                   "load_s": round(time.perf_counter() - t0, 1), "graphs": model.graphs.summary(), "rows": []}
    seqs = [f"s{i}" for i in range(max(batches))]
    for i, s in enumerate(seqs):
        model.fill_context(s, a.context, seed=a.seed + i)
    bw = kb.read_bandwidth()  # TB/s, this run
    facts["read_tb_s"] = round(bw, 3)
    gen = torch.Generator().manual_seed(a.seed)
    for b in batches:
        for _ in range(2):  # through the API: the inputs of this batch's rows, then warm
            model.decode(seqs[:b], torch.randint(0, spec.vocab_size, (b,), generator=gen).tolist())
        key, sizes = ("decode", b, b), {"B": b, "R": b}
        ms = statistics.median(timed(replay(model, key, "decode", sizes), device, a.steps))
        nbytes = step_bytes(model, spec, a.context, b)
        row = {"batch": b, "ms": ms, "tokens_per_s": b / ms * 1e3, "bytes": nbytes,
               "read_ms": nbytes["total"] / (bw * 1e12) * 1e3 if bw else None, "runs_as": model.graphs.status.get(key)}
        if device.type == "cuda":
            prof = profile_step(model, "decode", sizes, reps=1)
            row["by_op_us"] = by_op(profile_replay(replay(model, key, "decode", sizes), device, 1,
                                                   launch_kernels=prof.pop("launch_kernels", None)))
        facts["rows"].append(row)
        print(f"batch {b}: {ms:.3f} ms", flush=True)
    facts["total_s"] = round(time.perf_counter() - t0, 1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "".join(f"-{EMITTER_OPTIONS[flag][1]}{n}" for flag, n in chosen.items()) + "".join(
        "-" + o.split(".", 1)[-1].replace("=", "") for o in a.set)  # (--set a.B=4: -B4)
    path = out / f"decode-batch-{facts['date']}{tag}{'-dry' if a.dry else ''}.json"
    path.write_text(json.dumps(facts, indent=1) + "\n")
    print(f"{spec.name}: TP-{a.tp} rank 0 on one {facts['env']['device']}, context {a.context}, read {bw:.2f} TB/s; "
          f"MoE decode kernel up to {emitters.MOE_DECODE_MAX_TOKENS} tokens; --set {a.set}; graphs: {facts['graphs']}")
    print(f"{'batch':>6}{'ms':>9}{'tok/s':>9}{'GB read':>9}{'read ms':>9}{'roof':>6}  largest ops (us a step)")
    for r in facts["rows"]:
        roof = f"{r['read_ms'] / r['ms']:.0%}" if r["read_ms"] else ""
        read_ms = f"{r['read_ms']:.3f}" if r["read_ms"] else ""
        ops = ", ".join(f"{o.split('/')[-1]} {us:.0f}" for o, us in list(r.get("by_op_us", {}).items())[:4])
        print(f"{r['batch']:>6}{r['ms']:>9.3f}{r['tokens_per_s']:>9.0f}{r['bytes']['total'] / 1e9:>9.2f}"
              f"{read_ms:>9}{roof:>6}  {ops}")
    print(f"wrote {path} ({facts['total_s']} s)")
    return facts


if __name__ == "__main__":
    main()
