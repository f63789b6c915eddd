"""Decode attention (`attention_decode`, issue 9) of one TP-8 rank of Beam, timed on the GPU beside torch SDPA.

Imported by `bench/kernels.py` (`bench_cases(graph_time, copy_bw)`; graph_time(fn, reps) -> seconds per call in a
CUDA graph); the records join its JSON. Batch 1 (one query token), 6 query heads / 1 KV head of 128:
- full layer (paged cache, pages of 16, a shuffled block table) at 8K, 32K and 100K context, bf16 and fp8 e4m3 KV;
- sliding layer (window 512, ring of 512 positions) at position 4096, bf16 and fp8 KV;
each: the kernel as rendered by default (split rule `num_splits`), then a sweep of tile configs (BLOCK_N, num_warps,
num_stages) x split counts, the best recorded beside the default; baseline torch SDPA
(`scaled_dot_product_attention`, enable_gqa) on the same context as contiguous bf16 K/V [1, 1, L, 128] (fp8: the
dequantised values; SDPA has no fp8 or paged input), in a CUDA graph. TB/s = K and V bytes of the context read
(the cache dtype) / time; outputs checked against attention_ref (rel err, printed and recorded).

    python bench/attention_decode.py --dry     # the tiny fp32 path under Triton's CPU interpreter (no timing meaning)
    ncu ... python bench/attention_decode.py --ncu-qkn sliding:f8e4m3:4096   # the step's QKN render, for ncu
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

if __name__ == "__main__" and "--dry" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from beamc.codegen.kernel import KernelSpec, load_kernel  # noqa: E402
from beamc.spec import load_spec  # noqa: E402
from test_kernels_attention_decode import TEMPLATE, constants, make_case, reference  # noqa: E402

PAGE = 16
# template constants swept beside the default render (label, constants); "before" is the kernel as it was up to
# 2026-12-01's fifth session (no software pipeline, stage 1 one program per head in chunks of 32 splits)
CONFIGS = (("default", {}), ("before", dict(PREFETCH=False, MERGE_CHUNK=32, MERGE_D=128, LAST_MERGE_MAX=1)),
           ("two-launch", dict(LAST_MERGE_MAX=1)),  # stage 1 merges at every split count (no last-arriver merge)
           ("no-prefetch", dict(PREFETCH=False)), ("bn128/no-prefetch", dict(BLOCK_N=128, PREFETCH=False)),
           ("bn32", dict(BLOCK_N=32)), ("bn32/two-launch", dict(BLOCK_N=32, LAST_MERGE_MAX=1)),
           # deeper software pipelines: more K/V bytes in flight per program (the loop measured latency-bound)
           ("prefetch2", dict(PREFETCH=2)), ("bn32/prefetch2", dict(BLOCK_N=32, PREFETCH=2)),
           ("bn32/prefetch3", dict(BLOCK_N=32, PREFETCH=3)), ("bn32/prefetch4", dict(BLOCK_N=32, PREFETCH=4)),
           # fewer warps per program: no cross-warp row reductions (shared memory + barriers) in the loop
           ("w1/bn16", dict(NUM_WARPS=1, BLOCK_N=16, MERGE_D=16)), ("w1/bn32", dict(NUM_WARPS=1, BLOCK_N=32, MERGE_D=16)),
           ("w1/bn64", dict(NUM_WARPS=1, BLOCK_N=64, MERGE_D=16)),
           ("w1/bn32/no-prefetch", dict(NUM_WARPS=1, BLOCK_N=32, PREFETCH=False, MERGE_D=16)),
           ("w2/bn32", dict(NUM_WARPS=2, BLOCK_N=32)), ("w2/bn64", dict(NUM_WARPS=2, BLOCK_N=64)),
           ("w2/bn128/no-prefetch", dict(NUM_WARPS=2, BLOCK_N=128, PREFETCH=False)),
           # more warps per SM: the loop is latency-bound at 2 programs (8 warps) per SM, held there by registers
           # (the TP-8 QKN full render with Triton 3.6 for sm_90a: 234 registers at the default; bn32 156 -> 3
           # programs per SM; w8/bn32 94 and w8/bn16 102 -> 2 programs of 8 warps; bn16 128 -> 4 programs of 4)
           ("w8/bn32", dict(NUM_WARPS=8, BLOCK_N=32)), ("w8/bn16", dict(NUM_WARPS=8, BLOCK_N=16)),
           ("bn16", dict(BLOCK_N=16)), ("w8/bn64", dict(NUM_WARPS=8)),
           # fp8 caches: the MMAs on fp16 operands (e4m3 -> fp16 is one packed instruction; -> bf16 adds a per-value
           # F2F on the MIO pipe: 128 of the full layer's ~900 SASS per block and thread, s19run1's ncu); and the
           # merge of up to 256 splits in one step (stage 1: one round of loads instead of two at 100K)
           # (s19run2, before F16_DOT and the merge chunks were the defaults: fp8 100K 22.9 -> 17.2 us with both)
           ("f16", dict(F16_DOT=True)), ("mc256", dict(MERGE_CHUNK=256)), ("f16/mc256", dict(F16_DOT=True, MERGE_CHUNK=256)),
           ("f16/bn32", dict(F16_DOT=True, BLOCK_N=32)),
           # with F16_DOT the default (fp8): bf16 operands again; and the loop's other knobs now that it is shorter
           ("bf16dot", dict(F16_DOT=False)), ("mergeD16", dict(MERGE_D=16)), ("mergeD64", dict(MERGE_D=64)),
           ("prefetch2/f16", dict(PREFETCH=2)), ("bn32/prefetch2/f16", dict(BLOCK_N=32, PREFETCH=2)),
           ("w8/bn64/f16", dict(NUM_WARPS=8)), ("bn128/no-prefetch/f16", dict(BLOCK_N=128, PREFETCH=False)),
           # TMA_KV (full layers): each block's pages by TMA boxes in a pipelined loop; num_stages 8 / 10 / 12 keep
           # 3 / 4 / 5 blocks of boxes in flight (TMA_JOIN, the default: 195 registers a thread against the default's 232)
           ("tma", dict(TMA_KV=True)), ("tma10", dict(TMA_KV=True, TMA_STAGES=10)),
           ("tma12", dict(TMA_KV=True, TMA_STAGES=12)), ("tma6", dict(TMA_KV=True, TMA_STAGES=6)),
           ("tma/bn32", dict(TMA_KV=True, BLOCK_N=32, TMA_STAGES=12)),
           ("tma/bn128", dict(TMA_KV=True, BLOCK_N=128, TMA_STAGES=6)),
           # (the above stack a block's pages into one tile for the default's block arithmetic: TMA_JOIN; these take
           # each page's own dots instead: 106 registers against 195, more MMA instructions and barriers a block)
           ("tma/pages", dict(TMA_KV=True, TMA_JOIN=False)), ("tma10/pages", dict(TMA_KV=True, TMA_JOIN=False, TMA_STAGES=10)))
# (s18run1: every one of those four slower than the default at 100K (25.8-35.0 us against 23.0 at their best splits):
# more warps per SM do not shorten this loop)
# --configs picks some by label (the default always runs)
FULL_SPLITS = (128, 256, 396, 512, 528, 1024)  # (396 / 528: 3 / 4 programs on each of 132 SMs)
SLIDING_SPLITS = (4, 8, 16)


def _cases(dry: bool) -> list[tuple[str, str, int]]:
    """(kind, kv dtype, context)."""
    if dry:
        return [("full", "f32", 64), ("full", "f8e4m3", 200), ("sliding", "f32", 100)]
    return ([("full", kv, n) for n in (8192, 32768, 100_000) for kv in ("bf16", "f8e4m3")]
            + [("sliding", kv, 4096) for kv in ("bf16", "f8e4m3")])


def _constants(kind: str, kv: str, dry: bool, **extra) -> dict:
    if dry:  # tiny fp32: 6 query heads / 1 KV head of 32, window 32, blocks of 16
        return constants(6, 1, 32, 32 if kind == "sliding" else 0, "f32", kv, PAGE if kind == "full" else None,
                         BLOCK_N=16, **extra)
    from beamc.codegen.emitters import attention_decode_tiles, attention_dot

    a = load_spec(ROOT / "models/beam.yaml").attention
    window = load_spec(ROOT / "models/beam.yaml").effective_window if kind == "sliding" else 0
    # the emitted tiles and MMA operand type, unless a sweep config overrides them
    tiles = dict(attention_decode_tiles(window), **attention_dot(kv, "bf16"), **extra)
    return constants(a.num_heads // 8, max(a.num_kv_heads // 8, 1), a.head_dim, window, "bf16", kv,
                     PAGE if kind == "full" else None, **tiles)


def _sdpa_fn(case, c, keys: int):
    """torch SDPA over the token's context as contiguous bf16 (or fp32 when dry) K/V, GQA."""
    import torch.nn.functional as F

    q, kc, vc, slot, pos, *extras = case["args"]
    p = int(pos[0])
    kpos = torch.arange(p + 1 - keys, p + 1, device=q.device)
    if c["PAGED"]:
        bt = extras[0]
        rows = (bt[0, kpos // c["PAGE_SIZE"]].long(), kpos % c["PAGE_SIZE"])
    else:
        rows = (torch.zeros_like(kpos), kpos % kc.shape[1])
    dt = q.dtype
    if c["CACHE_DTYPE"] == "f8e4m3":
        ks, vs = extras[-2:]
        k, v = (kc.float()[rows] * ks).to(dt), (vc.float()[rows] * vs).to(dt)
    else:
        k, v = kc[rows].to(dt), vc[rows].to(dt)
    k = k.permute(1, 0, 2)[None].contiguous()  # [1, HKV, L, D]
    v = v.permute(1, 0, 2)[None].contiguous()
    qq = q.permute(1, 0, 2)[None].contiguous()  # [1, HQ, 1, D]
    out = torch.empty_like(qq)

    def fn():
        out.copy_(F.scaled_dot_product_attention(qq, k, v, scale=c["SCALE"], enable_gqa=True))
    return fn


def _flashinfer_fn(case, c, keys: int, tensor_cores: bool = True):
    """FlashInfer 0.7.2's tensor-core paged decode (BatchDecodeWithPagedKVCacheWrapper, NHD pages of 16, CUDA-graph
    mode) over the token's last `keys` positions: the full layer reads our paged cache and block table as they are
    (the same [P, 16, HKV, D] layout); the sliding layer's ring is copied into pages first (FlashInfer has no ring)
    and read whole (its 512 positions are the window). fp8 caches with their scales. None when FlashInfer is absent
    (`../shared/tools/stage_flashinfer.sh` makes it run on the H200)."""
    try:  # the staged bundle's flashinfer/__init__.py is trimmed: the wrappers come from their submodules
        from flashinfer.decode import BatchDecodeWithPagedKVCacheWrapper
    except ImportError:
        return None
    q, kc, vc, slot, pos, *extras = case["args"]
    p = int(pos[0])
    dev = q.device
    npages = -(-keys // PAGE)
    if c["PAGED"]:
        assert keys == p + 1, "full layer: the whole context"
        kpages, vpages, indices = kc, vc, extras[0][0, :npages].to(torch.int32)
    else:  # the ring's last `keys` positions, in order, into fresh pages
        kpos = torch.arange(p + 1 - keys, p + 1, device=dev)
        rows = kpos % kc.shape[1]
        kpages = torch.zeros(npages * PAGE, *kc.shape[2:], dtype=kc.dtype, device=dev)
        vpages = torch.zeros_like(kpages)
        kpages[:keys], vpages[:keys] = kc[0, rows], vc[0, rows]
        kpages, vpages = kpages.view(npages, PAGE, *kc.shape[2:]), vpages.view(npages, PAGE, *kc.shape[2:])
        indices = torch.arange(npages, dtype=torch.int32, device=dev)
    fp8 = c["CACHE_DTYPE"] == "f8e4m3"
    ks, vs = (float(extras[-2]), float(extras[-1])) if fp8 else (None, None)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    indptr = torch.tensor([0, npages], dtype=torch.int32, device=dev)
    last = torch.tensor([keys - (npages - 1) * PAGE], dtype=torch.int32, device=dev)
    w = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
                                                      paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
                                                      paged_kv_last_page_len_buffer=last)
    w.plan(indptr, indices, last, c["HQ"], c["HKV"], c["HEAD_DIM"], PAGE, pos_encoding_mode="NONE",
           q_data_type=q.dtype, kv_data_type=kc.dtype, sm_scale=c["SCALE"])
    out = torch.empty_like(q)

    def fn():
        w.run(q, (kpages, vpages), out=out, k_scale=ks, v_scale=vs)
    return fn


def bench_cases(graph_time, copy_bw: float, device: str = "cuda", dry: bool = False) -> list[dict]:
    kdir = tempfile.mkdtemp(prefix="beamc_bench_attn_")
    records = []
    for kind, kv, n in _cases(dry):
        c = _constants(kind, kv, dry)
        mod = load_kernel(KernelSpec(TEMPLATE, "attention", c), kdir)
        cap = c["WINDOW"] if kind == "sliding" else None  # a ring of window - 1 + 1 positions
        case = make_case(c, [(0, [n - 1])], cap=cap, seed=n, device=device, scales=(0.02, 0.01))
        args = case["args"]
        keys = min(n, c["WINDOW"] or n)
        max_ctx = args[5].shape[1] * PAGE if c["PAGED"] else args[1].shape[1]
        out = torch.full_like(args[0], float("nan"))
        scratch = torch.empty(mod.scratch_numel(1), dtype=torch.float32, device=device)
        reps = 50
        t = graph_time(lambda: mod.launch(*args, out, scratch=scratch), reps)
        want = reference(c, case, fp32=True)
        err = ((out.float() - want.float()).norm() / want.float().norm()).item()
        nbytes = 2 * keys * c["HKV"] * c["HEAD_DIM"] * args[1].element_size()
        flops = 4 * c["HQ"] * c["HEAD_DIM"] * keys
        sweep = []
        for label, cfg in CONFIGS[:2] if dry else CONFIGS:
            m = load_kernel(KernelSpec(TEMPLATE, "attention", dict(c, **cfg)), kdir)
            for s in (None,) + (SLIDING_SPLITS if kind == "sliding" else FULL_SPLITS)[: 2 if dry else None]:
                if s is not None and s > triton_cdiv(keys, m.BLOCK_N):
                    continue
                sc = torch.empty(m.scratch_numel(1, s), dtype=torch.float32, device=device)
                o = torch.full_like(args[0], float("nan"))  # poisoned: each variant's output checked
                try:
                    ts = graph_time(lambda: m.launch(*args, o, scratch=sc, splits=s), reps)
                except Exception as e:  # noqa: BLE001 - a config that does not compile / launch: say so, go on
                    sweep.append(dict(config=label, splits=s, error=repr(e)[:200]))
                    continue
                e = ((o.float() - want.float()).norm() / want.float().norm()).item()
                sweep.append(dict(config=label, splits=s if s else m.num_splits(1, max_ctx), us=ts * 1e6,
                                  tb_s=nbytes / ts / 1e12, rel_err=e))
        timed = [x for x in sweep if "us" in x and x["rel_err"] < 1e-2]  # only variants with right outputs
        best = min(timed, key=lambda x: x["us"]) if timed else None
        try:
            tb = graph_time(_sdpa_fn(case, c, keys), reps) * 1e6
        except Exception as e:  # noqa: BLE001 - the baseline may lack a backend for these shapes
            print(f"attention_decode baseline {kind} {kv} {n}: {type(e).__name__}: {e}")
            tb = None
        fi, fi_note = None, "FlashInfer not installed"
        if not dry:
            # the tensor-core decode (FlashInfer runs its FA2 prefill module) for bf16, the CUDA-core decode module for
            # fp8: the modules `stage_flashinfer.sh` built here (a missing one would JIT-compile for minutes there)
            for tc in ((True,) if kv == "bf16" else (False,)):
                try:
                    f = _flashinfer_fn(case, c, keys, tensor_cores=tc)
                    if f is not None:
                        fi = graph_time(f, reps) * 1e6
                        fi_note = f"FlashInfer 0.7.2 {'tensor-core' if tc else 'CUDA-core'} paged decode, CUDA graph"
                    break
                except Exception as e:  # noqa: BLE001 - a module not staged for this variant: say so, go on
                    fi_note = f"FlashInfer failed: {type(e).__name__}: {str(e)[:200]}"
        rec = {"kernel": f"attention_decode {kind} {'paged' if c['PAGED'] else 'ring'}", "op": "attention",
               "tokens": 1, "us": t * 1e6, "tb_s": nbytes / t / 1e12, "tflops": flops / t / 1e12,
               "baseline": "torch SDPA (enable_gqa) on the context as contiguous bf16 K/V, CUDA graph",
               "baseline_us": tb, "flashinfer_us": fi, "flashinfer": fi_note, "context": n, "keys": keys, "kv_dtype": kv, "bytes": nbytes,
               "splits": mod.num_splits(1, max_ctx), "config": dict(BLOCK_N=mod.BLOCK_N, NUM_WARPS=mod.NUM_WARPS),
               "rel_err": err, "best": best, "sweep": sweep, "copy_tb_s": copy_bw,
               "roofline_us": nbytes / (copy_bw * 1e12) * 1e6}
        print(f"attention_decode {kind:8s} {kv:7s} ctx {n:>6}: {rec['us']:7.2f} us {rec['tb_s']:5.2f} TB/s "
              f"(splits {rec['splits']}), best {best['us'] if best else float('nan'):7.2f} us "
              f"[{best and {k: best[k] for k in ('config', 'splits')}}], "
              f"SDPA {tb if tb else float('nan'):7.2f} us, FlashInfer {fi if fi else float('nan'):7.2f} us, "
              f"rel err {err:.2e}")
        for label, _ in CONFIGS:  # each config's best split, and its default split's time
            xs = [x for x in sweep if x.get("config") == label and "us" in x]
            if xs:
                bx = min(xs, key=lambda x: x["us"])
                print(f"    {label:18s} default split {xs[0]['us']:7.2f} us ({xs[0]['splits']}), best {bx['us']:7.2f} us "
                      f"({bx['splits']} splits), max rel err {max(x['rel_err'] for x in xs):.1e}")
        records.append(rec)
    return records


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def qkn_ncu_launches(kind: str, cache: str, context: int, reps: int = 3, device: str = "cuda",
                     overrides: dict | None = None) -> dict:
    """The decode step's QKN render (the qk_attention op's kernel exactly as `beamc compile models/beam.yaml --tp 8`
    emits it for a `kind` layer over a `cache` cache, with `overrides` pinned: `--set`) launched `reps` times on one
    token at `context`, no graphs, no timing: for `ncu --kernel-name regex:^kernel$` (two launches per rep: stage 0,
    then the merge). Returns what ran (constants, splits)."""
    from test_kernels_attention_decode import qkn_inputs

    from beamc.codegen.package import compile_package
    from beamc.passes.manager import PASSES

    spec = load_spec(ROOT / "models/beam.yaml")
    data = spec.model_dump()
    data["dtypes"]["kv_cache"] = "fp8" if cache == "f8e4m3" else "bfloat16"
    data["max_position_embeddings"] = max(spec.max_position_embeddings, context + 16)
    from beamc.spec import parse_spec

    pkg = compile_package(parse_spec(data), tp=8, passes=list(PASSES), phases=("decode",),
                          template_overrides=overrides)
    want = 0 if kind == "full" else spec.effective_window
    (ks,) = {k.name: k for k in pkg.kernels.values()
             if k.op == "qk_attention" and k.constants["WINDOW"] == want}.values()
    c = ks.constants
    mod = load_kernel(ks, tempfile.mkdtemp(prefix="beamc_ncu_qkn_"))
    case = make_case(c, [(0, [context - 1])], cap=c["WINDOW"] or None, seed=context, device=device,
                     scales=(0.02, 0.01))
    _, kc, vc, slot, pos, *extras = case["args"]
    x = qkn_inputs(c, case, seed=1, device=device)
    gen = torch.Generator(device="cpu").manual_seed(2)
    dt = x["raw"][0].dtype
    g = torch.randn(x["raw"][0].shape, generator=gen).to(dt).to(device)
    b = torch.randn(c["HQ"], 1, generator=gen).to(dt).to(device)
    out = torch.full_like(x["raw"][0], float("nan"))
    for _ in range(reps):
        mod.launch(*x["raw"], *x["w"], kc, vc, slot, pos, *extras, g, b, out)
    if device == "cuda":
        torch.cuda.synchronize()
    assert not out.isnan().any(), "QKN left outputs unwritten"
    return dict(kernel=ks.name, kind=kind, cache=cache, context=context, splits=mod.num_splits(1, context),
                constants={k: v for k, v in c.items() if k.isupper()})


def main() -> int:
    """--dry: the tiny fp32 path on CPU. Else on the GPU: --cases kind:kv:context,... (default: every case of
    `_cases`), --out DIR writes attention-decode-sweep-<date>.json there (command, date, device, records)."""
    import argparse
    import datetime
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", default=None, help="labels of CONFIGS to sweep, comma-separated")
    ap.add_argument("--cases", default=None, help="kind:kv:context,... e.g. full:f8e4m3:100000,sliding:f8e4m3:4096")
    ap.add_argument("--ncu-qkn", default=None, metavar="KIND:KV:CONTEXT", help="only launch the decode step's QKN "
                    "render (the qk_attention kernel as the compiler emits it at TP 8) 3 times at this case, no "
                    "graphs, no timing: for `ncu --kernel-name regex:^kernel$` (e.g. sliding:f8e4m3:4096)")
    a = ap.parse_args()
    if a.ncu_qkn:
        kind, kv, n = a.ncu_qkn.split(":")
        print(qkn_ncu_launches(kind, kv, int(n)))
        return 0
    global _cases, CONFIGS
    if a.configs:
        CONFIGS = tuple(x for x in CONFIGS if x[0] in a.configs.split(","))
    if a.cases:
        chosen = [(k, kv, int(n)) for k, kv, n in (x.split(":") for x in a.cases.split(","))]
        _cases = lambda dry: chosen  # noqa: E731 - the chosen cases instead of the default list
    if a.dry:
        recs = bench_cases(lambda fn, reps: (fn(), 1e-6)[1], 1.0, device="cpu", dry=True)
        assert all(r["rel_err"] < 1e-5 for r in recs), [r["rel_err"] for r in recs]
    else:
        sys.path.insert(0, str(ROOT / "bench"))
        import kernels

        bw = kernels.copy_bandwidth()
        recs = bench_cases(kernels.graph_time, bw)
    print(json.dumps([{k: v for k, v in r.items() if k != "sweep"} for r in recs], indent=1, default=str))
    if a.out:
        date = datetime.date.today().isoformat()
        doc = dict(date=date, command="python bench/attention_decode.py " + " ".join(sys.argv[1:]),
                   device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", records=recs)
        path = Path(a.out) / f"attention-decode-sweep-{date}.json"
        path.parent.mkdir(parents=True, exist_ok=True)  # (s46run1 lost its sweep's JSON to a missing folder)
        path.write_text(json.dumps(doc, indent=1, default=str))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
