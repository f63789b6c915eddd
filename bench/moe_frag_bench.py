"""Issue 8: the fragment-load NVFP4 MoE kernel of small decode steps (moe_nvfp4_frag, Gluon) against the
fp32-accumulated reference and the moe_nvfp4_decode COMBINE render, TP-8 shapes, on the H200.

    python bench/moe_frag_bench.py --out DIR [--tokens 1,8] [--variants default,ks8,...]
                                           (a table last; DIR/moe-frag-<date>.json)

At each token count, three checks on fresh inputs (h and out against the reference, ||.|| / ||ref|| < 1e-2; out
against the COMBINE render), then CUDA graphs replayed after a 256 MB write that flushes the L2: the COMBINE render's
two launches, and for each render of the frag template (VARIANTS: its constants) both launches, each alone, and both
with every expert id invalid (no weight read: the fixed cost of the chains); `torch.sum` over the same bytes beside
them.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from beamc.codegen.kernel import KernelSpec, load_kernel  # noqa: E402
from beamc.spec import load_spec  # noqa: E402
from moe_decode import graph_us  # noqa: E402
from test_kernels_moe import (TEMPLATE, combined_reference, distinct_idx, h_reference, moe_constants,  # noqa: E402
                              nvfp4_experts)


# (label, template constants over the defaults)
VARIANTS = {
    "default": {},
    "no xpf": {"XPF": False},
    "ks8": {"KSPLIT": 8},  # 8 warps a stage-0 program, 80 registers (3 programs an SM)
    "ks8 uncapped": {"KSPLIT": 8, "MAXNREG0": 0},  # 116 registers: 2 programs an SM
    "ks4 uncapped": {"MAXNREG0": 0},  # ~184 registers: 2 programs an SM
    "cp.async": {"CP_ASYNC": True},  # the words (and stage 0's scales) through shared memory, all issued first
    "cp.async ks8": {"CP_ASYNC": True, "KSPLIT": 8},
    "cp.async g2": {"CP_ASYNC": True, "CP_GROUPS": 2},  # stage 0's copies in 2 / 5 / 10 commit groups
    "cp.async g5": {"CP_ASYNC": True, "CP_GROUPS": 5},
    "cp.async g10": {"CP_ASYNC": True, "CP_GROUPS": 10},
    # 96 registers (no spill with cp.async): 3 stage-0 programs an SM leave room for a stage-1 program beside them,
    # which then reads its words (before its PDL wait) while stage 0 finishes
    "cp.async g5 r96": {"CP_ASYNC": True, "CP_GROUPS": 5, "MAXNREG0": 96},
    "cp.async r96": {"CP_ASYNC": True, "MAXNREG0": 96},
}


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--tokens", default="1", help="comma-separated token counts (8 distinct experts a token)")
    ap.add_argument("--ncu", action="store_true", help="only launch the first variant's two stages 3 times at the "
                    "first token count, no graphs, no timing: for `ncu --clock-control none` (bench/ncu_source.sh)")
    a = ap.parse_args(argv)
    c = moe_constants(load_spec(ROOT / "models/beam.yaml"), 8, "bf16")
    E, H, I, K = c["E"], c["H"], c["I"], c["TOP_K"]
    kdir = Path(tempfile.mkdtemp(prefix="moe-frag-"))
    cur = load_kernel(KernelSpec(TEMPLATE, "moe_experts", dict(c, COMBINE=True, ROUTED_SCALE=2.5)), kdir)
    mods, broken = {}, []
    for v in a.variants.split(","):
        if v not in VARIANTS:
            raise SystemExit(f"--variants: unknown {v!r}; known: {', '.join(VARIANTS)}")
        try:  # a render its template refuses is reported, the others go on
            mods[v] = load_kernel(KernelSpec("moe_nvfp4_frag", "moe_experts", dict(c, ROUTED_SCALE=2.5, **VARIANTS[v])),
                                  kdir)
        except Exception as e:
            broken.append(dict(T=0, variant=v, error=f"{type(e).__name__}: {str(e)[:300]}"))
    if not mods:
        raise SystemExit(f"no render of moe_nvfp4_frag loads: {broken}")
    frag = mods[next(iter(mods))]  # (the checks: the first variant's render)
    g = torch.Generator().manual_seed(1)
    raw = nvfp4_experts(E, H, I, g, device="cuda")
    ps = cur.relayout(raw)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows, facts = list(broken), {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
                       "device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": dict(c)}
    import triton
    facts["triton"] = triton.__version__
    if a.ncu:
        T = int(a.tokens.split(",")[0])
        x = torch.randn(T, H, generator=g).bfloat16().cuda()
        idx = distinct_idx(T, E, K, g).cuda()
        w = (torch.rand(T, K, generator=g) + 0.05).cuda()
        out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
        h = torch.empty(frag.scratch_numel(T), dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            frag.launch(x, idx, *ps, w, out, h)
        torch.cuda.synchronize()
        return facts
    per_expert = 2 * I * H // 2 + 2 * I * H // 16 + H * I // 2 + H * I // 16 + 12
    checks, ok = [], True
    for T in (int(t) for t in a.tokens.split(",")):
        for trial in range(3):  # fresh inputs each check
            x = torch.randn(T, H, generator=g).bfloat16().cuda()
            idx = distinct_idx(T, E, K, g).cuda()
            w = (torch.rand(T, K, generator=g) + 0.05).cuda()
            h = torch.full((T * K * I,), float("nan"), dtype=torch.bfloat16, device="cuda")
            out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
            frag.launch(x, idx, *ps, w, out, h)
            o2 = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
            cur.launch(x, idx, *ps, w, o2)
            torch.cuda.synchronize()
            ref = combined_reference(x, idx, raw, w, 2.5)
            checks.append(dict(T=T, h_rel=rel(h, h_reference(x, idx, raw).view(-1)), out_rel=rel(out, ref),
                               cur_rel=rel(o2, ref), out_vs_cur=rel(out, o2),
                               finite=bool(torch.isfinite(out).all() and torch.isfinite(h).all())))
            ok = ok and checks[-1]["finite"] and checks[-1]["h_rel"] < 1e-2 and checks[-1]["out_rel"] < 1e-2
            print(checks[-1], flush=True)
        nbytes = int(torch.unique(idx).numel()) * per_expert  # the chosen experts' bytes (each read once at least)
        buf = torch.randn(nbytes // 4, device="cuda")
        rows.append(dict(T=T, bytes=nbytes, variant="torch.sum, same bytes",
                         us=graph_us(lambda: buf.sum(), flush, a.reps)))
        rows.append(dict(T=T, bytes=nbytes, variant="COMBINE render (both)",
                         us=graph_us(lambda: cur.launch(x, idx, *ps, w, o2), flush, a.reps)))
        for name, m in mods.items():  # timed even if a check failed (the table says so)
            try:
                def stage(st, m=m, ids=idx, x=x, w=w, out=out, h=h, T=T):
                    return m.launch_stage(st, T, (x, ids, *ps, w, out, h))
                ks = [stage(0), stage(1)]
                torch.cuda.synchronize()
                r = dict(T=T, bytes=nbytes, variant=name, constants=VARIANTS[name], regs=[k.n_regs for k in ks],
                         spills=[k.n_spills for k in ks], out_rel=rel(out, combined_reference(x, idx, raw, w, 2.5)))
                r["us"] = graph_us(lambda: (stage(0), stage(1)), flush, a.reps)
                r["stage0_us"] = graph_us(lambda: stage(0), flush, a.reps)
                r["stage1_us"] = graph_us(lambda: stage(1), flush, a.reps)
                bad = torch.full_like(idx, E)
                r["ids_invalid_us"] = graph_us(lambda: (stage(0, ids=bad), stage(1, ids=bad)), flush, a.reps)
            except Exception as e:  # reported, the rest go on
                r = dict(T=T, variant=name, error=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(r)
            print(r, flush=True)
    facts["checks"] = checks
    for r in rows:
        if "us" in r:
            r["tb_s"] = r["bytes"] / r["us"] / 1e6
    facts["records"] = rows
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"moe-frag-{facts['date']}.json").write_text(json.dumps(facts, indent=1) + "\n")
    print(f"checks ok: {ok}")
    print(f"{'T':>2} {'variant':<22} {'us':>7} {'stage0':>7} {'stage1':>7} {'TB/s':>6} {'no-read':>7} regs")
    for r in rows:
        if "error" in r:
            print(f"{r['T']:>2} {r['variant']:<22} {r['error'][:100]}")
        else:
            print(f"{r['T']:>2} {r['variant']:<22} {r['us']:>7.2f} {r.get('stage0_us', 0):>7.2f} "
                  f"{r.get('stage1_us', 0):>7.2f} {r['tb_s']:>6.2f} {r.get('ids_invalid_us', 0):>7.2f} "
                  f"{r.get('regs', '')}")
    return facts


if __name__ == "__main__":
    main()
