"""Where the NVFP4 MoE decode kernel's time goes (issue 8): its two stages timed apart, in both weight layouts, with
a few launch-time variants, beside a plain read of the same bytes, at one TP-8 rank's shapes on the H200.

    python bench/moe_decode.py --out DIR        (prints a table last; writes DIR/moe-decode-<date>.json)

For T = 1 and 8 tokens (8 distinct random experts per token) and each (layout, variant):
- y checked first against the reference (||y - ref|| / ||ref|| < 1e-2; a variant that fails is reported, not timed);
- three CUDA graphs, each replayed 30 times after a 256 MB write that flushes the L2: both stages (what a decode
  step runs), stage 0 alone (gate_up + SwiGLU), stage 1 alone (down; its h from a previous stage 0);
- the chosen experts' bytes over each time; and, in the same run, `torch.sum` over a buffer of the same bytes (the
  read rate a weight-streaming kernel can reach at this size, launch included).
Variants override the launcher's constexprs / options: the cp.async depth of each stage, the L2 prefetch of the
down weights, 8 warps instead of 4, the register cap (maxnreg: programs per SM); or render the template with other
constants (SCAN_T1: no idx scan at one token).
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

from beamc.codegen.kernel import KernelSpec, load_kernel  # noqa: E402
from beamc.spec import load_spec  # noqa: E402
from test_kernels_moe import TEMPLATE, distinct_idx, moe_constants, nvfp4_experts, y_reference  # noqa: E402

# (label, constexpr overrides, option overrides[, render overrides: template constants, another module])
VARIANTS = (
    ("default", {}, {}),
    ("STAGES0=2", {"STAGES0": 2}, {}),
    ("STAGES1=3", {"STAGES1": 3}, {}),
    ("no prefetch", {"PREFETCH": False}, {}),
    ("8 warps", {}, {"num_warps": 8}),
    ("maxnreg=128", {}, {"maxnreg": 128}),  # 4 programs per SM (spills 8-26 bytes: 2026-12-01)
    ("maxnreg=96", {}, {"maxnreg": 96}),  # 5 programs per SM
    ("STAGES0=3", {"STAGES0": 3}, {}),
    # each pair its own program at one token (80 / 60 registers, not 146 / 91): 19.6 us against 21.9 here, but the
    # decode step 17% slower with it (2026-12-01, s14run1-2: docs/perf-log.md)
    ("no scan at T=1", {}, {}, {"SCAN_T1": False}),
    # stage 0 on 8 warps, each with half the K loop (KSPLIT 8, its registers capped at 80 by the render: 3 programs
    # per SM; 64 without the scan: 4 per SM); stage 1 as before on 4 warps
    ("KSPLIT=8", {}, {}, {"KSPLIT": 8}),
    ("KSPLIT=8/no scan", {}, {}, {"KSPLIT": 8, "SCAN_T1": False}),
    # pairs of one expert per pass (the mma's N; the launcher's MP = min(8, next_pow2(T))): at T > 1 with mostly
    # distinct experts a program holds one pair, so MP 8 only costs registers (the x tile [4, BK0, MP]) and programs
    # per SM; an expert with more pairs than MP takes more passes over its weights (from L2 after the first)
    ("MP=1", {"MP": 1}, {}),
    ("MP=2", {"MP": 2}, {}),
    # wider programs for batch decode (s47: at 16-64 tokens the time follows the programs, ~20 waves of them): 16 rows
    # of I a stage-0 program (224 registers uncapped, 168 capped with 96 bytes of stack), 64 rows of H a stage-1 warp
    ("MP=2/maxnreg=128", {"MP": 2}, {"maxnreg": 128}),
    ("BLOCK_I=16", {}, {}, {"BLOCK_I": 16}),
    ("BLOCK_I=16/maxnreg=168", {}, {"maxnreg": 168}, {"BLOCK_I": 16}),
    ("RW=64", {}, {}, {"RW": 64}),
    ("RW=64/maxnreg=128", {}, {"maxnreg": 128}, {"RW": 64}),
    ("BLOCK_I=16/RW=64/maxnreg=168", {}, {"maxnreg": 168}, {"BLOCK_I": 16, "RW": 64}),
    # every program (a pair's, live or not) scans all T x TOP_K ids in steps of IDX_CHUNK (32: 16 dependent steps at 64
    # tokens, each a load and a few reductions) before its weights or its exit: fewer, wider steps (the scanning
    # render: s48run1, T 64 603.4 -> 541.3 / 403.6 us; PLAN 289.1)
    ("IDX_CHUNK=128/maxnreg=128", {}, {"maxnreg": 128}, {"IDX_CHUNK": 128, "PLAN": False}),
    ("IDX_CHUNK=512/maxnreg=128", {}, {"maxnreg": 128}, {"IDX_CHUNK": 512, "PLAN": False}),
    # PLAN (the default since s48run1): a first launch of one program groups the pairs by expert; each stage's
    # program j then takes item j (its expert and pairs in a few loads) instead of scanning all the ids (steps of more
    # than 64 pairs: T > 8 at top-8; the plan's launch is in stage 0's time). s48run1 (H100): T 16 189.1 -> 150.8 us,
    # T 64 688.8 -> 289.1 (with MAXNREG 128: 147.1 / 281.2). "no PLAN": the scanning render
    ("PLAN", {}, {}, {"PLAN": True}),
    ("PLAN/maxnreg=128", {}, {}, {"PLAN": True, "MAXNREG": 128}),
    ("no PLAN", {}, {}, {"PLAN": False}),
    ("no PLAN/maxnreg=128", {}, {}, {"PLAN": False, "MAXNREG": 128}),
)


def graph_us(fn, flush: torch.Tensor, reps: int = 30) -> float:
    """Median µs of fn() captured in a CUDA graph, replayed after an L2-flushing write each time."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return replay_us(g, flush, reps)


def replay_us(g: "torch.cuda.CUDAGraph", flush: torch.Tensor, reps: int = 30) -> float:
    """Median µs of `reps` replays of a captured graph, each after `flush.zero_()` (a write larger than the L2
    flushes it; a small one leaves it warm)."""
    times = []
    for _ in range(reps):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def ncu_launches(T: int) -> dict:
    """Both stages at T tokens, 3 times, nothing else on the GPU between them (for a counter profiler)."""
    c = moe_constants(load_spec(ROOT / "models/beam.yaml"), 8, "bf16")
    kdir = Path(tempfile.mkdtemp(prefix="moe-decode-"))
    mod = load_kernel(KernelSpec(TEMPLATE, "moe_experts", c), kdir)
    g = torch.Generator().manual_seed(0)
    params = mod.relayout(nvfp4_experts(c["E"], c["H"], c["I"], g, device="cuda"))
    x = torch.randn(T, c["H"], generator=g).bfloat16().cuda()
    idx = distinct_idx(T, c["E"], c["TOP_K"], g).cuda()
    y = torch.empty(T, c["TOP_K"], c["H"], dtype=torch.bfloat16, device="cuda")
    h = torch.empty(mod.scratch_numel(T), dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        mod.launch(x, idx, *params, y, h)
    torch.cuda.synchronize()
    return {}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--variants", default=None, help="comma-separated variant labels (default: all)")
    ap.add_argument("--ncu", action="store_true", help="only launch both stages (default render, re-laid out, "
                    "T = first of --tokens) 3 times, no graphs, no timing: for `ncu --clock-control none`")
    a = ap.parse_args(argv)
    if a.ncu:
        return ncu_launches(int(a.tokens.split(",")[0]))
    c = moe_constants(load_spec(ROOT / "models/beam.yaml"), 8, "bf16")
    mod = load_kernel(KernelSpec(TEMPLATE, "moe_experts", c), Path(tempfile.mkdtemp(prefix="moe-decode-")))
    g = torch.Generator().manual_seed(0)
    raw = nvfp4_experts(c["E"], c["H"], c["I"], g, device="cuda")
    layouts = {"modelopt": raw, "relaid": mod.relayout(raw)}
    H, I, K = c["H"], c["I"], c["TOP_K"]
    per_expert = 2 * I * H // 2 + 2 * I * H // 16 + H * I // 2 + H * I // 16 + 12
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows: list[dict] = []
    facts = {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
             "device": torch.cuda.get_device_name(),
             "torch": torch.__version__, "shapes": dict(c), "records": rows}
    for T in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(T, H, generator=g).bfloat16().cuda()
        idx = distinct_idx(T, c["E"], K, g).cuda()
        n_exp = int(torch.unique(idx).numel())
        nbytes = n_exp * per_expert
        buf = torch.randn(nbytes // 4, device="cuda")
        read = graph_us(lambda: buf.sum(), flush)
        rows.append(dict(T=T, layout="-", variant="torch.sum, same bytes", us=read, tb_s=nbytes / read / 1e6))
        noflush = torch.empty(0, dtype=torch.uint8, device="cuda")
        read = graph_us(lambda: buf.sum(), noflush)
        rows.append(dict(T=T, layout="-", variant="torch.sum, L2 warm", us=read, tb_s=nbytes / read / 1e6))
        ref = y_reference(x, idx, raw)
        for lname, params in layouts.items():
            chosen = [v for v in VARIANTS if a.variants is None or v[0] in a.variants.split(",")]
            for vname, cover, oover, *render in chosen if lname == "relaid" else chosen[:1]:
                m = load_kernel(KernelSpec(TEMPLATE, "moe_experts", dict(c, **render[0])),
                                Path(tempfile.mkdtemp(prefix="moe-variant-"))) if render else mod
                # (KSPLIT 8 re-lays gate_up out in chunks of H / 8: that module's own relayout)
                ps = m.relayout(raw) if m is not mod and lname == "relaid" and m.BK0 != mod.BK0 else params
                consts = dict(m.constexprs(T, lname == "relaid"), **cover)
                y = torch.full((T, K, H), float("nan"), dtype=torch.bfloat16, device="cuda")
                h = torch.empty(m.scratch_numel(T), dtype=torch.bfloat16, device="cuda")
                grids = m.stage_grids(T, consts)  # (PLANNED: the plan's items on the first axis)

                def stage(s, consts=consts, y=y, h=h, params=ps, ids=idx, m=m, oover=oover):
                    if s == 0 and consts.get("PLANNED"):  # (PLAN: the plan's launch first, in stage 0's time)
                        m.plan(ids, h, T, consts)
                    cx, o = m.stage_launch(s, consts)  # (KSPLIT 8: each stage its own binary and warps)
                    return m.kernel[grids[s]](x, ids, *params, y, h, T, x.stride(0), s, **cx, **dict(o, **oover))

                rec = dict(T=T, layout=lname, variant=vname, experts=n_exp, bytes=nbytes)
                try:
                    ks = [stage(0), stage(1)]
                    torch.cuda.synchronize()
                    rec["regs"] = [getattr(k, "n_regs", None) for k in ks]  # per stage (stage 1's binary is
                    rec["spills"] = [getattr(k, "n_spills", None) for k in ks]  # specialised on stage == 1)
                    rec["rel_err"] = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                    if not rec["rel_err"] < 1e-2:
                        raise AssertionError(f"rel err {rec['rel_err']}")
                    rec["us"] = graph_us(lambda: (stage(0), stage(1)), flush)
                    if vname == "default":  # the flush leaves dirty lines that the kernel's reads write back
                        rec["us_no_flush"] = graph_us(lambda: (stage(0), stage(1)), noflush)
                    rec["stage0_us"] = graph_us(lambda: stage(0), flush)
                    rec["stage1_us"] = graph_us(lambda: stage(1), flush)
                    rec["tb_s"] = nbytes / rec["us"] / 1e6
                except Exception as e:  # a variant that does not compile or is wrong: reported, the rest go on
                    rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                rows.append(rec)
                print(rec, flush=True)
                if lname == "relaid" and vname == "default":  # the fixed cost: every id invalid, no weight read
                    bad = torch.full_like(idx, c["E"])
                    us = graph_us(lambda: (stage(0, ids=bad), stage(1, ids=bad)), flush)
                    rows.append(dict(T=T, layout=lname, variant="ids invalid: no weight read", us=us, tb_s=0.0,
                                     stage0_us=graph_us(lambda: stage(0, ids=bad), flush),
                                     stage1_us=graph_us(lambda: stage(1, ids=bad), flush)))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"moe-decode-{facts['date']}.json").write_text(json.dumps(facts, indent=1) + "\n")
    print(f"{'T':>3} {'layout':<9} {'variant':<28} {'both us':>8} {'stage0':>8} {'stage1':>8} {'TB/s':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['T']:>3} {r['layout']:<9} {r['variant']:<28} {r['error']}")
        elif "stage0_us" in r:
            print(f"{r['T']:>3} {r['layout']:<9} {r['variant']:<28} {r['us']:>8.1f} {r['stage0_us']:>8.1f} "
                  f"{r['stage1_us']:>8.1f} {r['tb_s']:>6.2f} {r.get('regs', '')}")
        else:
            print(f"{r['T']:>3} {r['layout']:<9} {r['variant']:<28} {r['us']:>8.1f} {'':>8} {'':>8} {r['tb_s']:>6.2f}")
    return facts


if __name__ == "__main__":
    main()
