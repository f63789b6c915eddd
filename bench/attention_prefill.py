"""Ragged prefill attention (issue 9) of one TP-8 rank of Beam on the GPU, beside torch SDPA on equivalent inputs.

Imported by `bench/kernels.py` (`bench_cases(graph_time, copy_bw)`; graph_time(fn, reps) -> seconds per call,
replayed in a CUDA graph); the records join its JSON. The generated `attention_prefill` kernel (bf16 q, 6 query /
1 KV head of 128, the full spec at TP 8) on:
- full layer (paged cache, page 16, shuffled block table): 8 sequences x 2048 new tokens with 0 and with 100,000
  tokens of prior context each (the 100K case holds 8 x 102,400 positions: 2 x 210 MB of bf16 cache; the SDPA
  baseline's K/V expanded to 6 heads take 2 x 1.26 GB), bf16 and fp8 e4m3 caches;
- sliding layer (window 512, ring of 511 + 2048 positions per sequence): the same batch with 0 and 100,000 prior.
TFLOP/s counts only the unmasked work: 4 * HQ * head_dim FLOPs (q.k and p.v, a multiply and an add each) per
(query token, allowed key) pair, pairs = sum over tokens of p + 1 (full) or min(p + 1, 512) (sliding): the causal
half of the square and the window band, nothing masked. The baseline gets the same count.
Baseline: torch.nn.functional.scaled_dot_product_attention, bf16, on the same q and the same keys/values gathered
out of the cache into dense [seqs, 6, keys, 128] tensors (GQA expanded), in a CUDA graph: full layers on the flash
backend (is_causal with no prior context; a lower-right causal bias with prior context, if the flash backend takes
it there, else the default backend with that bias, as the record says); sliding layers on SDPA's default backend
with a boolean band mask (flash attention has no window in SDPA). The gather is not timed.
tb_s: (q + out + the distinct K/V cache rows the step needs) / time: how far the kernel is from a memory bound
(it is compute bound at these shapes). Outputs are poisoned before the timing and checked after it.
"""
from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from beamc.codegen.kernel import KernelSpec, load_kernel  # noqa: E402
from beamc.ir.reference import kv_store  # noqa: E402
from beamc.spec import load_spec  # noqa: E402

SEQS, CHUNK, PAGE = 8, 2048, 16
PRIORS = (0, 100_000)
FP8 = torch.float8_e4m3fn


def layer_constants(kind: str, cache: str = "bf16", tp: int = 8) -> dict:
    """The template's constants for one full-spec layer kind at TP `tp` (sliding: ring; full: paged)."""
    a = load_spec(ROOT / "models/beam.yaml").attention
    return dict(DTYPE="bf16", CACHE_DTYPE=cache, HQ=a.num_heads // tp, HKV=max(a.num_kv_heads // tp, 1),
                HEAD_DIM=a.head_dim, WINDOW=a.sliding.window if kind == "sliding" else 0,
                SCALE=1 / math.sqrt(a.head_dim), PAGED=kind == "full", PAGE_SIZE=PAGE if kind == "full" else 0)


TABLE_ROWS = None  # (--table-rows) the block table's rows, as the runtime's max_batch + 1: None, one a sequence


def make_inputs(c: dict, seqs: int, chunk: int, prior: int, device, gen: torch.Generator) -> list[torch.Tensor]:
    """Launcher inputs (q, kc, vc, slot, pos[, block_table][, k_scale, v_scale]): `seqs` sequences of `chunk` new
    tokens each at positions prior ... prior + chunk - 1, consecutive per sequence (SlotTable.plan's layout); random
    caches (every row, not only the ones read); a paged cache's block table of TABLE_ROWS rows where set (the rows
    past the sequences' repeat the first: no token reads them, as the runtime's table of max_batch + 1 rows)."""
    hq, hkv, d, W = c["HQ"], c["HKV"], c["HEAD_DIM"], c["WINDOW"]
    T = seqs * chunk
    slot = torch.arange(seqs, device=device).repeat_interleave(chunk)
    pos = (prior + torch.arange(chunk, device=device)).repeat(seqs)
    q = torch.randn(T, hq, d, generator=gen, device=device).to(torch.bfloat16)
    if c["PAGED"]:
        mp = -(-(prior + chunk) // PAGE)
        bt = torch.randperm(seqs * mp, generator=gen, device=device).view(seqs, mp).to(torch.int32)
        if TABLE_ROWS is not None and TABLE_ROWS > seqs:
            bt = torch.cat([bt, bt[:1].expand(TABLE_ROWS - seqs, mp)]).contiguous()
        shape = (seqs * mp, PAGE, hkv, d)
    else:
        bt = None
        shape = (seqs, W - 1 + chunk, hkv, d)
    ins = [q]
    scales = [torch.tensor([0.02], device=device), torch.tensor([0.05], device=device)]
    for s in scales:
        x = torch.randn(shape, generator=gen, device=device)
        ins.append(kv_store(x, FP8, s) if c["CACHE_DTYPE"] == "f8e4m3" else x.to(torch.bfloat16))
        del x
    ins += [slot, pos] + ([bt] if bt is not None else [])
    if c["CACHE_DTYPE"] == "f8e4m3":
        ins += scales
    return ins


def key_range(c: dict, prior: int, chunk: int) -> tuple[int, int]:
    """[lo, hi) of the key positions a sequence's chunk reads."""
    W = c["WINDOW"]
    return (max(prior - W + 1, 0) if W else 0), prior + chunk


def allowed_pairs(c: dict, seqs: int, chunk: int, prior: int) -> int:
    """Unmasked (query token, key) pairs: p + 1 keys per token (full), min(p + 1, window) (sliding)."""
    W = c["WINDOW"]
    per = [(p + 1) if not W else min(p + 1, W) for p in range(prior, prior + chunk)]
    return seqs * sum(per)


def dense_kv(c: dict, ins: list[torch.Tensor], seqs: int, chunk: int, prior: int) -> tuple[torch.Tensor, ...]:
    """SDPA's operands: q [seqs, HQ, chunk, d], K/V [seqs, HQ, keys, d] (bf16, GQA expanded) gathered out of the
    cache (fp8: dequantised) for the positions key_range reads, and the boolean mask [chunk, keys] (True: allowed)."""
    q, kc, vc, slot, pos = ins[:5]
    hq, hkv, d, W = c["HQ"], c["HKV"], c["HEAD_DIM"], c["WINDOW"]
    lo, hi = key_range(c, prior, chunk)
    kpos = torch.arange(lo, hi, device=q.device)
    out = [q.view(seqs, chunk, hq, d).transpose(1, 2)]
    for cache, scale in zip((kc, vc), ins[-2:] if c["CACHE_DTYPE"] == "f8e4m3" else (None, None)):
        rows = []
        for s in range(seqs):
            if c["PAGED"]:
                r = cache[ins[5][s, kpos // PAGE].long(), kpos % PAGE]
            else:
                r = cache[s, kpos % cache.shape[1]]
            rows.append(r.float() * scale if scale is not None else r)
        x = torch.stack(rows).to(torch.bfloat16)  # [seqs, keys, hkv, d]
        out.append(x.transpose(1, 2).repeat_interleave(hq // hkv, dim=1).contiguous())
    qpos = torch.arange(prior, prior + chunk, device=q.device)
    mask = kpos[None, :] <= qpos[:, None]
    if W:
        mask &= kpos[None, :] > qpos[:, None] - W
    return (*out, mask)


def sdpa_fn(c: dict, q4, k4, v4, mask, prior: int):
    """(fn, label) of the SDPA baseline on the dense operands (see the module docstring)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = torch.empty_like(q4)
    scale = c["SCALE"]
    if c["WINDOW"]:
        def fn():
            out.copy_(F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale))
        return fn, "torch SDPA, default backend, boolean band mask (bf16)"
    if prior == 0:
        def fn():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out.copy_(F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale))
        return fn, "torch SDPA flash backend, is_causal (bf16)"
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(q4.shape[2], k4.shape[2])
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q4, k4, v4, attn_mask=bias, scale=scale)
        backends, label = [SDPBackend.FLASH_ATTENTION], "torch SDPA flash backend, causal_lower_right (bf16)"
    except RuntimeError:
        backends, label = None, "torch SDPA default backend, causal_lower_right (bf16; flash refused it)"

    def fn():
        if backends:
            with sdpa_kernel(backends):
                out.copy_(F.scaled_dot_product_attention(q4, k4, v4, attn_mask=bias, scale=scale))
        else:
            out.copy_(F.scaled_dot_product_attention(q4, k4, v4, attn_mask=bias, scale=scale))
    return fn, label


def flashinfer_fn(c: dict, ins: list, seqs: int, chunk: int, prior: int):
    """FlashInfer 0.7.2's paged prefill (BatchPrefillWithPagedKVCacheWrapper, FA2 backend, NHD pages of 16, causal
    bottom-right aligned, CUDA-graph mode) on the same q: full layers read our paged cache through our block table
    as it is; sliding layers' rings are copied into pages (FlashInfer has no ring) and read with window_left =
    window - 1. None when FlashInfer is absent (`../shared/tools/stage_flashinfer.sh` stages it for the H200)."""
    try:  # the staged bundle's flashinfer/__init__.py is trimmed: the wrappers come from their submodules
        from flashinfer.prefill import BatchPrefillWithPagedKVCacheWrapper
    except ImportError:
        return None
    q, kc, vc = ins[:3]
    dev = q.device
    i32 = dict(dtype=torch.int32, device=dev)
    if c["PAGED"]:
        n = prior + chunk
        npg = -(-n // PAGE)
        kp, vp, indices = kc, vc, ins[5][:seqs, :npg].reshape(-1).to(torch.int32)
        window_left = -1
    else:  # each ring's positions max(0, prior - (window - 1)) ... prior + chunk - 1, in order, into pages
        lo = max(0, prior - (c["WINDOW"] - 1))
        n = prior + chunk - lo
        npg = -(-n // PAGE)
        kpos = torch.arange(lo, prior + chunk, device=dev)
        kp = torch.zeros(seqs, npg * PAGE, *kc.shape[2:], dtype=kc.dtype, device=dev)
        vp = torch.zeros_like(kp)
        for s in range(seqs):
            kp[s, :n], vp[s, :n] = kc[s, kpos % kc.shape[1]], vc[s, kpos % kc.shape[1]]
        kp, vp = kp.view(seqs * npg, PAGE, *kc.shape[2:]), vp.view(seqs * npg, PAGE, *kc.shape[2:])
        indices = torch.arange(seqs * npg, **i32)
        window_left = c["WINDOW"] - 1
    qo = torch.arange(0, seqs + 1, **i32) * chunk
    kv_indptr = torch.arange(0, seqs + 1, **i32) * npg
    last = torch.full((seqs,), n - (npg - 1) * PAGE, **i32)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    w = BatchPrefillWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, qo_indptr_buf=qo, paged_kv_indptr_buf=kv_indptr,
        paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=last, backend="fa2")
    w.plan(qo, kv_indptr, indices, last, c["HQ"], c["HKV"], c["HEAD_DIM"], PAGE, causal=True,
           sm_scale=c["SCALE"], window_left=window_left, q_data_type=q.dtype, kv_data_type=kc.dtype)
    out = torch.empty_like(q)

    def fn():
        w.run(q, (kp, vp), out=out)
    return fn


def _case(graph_time, kdir, kind: str, cache: str, prior: int, device) -> dict:
    c = layer_constants(kind, cache)
    mod = load_kernel(KernelSpec("attention_prefill", "attention", c), kdir)
    gen = torch.Generator(device=device).manual_seed(prior + len(kind) + len(cache))
    ins = make_inputs(c, SEQS, CHUNK, prior, device, gen)
    out = torch.full_like(ins[0], float("nan"))
    reps = 3 if prior else 20
    t = graph_time(lambda: mod.launch(*ins, out), reps)
    assert not out.isnan().any(), f"attention_prefill {kind} {cache} prior {prior}: unwritten outputs"
    pairs = allowed_pairs(c, SEQS, CHUNK, prior)
    flops = 4 * c["HQ"] * c["HEAD_DIM"] * pairs
    lo, hi = key_range(c, prior, CHUNK)
    kv_bytes = 2 * SEQS * (hi - lo) * c["HKV"] * c["HEAD_DIM"] * ins[1].element_size()
    nbytes = 2 * ins[0].numel() * ins[0].element_size() + kv_bytes
    rec = {"kernel": f"prefill {kind} {cache} ctx{prior // 1000}K", "op": "attention", "tokens": SEQS * CHUNK,
           "us": t * 1e6, "tb_s": nbytes / t / 1e12, "tflops": flops / t / 1e12, "flops": flops, "bytes": nbytes,
           "seqs": SEQS, "chunk": CHUNK, "prior": prior, "layer": kind, "cache": cache, "window": c["WINDOW"],
           "block": [mod.BLOCK_M, mod.BLOCK_N, mod.NUM_WARPS], "pdl": bool(mod.PDL),
           "baseline": None, "baseline_us": None}
    if cache == "bf16":  # the baseline once per layer kind and prior (SDPA reads bf16; fp8 records: see bf16's)
        q4, k4, v4, mask = dense_kv(c, ins, SEQS, CHUNK, prior)
        try:
            fn, label = sdpa_fn(c, q4, k4, v4, mask, prior)
            tb = graph_time(fn, reps)
            rec.update(baseline=label, baseline_us=tb * 1e6, baseline_tflops=flops / tb / 1e12)
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run is recorded, the kernel's figure stays
            rec.update(baseline=f"torch SDPA failed: {type(e).__name__}: {e}"[:300])
        del q4, k4, v4, mask
        try:
            f = flashinfer_fn(c, ins, SEQS, CHUNK, prior)
            if f is not None:
                tf = graph_time(f, reps)
                rec.update(flashinfer_us=tf * 1e6, flashinfer_tflops=flops / tf / 1e12,
                           flashinfer="FlashInfer 0.7.2 paged prefill (FA2 backend), CUDA graph")
            else:
                rec.update(flashinfer="FlashInfer not installed")
        except Exception as e:  # noqa: BLE001 - a module not staged for this variant: recorded, the run goes on
            rec.update(flashinfer=f"FlashInfer failed: {type(e).__name__}: {e}"[:300])
    torch.cuda.empty_cache()
    return rec


def bench_cases(graph_time, copy_bw: float | None = None) -> list[dict]:
    """Records for bench/kernels.py (GPU only)."""
    kdir = Path(tempfile.mkdtemp(prefix="beamc_attention_prefill_"))
    out = []
    for kind, cache in (("full", "bf16"), ("full", "f8e4m3"), ("sliding", "bf16")):
        for prior in PRIORS:
            rec = _case(graph_time, kdir, kind, cache, prior, "cuda")
            if copy_bw is not None:
                rec["copy_tb_s"] = copy_bw
            out.append(rec)
    return out


# tiles tried by `sweep` (render constants). Without MIRROR the fp8 full layer's default is BLOCK_M 64, BLOCK_N 128,
# 4 warps, 2 stages (H200 2026-12-01 s8run1, 100K: 23.3 ms; 64 / 256 38.9, 128 / 128 / 4 warps 29.6, 4 stages 23.9).
# MIRROR (fp8 full layers only: the step's K/V converted once into a bf16 mirror, then read as bf16 with linear
# addressing; the same bits as without it at the same BLOCK_N): its default is 128 / 64 / 8 warps / 3 stages (s8run1:
# 14.8 ms against 17.5 at 128 / 128 / 8 / 2 and 29.0 at 64 / 128 / 4 / 2); the rest probe around it.
SWEEP = ({}, dict(BLOCK_M=64, BLOCK_N=128, NUM_WARPS=4, NUM_STAGES=4),
         dict(MIRROR=True), dict(MIRROR=True, NUM_STAGES=4), dict(MIRROR=True, NUM_STAGES=2),
         dict(MIRROR=True, BLOCK_N=32), dict(MIRROR=True, BLOCK_M=64, NUM_WARPS=4),
         dict(MIRROR=True, BLOCK_M=256, NUM_WARPS=8), dict(MIRROR=True, BLOCK_M=128, BLOCK_N=128, NUM_WARPS=8,
                                                             NUM_STAGES=2),
         # the model's form (attention_gate: the output gate in the epilogue, g a strided view of the packed QKV+gate
         # output): in the s8run6 model profile the mirrored full layer took 20.3 ms against this sweep's 14.7
         dict(MIRROR=True, GATE=True), dict(GATE=True),
         # TMA: the mirrored pass's unmasked K/V blocks by TMA copies (Triton 3.6's ptxas serialises the wgmmas of the
         # cp.async render, C7515; not with TMA)
         dict(MIRROR=True, TMA=True), dict(MIRROR=True, TMA=True, NUM_STAGES=4), dict(MIRROR=True, TMA=True, GATE=True),
         # WGMMA: the mirrored pass as a warp-specialised Gluon kernel (K/V by TMA into a ring of WG_STAGES slots, the
         # next block's scores issued before this block's P @ V)
         dict(MIRROR=True, WGMMA=True), dict(MIRROR=True, WGMMA=True, WG_STAGES=3),
         dict(MIRROR=True, WGMMA=True, BLOCK_N=128), dict(MIRROR=True, WGMMA=True, GATE=True))


def kernel_medians(fn, device, reps: int = 3) -> list[tuple[str, float]]:
    """(name, median device us) of each generated kernel one call of `fn` launches, in launch order (torch.profiler
    over `reps` calls): where a multi-launch render's time goes, beside the graph timing of the whole."""
    from profile_step import GENERATED, device_kernels  # bench/profile_step.py

    ev = [e for e in device_kernels(fn, device, reps) if e.name in GENERATED]
    n = len(ev) // reps
    return [(ev[s].name, sorted(ev[r * n + s].time_range.elapsed_us() for r in range(reps))[reps // 2])
            for s in range(n)]


def sweep(graph_time, kind: str = "full", cache: str = "f8e4m3", prior: int = 100_000, device="cuda",
          tiles=SWEEP, profile: bool = False) -> list[dict]:
    """The prefill kernel at other tiles on one case (default: the model's, full layer with fp8 KV over 100K prior
    context): us and TFLOP/s of each, its output checked against the default tiles' (relative error < 1e-2; a tile
    that fails to compile or to match is reported, not timed); `profile`: each launch's kernels' device us too."""
    kdir = Path(tempfile.mkdtemp(prefix="beamc_attention_prefill_sweep_"))
    gen = torch.Generator(device=device).manual_seed(7)
    c = layer_constants(kind, cache)
    ins = make_inputs(c, SEQS, CHUNK, prior, device, gen)
    flops = 4 * c["HQ"] * c["HEAD_DIM"] * allowed_pairs(c, SEQS, CHUNK, prior)
    ref, out = None, []
    for extra in tiles:
        rec = {"kernel": f"prefill {kind} {cache} ctx{prior // 1000}K", "tiles": extra, "tokens": SEQS * CHUNK}
        try:
            gate = extra.get("GATE", False)
            mod = load_kernel(KernelSpec("attention_prefill", "attention_gate" if gate else "attention",
                                         dict(c, **extra)), kdir)
            o = torch.full_like(ins[0], float("nan"))
            args = ins
            if gate:  # g: the gate's heads of a [T, QKV + gate] row, as the packed projection leaves them
                T, hq, d = ins[0].shape
                packed = torch.randn(T, (hq + 2 * c["HKV"] + hq) * d, device=device, generator=gen,
                                     dtype=ins[0].dtype)
                g = packed[:, (hq + 2 * c["HKV"]) * d:].view(T, hq, d)
                b = torch.randn(hq, 1, device=device, generator=gen, dtype=ins[0].dtype)
                args = (*ins, g, b)
            t = graph_time(lambda: mod.launch(*args, o), 3)
            assert not o.isnan().any(), "unwritten outputs"
            err = None  # (a gated output is another function: its values are the GPU tests' to check)
            if not gate:
                ref = o.clone() if ref is None else ref
                err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
                assert err < 1e-2, f"rel err vs the default tiles {err}"
            rec.update(us=t * 1e6, tflops=flops / t / 1e12, rel_err_vs_default=err,
                       block=[mod.BLOCK_M, mod.BLOCK_N, mod.NUM_WARPS, mod.NUM_STAGES])
            if profile:  # each launch's kernels (MIRROR: the plan, the copy, the two passes), median device us
                rec["kernels_us"] = kernel_medians(lambda: mod.launch(*args, o), device)
        except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
            rec.update(us=None, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        print(rec, flush=True)
        out.append(rec)
    return out


if __name__ == "__main__":
    import argparse
    import datetime
    import json

    ap = argparse.ArgumentParser(description="attention prefill tile sweep (one case)")
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    ap.add_argument("--cases", default="full:f8e4m3:100000",
                    help="comma-separated kind:cache:prior (kind full|sliding, cache bf16|f8e4m3)")
    ap.add_argument("--tiles", default=None,
                    help='the render constants to try instead of SWEEP, a JSON list of objects: the first is the '
                         'reference the others are checked against, e.g. \'[{"MIRROR": true}, {"MIRROR": true, "TMA": true}]\'')
    ap.add_argument("--profile", action="store_true", help="each launch's kernels' device us too (torch.profiler)")
    ap.add_argument("--table-rows", type=int, default=None,
                    help="a paged cache's block-table rows (the runtime has max_batch + 1; default: one a sequence)")
    a = ap.parse_args()
    TABLE_ROWS = a.table_rows
    tiles = SWEEP if a.tiles is None else tuple(json.loads(a.tiles))
    sys.path.insert(0, str(ROOT / "bench"))
    from kernels import graph_time

    recs = []
    for case in a.cases.split(","):
        kind, cache, prior = case.split(":")
        recs += sweep(graph_time, kind, cache, int(prior), tiles=tiles, profile=a.profile)
        torch.cuda.empty_cache()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    facts = {"date": date, "device": torch.cuda.get_device_name(), "command": "python " + " ".join(sys.argv),
             "records": recs}
    (Path(a.out) / f"attention-prefill-sweep-{date}.json").write_text(json.dumps(facts, indent=1) + "\n")
    for r in recs:
        print(f"{r['kernel'][8:]:<22} {str(r['tiles']):<72} {r['us'] if r['us'] is None else round(r['us'], 1):>10} "
              f"{'' if r['us'] is None else round(r['tflops'], 1):>8} {r.get('error', '')}")
        if r.get("kernels_us"):
            print("    kernels (us):", ", ".join(f"{name} {us:.1f}" for name, us in r["kernels_us"]))
