"""What the runtime's API costs on the host: `model.decode` / `model.prefill` against their CUDA graphs' replays,
for the input path in the tree and the one before it (`legacy`), in one run on one loaded model.

    python bench/api_overhead.py [--out bench/results] [--context 102400] [--chunk 2048] [--steps 100] [--reps 5]
    TRITON_INTERPRET=1 python bench/api_overhead.py --dry      # the same code path: tiny spec, CPU

The model is bench/full_model.py's: the spec's TP-8 rank-0 share with random weights, fp8 KV, one sequence at
`--context` for decode (batch 1), 8 sequences of `--chunk` tokens after `--context` for prefill. Per step kind, ms:
- `graph`: the bucket's graph replayed (CUDA events, median), the GPU's time alone;
- `api`: one public call, synchronised before and after (the host's planning, checks and copies, then the GPU's);
- `host`: the same call with the replay left out (what the host spends before the GPU can start);
- `loop` (decode): `--steps` calls issued back to back, one synchronisation at the end, per step: where the host's
  work overlaps the GPU's (the host runs ahead), this is the graph's time.
`legacy` is the input path before 2026-12-07 (`LEGACY_WRITE` below): token lists padded in Python, one host tensor
and one synchronising copy per input, long prefill chunks planned as int lists; `tree` is the runtime as it is.
Writes OUT/api-overhead-<date>.json and prints a table last.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from full_model import (SKIPPED, add_common_args, bench_spec, device_for, load_rank_model,  # noqa: E402
                        single_rank_collectives, sync, timed, wall)


def legacy_write(self, phase: str, ids, pos, slots, rows, size: int, rb: int) -> None:
    """The runtime's `_write_inputs` before 2026-12-07: each input padded as a Python list, made a host tensor and
    copied with torch's synchronising copy (pageable memory: the host waits for the stream each time)."""
    ids, pos, slots = (x.tolist() if isinstance(x, torch.Tensor) else x for x in (ids, pos, slots))
    pad, ins = size - len(ids), self.inputs[phase]
    ins["input_ids"][:size].copy_(torch.tensor(ids + [0] * pad, dtype=torch.int64))
    ins["positions"][:size].copy_(torch.tensor(pos + [i % self._pad_mod for i in range(pad)], dtype=torch.int64))
    ins["slots"][:size].copy_(torch.tensor(slots + [self.pad_slot] * pad, dtype=torch.int64))
    if "logit_rows" in ins:
        ins["logit_rows"][:rb].copy_(torch.tensor(rows + [0] * (rb - len(rows)), dtype=torch.int64))


@contextlib.contextmanager
def input_path(model, name: str):
    """`tree`: the runtime as it is; `legacy`: its input path before 2026-12-07 (see legacy_write)."""
    import beamc.runtime.model as rm

    if name == "tree":
        yield
        return
    saved = rm.LONG_CHUNK
    rm.LONG_CHUNK = 1 << 62  # every chunk an int list, as before
    model._write_inputs = legacy_write.__get__(model)
    try:
        yield
    finally:
        rm.LONG_CHUNK = saved
        del model._write_inputs


@contextlib.contextmanager
def no_replay(model):
    """The API's host work alone: the graph (or eager step) left out."""
    run = model.graphs.run
    model.graphs.run = lambda key, v: None
    try:
        yield
    finally:
        model.graphs.run = run


def loop_ms(fn, device, steps: int) -> float:
    """ms per call of `steps` calls issued back to back, synchronised once at the end."""
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - t) * 1e3 / steps


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, steps=100, reps=5)
    a = ap.parse_args(argv)
    device = device_for(a)
    single_rank_collectives()
    t0 = time.perf_counter()
    room = max(a.chunk, 2 * a.steps + 8)
    spec = bench_spec(Path(a.spec), a.context, room, a.experts)
    _, model, tmp = load_rank_model(a, spec, device, "beam-api-", dict(
        max_batch=a.batch, max_context=a.context + room, max_prefill_tokens=a.batch * a.chunk),
        attention_mirror_pages=None if a.attention_mirror else 0)
    gen = torch.Generator().manual_seed(a.seed)
    facts: dict = {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
                   "dry": a.dry, "note": SKIPPED, "tp": a.tp, "context": a.context, "chunk": a.chunk,
                   "batch": a.batch, "steps": a.steps, "reps": a.reps,
                   "env": {"torch": torch.__version__,
                           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"},
                   "load_s": round(time.perf_counter() - t0, 1), "decode": {}, "prefill": {}}

    # ---- decode, batch 1 at `context`: each path's calls rewound to the same length (start over per path)
    def decode_call():
        model.decode(["d"], torch.randint(0, spec.vocab_size, (1,), generator=gen).tolist())

    from full_model import replay

    rounds = ("legacy", "tree") * (1 if a.dry else 2)  # alternating (the GPU is shared and noisy)
    for path in rounds:
        model.fill_context("d", a.context, seed=a.seed)
        with input_path(model, path):
            for _ in range(3):
                decode_call()
            d = facts["decode"].setdefault(path, {"api": [], "host": [], "loop": []})
            d["api"] += wall(decode_call, device, max(1, a.steps // 2))
            with no_replay(model):
                d["host"] += wall(decode_call, device, max(1, a.steps // 2))
            d["loop"].append(loop_ms(decode_call, device, max(1, a.steps // 2)))
        model.release("d")
    facts["decode"]["graph"] = timed(replay(model, ("decode", 1, 1), "decode", {"B": 1, "R": 1}), device, a.steps)

    # ---- prefill: `batch` x `chunk` tokens after `context` each, rewound each call (start_positions)
    seqs = [f"p{i}" for i in range(a.batch)]
    for i, s in enumerate(seqs):
        model.fill_context(s, a.context, seed=a.seed + 1 + i)
    chunks = [torch.randint(0, spec.vocab_size, (a.chunk,), generator=gen).tolist() for _ in seqs]
    starts = [a.context] * a.batch

    def prefill_call():
        model.prefill(seqs, chunks, start_positions=starts)

    prefill_call()  # captures the bucket's graph
    for path in rounds:
        with input_path(model, path):
            p = facts["prefill"].setdefault(path, {"api": [], "host": []})
            p["api"] += wall(prefill_call, device, a.reps)
            with no_replay(model):
                p["host"] += wall(prefill_call, device, a.reps)
    pkey = next(k for k in model.graphs.status if k[0] == "prefill")
    facts["prefill"]["graph"] = timed(replay(model, pkey, "prefill", {"T": pkey[1], "R": pkey[2]}), device, a.reps)
    facts["graphs"] = model.graphs.summary()
    facts["total_s"] = round(time.perf_counter() - t0, 1)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"api-overhead-{facts['date']}{'-dry' if a.dry else ''}.json"
    path.write_text(json.dumps(facts, indent=1) + "\n")
    med = statistics.median
    print(f"{spec.name}: TP-{a.tp} rank 0 on one {facts['env']['device']}; graphs: {facts['graphs']}")
    print(f"{'ms (median)':<36}{'graph':>10}{'api':>10}{'host':>10}{'loop':>10}")
    for kind, label in (("decode", f"decode, batch 1 @ {a.context}"),
                        ("prefill", f"prefill {a.batch} x {a.chunk} @ {a.context}")):
        f = facts[kind]
        for p in ("legacy", "tree"):
            loop = f"{med(f[p]['loop']):>10.3f}" if "loop" in f[p] else ""
            print(f"{f'{label}, {p}':<36}{med(f['graph']):>10.3f}{med(f[p]['api']):>10.3f}"
                  f"{med(f[p]['host']):>10.3f}{loop}")
    print(f"wrote {path} ({facts['total_s']} s)")
    return facts


if __name__ == "__main__":
    main()
