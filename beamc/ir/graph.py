"""The graph IR: a list of nodes in topological order, each an op with typed inputs, outputs and attributes.

Values are SSA: one producer each. Shapes may be symbolic (`"T"`: tokens in the step, `"S"`: sequence slots,
`"Cs"`: a sliding ring's capacity, `"P"`/`"MP"`: pages in the full layers' pool / per block table). Leaves are nodes too: `input` (runtime data), `param` (a weight, by
its graph param name) and `state` (a KV cache, carried between steps); `Graph.outputs` and `Graph.state_out` name
what a step returns. Passes rewrite `nodes`; `verify` (beamc.ir.verify) proves the result is well formed.
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from beamc.ir.ops import OPS

Dim = int | str
Shape = tuple[Dim, ...]

@dataclass(eq=False)
class Value:
    name: str
    shape: Shape
    dtype: str
    producer: "Node | None" = field(default=None, repr=False)

    def __repr__(self) -> str:
        return f"%{self.name}:{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclass(eq=False)
class Node:
    op: str
    inputs: list[Value]
    outputs: list[Value]
    attrs: dict[str, Any] = field(default_factory=dict)
    layer: int | None = None  # decoder layer this node belongs to (None: embedding / head)

    @property
    def out(self) -> Value:
        assert len(self.outputs) == 1, f"{self.op} has {len(self.outputs)} outputs"
        return self.outputs[0]


class Graph:
    def __init__(self, name: str, meta: dict[str, Any] | None = None):
        self.name = name
        self.nodes: list[Node] = []
        self.outputs: dict[str, Value] = {}
        self.state_out: dict[str, Value] = {}  # state name -> value holding its new contents
        self.meta: dict[str, Any] = dict(meta or {})  # spec name, tp, rank, phase, dtype ...
        self._names: set[str] = set()
        self._counter = itertools.count()
        self.current_layer: int | None = None

    # ---- building ----
    def fresh(self, hint: str) -> str:
        name = hint
        while name in self._names:
            name = f"{hint}.{next(self._counter)}"
        self._names.add(name)
        return name

    def add(self, op: str, *inputs: Value, name: str | None = None, **attrs: Any) -> Value | tuple[Value, ...]:
        """Append a node; its output types come from the op's inference rule. Returns one Value or a tuple."""
        opdef = OPS[op]
        types = opdef.infer(list(inputs), attrs)
        hint = name or op
        if self.current_layer is not None and not hint.startswith(f"L{self.current_layer}."):
            hint = f"L{self.current_layer}.{hint}"  # values say which layer they belong to
        outs = []
        for i, (shape, dtype) in enumerate(types):
            outs.append(Value(self.fresh(hint if len(types) == 1 else f"{hint}.{i}"), tuple(shape), dtype))
        node = Node(op, list(inputs), outs, dict(attrs), self.current_layer)
        for v in outs:
            v.producer = node
        self.nodes.append(node)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def input(self, name: str, shape: Shape, dtype: str) -> Value:
        return self._leaf("input", name, shape, dtype)

    def param(self, name: str, shape: Shape, dtype: str, **attrs: Any) -> Value:
        return self._leaf("param", name, shape, dtype, **attrs)

    def state(self, name: str, shape: Shape, dtype: str) -> Value:
        return self._leaf("state", name, shape, dtype)

    def _leaf(self, op: str, name: str, shape: Shape, dtype: str, **attrs: Any) -> Value:
        v = Value(self.fresh(name), tuple(shape), dtype)
        node = Node(op, [], [v], {"name": name, **attrs}, self.current_layer)
        v.producer = node
        self.nodes.append(node)
        return v

    # ---- queries ----
    def leaves(self, op: str) -> dict[str, Node]:
        return {n.attrs["name"]: n for n in self.nodes if n.op == op}

    def users(self) -> dict[Value, list[Node]]:
        u: dict[Value, list[Node]] = {}
        for n in self.nodes:
            for v in n.inputs:
                u.setdefault(v, []).append(n)
        return u

    def compute_nodes(self) -> list[Node]:
        """Nodes that do work on a device (not leaves, not free views)."""
        return [n for n in self.nodes if not OPS[n.op].leaf and not OPS[n.op].is_view]

    def ops_by_layer_kind(self) -> dict[str, Counter]:
        """Compute ops of one layer of each kind (the last layer of that kind: layer 0 also carries the
        embedding), by op name, in order of first appearance."""
        kinds = self.meta.get("layer_kinds", [])
        last = {k: L for L, k in enumerate(kinds)}
        first_seen = list(dict.fromkeys(kinds))
        out = {k: Counter() for k in first_seen}
        for n in self.compute_nodes():
            if n.layer is not None and last.get(kinds[n.layer]) == n.layer:
                out[kinds[n.layer]][n.op] += 1
        return out

    def to_networkx(self) -> nx.DiGraph:
        g = nx.DiGraph()
        for i, n in enumerate(self.nodes):
            g.add_node(i, op=n.op, layer=n.layer)
        index = {id(v): i for i, n in enumerate(self.nodes) for v in n.outputs}
        for i, n in enumerate(self.nodes):
            for v in n.inputs:
                if id(v) in index:
                    g.add_edge(index[id(v)], i, value=v.name)
        return g

    def remove_dead(self) -> int:
        """Drop nodes whose outputs reach no graph output; returns how many were removed."""
        live: set[int] = {id(v) for v in list(self.outputs.values()) + list(self.state_out.values())}
        keep = []
        for n in reversed(self.nodes):
            if any(id(v) in live for v in n.outputs) or n.op in ("input", "state"):
                keep.append(n)
                live.update(id(v) for v in n.inputs)
        removed = len(self.nodes) - len(keep)
        self.nodes = keep[::-1]
        return removed
