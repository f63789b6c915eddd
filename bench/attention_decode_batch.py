"""The full layers' decode attention (`attention_decode`, issue 9) at a batch of sequences: where batch decode spends
its attention time (s48run4, H100: 9.3 ms of the batch-64 step at 100K contexts, ~1.8 TB/s of fp8 K / V).

    python bench/attention_decode_batch.py --out DIR [--batches 16,64] [--context 100000] [--configs a,b]
    python bench/attention_decode_batch.py --dry      # tiny fp32 shapes under Triton's CPU interpreter (no timing)

At batch 1 (`bench/attention_decode.py`) a program walks ~6 blocks of 64 keys and the time is mostly fixed costs; at
batch 16-64 each program walks ~100-200 blocks, so the loop's steady rate decides, and the tile configs measured slower
at batch 1 (more warps or programs an SM, shorter blocks, deeper prefetch) may rank otherwise. For each batch: B
sequences at `--context` positions each (fp8 e4m3 pages of 16, one shuffled block table, caches built on the GPU),
one query token each; each config of CONFIGS (the emitter's tiles overridden) at the default split rule, at half
and twice its splits, and at the most splits within 1-4 waves of 264 programs (WHOLE_WAVES), in a CUDA graph (reps
launches a replay), outputs poisoned first and checked against the fp32 reference (||out - ref|| / ||ref|| <
1e-2; a config that fails is reported, not ranked); the read rate of 1 GiB (bench/kernels.py) in the same run beside
it. Prints a table last; DIR/attention-decode-batch-<date>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

if __name__ == "__main__" and "--dry" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from beamc.codegen.kernel import KernelSpec, load_kernel  # noqa: E402
from beamc.ir.reference import kv_store  # noqa: E402
from beamc.spec import load_spec  # noqa: E402
from test_kernels_attention_decode import TEMPLATE, constants, reference  # noqa: E402

PAGE = 16
# (label, template constants over the emitter's tiles). Registers a thread at batch 1's measurements (Triton 3.6,
# sm_90a, the QKN render): default 232-234 (2 programs of 4 warps an SM), bn32 156 (3), bn16 128 (4), w8/bn32 94 and
# w8/bn16 102 (2 programs of 8 warps); at batch 1 all slower than the default (s18run1, s19run2)
CONFIGS = (("default", {}), ("bn32", dict(BLOCK_N=32)), ("bn16", dict(BLOCK_N=16)),
           ("w8/bn32", dict(NUM_WARPS=8, BLOCK_N=32)), ("w8/bn64", dict(NUM_WARPS=8)),
           ("prefetch2", dict(PREFETCH=2)), ("no-prefetch", dict(PREFETCH=False)),
           ("bn128/no-prefetch", dict(BLOCK_N=128, PREFETCH=False)), ("w2/bn64", dict(NUM_WARPS=2, BLOCK_N=64)),
           ("bn32/prefetch2", dict(BLOCK_N=32, PREFETCH=2)),
           # 4 programs an SM: blocks of 32 capped at 128 registers (no stack: Triton 3.6, sm_90a, the QKN render)
           ("bn32/maxnreg128", dict(BLOCK_N=32, MAXNREG=128)))


def tiles(dry: bool, **extra) -> dict:
    """The full layer's constants at one TP-8 rank (fp8 cache, bf16 model), the emitter's tiles, `extra` over them;
    dry: tiny fp32 (6 query heads / 1 KV head of 32, blocks of 16)."""
    if dry:
        return constants(6, 1, 32, 0, "f32", "f32", PAGE, **dict(dict(BLOCK_N=16), **extra))
    from beamc.codegen.emitters import attention_decode_tiles, attention_dot

    a = load_spec(ROOT / "models/beam.yaml").attention
    t = dict(attention_decode_tiles(0), **attention_dot("f8e4m3", "bf16"), **extra)
    return constants(a.num_heads // 8, max(a.num_kv_heads // 8, 1), a.head_dim, 0, "bf16", "f8e4m3", PAGE, **t)


def batch_case(c: dict, batch: int, context: int, device: str, seed: int) -> dict:
    """`batch` sequences (slots 0..batch-1) at position context - 1 each, one query token each: every position's K / V
    random in one shuffled block table's pages (built on the device: 64 x 100K positions would take minutes on the
    host), the spare pages poisoned (NaN)."""
    g = torch.Generator(device=device).manual_seed(seed)
    hq, hkv, d = c["HQ"], c["HKV"], c["HEAD_DIM"]
    mp = -(-context // PAGE)
    P = batch * mp + 3
    block_table = torch.randperm(P, generator=g, device=device)[: batch * mp].view(batch, mp).to(torch.int32)
    fp8 = c["CACHE_DTYPE"] == "f8e4m3"
    cdt = torch.float8_e4m3fn if fp8 else torch.float32
    scales = (torch.tensor(0.02, device=device), torch.tensor(0.01, device=device)) if fp8 else (None, None)
    caches = []
    for s in scales:
        x = torch.empty(P, PAGE, hkv, d, dtype=cdt, device=device)
        x.view(torch.uint8).fill_(0x7F) if fp8 else x.fill_(float("nan"))  # poison (0x7F: e4m3 NaN)
        used = block_table.flatten().long()
        x[used] = kv_store(torch.randn(used.numel(), PAGE, hkv, d, generator=g, device=device), cdt, s)
        caches.append(x)
    q = (torch.randn(batch, hq, d, generator=g, device=device) * 2).to(torch.bfloat16 if fp8 else torch.float32)
    slot = torch.arange(batch, dtype=torch.int64, device=device)
    pos = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    extras = [block_table] + ([*scales] if fp8 else [])
    return dict(args=[q, caches[0], caches[1], slot, pos, *extras], T=batch)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--context", type=int, default=100_000)
    ap.add_argument("--configs", default=None, help="labels of CONFIGS, comma-separated (default: all)")
    ap.add_argument("--reps", type=int, default=10, help="launches per graph replay")
    ap.add_argument("--dry", action="store_true")
    a = ap.parse_args(argv)
    import kernels as kb  # bench/kernels.py: graph_time, read_bandwidth

    device = "cpu" if a.dry else "cuda"
    kb.DEVICE = device
    batches = [2] if a.dry else [int(b) for b in a.batches.split(",")]
    context = 100 if a.dry else a.context
    chosen = [cf for cf in CONFIGS if a.configs is None or cf[0] in a.configs.split(",")][: 2 if a.dry else None]
    kdir = tempfile.mkdtemp(prefix="beamc_bench_attn_batch_")
    facts = {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv), "dry": a.dry,
             "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
             "context": context, "read_tb_s": kb.read_bandwidth(), "records": []}
    for B in batches:
        c0 = tiles(a.dry)
        case = batch_case(c0, B, context, device, seed=B)
        args = case["args"]
        want = reference(c0, case, fp32=True).float()
        nbytes = 2 * B * context * c0["HKV"] * c0["HEAD_DIM"] * args[1].element_size()
        for label, cfg in chosen:
            m = load_kernel(KernelSpec(TEMPLATE, "attention", tiles(a.dry, **cfg)), kdir)
            base = m.num_splits(B, args[5].shape[1] * PAGE)
            # the rule's splits, half and twice them, and the most within 1 / 2 / 4 waves of 264 programs (2 an SM)
            for s in sorted({base, max(1, base // 2), 2 * base} | {max(1, w // B) for w in (264, 528, 792, 1056)}):
                o = torch.full_like(args[0], float("nan"))
                sc = torch.empty(m.scratch_numel(B, s), dtype=torch.float32, device=device)
                rec = dict(batch=B, config=label, splits=s, default_split=s == base,
                           programs=B * m.HKV * s)
                try:
                    t = kb.graph_time(lambda: m.launch(*args, o, scratch=sc, splits=s), a.reps)
                except Exception as e:  # noqa: BLE001 - a config that does not compile / launch: say so, go on
                    rec["error"] = repr(e)[:300]
                    facts["records"].append(rec)
                    continue
                err = ((o.float() - want).norm() / want.norm()).item()
                rec.update(us=t * 1e6, tb_s=nbytes / t / 1e12, rel_err=err, ok=err < 1e-2)
                facts["records"].append(rec)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"attention-decode-batch-{facts['date']}{'-dry' if a.dry else ''}.json"
    path.write_text(json.dumps(facts, indent=1) + "\n")
    print(f"read {facts['read_tb_s']:.2f} TB/s (1 GiB); full layer, fp8 K / V, {context} positions a sequence")
    print(f"{'batch':>5} {'config':<20} {'splits':>6} {'us':>9} {'TB/s':>6} {'rel err':>8}")
    for r in facts["records"]:
        mark = "*" if r["default_split"] else " "
        if "error" in r:
            print(f"{r['batch']:>5} {r['config']:<20} {r['splits']:>5}{mark} {'error: ' + r['error'][:60]}")
        else:
            print(f"{r['batch']:>5} {r['config']:<20} {r['splits']:>5}{mark} {r['us']:>9.1f} {r['tb_s']:>6.2f} "
                  f"{r['rel_err']:>8.1e}{'' if r['ok'] else '  WRONG'}")
    print(f"wrote {path}")
    return facts


if __name__ == "__main__":
    main()
