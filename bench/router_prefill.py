"""moe_router's large-M path (prefill) at 16,384 tokens, one TP-8 rank of the full spec: the stage-0 tiles (the 3xTF32
logits GEMM) as VARIANTS, each a CUDA-graph replay of both launches (bench/kernels.py graph_time), with each stage's
device time (torch.profiler) and torch's fp32 GEMM (cuBLAS, TF32 off) beside them in the same run. Checked per variant:
the logits against an fp64 product (max |d| / max |ref| < 1e-6) and the expert ids against the default tiles' (the
fraction equal: sums in another order may flip a near-tie).

    python bench/router_prefill.py --out $OUT [--tokens 16384] [--only LABEL,LABEL]
    ncu ... python bench/router_prefill.py --ncu [--tokens 16384]   # the default's two launches 3 times, no timing
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

from beamc.codegen.kernel import KernelSpec, load_kernel  # noqa: E402
from beamc.spec import load_spec  # noqa: E402

# (label, render constants): stage 0's tiles (BLOCK_T tokens x BLOCK_E experts, BLOCK_K, warps, pipeline depth)
VARIANTS = (
    # the default since s36run2: BF16X3 (W split by a first launch into three exact bf16 parts, three bf16 MMAs a step
    # on operands straight from the pipelined loads), 128 x 128 x K 64, 8 warps, 3 deep; and SPLIT_K (below a wave of
    # tiles, K split over up to 8 programs per tile) since s36run7/8
    ("default", {}),
    ("bf16x3 s2", dict(LOGIT_STAGES=2)),
    ("bf16x3 s4 K32", dict(LOGIT_STAGES=4, BLOCK_K=32)),
    ("bf16x3 T64 w4", dict(BLOCK_T=64, NUM_WARPS=4)),
    ("bf16x3 E256 T64 K32", dict(BLOCK_E=256, BLOCK_T=64, BLOCK_K=32)),
    ("bf16x3 T256 E64", dict(BLOCK_T=256, BLOCK_E=64)),
    # without SPLIT_K (the default since s36run7/8: K split over up to 8 programs per tile below a wave of tiles)
    ("no-split-k", dict(SPLIT_K=False)),
    # the selection (stage 1) with BLOCK_M tokens a program (one warp; 1 by default)
    ("select m2", dict(BLOCK_M=2)),
    ("select m4", dict(BLOCK_M=4)),
    ("select m8", dict(BLOCK_M=8)),
    # TF32X2 (the default s9run3 - s36: bf16 x is exact in TF32, W split by hand, two TF32 MMAs a step), 128 x 128 x
    # K 64, 8 warps, 2 deep, and its other tiles
    ("tf32x2", dict(BF16X3=False)),
    ("tf32x2 T64 K32 w4 s4", dict(BF16X3=False, BLOCK_T=64, BLOCK_K=32, NUM_WARPS=4, LOGIT_STAGES=4)),
    ("tf32x2 s3", dict(BF16X3=False, LOGIT_STAGES=3)),
    ("tf32x2 T64 w4", dict(BF16X3=False, BLOCK_T=64, NUM_WARPS=4)),
    ("tf32x2 E256", dict(BF16X3=False, BLOCK_E=256)),
    # tf32x3 (the default before s9run3: 64 x 128 x K 32, 4 warps, 4 deep) and at TF32X2's tiles
    ("tf32x3", dict(BF16X3=False, TF32X2=False)),
    ("tf32x3 T128 E128 K64 w8 s2", dict(BF16X3=False, TF32X2=False, BLOCK_T=128, BLOCK_E=128, BLOCK_K=64,
                                        NUM_WARPS=8, LOGIT_STAGES=2)),
)


def main() -> int:
    import kernels
    from profile_step import launch_medians
    from test_kernels_attn_router import router_constants

    args = sys.argv[1:]
    out = Path(args[args.index("--out") + 1]) if "--out" in args else None
    T = int(args[args.index("--tokens") + 1]) if "--tokens" in args else 16384
    c = router_constants(load_spec(ROOT / "models/beam.yaml"), "large")
    kdir = tempfile.mkdtemp()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, c["H"], device="cuda", generator=g).to(torch.bfloat16)
    W = torch.randn(c["E"], c["H"], device="cuda", generator=g) * 0.02
    bias = torch.randn(c["E"], device="cuda", generator=g) * 0.01
    if "--ncu" in args:  # for a counter profiler: the default render's two launches, 3 times, nothing else
        mod = load_kernel(KernelSpec("moe_router", "moe_router", c), kdir)
        w = torch.empty((T, c["TOP_K"]), device="cuda")
        ids = torch.empty((T, c["TOP_K"]), dtype=torch.int64, device="cuda")
        scratch = torch.empty(mod.scratch_numel(T), device="cuda")
        for _ in range(3):
            mod.launch(x, W, bias, w, ids, scratch)
        torch.cuda.synchronize()
        return 0
    exact = x.double() @ W.double().T
    torch.backends.cuda.matmul.allow_tf32 = False
    xf = x.float()
    t_torch = kernels.graph_time(lambda: torch.nn.functional.linear(xf, W), 5)
    # the bf16 tensor-core rate in the same run: cuBLAS on the same shape with bf16 operands (3 of them = BF16X3's work)
    wb = W.to(torch.bfloat16)
    t_bf16 = kernels.graph_time(lambda: torch.nn.functional.linear(x, wb), 5)
    only = args[args.index("--only") + 1].split(",") if "--only" in args else None
    recs, ids0 = {}, None
    for label, extra in VARIANTS:
        if only and label != "default" and label not in only:
            continue
        rec = dict(tiles=extra)
        try:
            mod = load_kernel(KernelSpec("moe_router", "moe_router", dict(c, **extra)), kdir)
            w = torch.full((T, c["TOP_K"]), float("nan"), device="cuda")
            ids = torch.full((T, c["TOP_K"]), -1, dtype=torch.int64, device="cuda")
            scratch = torch.empty(mod.scratch_numel(T), device="cuda")
            t = kernels.graph_time(lambda: mod.launch(x, W, bias, w, ids, scratch), 5)
            err = ((mod.logits(scratch, T).double() - exact).abs().max() / exact.abs().max()).item()
            n_launch = 3 if getattr(mod, "BF16X3", False) or mod.W_SPLIT else 2  # (W's split launch first)
            stage = launch_medians(lambda: mod.launch(x, W, bias, w, ids, scratch), x.device, n_launch)
            stage = stage[n_launch - 2:] + stage[:n_launch - 2]  # stage 0, stage 1[, the split]
            ids0 = ids.clone() if ids0 is None else ids0
            rec.update(us=t * 1e6, stage_us=stage, logits_rel_err=err,
                       ids_equal_to_default=(ids == ids0).all(dim=1).float().mean().item(),
                       gemm_tflops_fp32=2 * T * c["E"] * c["H"] / (stage[0] * 1e-6) / 1e12)
            assert err < 1e-6 and torch.isfinite(w).all(), rec
        except Exception as e:  # noqa: BLE001 - a variant that does not compile or check is reported, the run goes on
            rec.update(us=None, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        recs[label] = rec
        print(label, rec, flush=True)
    print(f"torch fp32 GEMM (cuBLAS, no TF32): {t_torch * 1e6:.1f} us; bf16 GEMM (cuBLAS) {t_bf16 * 1e6:.1f} us "
          f"({2 * T * c['E'] * c['H'] / t_bf16 / 1e12:.0f} TFLOP/s)")
    print(f"{'variant':<24} {'us':>8} {'stage0':>8} {'stage1':>8} {'TFLOP/s':>8} {'ids=':>6}")
    for label, r in recs.items():
        if r.get("us") is None:
            print(f"{label:<24} {r['error'][:90]}")
        else:
            print(f"{label:<24} {r['us']:>8.1f} {r['stage_us'][0]:>8.1f} {r['stage_us'][1]:>8.1f} "
                  f"{r['gemm_tflops_fp32']:>8.1f} {r['ids_equal_to_default']:>6.4f}")
    if out:
        date = datetime.date.today().isoformat()
        doc = dict(date=date, command="python " + " ".join(sys.argv), device=torch.cuda.get_device_name(), tokens=T,
                   torch_fp32_gemm_us=t_torch * 1e6, torch_bf16_gemm_us=t_bf16 * 1e6, records=recs)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"router-prefill-{date}.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
