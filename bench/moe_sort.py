"""The prefill MoE's counting sort alone (`moe_nvfp4_prefill` stages 0-2: histogram, prefix, scatter; issue 8) at one
TP-8 rank of Beam, in the emitter's WGMMA forms (`emitters.MOE_WGMMA_FORMS`: the 256-row form at 16,384 tokens, the
128-row form at 2,048 / 4,096), with render constants of the sort as VARIANTS: stage 2's ranks from a sort of each
chunk (RANK_SORT, the default since s41) against [32, 256] comparison tiles, stage 2's block-map tile (SCAN_B_PAR), the chunk size
(SORT_CHUNK), the sort's own binary (SORT_ALONE, where the form has it not).

Each variant: a CUDA-graph replay (bench/kernels.py graph_time) of the three launches (`launch_stages((0, 1, 2), ...)`, PDL
as in the step) and of stage 2 alone, beside the copy rate measured in the same run; checked against the form's own
render: the sorted rows, starts, counts and block map bit for bit (no GEMM runs: y and h are not read).

    python bench/moe_sort.py --out $OUT [--only WORD,WORD]
"""
from __future__ import annotations

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

from beamc.codegen.emitters import moe_wgmma_form  # noqa: E402
from beamc.codegen.kernel import KernelSpec, load_kernel  # noqa: E402
from beamc.spec import load_spec  # noqa: E402

# (tokens, form): the emitter's choice at those token counts
CASES = ((16384, "bm256"), (4096, "bm128"), (2048, "bm128"))
# (label, render constants beside the form's)
# (s41run1 ran these before RANK_SORT and SCAN_B_PAR 8 were the defaults: its "form" was rank_tiles scan_b64 here,
# its "rank_sort" the form, its "scan_b8" rank_tiles)
VARIANTS = (
    ("form", {}),
    ("rank_tiles scan_b64", dict(RANK_SORT=False, SCAN_B_PAR=64)),  # (the sort before s41)
    ("rank_tiles", dict(RANK_SORT=False)),
    ("rank_sort scan_b64", dict(RANK_SORT=True, SCAN_B_PAR=64)),
    ("rank_sort chunk512", dict(RANK_SORT=True, SORT_CHUNK=512)),
    ("rank_sort chunk128", dict(RANK_SORT=True, SORT_CHUNK=128)),
    ("rank_sort warps2", dict(RANK_SORT=True, SORT_WARPS=2)),
    ("rank_sort alone", dict(RANK_SORT=True, SORT_ALONE=True)),  # (the 128-row form has SORT_ALONE off)
)
SAME = ("start", "count", "blk_expert", "blk_end", "sorted")  # (the prefix's layout follows SORT_CHUNK)


def main() -> int:
    import argparse

    from kernels import copy_bandwidth, graph_time
    from test_kernels_moe import distinct_idx, moe_constants

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="comma-separated words of variant labels (the form always runs)")
    args = ap.parse_args()
    c = moe_constants(load_spec(ROOT / "models/beam.yaml"), 8, "bf16")
    E, H, I, k = c["E"], c["H"], c["I"], c["TOP_K"]
    kdir = tempfile.mkdtemp(prefix="beamc_bench_moe_sort_")
    # weights are only shape-checked by the sort's launches: small random bytes in the re-laid-out layout
    params = [torch.randint(0, 255, shape, dtype=torch.int32 if dt == "w" else torch.uint8, device="cuda")
              if dt != "f" else torch.rand(shape, device="cuda")
              for shape, dt in (((E, 2 * I, H // 8), "w"), ((E, 2 * I, H // 16), "s"), ((E, 2), "f"),
                                ((E, H, I // 8), "w"), ((E, H, I // 16), "s"), ((E, 1), "f"))]
    bw = copy_bandwidth()
    recs = []
    for tokens, form in CASES:
        g = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, H, generator=g).bfloat16().cuda()
        idx = distinct_idx(tokens, E, k, g).cuda()
        y = torch.empty(tokens, k, H, dtype=torch.bfloat16, device="cuda")
        ref = None
        for label, extra in VARIANTS:
            words = (args.only or "").split(",")
            if args.only and label != "form" and not any(w in label for w in words):
                continue
            rec = dict(tokens=tokens, form=form, variant=label, extra=extra)
            try:
                mod = load_kernel(KernelSpec("moe_nvfp4_prefill", "moe_experts",
                                             dict(c, **dict(moe_wgmma_form(form), **extra))), kdir)
                scratch = torch.full((mod.scratch_numel(tokens),), float("nan"), dtype=torch.bfloat16, device="cuda")
                sort = lambda st: (lambda: mod.launch_stages(st, x, idx, *params, y, scratch))  # noqa: E731
                sort((0, 1, 2))()
                torch.cuda.synchronize()
                views = {n: v.clone() for n, v in mod.scratch_views(scratch, tokens).items() if n in SAME}
                if ref is None:
                    ref = views
                rec["same_rows"] = all(torch.equal(views[n], ref[n]) for n in SAME)
                rec["sort_us"] = graph_time(sort((0, 1, 2)), 20) * 1e6
                rec["stage2_us"] = graph_time(sort((2,)), 20) * 1e6
                rec["stage0_us"] = graph_time(sort((0,)), 20) * 1e6
                rec.update(RANK_SORT=mod.RANK_SORT, SORT_ALONE=mod.SORT_ALONE, SORT_CHUNK=mod.SORT_CHUNK,
                           SORT_WARPS=mod.SORT_WARPS, NCH=int(mod.sizes(tokens)["NCH"]))
            except Exception as e:  # noqa: BLE001 - a variant that does not build says why; the run goes on
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            rec["copy_tb_s"] = bw
            print(json.dumps(rec), flush=True)
            recs.append(rec)
    if args.out:
        date = datetime.date.today().isoformat()
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"moe-sort-{date}.json").write_text(json.dumps(dict(
            date=date, device=torch.cuda.get_device_name(), command="python " + " ".join(sys.argv), copy_tb_s=bw,
            records=recs), indent=1) + "\n")
    print(f"copy {bw:.2f} TB/s")
    print(f"{'tokens':>6} {'form':<6} {'variant':<22} {'sort us':>8} {'stage2':>7} {'stage0':>7} same")
    for r in recs:
        print(f"{r['tokens']:>6} {r['form']:<6} {r['variant']:<22} {r.get('sort_us', 0):>8.1f} "
              f"{r.get('stage2_us', 0):>7.1f} {r.get('stage0_us', 0):>7.1f} {r.get('same_rows', r.get('error', ''))}")
    return 0 if all(r.get("same_rows", True) for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
