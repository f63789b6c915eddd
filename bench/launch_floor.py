"""The floor of a launch in the decode step's chain: what one kernel costs in a CUDA graph of PDL launches when it does
(almost) nothing, by grid size, warps and where it triggers. Issue 10's decode step is ~520 launches of ~10 kinds per
layer; this says how much of the step a launch costs before its body does any work, i.e. whether fewer launches
(fusion, a persistent kernel) or shorter bodies are the lever.

    python bench/launch_floor.py --out $OUT            # on the GPU: a table last, launch-floor-<date>.json in OUT
    TRITON_INTERPRET=1 python bench/launch_floor.py --dry   # the kernels' logic on the CPU (no timing meaning)

Each row: L launches of `_tick` captured in one CUDA graph (each program reads one int32 the launch before wrote and
writes it + 1: a real dependency, checked after the replays), replayed; us per launch = the replay's time / L. Rows:
- no PDL: the next launch starts once the previous grid has completed (a plain stream order);
- PDL, trigger first: each program lets the next launch be scheduled at once, then waits (griddepcontrol.wait) for
  the previous grid before its load (the step's kernels without LATE_TRIGGER);
- PDL, trigger last: the trigger after the store (LATE_TRIGGER's place);
- grids of 1, 132, 264 and 528 programs of 4 warps, and 1 program of 16 warps (the boundary's shape at one token);
- "chain of loads": the same with each program also reading BYTES of a buffer no kernel writes before its wait
  (weights prefetched into registers, as the GEMVs do), to see what a real body's pre-wait loads cost;
- "grid barrier": cooperative PDL launches of 132 and 320 programs (the MoE decode kernel's PERSIST grid at one
  token), and plain PDL launches of 320 (PERSIST_COOP off: what the cooperative attribute itself costs), with 0 or
  NBAR grid barriers inside each (the PERSIST render's own `_grid_barrier`, each barrier followed by
  a read of another program's value); (us with NBAR - us with 0) / NBAR is what a barrier costs, against the PDL
  handoff between two launches above (what PERSIST replaces with one). Not in --dry (the interpreter runs one
  program at a time: a barrier would wait forever).
The copy bandwidth of the same run is recorded beside it (the GPU is shared: ratios hold, absolute times drift).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y")
LAUNCHES = 400  # launches per graph


@triton.jit
def _tick(src_ptr, dst_ptr, w_ptr, W_ELEMS: tl.constexpr, PDL: tl.constexpr, LATE: tl.constexpr,
          INTERPRET: tl.constexpr):
    """dst[pid] = src[pid] + 1 (+ 0 * the sum of W_ELEMS fp32 of w read before the wait)."""
    pid = tl.program_id(0)
    if PDL and not LATE and not INTERPRET:
        tl.extra.cuda.gdc_launch_dependents()  # the next launch may be scheduled now
    if W_ELEMS > 0:  # a parameter no launch writes: read before the wait, as the GEMVs read their weights
        offs = pid * W_ELEMS + tl.arange(0, W_ELEMS)
        keep = (tl.sum(tl.load(w_ptr + offs), axis=0) * 0.0).to(tl.int32)  # 0, but the loads must complete
    else:
        keep = 0
    if PDL and not INTERPRET:
        tl.extra.cuda.gdc_wait()  # the previous grid has completed and its writes are visible
    v = tl.load(src_ptr + pid)
    tl.store(dst_ptr + pid, v + 1 + keep)
    if PDL and LATE and not INTERPRET:
        tl.extra.cuda.gdc_launch_dependents()


_grid_barrier = None  # the PERSIST render's barrier (set by barrier_rows before the first compile)


@triton.jit
def _bar_tick(src_ptr, dst_ptr, tmp_ptr, sync_ptr, NBAR: tl.constexpr):
    """dst[pid] = src[(pid + NBAR) % programs] + 1, through NBAR grid barriers: before barrier i each program stores
    its value in row i of tmp, after it reads its neighbour's (a dependency across programs through the barrier).
    Barrier i uses counters 2 i, 2 i + 1 (a barrier's counters are reset by its last program out, which may come
    after another program's arrival at the next barrier)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tl.extra.cuda.gdc_wait()
    v = tl.load(src_ptr + pid)
    for i in tl.static_range(NBAR):
        tl.store(tmp_ptr + i * nprog + pid, v)
        _grid_barrier(sync_ptr + 2 * i, nprog)  # (its PDL trigger: the next launch may be scheduled)
        v = tl.load(tmp_ptr + i * nprog + (pid + 1) % nprog)
    tl.store(dst_ptr + pid, v + 1)
    if NBAR == 0:
        tl.extra.cuda.gdc_launch_dependents()


def _barrier_chain_us(programs: int, coop: bool, nbar: int, device: str, graph_time) -> float:
    """us per launch of a LAUNCHES-long chain of `_bar_tick` launches with nbar barriers each (checked first)."""
    a = torch.randint(0, 1000, (programs,), dtype=torch.int32, device=device)
    b = torch.full_like(a, -7)
    tmp = torch.zeros(max(1, nbar) * programs, dtype=torch.int32, device=device)
    sync = torch.zeros(2 * max(1, nbar), dtype=torch.int32, device=device)
    start = a.clone()

    def chain(n=LAUNCHES):
        for i in range(n):
            src, dst = (a, b) if i % 2 == 0 else (b, a)
            _bar_tick[(programs,)](src, dst, tmp, sync, NBAR=nbar, num_warps=4, launch_pdl=True,
                                   launch_cooperative_grid=coop)

    chain(2)
    torch.cuda.synchronize()
    assert torch.equal(a, torch.roll(start, -2 * nbar) + 2), "the barrier's dependency did not hold"
    us = graph_time(chain, 1, iters=11) / LAUNCHES * 1e6
    assert int(sync.abs().sum()) == 0, "a barrier's counters not left at 0"
    return us


def barrier_rows(device: str) -> list[dict]:
    """The grid-barrier rows (see the docstring): us per launch of a LAUNCHES-long chain, with 0 and NBAR barriers."""
    global _grid_barrier
    import tempfile

    from beamc.codegen.kernel import KernelSpec, load_kernel
    from beamc.spec import load_spec

    sys.path.insert(0, str(ROOT / "tests"))
    from kernels import graph_time
    from test_kernels_moe import TEMPLATE, moe_constants

    c = dict(moe_constants(load_spec(ROOT / "models/beam-tiny.yaml"), 1, "bf16"), COMBINE=True, PERSIST=True)
    _grid_barrier = load_kernel(KernelSpec(TEMPLATE, "moe_experts", c),
                                Path(tempfile.mkdtemp(prefix="barrier-")))._grid_barrier
    rows = []
    for programs, coop in ((132, True), (320, True), (320, False)):  # (a plain launch: 320 tiny programs fit at once)
        label = f"{programs} x 4 warps, {'cooperative + ' if coop else ''}PDL"
        try:  # (one form refused, e.g. a cooperative launch under capture: recorded, the others still run)
            per = {nbar: _barrier_chain_us(programs, coop, nbar, device, graph_time) for nbar in (0, NBAR)}
        except Exception as e:  # noqa: BLE001
            rows.append(dict(label=f"{label}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                             programs=programs, cooperative=coop, us_per_launch=float("nan")))
            continue
        rows.append(dict(label=f"{label}, no barrier", programs=programs, warps=4, pdl=True, late_trigger=True,
                         prewait_bytes=0, cooperative=coop, us_per_launch=per[0]))
        rows.append(dict(label=f"{label}, {NBAR} grid barriers", programs=programs, warps=4, pdl=True,
                         late_trigger=False, prewait_bytes=0, cooperative=coop, us_per_launch=per[NBAR],
                         us_per_barrier=(per[NBAR] - per[0]) / NBAR))
    return rows


NBAR = 4  # grid barriers per launch in the barrier rows


ROWS = [  # (label, programs, warps, pdl, late trigger, fp32 elements read before the wait per program)
    ("1 x 4 warps, no PDL", 1, 4, False, False, 0),
    ("1 x 4 warps, PDL first", 1, 4, True, False, 0),
    ("1 x 4 warps, PDL last", 1, 4, True, True, 0),
    ("1 x 16 warps, PDL first", 1, 16, True, False, 0),
    ("132 x 4 warps, no PDL", 132, 4, False, False, 0),
    ("132 x 4 warps, PDL first", 132, 4, True, False, 0),
    ("264 x 4 warps, PDL first", 264, 4, True, False, 0),
    ("528 x 4 warps, PDL first", 528, 4, True, False, 0),
    ("528 x 4 warps, PDL last", 528, 4, True, True, 0),
    ("264 x 4 warps, PDL first, 16 KB pre-wait", 264, 4, True, False, 4096),
]


def run_row(programs: int, warps: int, pdl: bool, late: bool, w_elems: int, device: str, dry: bool) -> float:
    """us per launch of a LAUNCHES-long chain in one CUDA graph (dry: the chain run once, eagerly, 4 launches)."""
    n = 4 if dry else LAUNCHES
    a = torch.randint(0, 1000, (programs,), dtype=torch.int32, device=device)
    b = torch.full_like(a, -7)
    w = torch.randn(max(1, programs * w_elems), device=device)
    start = a.clone()

    def chain():
        for i in range(n):
            src, dst = (a, b) if i % 2 == 0 else (b, a)
            _tick[(programs,)](src, dst, w, W_ELEMS=w_elems, PDL=pdl, LATE=late, INTERPRET=INTERPRET,
                               num_warps=warps, **({} if INTERPRET else {"launch_pdl": pdl}))

    if dry:
        chain()
        assert torch.equal(a, start + n), "the chain's dependency did not hold"
        return 0.0
    from kernels import graph_time  # bench/kernels.py: reps calls in one graph, median of replays

    chain()
    torch.cuda.synchronize()
    assert torch.equal(a, start + n), "the chain's dependency did not hold (eager)"
    t = graph_time(chain, 1, iters=11)
    # every run of the chain adds n to every program's value: after the warm-up calls and the replays, the same
    # multiple of n everywhere
    torch.cuda.synchronize()
    d = a - start
    assert bool((d == d[0]).all()) and int(d[0]) % n == 0, "the chain's dependency did not hold (graph)"
    return t / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write launch-floor-<date>[tag].json here")
    ap.add_argument("--tag", default="")
    ap.add_argument("--dry", action="store_true", help="CPU, Triton interpreter: the logic only")
    a = ap.parse_args()
    device = "cpu" if a.dry else "cuda"
    if a.dry and not INTERPRET:
        raise SystemExit("--dry runs under the Triton interpreter: set TRITON_INTERPRET=1")
    import kernels

    kernels.DEVICE = device
    bw = kernels.copy_bandwidth()
    rows = []
    for label, programs, warps, pdl, late, w_elems in ROWS:
        us = run_row(programs, warps, pdl, late, w_elems, device, a.dry)
        rows.append(dict(label=label, programs=programs, warps=warps, pdl=pdl, late_trigger=late,
                         prewait_bytes=4 * w_elems, us_per_launch=us))
    if not a.dry:
        try:
            rows += barrier_rows(device)
        except Exception as e:  # noqa: BLE001 - e.g. a cooperative launch refused under capture: recorded, not fatal
            rows.append(dict(label=f"grid barrier rows failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                             us_per_launch=float("nan")))
    date = datetime.date.today().isoformat()
    doc = dict(date=date, device=torch.cuda.get_device_name() if device == "cuda" else "cpu (dry)",
               command="python bench/launch_floor.py " + " ".join(sys.argv[1:]), launches_per_graph=LAUNCHES,
               copy_tb_s=bw, rows=rows)
    if a.out:
        p = Path(a.out) / f"launch-floor-{date}{'-dry' if a.dry else ''}{a.tag}.json"
        p.write_text(json.dumps(doc, indent=1))
        print(f"wrote {p}")
    print(f"launch floor: {LAUNCHES} launches per CUDA graph, copy {bw:.2f} TB/s")
    print("| launch | us per launch |\n|---|---:|")
    for r in rows:
        per_barrier = f" ({r['us_per_barrier']:.2f} a barrier)" if "us_per_barrier" in r else ""
        print(f"| {r['label']} | {r['us_per_launch']:.2f}{per_barrier} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
