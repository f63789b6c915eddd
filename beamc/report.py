"""`beamc compile`: parse, validate, lower and verify a spec, then print the model's figures derived from the
spec alone (parameters, KV cache, layer mix, ops per layer type), for the whole model or one TP rank."""
from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from beamc.checkpoint.layout import TensorInfo, graph_params, rank_dims, rank_shape
from beamc.compiler import compile_spec
from beamc.errors import BeamcError
from beamc.ir import dtypes
from beamc.ir.graph import Graph
from beamc.ir.lower import layer_kind
from beamc.ir.ops import OPS
from beamc.passes.manager import select_passes
from beamc.spec import load_spec
from beamc.spec.schema import ModelSpec

GiB, KiB = 1 << 30, 1 << 10
# bytes per stored element of each graph param dtype (NVFP4: uint8 codes, two a byte, and e4m3/fp32 scales)


@dataclass
class ParamCounts:
    total: int
    active: int
    by_group: dict[str, int]
    weight_bytes: float


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def param_counts(spec: ModelSpec, tp: int = 1, rank: int = 0) -> ParamCounts:
    """Logical parameters (an NVFP4 weight counts its values, two a stored byte; scales excluded), total and active
    per token, for one rank's share when tp > 1; and the bytes they are stored in, scales included.
    Active = everything except the experts a token does not route to."""
    m = spec.mlp.moe
    by_group: Counter = Counter()
    total = active = 0
    nbytes = 0.0
    for t in file_tensors_graph(spec):
        n = _numel(rank_shape(spec, t, tp, rank))
        nbytes += n * dtypes.nbytes(dtypes.ir_dtype(t.dtype))
        if t.group == "kv_scales" or t.name.endswith(("weight_scale", "weight_scale_2")):
            continue  # scales: storage, not parameters
        n *= 2 if t.dtype == "uint8" else 1  # packed E2M1 codes
        by_group[t.group] += n
        total += n
        active += n * m.top_k // m.num_experts if t.group == "experts" else n
    return ParamCounts(total, active, dict(by_group), nbytes)


def file_tensors_graph(spec: ModelSpec) -> list[TensorInfo]:
    """Tensors as the graph sees them: experts stacked (NVFP4 in storage format), everything else as in the files."""
    return graph_params(spec)


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str, tp: int = 1) -> tuple[int, int]:
    """(bytes per token of context on full layers, bytes per sequence held by the sliding rings) for one rank."""
    a = spec.attention
    kvh = rank_dims(spec, tp).kv_heads
    el = 1 if kv_dtype == "fp8" else 2
    per_layer = 2 * kvh * a.head_dim * el
    types = spec.attention_types
    full = types.count("full_attention") * per_layer
    ring = types.count("sliding_attention") * per_layer * (a.sliding.window - 1)
    return full, ring


def _b(x: float) -> str:
    return f"{x / 1e9:.1f}B"


def summary(spec: ModelSpec, tp: int = 1, rank: int = 0, graphs: dict[str, Graph] | None = None) -> str:
    d = rank_dims(spec, tp, rank)
    pc = param_counts(spec, tp, rank)
    types = spec.attention_types
    lines = [f"{spec.name}" + (f"  (tensor-parallel rank {rank} of {tp})" if tp > 1 else "")]
    lines.append(f"  layers: {spec.num_layers} = {types.count('sliding_attention')} sliding-window "
                 f"(window {spec.attention.sliding.window}, RoPE) + {types.count('full_attention')} full (NoPE) "
                 f"at {[i for i, t in enumerate(types) if t == 'full_attention']}")
    lines.append(f"  mlp: {spec.mlp_types.count('dense')} dense SwiGLU (d_ff {spec.mlp.dense.d_ff}) + "
                 f"{spec.mlp_types.count('sparse')} MoE ({spec.mlp.moe.num_experts} experts x d_ff {spec.mlp.moe.d_ff}, "
                 f"top-{spec.mlp.moe.top_k}, {spec.mlp.moe.n_group} groups / top-{spec.mlp.moe.topk_group})")
    share = "this rank's " if tp > 1 else ""
    lines.append(f"  parameters: {share}total {_b(pc.total)}, active per token {_b(pc.active)}")
    lines.append("    by group: " + ", ".join(f"{k} {_b(v)}" for k, v in sorted(pc.by_group.items())))
    lines.append(f"  weights in storage dtypes ({spec.dtypes.experts} experts): {pc.weight_bytes / GiB:.1f} GiB")
    for kvd in ("bfloat16", "fp8"):
        full, ring = kv_bytes_per_token(spec, kvd, tp)
        mark = " (spec's choice)" if kvd == spec.dtypes.kv_cache else ""
        lines.append(f"  KV cache {kvd}{mark}: {full / KiB:g} KiB/token on the full layers; "
                     f"{(full << 20) / GiB:g} GiB for a 2^20-token context; sliding rings "
                     f"{ring / (1 << 20):.1f} MiB per sequence")
    lines.append(f"  per-rank dims: heads {d.heads}, kv heads {d.kv_heads}, dense d_ff {d.dense_ff}, "
                 f"expert d_ff {d.moe_ff}, vocab {d.vocab}")
    if graphs:
        for phase, g in graphs.items():
            nodes = g.compute_nodes()
            lines.append(f"  {phase} graph: {len(g.nodes)} nodes, {len(nodes)} compute ops, verified")
        g = graphs.get("decode") or next(iter(graphs.values()))
        passes = ", ".join(g.meta.get("passes", [])) or "none"
        lines.append(f"  ops per layer (decode graph, views excluded, after passes: {passes}):")
        for kind, c in g.ops_by_layer_kind().items():
            n_layers = sum(1 for L in range(spec.num_layers) if layer_kind(spec, L) == kind)
            lines.append(f"    {kind:<15} x{n_layers:<3} {sum(c.values()):3d} ops: "
                         + ", ".join(f"{k} {v}" if v > 1 else k for k, v in c.items()))
    return "\n".join(lines)


WHY = {
    "embed_norm": "embedding gather + layer 0's input norm",
    "linear_packed": "one GEMM over the load-time packed [Wq; Wk; Wv; Wg]: the layer's attention weight stream",
    "linear": "GEMM (o_proj: row-parallel; its partial sums feed the boundary's all-reduce)",
    "qk_norm_pos_kv": "q/k head RMSNorm + RoPE or SSMax + K/V cache write: elementwise over the heads, one launch",
    "qk_norm_pos": "q/k head RMSNorm + RoPE or SSMax",
    "attention": "reads the layer's KV cache (ring or full): its own kernel",
    "sigmoid_gate": "sigmoid(gate + bias) * o with transformers' three roundings (attention_gate folds it)",
    "attention_gate": "reads the layer's KV cache (ring or full), the output gate in its epilogue: one kernel",
    "qk_attention": "decode: q/k norms, RoPE or SSMax and the K/V cache write in the attention kernel's prologue, "
                    "the output gate in its epilogue: one kernel",
    "moe_router": "fp32 router GEMM + grouped top-k selection in one kernel",
    "moe_experts": "the chosen experts' NVFP4 GEMMs gate_up -> SwiGLU -> down (grouped over experts)",
    "gate_up_swiglu": "gate and up GEMMs with the fp32 SwiGLU epilogue",
    "linear_softcap": "lm_head GEMM with the fp32 soft-cap epilogue",
}


def _describe(n) -> str:
    if n.op == "boundary":
        parts = []
        if n.attrs["combine"]:
            parts.append(f"combine top-k x routed weights, x{n.attrs['routed_scale']:g}")
        if n.attrs["allreduce"]:
            parts.append("all-reduce")
        parts.append("post-norm + depth-scaled residual + next pre-norm")
        return " + ".join(parts) + ": one pass over the hidden state"
    return WHY.get(n.op, OPS[n.op].doc)


def pass_report(spec: ModelSpec, g: Graph, rep) -> str:
    moe = next((L for L in range(spec.num_layers) if spec.mlp_types[L] == "sparse"), None)
    layer = 0 if moe is None else moe  # a spec without MoE layers: its first layer
    nodes = [n for n in g.compute_nodes() if n.layer == layer]
    lines = [f"ops left in {'MoE ' if moe is not None else ''}layer {layer} ({layer_kind(spec, layer)}"
             f"{'; the spec has no MoE layer' if moe is None else ''}), batch-1 decode, rank {g.meta['rank']} of "
             f"{g.meta['tp']}, in launch order: {len(nodes)} ops"]
    for i, n in enumerate(nodes, 1):
        lines.append(f"  {i:2d}. {n.op:<15} {_describe(n)}")
    lines += weight_plan(g)
    kinds = list(dict.fromkeys(g.meta["layer_kinds"]))
    lines.append("ops per layer, by layer kind, after each pass (views excluded):")
    lines.append("  " + f"{'after':<20}" + "".join(f"{k:>16}" for k in kinds) + "   matches")
    for step, counts in rep.ops_after.items():
        m = rep.counts.get(step)
        match = ", ".join(f"{r} {v}" for r, v in _by_rule(m).items()) if m else ""
        lines.append("  " + f"{step:<20}" + "".join(f"{counts.get(k, 0):>16}" for k in kinds) + f"   {match}")
    return "\n".join(lines)


def _rule_line(counts, rule: str, total: int) -> str:
    kinds = ", ".join(f"{k} {v}" for (r, k), v in counts.items() if r == rule)
    return f"{rule} {total} ({kinds})"


def weight_plan(g: Graph) -> list[str]:
    """The load-time weight transforms the passes recorded: packed params and what they concatenate."""
    packed = [n for n in g.leaves("param").values() if "pack" in n.attrs]
    if not packed:
        return []
    n = packed[0]
    parts = " + ".join(p.rsplit(".", 2)[-2] for p in n.attrs["pack"])
    return [f"load-time weight plan: {len(packed)} packed params, e.g. {n.attrs['name']} {list(n.out.shape)} = "
            f"rows of {parts} (this rank's slices, concatenated along dim {n.attrs['dim']})"]


def _by_rule(counts) -> dict[str, int]:
    out: dict[str, int] = {}
    for (rule, _kind), v in counts.items():
        out[rule] = out.get(rule, 0) + v
    return out


RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def ablation_lines(spec_name: str, results: Path = RESULTS) -> list[str]:
    """One line per pass with its measured effect from the latest `bench/ablation.py` JSON of this spec (dry runs
    ignored); no file, one of another spec, or one that does not read: no lines."""
    try:
        files = sorted(p for p in results.glob("ablation-*.json") if not p.stem.endswith("-dry"))
        if not files:
            return []
        import json

        facts = json.loads(files[-1].read_text())
        if facts.get("spec") != spec_name:  # measured on another model: its figures say nothing of this one
            return []
        rows = [r for r in facts["rows"] if "decode" in r and "prefill" in r]
        lines = [f"measured effect of each pass ({files[-1].name}: TP-{facts['tp']} rank 0, {facts['env']['device']}, "
                 f"decode batch 1 @ {facts['context']}, prefill {facts['batch']} x {facts['chunk']}):"]
        for prev, r in zip(rows, rows[1:]):
            added = [n for n in r["passes"] if n not in prev["passes"]]
            name = ", ".join(added) if len(added) <= 2 else f"{added[0]} .. {added[-1]}"
            dd, dp = r["decode"]["ms"] - prev["decode"]["ms"], r["prefill"]["ms"] - prev["prefill"]["ms"]
            lines.append(f"    {name:<20} decode {prev['decode']['ms']:.3f} -> {r['decode']['ms']:.3f} ms ({dd:+.3f}), "
                         f"prefill {prev['prefill']['ms']:.1f} -> {r['prefill']['ms']:.1f} ms ({dp:+.1f})")
        return lines if len(lines) > 1 else []
    except Exception:  # a partial or older file: print nothing rather than fail the compile
        return []


def compile_command(args: argparse.Namespace) -> None:
    from beamc.codegen.overrides import parse_overrides

    overrides = parse_overrides(getattr(args, "set", None))  # checked before any work
    if overrides and not getattr(args, "output", None):
        raise BeamcError("--set", "template overrides shape the generated package, and none is written",
                         "add -o DIR")
    spec = load_spec(args.spec)
    names = select_passes(args.passes, [d for d in args.disable.split(",") if d])
    compiled = compile_spec(spec, tp=args.tp, ranks=[args.rank], passes=names, dump_dir=args.dump_ir)
    graphs = {phase: gs[0] for phase, gs in compiled.graphs.items()}
    reports = compiled.reports
    print(summary(spec, args.tp, args.rank, graphs))
    print(f"  passes: {', '.join(names) or 'none'}")
    for name in names:
        c = reports["decode"].counts[name]
        print(f"    {name:<20} " + "; ".join(_rule_line(c, r, v) for r, v in _by_rule(c).items()) if c
              else f"    {name:<20} no match")
    if args.report:
        print(pass_report(spec, graphs["decode"], reports["decode"]))
        for line in ablation_lines(spec.name):
            print(line)
    if getattr(args, "output", None):
        from beamc.codegen.package import compile_package

        pkg = compile_package(spec, target=args.target, tp=args.tp, rank=args.rank, passes=names, pdl=args.pdl,
                              nvfp4_relayout=getattr(args, "nvfp4_relayout", True),
                              moe_dequant=getattr(args, "moe_dequant", True),
                              moe_wgmma=getattr(args, "moe_wgmma", True),
                              attention_mirror_pages=getattr(args, "attention_mirror", None),
                              moe_combine_max_tokens=getattr(args, "moe_combine_max_tokens", None),
                              moe_frag_max_tokens=getattr(args, "moe_frag_max_tokens", 0),
                              prefill_attention_gate=getattr(args, "prefill_attention_gate", False),
                              template_overrides=overrides,
                              l2_prefetch_mb=getattr(args, "l2_prefetch_mb", None))
        out = pkg.write(args.output)
        lib = sum(1 for st in pkg.steps.values() for _, ln in st.launches if ln.kernel is None)
        print(f"wrote {out}: {len(pkg.kernels)} generated kernels ({args.target}), step.py "
              f"({', '.join(f'{p} {len(s.launches)} launches' for p, s in pkg.steps.items())}; {lib} library calls), "
              "manifest.json")
    if args.dump_ir:
        dirs = [Path(args.dump_ir) / phase for phase in graphs]
        n = sum(1 for d in dirs for f in d.iterdir() if f.is_file())
        print(f"wrote IR dumps to {', '.join(map(str, dirs))}: {n} files (text and DOT, lowered and before/after "
              "each pass)")
