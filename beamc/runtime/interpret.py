"""The IR interpreter: executes a step graph with each op's torch reference, on CPU or CUDA.

Tensor parallelism is simulated: the N rank graphs (same node sequence, per-rank shapes) run in lockstep in one
process, and a collective node combines the ranks' values (`reference.RANK_REFS`). KV caches are explicit state:
`run` reads them from, and writes them back to, one dict per rank. Every value an op produces is checked to be
finite (a NaN weight or an overflow must not turn into a silently wrong token): the first op that produces a NaN or
an Inf is named, with its layer.
"""
from __future__ import annotations

import torch

from beamc.errors import BeamcError
from beamc.ir.dtypes import torch_dtype
from beamc.ir.graph import Graph, Node, Value
from beamc.ir.ops import OPS
from beamc.ir.reference import RANK_REFS, REFS, check_step_caches


def _bind(v: Value, t: torch.Tensor, env: dict[str, int], what: str) -> None:
    """Check a runtime tensor against a value's (possibly symbolic) shape and dtype, binding symbols."""
    if t.dtype != torch_dtype(v.dtype):
        raise BeamcError(what, f"dtype {t.dtype}, expected {torch_dtype(v.dtype)} ({v.dtype})")
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
            record: dict[str, list[torch.Tensor]] | None = None, check_finite: bool = True
            ) -> list[dict[str, torch.Tensor]]:
        """Run one step on every rank; returns each rank's outputs. `record`, if given, collects every value by
        name (per rank) for op-by-op comparisons. `check_finite`: raise at the first op producing NaN/Inf."""
        R = len(self.graphs)
        states = states if states is not None else [{} for _ in range(R)]
        envs: list[dict[int, torch.Tensor]] = [{} for _ in range(R)]
        sym: dict[str, int] = {}
        for r, g in enumerate(self.graphs):  # cache capacity, pages, block tables: all layers, before any write
            src = {"input": inputs, "state": states[r]}
            check_step_caches(g.nodes, lambda v: src[v.producer.op][v.producer.attrs["name"]]
                              if v.producer.attrs.get("name") in src.get(v.producer.op, {}) else _missing(v))
        for i in range(len(self.graphs[0].nodes)):
            nodes = [g.nodes[i] for g in self.graphs]
            n0 = nodes[0]
            opdef = OPS[n0.op]
            if opdef.leaf:
                for r, n in enumerate(nodes):
                    name = n.attrs["name"]
                    src = {"input": inputs, "param": self.weights[r], "state": states[r]}[n0.op]
                    if name not in src:
                        raise BeamcError(f"{n0.op} {name}", "not provided to the step")
                    _bind(n.out, src[name], sym, f"{n0.op} {name}")
                    envs[r][id(n.out)] = src[name]
                continue
            if opdef.is_collective(n0.attrs):
                outs_per_rank = RANK_REFS[n0.op]([[envs[r][id(v)] for v in n.inputs] for r, n in enumerate(nodes)],
                                                 n0.attrs)
            else:
                outs_per_rank = [REFS[n0.op]([envs[r][id(v)] for v in n.inputs], n.attrs) for r, n in enumerate(nodes)]
            for r, (n, outs) in enumerate(zip(nodes, outs_per_rank)):
                if check_finite:
                    _check_finite(n, outs, r)
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


def _missing(v: Value):
    raise BeamcError(f"{v.producer.op} {v.producer.attrs.get('name')}", "not provided to the step")


def _check_finite(n: Node, outs: tuple[torch.Tensor, ...], rank: int) -> None:
    """Raise when an op's (non-state) float output holds a NaN or an Inf, naming the op, its layer and the value."""
    written = {o for _, o in OPS[n.op].state_io}  # caches: checked where they are written, not re-scanned
    for i, (v, t) in enumerate(zip(n.outputs, outs)):
        if i in written or not t.is_floating_point() or bool(torch.isfinite(t).all()):
            continue
        bad = (~torch.isfinite(t)).nonzero()[0].tolist()
        where = "embedding/head" if n.layer is None else f"layer {n.layer}"
        raise BeamcError(f"{where}, op {n.op} (value {v.name}, rank {rank})",
                         f"produced a non-finite value ({t[tuple(bad)].item()} at index {bad}); the ops before it "
                         "were finite", "check the checkpoint's weights of this layer and the inputs of this step")


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
