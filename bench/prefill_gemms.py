"""The prefill step's dense GEMMs (the library routes of `beamc.runtime.library`) at one TP-8 rank's shapes, beside
routes that keep cuBLAS on aligned shapes, and beside a plain bf16 GEMM of an aligned shape timed in the same run.

Why: the packed QKV+gate projection has N = 6 + 1 + 1 heads x 128 + 6 gate columns = 1,030 at TP 8: its output rows
are 2,060 bytes, not a multiple of 16, which keeps cuBLAS off its TMA kernels. The s24 profile of the 8 x 2,048 prefill
step put `linear_packed` at 23.5 ms (0.45 ms a layer: 383 TFLOP/s with the part copies), where an aligned GEMM of its
FLOPs would take ~0.27 ms at 650 TFLOP/s. Routes timed, each a CUDA-graph replay with the outputs poisoned first and
checked after (against the step's route: the same bits expected where the GEMM's K order is the same):
- `step`: the step's route (`library.linear_packed`: one GEMM of N 1,030, then a copy into each part);
- `aligned+gate`: the first 1,024 rows (q, k, v) in one GEMM into an aligned buffer, the 6 gate rows in a second;
- `padded`: one GEMM over the weight padded with zero rows to a multiple of 8 (1,032: a copy made once, as a load
  transform would), then the part copies;
- `bare-1024`: one GEMM of N 1,024 into a fixed output: the rate an aligned shape gets in this run (the reference).
Also the other dense prefill GEMMs of the step (o_proj, the dense layers' gate_up and down) for their TFLOP/s.

    python3 bench/prefill_gemms.py --out $OUT            # on the GPU; a short table last
    python3 bench/prefill_gemms.py --dry                 # the script's logic on the CPU (no timing meaning)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from beamc.runtime import library  # noqa: E402

# one TP-8 rank of the full spec: hidden 5,120; 48 / 8 query heads and 8 / 8 KV heads of 128; the output gate's 6
# heads; the dense layers' intermediate size per rank (the spec's dense SwiGLU: 2,560 at TP 8)
H, HEAD, QH, KVH, DENSE_I = 5120, 128, 6, 1, 2560
SPLITS = (QH * HEAD, KVH * HEAD, KVH * HEAD, QH)


def graph_time(fn, reps: int, device: str) -> float:
    """Median seconds of one `fn()` over 5 replays of a graph of `reps` calls (a dry run: one call, 1e-6)."""
    if device == "cpu":
        fn()
        return 1e-6
    import kernels as kb  # bench/kernels.py (imported here, as variants.py does: not a module-level name that
    # shadows an installed `kernels` package where the tests load this file)

    return kb.graph_time(fn, reps=reps)


def qkvg_routes(T: int, device: str) -> dict:
    """The QKV+gate routes' (function, outputs) over the same x and packed weight."""
    g = torch.Generator().manual_seed(35)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    x = (torch.randn(T, H, generator=g) * 0.5).to(device, dt)
    w = (torch.randn(sum(SPLITS), H, generator=g) / H ** 0.5).to(device, dt)
    w_pad = torch.zeros(-(-sum(SPLITS) // 8) * 8, H, dtype=dt, device=device)
    w_pad[:sum(SPLITS)] = w
    parts = {name: [torch.empty(T, n, dtype=dt, device=device) for n in SPLITS]
             for name in ("step", "aligned+gate", "padded")}
    y1024 = torch.empty(T, 1024, dtype=dt, device=device)
    y_pad = torch.empty(T, w_pad.shape[0], dtype=dt, device=device)
    nq = sum(SPLITS[:3])

    def step():
        library.linear_packed(x, w, *parts["step"])

    def aligned_gate():
        q, k, v, gate = parts["aligned+gate"]
        torch.mm(x, w[:nq].t(), out=y1024)
        torch.mm(x, w[nq:].t(), out=gate)
        library.copy_parts(y1024, (q, k, v))

    def padded():
        torch.mm(x, w_pad.t(), out=y_pad)
        library.copy_parts(y_pad, parts["padded"])  # (the padding columns past the last part not copied)

    def bare():
        torch.mm(x, w[:nq].t(), out=y1024)

    flops = 2 * T * H * sum(SPLITS)
    return {"step": (step, parts["step"], flops), "aligned+gate": (aligned_gate, parts["aligned+gate"], flops),
            "padded": (padded, parts["padded"], flops), "bare-1024": (bare, [y1024], 2 * T * H * 1024)}


def dense_cases(T: int, device: str) -> dict:
    """The step's other dense prefill GEMMs (one `library.linear` each): o_proj, the dense layers' gate / up, down."""
    g = torch.Generator().manual_seed(36)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    out = {}
    for name, (K, N) in {"o_proj": (QH * HEAD, H), "dense_gate": (H, DENSE_I), "dense_down": (DENSE_I, H)}.items():
        x = torch.randn(T, K, generator=g).to(device, dt)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dt)
        y = torch.empty(T, N, dtype=dt, device=device)
        out[name] = ((lambda x=x, w=w, y=y: library.linear(x, w, y)), [y], 2 * T * K * N)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dry", action="store_true", help="the script's logic on the CPU (small T, no timing meaning)")
    args = ap.parse_args()
    device = "cpu" if args.dry else "cuda"
    T = 64 if args.dry else args.tokens
    rows = []
    routes = qkvg_routes(T, device)
    for name, (fn, outs, flops) in {**routes, **dense_cases(T, device)}.items():
        for o in outs:
            o.fill_(float("nan"))  # poisoned: a route that does not write every output fails below
        t = graph_time(fn, args.reps, device)
        ok = all(bool(torch.isfinite(o).all()) for o in outs)
        row = dict(case=name, tokens=T, us=t * 1e6, tflops=flops / t / 1e12, outputs_written=ok)
        if name in ("aligned+gate", "padded"):  # against the step's route (the same GEMM sums: equal bits expected)
            row["max_abs_diff_vs_step"] = max(float((a.float() - b.float()).abs().max())
                                              for a, b in zip(outs, routes["step"][1]))
        rows.append(row)
        print(json.dumps(row), flush=True)
        assert ok, row
    rec = dict(date=time.strftime("%Y-%m-%d"), command="python3 " + " ".join(sys.argv),
               device=torch.cuda.get_device_name() if device == "cuda" else "cpu (dry)", torch=torch.__version__,
               rows=rows)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"prefill-gemms-{rec['date']}{'-dry' if args.dry else ''}.json"
    path.write_text(json.dumps(rec, indent=1))
    print(f"{'case':<16}{'tokens':>8}{'us':>10}{'TFLOP/s':>10}  vs step")
    for r in rows:
        print(f"{r['case']:<16}{r['tokens']:>8}{r['us']:>10.1f}{r['tflops']:>10.1f}  {r.get('max_abs_diff_vs_step', '')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
