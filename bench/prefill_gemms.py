"""The prefill step's dense GEMMs (the library routes of `beamc.runtime.library`) at one TP-8 rank's shapes, beside
routes that keep cuBLAS on aligned shapes, and beside a plain bf16 GEMM of an aligned shape timed in the same run.

Why: a packed QKV+gate projection whose N is not a multiple of 8 gives output rows that are not a multiple of 16 bytes,
which keeps cuBLAS off its TMA kernels (H100 s36run1: N = 1,030, 16,384 tokens, 772 us against 278 over the rows up
to 1,032). The shipped spec's N is 1,792 at TP 8 (q 6 x 128, k and v 128, the output gate full width, 6 x 128):
aligned. A spec whose output gate is one column per head (`output_gate.width: per_head`) has N = 1,030 there; the
runtime's loader leaves storage for the rows up to a multiple of 8 behind every packed weight
(`library.with_row_room`), and `library.linear_packed` runs its GEMM over them. Routes timed at both N, each a
CUDA-graph replay with the outputs poisoned first and checked after (against the step's route):
- `step`: the step's route (`library.linear_packed` over a weight loaded through `library.with_row_room`, then a
  copy into each part);
- `unaligned`: the route before s36 (one GEMM over the weight's own rows, then the part copies);
- `aligned+gate`: the q, k, v rows in one GEMM into an aligned buffer, the gate rows in a second;
- `bare-qkv`: one GEMM of the q, k, v rows (N 1,024) into a fixed output: the rate an aligned shape gets in this run.
Cases at N = 1,030 are labelled `/per-head-gate`.
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

# one TP-8 rank of the full spec: hidden 5,120; 48 / 8 query heads and 8 / 8 KV heads of 128; the output gate full
# width (6 heads x 128); the dense layers' intermediate size per rank (the spec's dense SwiGLU: 2,560 at TP 8)
H, HEAD, QH, KVH, DENSE_I = 5120, 128, 6, 1, 2560
SPLITS = (QH * HEAD, KVH * HEAD, KVH * HEAD, QH * HEAD)  # N = 1,792
SPLITS_PER_HEAD_GATE = (QH * HEAD, KVH * HEAD, KVH * HEAD, QH)  # N = 1,030: a spec with one gate column per head


def graph_time(fn, reps: int, device: str) -> float:
    """Median seconds of one `fn()` over 5 replays of a graph of `reps` calls (a dry run: one call, 1e-6)."""
    if device == "cpu":
        fn()
        return 1e-6
    import kernels as kb  # bench/kernels.py (imported here, as variants.py does: not a module-level name that
    # shadows an installed `kernels` package where the tests load this file)

    return kb.graph_time(fn, reps=reps)


def qkvg_routes(T: int, device: str, splits: tuple[int, ...] = SPLITS) -> dict:
    """The QKV+gate routes' (function, outputs, FLOPs) over the same x and packed weight of the parts' widths."""
    g = torch.Generator().manual_seed(35)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    x = (torch.randn(T, H, generator=g) * 0.5).to(device, dt)
    w = (torch.randn(sum(splits), H, generator=g) / H ** 0.5).to(device, dt)
    w_room = library.with_row_room(w)  # (as the runtime's loader leaves it)
    parts = {name: [torch.empty(T, n, dtype=dt, device=device) for n in splits]
             for name in ("step", "unaligned", "aligned+gate")}
    y_qkv = torch.empty(T, sum(splits[:3]), dtype=dt, device=device)
    nq = sum(splits[:3])

    def step():
        library.linear_packed(x, w_room, *parts["step"])

    def unaligned():
        library.copy_parts(x @ w.t(), parts["unaligned"])

    def aligned_gate():
        q, k, v, gate = parts["aligned+gate"]
        torch.mm(x, w[:nq].t(), out=y_qkv)
        torch.mm(x, w[nq:].t(), out=gate)
        library.copy_parts(y_qkv, (q, k, v))

    def bare():
        torch.mm(x, w[:nq].t(), out=y_qkv)

    flops = 2 * T * H * sum(splits)
    return {"step": (step, parts["step"], flops), "unaligned": (unaligned, parts["unaligned"], flops),
            "aligned+gate": (aligned_gate, parts["aligned+gate"], flops), "bare-qkv": (bare, [y_qkv], 2 * T * H * nq)}


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
    per_head = {f"{k}/per-head-gate": r for k, r in qkvg_routes(T, device, SPLITS_PER_HEAD_GATE).items()
                if k != "bare-qkv"}
    for name, (fn, outs, flops) in {**routes, **per_head, **dense_cases(T, device)}.items():
        for o in outs:
            o.fill_(float("nan"))  # poisoned: a route that does not write every output fails below
        t = graph_time(fn, args.reps, device)
        ok = all(bool(torch.isfinite(o).all()) for o in outs)
        row = dict(case=name, tokens=T, us=t * 1e6, tflops=flops / t / 1e12, outputs_written=ok)
        base = name.split("/")[0]
        if base in ("unaligned", "aligned+gate"):  # against the step's route (other GEMM kernels: ~1 bf16 ulp)
            step_outs = (per_head["step/per-head-gate"] if "/" in name else routes["step"])[1]
            row["max_abs_diff_vs_step"] = max(float((a.float() - b.float()).abs().max())
                                              for a, b in zip(outs, step_outs))
        rows.append(row)
        print(json.dumps(row), flush=True)
        assert ok, row
    rec = dict(date=time.strftime("%Y-%m-%d"), command="python3 " + " ".join(sys.argv),
               device=torch.cuda.get_device_name() if device == "cuda" else "cpu (dry)", torch=torch.__version__,
               rows=rows)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"prefill-gemms-{rec['date']}{'-dry' if args.dry else ''}.json"
    path.write_text(json.dumps(rec, indent=1))
    print(f"{'case':<28}{'tokens':>8}{'us':>10}{'TFLOP/s':>10}  vs step")
    for r in rows:
        print(f"{r['case']:<28}{r['tokens']:>8}{r['us']:>10.1f}{r['tflops']:>10.1f}  {r.get('max_abs_diff_vs_step', '')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
