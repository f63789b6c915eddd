"""What reading the decode MoE's bytes costs by itself: the floor under issue 8's "MoE decode <= 8 us" target.

    python bench/read_floor.py --out $OUT            # on the GPU: a table last, read-floor-<date>.json in OUT
    TRITON_INTERPRET=1 python bench/read_floor.py --dry   # the kernel's logic on the CPU (no timing meaning)

Why: the MoE decode at one token reads 8 experts' NVFP4 bytes (TP-8 rank: 22.1 MB, gate_up 14.7 + down 7.4) and takes
~21 us; the bytes at the copy rate are 5-8 us. Every earlier measurement of "the bytes alone" was torch.sum (13-16 us:
a reduction's launch and tail, not a floor). This bench times kernels that only read those bytes, laid out as the
experts lie (8 slices of an [E, bytes-per-expert] tensor at random experts), with nothing else on the chain:
- `_stream`: P programs of W warps; program p reads chunks p, p + P, ... of BLOCK int32 (16-byte loads, all of a
  chunk's loads issued together) and stores one int32 (their XOR, so no load can be dropped). P = the chunks: one
  chunk a program, every load in flight at once; smaller P: each program walks several.
- as one launch over both stages' bytes (22.1 MB), and as two launches (gate_up's 14.7 MB, then down's 7.4 MB: the
  MoE's two stages, with the launch between them), plain stream order (PDL would not change a read-only chain);
- after three L2 states: `write` (a 256 MB zero_: the L2 full of dirty lines, as bench/moe_decode.py flushes),
  `read` (a 256 MB read: clean lines of other data, as the step's previous layers leave it), `warm` (none: the bytes
  in L2 from the replay before; an upper bound).
torch.sum over the same 8 slices and the copy rate of a 1 GiB clone are recorded beside it (the GPU is shared).
"""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

# one TP-8 rank's expert at the full spec (H 5120, I 320 a rank): codes H * 2I / 2 + scales H * 2I / 16 (gate_up),
# codes I * H / 2 + scales I * H / 16 (down), in bytes; both multiples of 16
GATE_UP_BYTES = 5120 * 640 // 2 + 5120 * 640 // 16
DOWN_BYTES = 320 * 5120 // 2 + 320 * 5120 // 16


@triton.jit
def _stream(w_ptr, ids_ptr, out_ptr, expert_words, base_words, span_words, n_chunks, TOP_K: tl.constexpr,
            BLOCK: tl.constexpr):
    """out[pid] = the XOR of the int32 words of chunks pid, pid + P, ... of the chosen experts' spans (span_words
    words from base_words of each expert's row of expert_words words), chunk c = BLOCK words."""
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    per = span_words // BLOCK  # chunks an expert's span holds (the launcher picks BLOCK dividing the span)
    acc = tl.zeros([BLOCK], tl.int32)
    for c in range(pid, n_chunks, npg):
        j = c // per  # which of the TOP_K chosen experts
        e = tl.load(ids_ptr + j).to(tl.int64)
        offs = e * expert_words + base_words + (c - j * per) * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(w_ptr + offs, mask=j < TOP_K, other=0)
    tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))


def block_for(span_words: int, want: int) -> int:
    """The largest power of two <= want dividing span_words."""
    b = 1
    while b * 2 <= want and span_words % (b * 2) == 0:
        b *= 2
    return b


def launcher(w, ids, expert_words, base, span, programs, warps, block):
    """One `_stream` launch over [base, base + span) words of each chosen expert."""
    blk = block_for(span, block)
    n_chunks = ids.numel() * (span // blk)
    p = min(programs, n_chunks) if programs else n_chunks
    out = torch.empty(p, dtype=torch.int32, device=w.device)

    def run():
        _stream[(p,)](w, ids, out, expert_words, base, span, n_chunks, TOP_K=ids.numel(), BLOCK=blk, num_warps=warps)
        return out
    return run, dict(programs=p, block_words=blk, chunks=n_chunks, chunks_per_program=-(-n_chunks // p))


def xor(t: torch.Tensor) -> int:
    return int(np.bitwise_xor.reduce(t.cpu().numpy().ravel()))


def replay_us(g, prep, reps: int) -> float:
    """Median us of `reps` replays of graph g, each after prep() (the L2 state), timed by events around the replay."""
    ts = []
    for _ in range(reps):
        prep()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return sorted(ts)[len(ts) // 2]


def capture(fns):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    return g


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry", action="store_true", help="CPU: run each kernel once under the interpreter")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    dev = "cpu" if args.dry else "cuda"
    n_exp = 12 if args.dry else args.experts
    scale = 64 if args.dry else 1  # (--dry: every span 1/64 as long)
    gu_w, dn_w = GATE_UP_BYTES // 4 // scale, DOWN_BYTES // 4 // scale
    expert_words = gu_w + dn_w
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-2**31, 2**31 - 1, (n_exp * expert_words,), dtype=torch.int32, generator=g).to(dev)
    ids = torch.randperm(n_exp, generator=g)[:8].to(torch.int32).to(dev)
    want = w.view(n_exp, expert_words)[ids.long()]

    # (programs, warps, block words): 0 programs = one chunk a program
    shapes = [(0, 4, 1024), (0, 4, 2048), (0, 8, 4096), (0, 4, 512), (132, 4, 1024), (264, 4, 1024), (528, 4, 1024),
              (1056, 4, 1024), (264, 8, 2048), (528, 8, 2048)]
    if args.dry:
        shapes = [(0, 4, 256), (5, 4, 256)]
    rows = []
    for programs, warps, block in shapes:
        one, f1 = launcher(w, ids, expert_words, 0, gu_w + dn_w, programs, warps, block)
        st0, f0 = launcher(w, ids, expert_words, 0, gu_w, programs, warps, block)
        st1, fd = launcher(w, ids, expert_words, gu_w, dn_w, programs, warps, block)
        # check: every word read once (the XOR of all the programs' XORs)
        assert xor(one()) == xor(want), (programs, warps, block)
        assert xor(st0()) ^ xor(st1()) == xor(want), (programs, warps, block)
        rows.append(dict(programs=programs, warps=warps, block=block, one=f1, stage0=f0, stage1=fd, fns=(one, st0, st1)))
    if args.dry:
        print("dry: the sums check", len(rows), "shapes")
        return {}

    big = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    sink = torch.empty(1, dtype=torch.int64, device=dev)
    preps = {"write": lambda: big.zero_(), "read": lambda: sink.copy_(big.view(torch.int64).sum().view(1)),
             "warm": lambda: None}
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    copy_g = capture([lambda: x.clone()])
    copy_tbs = 2 * x.numel() / (replay_us(copy_g, lambda: None, 10) * 1e-6) / 1e12
    nbytes = 8 * expert_words * 4
    res = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
               bytes=nbytes, gate_up_bytes=8 * gu_w * 4, down_bytes=8 * dn_w * 4, copy_tbs=copy_tbs, rows=[])
    sum_g = capture([lambda: want.sum()])
    res["torch_sum_us"] = {k: replay_us(sum_g, p, args.reps) for k, p in preps.items()}
    for r in rows:
        one, st0, st1 = r.pop("fns")
        g1, g2 = capture([one]), capture([st0, st1])
        for k, p in preps.items():
            r[f"one_{k}_us"] = replay_us(g1, p, args.reps)
            r[f"two_{k}_us"] = replay_us(g2, p, args.reps)
        r["one_read_tbs"] = nbytes / (r["one_read_us"] * 1e-6) / 1e12
        res["rows"].append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"read-floor-{res['date']}.json").write_text(json.dumps(res, indent=1))
    print(f"\n{nbytes / 1e6:.1f} MB of 8 experts; copy {copy_tbs:.2f} TB/s; torch.sum us "
          + " / ".join(f"{k} {v:.2f}" for k, v in res["torch_sum_us"].items()))
    print(f"{'P':>6} {'W':>2} {'blk':>5} {'prog':>5} {'1x write':>9} {'1x read':>8} {'1x warm':>8} {'2x write':>9} "
          f"{'2x read':>8} {'TB/s rd':>8}")
    for r in res["rows"]:
        print(f"{r['programs']:>6} {r['warps']:>2} {r['block']:>5} {r['one']['programs']:>5} {r['one_write_us']:>9.2f} "
              f"{r['one_read_us']:>8.2f} {r['one_warm_us']:>8.2f} {r['two_write_us']:>9.2f} {r['two_read_us']:>8.2f} "
              f"{r['one_read_tbs']:>8.2f}")
    return res


if __name__ == "__main__":
    main()
