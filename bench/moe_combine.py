"""The MoE combine in the decode kernel's down epilogue (the combine_experts pass, COMBINE render) against the two
launches it replaces (the plain render's y, then the `moe_combine` kernel), at one TP-8 rank's shapes on the H200;
`--planned` adds a third route: the plain render with PLAN on every step (`PLAN_MIN_PAIRS` 0: the pairs grouped by
expert by a first launch, as steps of more than 64 pairs run it; MAXNREG 128, the emitter's) then `moe_combine`.

    python bench/moe_combine.py --out DIR [--tokens 1,2,4,8]   (prints a table last; DIR/moe-combine-<date>.json)

For each T (8 distinct random experts per token, routing weights in (0.05, 1.05), x 2.5 routed scale):
- correctness first: the fused output against the two-launch output (bits equal, share of elements) and both
  against the fp32 reference's combine (||out - ref|| / ||ref|| < 1e-2); outputs poisoned before each launch;
- timing as the step runs it: a CUDA graph of LAYERS consecutive MoE layers (PDL launches back to back, each layer
  its own weights, so nothing stays in L2 from the layer before), replayed alternately with the other route's graph;
  median us per layer;
- beside them, in the same run: the copy rate (bench/kernels.py: a 1 GiB device-to-device copy) and `torch.sum` over the chosen
  experts' bytes (the read rate at this size).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import kernels  # noqa: E402  (bench/kernels.py: the copy rate)
from beamc.codegen.kernel import KernelSpec, load_kernel  # noqa: E402
from beamc.spec import load_spec  # noqa: E402
from test_kernels_moe import (TEMPLATE, combine_constants, combined_reference, distinct_idx,  # noqa: E402
                              moe_constants, nvfp4_experts)

LAYERS = 8  # MoE layers per graph (each with its own 256 experts: 0.7 GB each)
SCALE = 2.5


def graph(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_alternating(graphs: dict, reps: int = 25) -> dict:
    """Median us of each graph's replay, the graphs replayed in turn (drift hits all alike)."""
    times = {k: [] for k in graphs}
    for _ in range(reps):
        for k, g in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times[k].append(a.elapsed_time(b) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--planned", action="store_true", help="also time the planned plain render + moe_combine")
    a = ap.parse_args(argv)
    kdir = Path(tempfile.mkdtemp(prefix="moe-combine-"))
    c = moe_constants(load_spec(ROOT / "models/beam.yaml"), 8, "bf16")
    plain = load_kernel(KernelSpec(TEMPLATE, "moe_experts", c), kdir)
    fused = load_kernel(KernelSpec(TEMPLATE, "moe_experts", dict(c, COMBINE=True, ROUTED_SCALE=SCALE)), kdir)
    planned = load_kernel(KernelSpec(TEMPLATE, "moe_experts", dict(c, PLAN_MIN_PAIRS=0, MAXNREG=128)),
                          kdir) if a.planned else None
    comb = load_kernel(KernelSpec("moe_combine", "moe_experts", combine_constants(c, SCALE)), kdir)
    E, H, I, K = c["E"], c["H"], c["I"], c["TOP_K"]
    g = torch.Generator().manual_seed(0)
    raws = [nvfp4_experts(E, H, I, g, device="cuda") for _ in range(LAYERS)]
    layers = [plain.relayout(r) for r in raws]
    per_expert = 2 * I * H // 2 + 2 * I * H // 16 + H * I // 2 + H * I // 16 + 12
    rows: list[dict] = []
    facts = {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
             "device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": dict(c), "layers": LAYERS,
             "records": rows}
    facts["copy_tb_s"] = kernels.copy_bandwidth()  # bench/kernels.py: 1 GiB, read + write
    for T in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(T, H, generator=g).bfloat16().cuda()
        idx = distinct_idx(T, E, K, g).cuda()
        w = (torch.rand(T, K, generator=g) + 0.05).cuda()
        nbytes = int(torch.unique(idx).numel()) * per_expert
        buf = torch.randn(nbytes // 4, device="cuda")
        y = torch.empty(T, K, H, dtype=torch.bfloat16, device="cuda")
        h = torch.empty(plain.scratch_numel(T), dtype=torch.bfloat16, device="cuda")
        outs = [torch.empty(T, H, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
        hp = torch.empty(planned.scratch_numel(T), dtype=torch.bfloat16, device="cuda") if planned else None

        def two(i=0):
            for p in (layers if i is None else [layers[i]]):
                plain.launch(x, idx, *p, y, h)
                comb.launch(y, w, idx, outs[0])

        def one(i=0):
            for p in (layers if i is None else [layers[i]]):
                fused.launch(x, idx, *p, w, outs[1], h)

        def plan(i=0):  # the planned plain render, then the combine (y shared with `two`: replayed apart)
            for p in (layers if i is None else [layers[i]]):
                planned.launch(x, idx, *p, y, hp)
                comb.launch(y, w, idx, outs[2])

        for o in outs:
            o.fill_(float("nan"))
        two(0)
        one(0)
        if planned:
            plan(0)
        torch.cuda.synchronize()
        ref = combined_reference(x.float(), idx, raws[0], w, SCALE)  # fp32, layer 0's experts
        rec = dict(T=T, experts=int(torch.unique(idx).numel()), bytes=nbytes,
                   equal_bits=float((outs[0].view(torch.int16) == outs[1].view(torch.int16)).float().mean()),
                   rel_err_fused=((outs[1].float() - ref).norm() / ref.norm()).item(),
                   rel_err_two=((outs[0].float() - ref).norm() / ref.norm()).item())
        assert rec["rel_err_fused"] < 1e-2 and rec["rel_err_two"] < 1e-2, rec
        routes = {"two": graph(lambda: two(None)), "one": graph(lambda: one(None))}
        if planned:  # a pair's bits do not depend on its item: the plain render's out exactly
            rec["planned_equal_bits"] = float((outs[0].view(torch.int16) == outs[2].view(torch.int16)).float().mean())
            routes["plan"] = graph(lambda: plan(None))
        us = time_alternating(dict(routes, sum=graph(lambda: buf.sum())))
        rec.update(two_launches_us=us["two"] / LAYERS, combined_us=us["one"] / LAYERS, sum_us=us["sum"],
                   read_tb_s=nbytes / us["sum"] / 1e6)
        if planned:
            rec["planned_us"] = us["plan"] / LAYERS
        rows.append(rec)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"moe-combine-{facts['date']}.json").write_text(json.dumps(facts, indent=1) + "\n")
    print(f"copy {facts['copy_tb_s']:.2f} TB/s (1 GiB, read + write); us per MoE layer, {LAYERS} layers per graph")
    print(f"{'T':>3} {'experts':>7} {'two launches':>13} {'combined':>9} {'gain':>6} {'sum same bytes':>15} "
          f"{'bits equal':>10} {'rel err':>8}" + (f" {'planned':>8} {'plan bits':>9}" if a.planned else ""))
    for r in rows:
        print(f"{r['T']:>3} {r['experts']:>7} {r['two_launches_us']:>13.2f} {r['combined_us']:>9.2f} "
              f"{r['two_launches_us'] - r['combined_us']:>6.2f} {r['sum_us']:>15.2f} {r['equal_bits']:>10.4f} "
              f"{r['rel_err_fused']:>8.1e}" + (f" {r['planned_us']:>8.2f} {r['planned_equal_bits']:>9.4f}"
                                               if a.planned else ""))
    return facts


if __name__ == "__main__":
    main()
