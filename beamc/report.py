"""`beamc compile`: parse, validate, lower and verify a spec, then print the model's figures derived from the
spec alone (parameters, KV cache, layer mix, ops per layer type), for the whole model or one TP rank."""
from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from beamc.checkpoint.layout import TensorInfo, expert_graph_params, file_tensors, rank_dims, shard_range
from beamc.ir.graph import Graph
from beamc.ir.lower import LowerOptions, lower
from beamc.ir.printer import to_dot, to_text
from beamc.ir.verify import verify
from beamc.spec import load_spec
from beamc.spec.schema import ModelSpec

GiB, KiB = 1 << 30, 1 << 10
STORAGE_BYTES = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0, "nvfp4": 0.5 + 1 / 16}


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
    """Logical parameters (NVFP4 counts one per weight, scales excluded), total and active per token, for one
    rank's share when tp > 1. Active = everything except the experts a token does not route to."""
    infos = [t for t in file_tensors_graph(spec)]
    m = spec.mlp.moe
    by_group: Counter = Counter()
    total = active = 0
    nbytes = 0.0
    for t in infos:
        shape = list(t.shape)
        r = shard_range(spec, t, tp, rank)
        if r is not None:
            shape[r[0]] = r[2] - r[1]
        n = _numel(shape)
        by_group[t.group] += n
        total += n
        active += n * m.top_k // m.num_experts if t.group == "experts" else n
        nbytes += n * STORAGE_BYTES.get(t.dtype, 2.0)
    return ParamCounts(total, active, dict(by_group), nbytes)


def file_tensors_graph(spec: ModelSpec) -> list[TensorInfo]:
    """Tensors as the graph sees them: experts stacked, everything else as in the files."""
    out = [t for t in file_tensors(spec) if ".mlp.experts." not in t.name]
    for L, mlp in enumerate(spec.mlp_types):
        if mlp == "sparse":
            out += expert_graph_params(spec, L)
    return out


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


def layer_kind(spec: ModelSpec, L: int) -> str:
    att = "sliding" if spec.attention_types[L] == "sliding_attention" else "full"
    return f"{att}+{spec.mlp_types[L]}"


def ops_per_layer_kind(spec: ModelSpec, g: Graph) -> dict[str, Counter]:
    """Compute ops (views excluded) of one layer of each kind, by op name."""
    first: dict[str, int] = {}
    for L in range(spec.num_layers):
        first.setdefault(layer_kind(spec, L), L)
    out: dict[str, Counter] = {}
    for kind, L in first.items():
        out[kind] = Counter(n.op for n in g.compute_nodes() if n.layer == L)
    return out


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
        lines.append("  ops per layer (decode graph, views excluded):")
        for kind, c in ops_per_layer_kind(spec, g).items():
            n_layers = sum(1 for L in range(spec.num_layers) if layer_kind(spec, L) == kind)
            lines.append(f"    {kind:<15} x{n_layers:<3} {sum(c.values()):3d} ops: "
                         + ", ".join(f"{k} {v}" if v > 1 else k for k, v in c.items()))
    return "\n".join(lines)


def compile_command(args: argparse.Namespace) -> None:
    spec = load_spec(args.spec)
    graphs = {phase: lower(spec, LowerOptions(phase=phase, tp=args.tp, rank=args.rank))
              for phase in ("prefill", "decode")}
    for g in graphs.values():
        verify(g)
    if args.dump_ir:
        out = Path(args.dump_ir)
        out.mkdir(parents=True, exist_ok=True)
        for phase, g in graphs.items():
            (out / f"{phase}.txt").write_text(to_text(g))
            (out / f"{phase}.dot").write_text(to_dot(g))
    print(summary(spec, args.tp, args.rank, graphs))
