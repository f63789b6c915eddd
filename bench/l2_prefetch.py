"""Does an L2 prefetch make the decode step's GEMV faster, and how fast does the prefetch fill L2? (H200)

The QKV+gate GEMV of one TP-8 rank at one token (18.4 MB of bf16 weights, the generated one-pass kernel) timed in
CUDA graphs, each rep after a 96 MB write that evicts L2 (its own time subtracted: the same graph without the GEMV):
    cold      flush, GEMV                       (weights from DRAM: what the step has without a prefetch)
    warm      flush, GEMV, GEMV (the second)    (weights in L2 from the first: the most a prefetch can give)
    pf+S      flush, l2_prefetch(W), sleep S us, GEMV    for S in SLEEPS: how soon a prefetch has filled L2
for the l2_prefetch renders in RENDERS (bulk / per-line, chunk sizes). Prints a table last; writes
OUT/l2-prefetch-<date>.json.

    python bench/l2_prefetch.py --out $OUT
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from beamc.codegen.kernel import KernelSpec, load_kernel  # noqa: E402

SLEEPS = (0, 2, 5, 10, 20)  # us between the prefetch launch and the GEMV
RENDERS = {"bulk32k": {}, "bulk4k": {"CHUNK": 4096}, "line4k": {"BULK": False, "CHUNK": 4096}}
FLUSH_BYTES = 96 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    a = ap.parse_args()
    import kernels as kb
    from test_kernels_gemv import TP8, kernel_spec, make_inputs

    kb.DEVICE = "cuda"
    dev = "cuda"
    epi, K, N, splits = TP8["qkvg"]
    ks, attrs = kernel_spec(epi, K, N, "bf16", splits=splits)
    gemv = load_kernel(ks)
    ins, outs = make_inputs(epi, K, N, 1, torch.bfloat16, device=dev, gen=torch.Generator().manual_seed(0),
                            attrs=attrs)
    got = [torch.empty(s, dtype=dt, device=dev) for s, dt in outs]
    scratch = torch.empty(gemv.scratch_numel(1), dtype=torch.float32, device=dev)
    weights = list(ins[1:])
    wbytes = sum(w.numel() * w.element_size() for w in weights)
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device=dev)
    cycles_per_us = 1980  # the H200's SM clock under load (MHz): torch.cuda._sleep counts cycles

    def run_gemv():
        gemv.launch(*ins, *got, scratch=scratch)

    def timed(fn) -> float:
        return kb.graph_time(fn, 20) * 1e6

    base = timed(lambda: flush.fill_(1.0))
    rec = {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
           "device": torch.cuda.get_device_name(), "weights_bytes": wbytes, "flush_bytes": FLUSH_BYTES,
           "flush_us": base, "sm_clock_mhz": cycles_per_us}
    cold = timed(lambda: (flush.fill_(1.0), run_gemv())) - base
    one = timed(lambda: (flush.fill_(1.0), run_gemv()))
    warm = timed(lambda: (flush.fill_(1.0), run_gemv(), run_gemv())) - one
    rec.update(cold_us=cold, warm_us=warm, read_tb_s=kb.read_bandwidth())
    rows = [("cold (DRAM)", cold), ("warm (L2, after a GEMV)", warm)]
    rec["renders"] = {}
    for name, consts in RENDERS.items():
        pf = load_kernel(KernelSpec("l2_prefetch", "l2_prefetch", consts))
        r = {}
        for s in SLEEPS:
            cyc = int(s * cycles_per_us)

            def pre():
                flush.fill_(1.0)
                pf._launch(pf._ranges(weights), pf._dummy(flush.device), False)  # (on this stream: timed in line)
                if cyc:
                    torch.cuda._sleep(cyc)

            t0 = timed(pre)
            t1 = timed(lambda: (pre(), run_gemv()))
            r[f"sleep{s}"] = {"gemv_us": t1 - t0, "prefetch_and_sleep_us": t0 - base}
            rows.append((f"{name} sleep {s} us", t1 - t0))
        rec["renders"][name] = r
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"l2-prefetch-{rec['date']}.json"
    path.write_text(json.dumps(rec, indent=1))
    print(f"wrote {path}; weights {wbytes / 1e6:.1f} MB, read rate {rec['read_tb_s']:.2f} TB/s, flush "
          f"{base:.1f} us")
    print("| QKV+gate GEMV, T = 1 | us |\n|---|---:|")
    for label, us in rows:
        print(f"| {label} | {us:.2f} |")
    for name, r in rec["renders"].items():
        print(f"{name}: prefetch + sleep us " + ", ".join(f"{k}: {v['prefetch_and_sleep_us']:.1f}"
                                                           for k, v in r.items()))


if __name__ == "__main__":
    main()
