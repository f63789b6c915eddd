"""qk_norm_pos_kv at prefill sizes: the step's renders and tile variants of them, timed in CUDA graphs.

    python bench/qk_norm_prefill.py [--out DIR] [--tokens 16384] [--tiles '[{}, {"TOKENS": 4}, {"NUM_WARPS": 8}]']

One TP-8 rank's shapes of the full spec, fp8 caches, 8 sequences of tokens/8 new tokens after 100,000 of context:
the step's two renders as the compiler emits them (RoPE over the sliding layers' rings, SSMax over the full layers'
pages). Each variant (a dict of template constants over the emitter's) is launched 10 times in one CUDA graph; TB/s = the bytes the kernel must
move (q, k, v read; q_out and the cache rows written) over its time, beside the copy bandwidth measured in the same
run. Outputs (q_out and the written cache rows) are compared with the first variant's: `bitwise`, else the count of
differing elements. Writes DIR/qk-norm-prefill-<date>.json; prints a table last. --dry: the script under Triton's CPU
interpreter at 64 tokens (fp32 activations and caches; no timing meaning).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def step_constants(dry: bool) -> tuple[dict[str, dict], int]:
    """The constants of the step's qk_norm_pos_kv kernels as the compiler emits them for one TP-8 rank of the full
    spec with an fp8 cache (by MODE: rope, the sliding layers' ring; ssmax, the full layers' pages), and the window.
    --dry: fp32 activations and caches, no PDL (the interpreter)."""
    from beamc.codegen.package import compile_package
    from beamc.passes.manager import PASSES
    from beamc.spec import load_spec, parse_spec

    data = load_spec(ROOT / "models/beam.yaml").model_dump()
    data["dtypes"]["kv_cache"] = "fp8"
    spec = parse_spec(data)
    pkg = compile_package(spec, tp=8, dtype="bf16", passes=list(PASSES), phases=("prefill",))
    out = {k.constants["MODE"]: dict(k.constants) for k in pkg.kernels.values() if k.template == "qk_norm_pos_kv"}
    if dry:
        for c in out.values():
            c.update(DTYPE="f32", CACHE_DTYPE="f32", PDL=False)
    return out, spec.attention.sliding.window


def make_inputs(c: dict, window: int, T: int, prior: int, device):
    """Launcher inputs: 8 sequences of T / 8 new tokens at positions prior ..; v a strided view (as the packed
    projection leaves it); caches poisoned (NaN / 0x7F) so that a missed write shows."""
    g = torch.Generator(device=device).manual_seed(T)
    hq, hkv, d = c["HQ"], c["HKV"], c["HEAD_DIM"]
    act = torch.bfloat16 if c["DTYPE"] == "bf16" else torch.float32
    seqs, chunk = 8, T // 8
    slot = torch.arange(seqs, device=device).repeat_interleave(chunk)
    pos = (prior + torch.arange(chunk, device=device)).repeat(seqs)
    q = (torch.randn(T, hq, d, device=device, generator=g) * 2).to(act)
    k = torch.randn(T, hkv, d, device=device, generator=g).to(act)
    v = torch.randn(T, hkv * d + 64, device=device, generator=g).to(act)[:, :hkv * d].view(T, hkv, d)
    w0 = 0.0 if c["NORM_OFFSET"] else 1.0
    wq = (w0 + 0.1 * torch.randn(d, device=device, generator=g)).to(act)
    wk = (w0 + 0.1 * torch.randn(d, device=device, generator=g)).to(act)
    fp8 = c["CACHE_DTYPE"] == "f8e4m3"
    if c["PAGED"]:
        mp = -(-(prior + chunk) // c["PAGE_SIZE"])
        bt = torch.randperm(seqs * mp, device=device, generator=g).view(seqs, mp).to(torch.int32)
        shape = (seqs * mp, c["PAGE_SIZE"], hkv, d)
    else:
        bt, shape = None, (seqs, window - 1 + chunk, hkv, d)
    kc = (torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn) if fp8
          else torch.full(shape, float("nan"), dtype=act, device=device))
    vc = kc.clone()
    scales = [torch.tensor(0.02, device=device), torch.tensor(0.05, device=device)] if fp8 else []
    q_out = torch.full_like(q, float("nan"))
    return [q, k, v, wq, wk, kc, vc, slot, pos] + ([bt] if bt is not None else []) + scales + [q_out]


def moved_bytes(ins) -> int:
    """q, k, v read; q_out and one cache row of K and V per token written."""
    q, k, v, kc = ins[0], ins[1], ins[2], ins[5]
    T, hkv, d = k.shape
    return (2 * q.numel() + k.numel() + v.numel()) * q.element_size() + 2 * T * hkv * d * kc.element_size()


def outputs(ins) -> list:
    return [ins[-1], ins[5], ins[6]]


def differing(a, b) -> int:
    """Elements whose bits differ (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return -1
    ia = a.view(torch.uint8) if a.element_size() == 1 else a.view(torch.int16 if a.element_size() == 2 else torch.int32)
    ib = b.view(ia.dtype)
    return int((ia != ib).sum())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--prior", type=int, default=100_000)
    ap.add_argument("--tiles", default='[{}, {"TOKENS": 2}, {"TOKENS": 4}, {"NUM_WARPS": 8}, '
                                      '{"TOKENS": 4, "NUM_WARPS": 8}]',
                    help="JSON list of template-constant dicts over the emitter's (the first: the reference)")
    ap.add_argument("--dry", action="store_true", help="under TRITON_INTERPRET=1 at 64 tokens (set it yourself)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    import kernels as kb  # graph_time and copy_bandwidth, with the same device switch
    from beamc.codegen.kernel import KernelSpec, load_kernel

    kb.DEVICE = device = "cpu" if args.dry else "cuda"
    T = 64 if args.dry else args.tokens
    tiles = json.loads(args.tiles)
    kdir = tempfile.mkdtemp(prefix="beamc_bench_qk_")
    bw = 0.0 if args.dry else max(kb.copy_bandwidth(), kb.copy_bandwidth())
    records = []
    constants, window = step_constants(args.dry)
    for mode, c in sorted(constants.items()):
        ref = None
        for t in tiles:
            mod = load_kernel(KernelSpec("qk_norm_pos_kv", "qk_norm_pos_kv", {**c, **t}), kdir)
            ins = make_inputs(c, window, T, args.prior, device)
            mod.launch(*ins)
            outs = [x.clone() for x in outputs(ins)]
            ref = ref or outs
            diff = [differing(a, b) for a, b in zip(outs, ref)]
            sec = kb.graph_time(lambda: mod.launch(*ins), reps=10)
            rec = dict(kernel=f"qk_norm_pos_kv {mode}", tiles=t, tokens=T, us=sec * 1e6,
                       tb_s=moved_bytes(ins) / sec / 1e12, copy_tb_s=bw, tokens_a_program=mod.TOKENS,
                       num_warps=mod.NUM_WARPS, bitwise=all(x == 0 for x in diff), differing=diff)
            print(rec, flush=True)
            records.append(rec)
    date = datetime.date.today().isoformat()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"qk-norm-prefill-{date}.json").write_text(json.dumps(dict(
        command="python3 bench/qk_norm_prefill.py " + " ".join(sys.argv[1:]), date=date,
        device="cpu (interpreter)" if args.dry else torch.cuda.get_device_name(), copy_tb_s=bw, records=records),
        indent=1))
    print(f"\n{'kernel':<24} {'tiles':<40} {'us':>8} {'TB/s':>6}  bitwise   (copy {bw:.2f} TB/s)")
    for r in records:
        print(f"{r['kernel']:<24} {json.dumps(r['tiles']):<40} {r['us']:8.1f} {r['tb_s']:6.2f}  {r['bitwise']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
