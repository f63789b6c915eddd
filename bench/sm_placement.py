"""Where the block scheduler puts a small grid (issue 8: the MoE decode kernel's 320 programs on 132 SMs).

Why: the MoE decode kernel at one token is 320 programs of 4 warps; its time is set by the SMs that hold the most
programs. With 146 registers a program, 3 fit on an SM; the render without the idx scan needs 80 (6 fit) and
made the decode step 17% slower (s14run1). If the scheduler fills an SM up to its limit before it moves to the
next, a smaller program packs 6 to an SM and leaves half the SMs idle; if it deals programs out in turns, the
limit does not matter. This bench launches a probe grid (each program records its SM and spins ~20 us, so that
all are resident together) with dynamic shared memory sized to allow 2 / 3 / 4 / 6 / 8 programs per SM, one grid
at a time on an idle GPU (a PDL launch behind a busy kernel is not what CuPy can launch).

    python bench/sm_placement.py --out $OUT        # needs CuPy (on the H200 image)
Prints one row per case: programs, the allowed programs per SM, SMs used, the most programs on one SM.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections import Counter
from pathlib import Path

import cupy as cp

SRC = r"""
extern "C" __global__ void probe(int* out, long long spin) {
    extern __shared__ int pad[];
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    long long t0 = clock64();
    while (clock64() - t0 < spin) { }
    if (threadIdx.x == 0) { pad[0] = smid; out[blockIdx.x] = pad[0]; }
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--programs", default="128,264,320,400")
    a = ap.parse_args()
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    n_sm = props["multiProcessorCount"]
    smem_sm = props["sharedMemPerMultiprocessor"]
    kern = cp.RawKernel(SRC, "probe")
    kern.max_dynamic_shared_size_bytes = 200 * 1024
    rows = []
    for programs in (int(p) for p in a.programs.split(",")):
        for per_sm in (2, 3, 4, 6, 8):
            smem = smem_sm // per_sm - 1024 - 64  # (1 KB per block reserved by the driver)
            out = cp.full(programs, -1, dtype=cp.int32)
            for _ in range(3):  # the last launch counts (warm)
                kern((programs,), (128,), (out, cp.int64(40_000)), shared_mem=smem)
            cp.cuda.runtime.deviceSynchronize()
            sms = cp.asnumpy(out)
            counts = Counter(sms.tolist())  # programs per SM
            rows.append(dict(programs=programs, allowed_per_sm=per_sm, smem=smem, sms_used=len(counts),
                             max_per_sm=max(counts.values()), first_smids=sms[:16].tolist(),
                             histogram=dict(sorted(Counter(counts.values()).items()))))
    rec = dict(date=datetime.date.today().isoformat(), command=" ".join(["python"] + sys.argv),
               device=props["name"].decode(), sms=n_sm, smem_per_sm=smem_sm, records=rows)
    Path(a.out, f"sm-placement-{rec['date']}.json").write_text(json.dumps(rec, indent=1))
    print("| programs | allowed / SM | SMs used | max / SM | histogram (programs: SMs) |")
    for r in rows:
        print(f"| {r['programs']} | {r['allowed_per_sm']} | {r['sms_used']} | {r['max_per_sm']} | {r['histogram']} |")


if __name__ == "__main__":
    main()
