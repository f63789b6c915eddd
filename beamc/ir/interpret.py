"""The IR interpreter: executes a step graph with each op's torch reference, on CPU or CUDA.

Tensor parallelism is simulated: the N rank graphs (same node sequence, per-rank shapes) run in lockstep in one
process, and a collective node combines the ranks' values (`ops.run_collective`). KV caches are explicit state:
`run` reads them from, and writes them back to, one dict per rank.
"""
from __future__ import annotations

from typing import Any

import torch

from beamc.errors import BeamcError
from beamc.ir.graph import Graph, Value
from beamc.ir.ops import OPS, TORCH_DTYPE


def _bind(v: Value, t: torch.Tensor, env: dict[str, int], what: str) -> None:
    """Check a runtime tensor against a value's (possibly symbolic) shape and dtype, binding symbols."""
    if v.dtype in TORCH_DTYPE and t.dtype != TORCH_DTYPE[v.dtype]:
        raise BeamcError(what, f"dtype {t.dtype}, expected {TORCH_DTYPE[v.dtype]}")
    if len(t.shape) != len(v.shape):
        raise BeamcError(what, f"shape {tuple(t.shape)}, expected {v.shape}")
    for d, n in zip(v.shape, t.shape):
        if isinstance(d, str):
            if env.setdefault(d, n) != n:
                raise BeamcError(what, f"dim {d} is {n} here but {env[d]} elsewhere in this step")
        elif d != n:
            raise BeamcError(what, f"shape {tuple(t.shape)}, expected {v.shape}")


class Interpreter:
    def __init__(self, graphs: list[Graph], weights: list[dict[str, torch.Tensor]]):
        if len(graphs) != len(weights):
            raise ValueError("one weight dict per rank graph")
        ops = [[n.op for n in g.nodes] for g in graphs]
        if any(o != ops[0] for o in ops):
            raise ValueError("rank graphs must have the same node sequence")
        self.graphs = graphs
        self.weights = weights = [with_packed_weights(g, w) for g, w in zip(graphs, weights)]
        for r, (g, w) in enumerate(zip(graphs, weights)):
            for name, node in g.leaves("param").items():
                if name not in w:
                    raise BeamcError(f"rank {r} weights", f"missing param {name}")
                _bind(node.out, w[name], {}, f"rank {r} param {name}")

    def run(self, inputs: dict[str, torch.Tensor], states: list[dict[str, torch.Tensor]] | None = None,
            record: dict[str, list[torch.Tensor]] | None = None) -> list[dict[str, torch.Tensor]]:
        """Run one step on every rank; returns each rank's outputs. `record`, if given, collects every value by
        name (per rank) for op-by-op comparisons."""
        R = len(self.graphs)
        states = states if states is not None else [{} for _ in range(R)]
        envs: list[dict[int, torch.Tensor]] = [{} for _ in range(R)]
        sym: dict[str, int] = {}
        for i in range(len(self.graphs[0].nodes)):
            nodes = [g.nodes[i] for g in self.graphs]
            n0 = nodes[0]
            opdef = OPS[n0.op]
            if n0.op in ("input", "param", "state"):
                for r, n in enumerate(nodes):
                    name = n.attrs["name"]
                    src = {"input": inputs, "param": self.weights[r], "state": states[r]}[n0.op]
                    if name not in src:
                        raise BeamcError(f"{n0.op} {name}", "not provided to the step")
                    _bind(n.out, src[name], sym, f"{n0.op} {name}")
                    envs[r][id(n.out)] = src[name]
                continue
            if opdef.is_collective(n0.attrs):
                outs_per_rank = opdef.ref_ranks([[envs[r][id(v)] for v in n.inputs] for r, n in enumerate(nodes)],
                                                n0.attrs)
            else:
                outs_per_rank = [opdef.ref([envs[r][id(v)] for v in n.inputs], n.attrs) for r, n in enumerate(nodes)]
            for r, (n, outs) in enumerate(zip(nodes, outs_per_rank)):
                for v, t in zip(n.outputs, outs):
                    envs[r][id(v)] = t
                    if record is not None:
                        record.setdefault(v.name, [None] * R)[r] = t
        results: list[dict[str, torch.Tensor]] = []
        for r, g in enumerate(self.graphs):
            for name, v in g.state_out.items():
                states[r][name] = envs[r][id(v)]
            results.append({k: envs[r][id(v)] for k, v in g.outputs.items()})
        return results


def with_packed_weights(g: Graph, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Apply the graph's load-time weight plan: a param with a `pack` attribute is the concatenation of other
    params (e.g. Q/K/V/gate for one GEMM), built once here from this rank's slices."""
    packed = {}
    for name, node in g.leaves("param").items():
        if "pack" in node.attrs and name not in weights:
            missing = [s for s in node.attrs["pack"] if s not in weights]
            if missing:
                raise BeamcError(f"param {name}", f"packs {missing}, which the weights lack")
            packed[name] = torch.cat([weights[s] for s in node.attrs["pack"]], dim=node.attrs["dim"])
    return {**weights, **packed} if packed else weights


def alloc_states(g: Graph, sizes: dict[str, int], device: Any = "cpu") -> dict[str, torch.Tensor]:
    """Zeroed state tensors for a graph's `state` leaves, symbolic dims taken from `sizes` (S, Cs, Cf)."""
    out = {}
    for name, node in g.leaves("state").items():
        v = node.out
        shape = [sizes[d] if isinstance(d, str) else d for d in v.shape]
        out[name] = torch.zeros(shape, dtype=TORCH_DTYPE[v.dtype], device=device)
    return out
