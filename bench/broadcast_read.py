"""Broadcast reads on the GPU: P programs each reading the same B bytes (the whole buffer, one tile per program), the
buffer written by the kernel just before (as a fused consumer reads its producer's output) or by no kernel of the
graph, against P programs each reading B bytes of their own (the same traffic, distinct lines).

Why: the twenty-second session's O_PROJ render (each of the o_proj GEMV's 80-320 programs merging the same 50 KB of
the sliding attention's partial states) took 14-24 us more than the launches it replaced, growing with its program
count: before another fusion has many programs read one producer's output (the router's logits in every MoE
program, a norm in every GEMV program), this measures what such reads cost per program count and size. Measured
(H200, s22run4): 64 KB read by 528 programs in 2.7 us after its writer (12.8 TB/s delivered; 5.7 us for 528 distinct
64 KB), 2 KB by 16-528 programs 1.2-1.6 us: a broadcast costs about what one program's read costs, so O_PROJ's excess
was its programs' own chains, not their reads.

    python bench/broadcast_read.py --out $OUT        # on the GPU: a table last, JSON into OUT
    TRITON_INTERPRET=1 python bench/broadcast_read.py --dry
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as kb  # noqa: E402  bench/kernels.py: graph_time, read_bandwidth


@triton.jit
def write_kernel(buf_ptr, n, value, BLOCK: tl.constexpr):
    # the producer: every element of the buffer written (a fresh value each launch)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(buf_ptr + i, (i % 7).to(tl.float32) + value, mask=i < n)


@triton.jit
def read_kernel(buf_ptr, out_ptr, stride_prog, N: tl.constexpr):
    # a consumer program: its N floats (at pid * stride_prog: 0 for the broadcast) in one tile, all in flight at once
    j = tl.arange(0, N)
    x = tl.load(buf_ptr + tl.program_id(0).to(tl.int64) * stride_prog + j, mask=j < N, other=0.0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(x, axis=0))


def run_case(nbytes: int, programs: int, mode: str, device: str, reps: int) -> dict:
    """µs of one read launch: mode "after-write" (broadcast, the buffer written by the launch before: pair - write),
    "read-only" (broadcast, no writer) or "distinct" (each program its own nbytes, written before: pair - write)."""
    n = nbytes // 4
    distinct = mode == "distinct"
    buf = torch.zeros(n * (programs if distinct else 1), device=device)
    out = torch.empty(programs, device=device)
    stride = n if distinct else 0
    block = 1024

    def write():
        write_kernel[(triton.cdiv(buf.numel(), block),)](buf, buf.numel(), 1.0, BLOCK=block, num_warps=4)

    def read():
        read_kernel[(programs,)](buf, out, stride, N=n, num_warps=8)

    def pair():
        write()
        read()

    # each program's sum checked once (its output poisoned first): the reads read what the writer wrote
    out.fill_(float("nan"))
    pair()
    want = buf.view(-1, n).sum(dim=1).expand(programs)  # (one buffer for all, or one row per program)
    assert torch.allclose(out, want, rtol=1e-5), (nbytes, programs, mode)
    t_read = kb.graph_time(read, reps) if mode == "read-only" else kb.graph_time(pair, reps) - kb.graph_time(write, reps)
    us = t_read * 1e6
    moved = nbytes * programs
    return dict(bytes=nbytes, programs=programs, mode=mode, us=round(us, 3), tb_s=round(moved / max(t_read, 1e-12) / 1e12, 3))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry", action="store_true", help="tiny sizes on the CPU (Triton's interpreter): the script runs")
    a = ap.parse_args(argv)
    device = "cpu" if a.dry else "cuda"
    kb.DEVICE = device  # (graph_time on the CPU: one call, no timing)
    sizes = (2048,) if a.dry else (2048, 16384, 65536)
    counts = (2,) if a.dry else (16, 132, 264, 528)
    rows = [run_case(b, p, m, device, 2 if a.dry else 20) for b in sizes for p in counts
            for m in ("after-write", "read-only", "distinct")]
    facts = dict(date=datetime.date.today().isoformat(), command=" ".join(["python"] + sys.argv),
                 device=torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
                 read_tb_s=round(kb.read_bandwidth(), 3) if device == "cuda" else None, rows=rows)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        path = Path(a.out) / f"broadcast-read-{facts['date']}{'-dry' if a.dry else ''}.json"
        path.write_text(json.dumps(facts, indent=1) + "\n")
        print(f"wrote {path}")
    print(f"read bandwidth (1 GiB, same run): {facts['read_tb_s']} TB/s")
    print("| bytes | programs | mode | us | TB/s delivered |\n|---:|---:|---|---:|---:|")
    for r in rows:
        print(f"| {r['bytes']} | {r['programs']} | {r['mode']} | {r['us']} | {r['tb_s']} |")
    return facts


if __name__ == "__main__":
    main()
