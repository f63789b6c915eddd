"""The elementwise and routing kernels of one TP-8 rank of Beam, timed on the GPU in CUDA graphs.

    python bench/kernels.py [--out DIR] [--tp 8] [--tokens 16384]

For each distinct kernel kind of the generated package (one representative node per template and variant):
- decode, M = 1: the kernel launched 200 times back to back in one CUDA graph (us per launch), and the layer's chain
  of this stage's kernels in the step's real order (qk_norm_pos_kv -> sigmoid_gate -> boundary -> moe_router ->
  boundary with the MoE combine) over 20 layers in one graph (us per layer);
- prefill, M = 16384 tokens: 10 launches in one graph; TB/s = bytes the kernel must move / time;
- with and without Programmatic Dependent Launch: `us` (and the chain's `us_per_layer`) times the kernels as the
  package generates them with `pdl=True` (griddepcontrol in the kernel and launch_pdl at the launch), `us_no_pdl`
  (`us_per_layer_no_pdl`) the same kernels rendered with PDL=False, on the same buffers;
- the baseline: the op's reference (the unfused torch ops) at the same shapes, in a CUDA graph;
- beside them the copy bandwidth measured in the same run (a 1 GiB device-to-device copy), since the GPU is shared
  and absolute times drift while ratios hold.
Writes DIR/kernels-<date>.json: records {kernel, op, tokens, us, tb_s, tflops, baseline, baseline_us} (+ us_no_pdl,
pdl, bytes, copy_tb_s) and the run's facts; prints a table last. --dry runs every kernel under Triton's CPU
interpreter, where there is no PDL: both variants are rendered with PDL=False there.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from beamc.codegen.inputs import node_buffers  # noqa: E402
from beamc.codegen.kernel import load_kernel  # noqa: E402
from beamc.codegen.package import compile_package  # noqa: E402
from beamc.ir.dtypes import torch_dtype  # noqa: E402
from beamc.ir.ops import OPS  # noqa: E402
from beamc.ir.reference import REFS, kv_store, qk_norm_pos_ref  # noqa: E402
from beamc.passes.manager import PASSES  # noqa: E402
from beamc.spec import load_spec  # noqa: E402


DEVICE = "cuda"


def graph_time(fn, reps: int, iters: int = 5) -> float:
    """Median seconds of one `fn()` when `reps` calls are captured in one CUDA graph and replayed."""
    if DEVICE == "cpu":  # --dry: exercise the script without a GPU (no timing meaning)
        fn()
        return 1e-6
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """TB/s of a 1 GiB device-to-device copy (read + write counted; torch runs cudaMemcpyAsync)."""
    src = torch.empty(1 << (30 if DEVICE == "cuda" else 20), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    t = graph_time(lambda: dst.copy_(src), reps=5)
    return 2 * src.numel() / t / 1e12


def read_bandwidth() -> float:
    """TB/s of reading 1 GiB once (a torch sum to one value): the ceiling of a weight-streaming kernel, which reads
    and barely writes. The H200's copy (read + write) ran at 2.7 TB/s on 2026-11-30 while GEMV kernels read 3.8."""
    src = torch.ones(1 << (28 if DEVICE == "cuda" else 18), dtype=torch.float32, device=DEVICE)
    out = torch.empty((), dtype=torch.float32, device=DEVICE)
    t = graph_time(lambda: torch.sum(src, dim=0, out=out), reps=5)
    return src.numel() * 4 / t / 1e12


def launch_args(node, lns, ln, ins, outs, sizes) -> list:
    """The tensors of one launch, by its argument names: the node's values, and scratch buffers (the all-reduced
    sum, a library GEMM's output) filled like activations."""
    buf = {v.name: t for v, t in zip(node.inputs, ins)}
    buf.update({v.name: t for v, t in zip(node.outputs, outs)})
    for other in lns:
        for name, shape, dt in other.scratch:
            buf[name] = torch.randn([sizes.get(d, d) if isinstance(d, str) else d for d in shape],
                                    device=DEVICE).to(torch_dtype(dt))
    return [buf[a] for a in ln.args]


def moved_bytes(node, ins, outs) -> int:
    """Bytes a kernel must read and write: its inputs and outputs, caches counted by the rows written."""
    state = {i for i, _ in OPS[node.op].state_io}
    n = 0
    for i, t in enumerate(ins):
        if i in state:
            continue
        n += t.numel() * t.element_size()
    for i, t in enumerate(outs):
        if i in {o for _, o in OPS[node.op].state_io}:
            continue
        n += t.numel() * t.element_size()
    if node.op == "embed_norm":  # the gathered rows, not the whole table
        n -= ins[1].numel() * ins[1].element_size()
        n += ins[0].numel() * ins[1].shape[1] * ins[1].element_size()
    if node.op == "qk_norm_pos_kv":  # k and v rows written into the cache
        n += ins[1].numel() * ins[5].element_size() * 2
    return n


def baseline_fn(node, ins, outs):
    """The unfused torch ops of the op's reference, graph-capturable (the capacity check, which syncs, left out)."""
    if node.op == "qk_norm_pos_kv":
        q, k, v, wq, wk, kc, vc, slot, pos = ins[:9]

        def fn():
            qo, ko = qk_norm_pos_ref(q, k, wq, wk, pos, node.attrs)
            idx = pos % kc.shape[1]
            kc[slot, idx] = kv_store(ko, kc.dtype, None)
            vc[slot, idx] = kv_store(v, vc.dtype, None)
            outs[0].copy_(qo)
        return fn
    ref = REFS[node.op]
    return lambda: ref(ins, node.attrs)


def kind_label(k) -> str:
    """A kernel's kind: its template and variant (per-layer constants such as residual scales aside)."""
    c = k.constants
    return k.template + ("+combine" if c.get("COMBINE") else "") + (f":{c['MODE']}" if "MODE" in c else "") + (
        f":{c['EPILOGUE']} {c['K']}x{c['N']}" if k.template == "gemv" else "") + (
        (":paged" if c.get("PAGED") else f":window {c['WINDOW']}") if k.template == "attention_decode" else "")


# templates timed by their own sections (bench/gemm.py, attention_*.py, moe_prefill.py), not by this file's table
OWN_SECTION = ("gemv", "moe_nvfp4_decode", "moe_nvfp4_prefill", "attention_decode", "attention_prefill")


def representative_nodes(pkg, phase: str):
    """(kind label, node, launches) for one node per distinct template variant (per-layer scales aside)."""
    seen, out = set(), []
    for node, lns in pkg.steps[phase].by_node():
        kernels = [ln.kernel for ln in lns if ln.kernel is not None and ln.kernel.template not in OWN_SECTION]
        if not kernels:
            continue
        label = kind_label(kernels[-1])
        if label not in seen:
            seen.add(label)
            out.append((label, node, lns))
    return out


def with_pdl(k, pdl: bool):
    """The kernel spec rendered with PDL on or off (KernelSpec is frozen: a new one, its own name and module)."""
    return dataclasses.replace(k, constants={**k.constants, "PDL": pdl})


def sizes_for(spec, T: int) -> dict[str, int]:
    S = max(1, min(T, 64))
    mp = (1000 + T) // 16 + 2  # pages per sequence: positions start at 1000
    return {"T": T, "B": T, "S": S, "Cs": spec.effective_window - 1 + T, "P": S * mp, "MP": mp,
            "R": 1, "V": spec.vocab_size, "E": spec.mlp.moe.num_experts, "P0": 1000}


# bench modules beside this one, each `bench_cases(graph_time, copy_bw) -> records` (GPU only)
SECTIONS = ("elementwise", "gemm", "attention_decode", "attention_prefill", "moe_prefill")


def extra_sections(names, bw: float, read_bw: float) -> tuple[list[dict], dict]:
    """Records of the other bench modules; a module that fails says why in the facts, the run goes on."""
    import importlib
    import inspect
    import traceback

    records, failed = [], {}
    for name in names:
        try:
            mod = importlib.import_module(f"bench.{name}")
            params = inspect.signature(mod.bench_cases).parameters  # each module takes what it needs
            kw = {k: v for k, v in (("copy_bw", bw), ("read_bw", read_bw)) if k in params}
            records += mod.bench_cases(graph_time, **kw)
        except Exception as e:  # one broken section must not cost the run's other figures
            failed[name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    return records, failed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dry", action="store_true", help="run on CPU under TRITON_INTERPRET=1 to check the script")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated, of {', '.join(SECTIONS)} (elementwise: this file's kernels and chain)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = "cpu" if args.dry else "cuda"

    def variants(k):
        """(as generated, without PDL): under the interpreter (--dry) there is no PDL, both render with PDL=False."""
        return (with_pdl(k, False) if args.dry else k), with_pdl(k, False)
    spec = load_spec(ROOT / "models/beam.yaml")
    kdir = tempfile.mkdtemp(prefix="beamc_bench_kernels_")  # generated sources: not results
    pkg = compile_package(spec, tp=args.tp, passes=list(PASSES), pdl=not args.dry)
    # at tp > 1 the MoE combine runs before the all-reduce (a library call for now): its fused boundary variant is
    # timed at the same hidden size from the tp = 1 package
    pkg1 = compile_package(spec, tp=1, passes=list(PASSES), pdl=not args.dry) if args.tp > 1 else None
    bw = max(copy_bandwidth(), copy_bandwidth())  # the first may run while the clocks ramp up
    read_bw = max(read_bandwidth(), read_bandwidth())
    sections = [x for x in args.sections.split(",") if x]
    records = []
    for phase, T, reps in [] if "elementwise" not in sections else (("decode", 1, 200), ("prefill", args.tokens, 10)):
        sizes = sizes_for(spec, T)
        reps_nodes = representative_nodes(pkg, phase)
        if pkg1 is not None:
            seen = {r[0] for r in reps_nodes}
            reps_nodes += [r for r in representative_nodes(pkg1, phase) if r[0] not in seen]
        for label, node, lns in reps_nodes:
            ins, outs = node_buffers(node, sizes, DEVICE, seed=T)
            kernels = [ln for ln in lns if ln.kernel is not None]
            only = kernels[-1]  # the generated kernel (after a library GEMM for the epilogue kernels)
            k_gen, k_off = variants(only.kernel)
            mods, mods_off = load_kernel(k_gen, kdir), load_kernel(k_off, kdir)
            args_k = launch_args(node, lns, only, ins, outs, sizes)
            t = graph_time(lambda: mods.launch(*args_k), reps)
            t_off = graph_time(lambda: mods_off.launch(*args_k), reps)
            nbytes = sum(a.numel() * a.element_size() for a in args_k if a.dim() > 0 and a.shape[0] == T) \
                if node.op in ("gate_up_swiglu", "linear_softcap") else moved_bytes(node, ins, outs)
            if node.op == "moe_router":
                nbytes = sum(x.numel() * x.element_size() for x in ins) + sum(o.numel() * o.element_size() for o in outs)
            base_us = None
            if node.op not in ("gate_up_swiglu", "linear_softcap"):
                try:
                    base_us = graph_time(baseline_fn(node, [x.clone() for x in ins], [o.clone() for o in outs]),
                                         max(1, reps // 10)) * 1e6
                except Exception as e:  # a reference op that cannot be captured: say so
                    print(f"baseline {label} T={T}: not capturable ({type(e).__name__})")
            flops = 2 * T * node.inputs[1].shape[0] * node.inputs[1].shape[1] if node.op == "moe_router" else None
            records.append({"kernel": label, "op": node.op, "tokens": T, "us": t * 1e6,
                            "tb_s": nbytes / t / 1e12, "tflops": flops / t / 1e12 if flops else None,
                            "baseline": "torch reference ops (unfused), CUDA graph", "baseline_us": base_us,
                            "us_no_pdl": t_off * 1e6, "pdl": bool(mods.OPTIONS["launch_pdl"]), "bytes": nbytes,
                            "copy_tb_s": bw})
    chain = layer_chain(spec, pkg, records, variants, kdir) if "elementwise" in sections else None
    extra, failed = extra_sections([x for x in sections if x != "elementwise"], bw, read_bw) if not args.dry else ([], {})
    records += extra
    facts = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)",
             "torch": torch.__version__, "triton": __import__("triton").__version__, "copy_tb_s": bw,
             "read_tb_s": read_bw,
             "pdl": "us / us_per_layer: the kernels as generated (PDL on: launch_pdl + griddepcontrol); *_no_pdl: "
                    "rendered with PDL=False" + (" (--dry: both without PDL, the interpreter has none)" if args.dry
                                                 else ""),
             "chain": chain, "sections": sections, "sections_failed": failed,
             "command": f"python bench/kernels.py --out $OUT --sections {','.join(sections)} (device tool, H200)"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"kernels-{facts['date']}.json"
    if path.exists():  # a second run the same day keeps the first
        path = out / f"kernels-{facts['date']}-{datetime.datetime.now().strftime('%H%M%S')}.json"
    path.write_text(json.dumps({"facts": facts, "records": records}, indent=1))
    print(f"copy bandwidth {bw:.2f} TB/s (read + write), read bandwidth {read_bw:.2f} TB/s")
    if chain:
        print(f"decode chain of layer {chain['layer']} ({len(chain['kernels'])} kernels): "
              f"{chain['us_per_layer']:.2f} us per layer with PDL, {chain['us_per_layer_no_pdl']:.2f} without "
              f"(sum of kernels alone {chain['sum_of_alone_us']:.2f} / {chain['sum_of_alone_us_no_pdl']:.2f} us)")
    for name, why in failed.items():
        print(f"section {name} FAILED: {why}")
    print(f"{'kernel':<28}{'tokens':>7}{'us':>10}{'no-PDL us':>11}{'TB/s':>8}{'TFLOP/s':>9}{'base us':>10}{'x':>7}")
    for r in records:
        if r.get("us") is None:  # a variant that did not compile or run: its reason
            print(f"{r['kernel'][:27]:<28}{r['tokens']:>7}  {r.get('error', 'no time')[:80]}")
            continue
        b = r.get("baseline_us")
        base = f"{b:10.2f}{b / r['us']:7.1f}" if b else f"{'-':>10}{'-':>7}"
        nopdl = f"{r['us_no_pdl']:11.2f}" if r.get("us_no_pdl") else f"{'-':>11}"
        tb = f"{r['tb_s']:8.2f}" if r.get("tb_s") is not None else f"{'-':>8}"
        tf = f"{r['tflops']:9.1f}" if r.get("tflops") is not None else f"{'-':>9}"
        print(f"{r['kernel'][:27]:<28}{r['tokens']:>7}{r['us']:>10.2f}{nopdl}{tb}{tf}{base}")
    print(f"wrote {path}")
    return 0


def layer_chain(spec, pkg, records, variants, kdir) -> dict:
    """The chain of this stage's kernels in one MoE layer's real order, 20 layers deep, decode M = 1."""
    sizes = sizes_for(spec, 1)
    layer = next(L for L in range(spec.num_layers) if spec.mlp_types[L] == "sparse"
                 and spec.attention_types[L] == "sliding_attention")
    chain = [(node, lns, ln) for node, lns in pkg.steps["decode"].by_node() if node.layer == layer
             for ln in lns if ln.kernel is not None and ln.kernel.template not in OWN_SECTION]
    calls, calls_off = [], []  # the same buffers, kernels as generated / without PDL
    for node, lns, ln in chain:
        ins, outs = node_buffers(node, sizes, DEVICE, seed=7)
        a = launch_args(node, lns, ln, ins, outs, sizes)
        k_gen, k_off = variants(ln.kernel)
        calls.append((load_kernel(k_gen, kdir), a))
        calls_off.append((load_kernel(k_off, kdir), a))
    t_chain = graph_time(lambda: [m.launch(*a) for m, a in calls], reps=20)
    t_chain_off = graph_time(lambda: [m.launch(*a) for m, a in calls_off], reps=20)
    us_alone = {r["kernel"]: r["us"] for r in records if r["tokens"] == 1}
    us_alone_off = {r["kernel"]: r["us_no_pdl"] for r in records if r["tokens"] == 1}
    alone = sum(us_alone[kind_label(ln.kernel)] for _, _, ln in chain)  # each launch of the chain, timed alone
    alone_off = sum(us_alone_off[kind_label(ln.kernel)] for _, _, ln in chain)
    return {"layer": layer, "kernels": [ln.kernel.template for _, _, ln in chain], "us_per_layer": t_chain * 1e6,
            "us_per_layer_no_pdl": t_chain_off * 1e6, "sum_of_alone_us": alone,
            "sum_of_alone_us_no_pdl": alone_off, "pdl": bool(calls[0][0].OPTIONS["launch_pdl"])}


if __name__ == "__main__":
    sys.exit(main())
