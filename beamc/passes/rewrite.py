"""Pattern rewriting over the IR (tinygrad style): a rule is (pattern, build); `rewrite` runs a list of rules.

A pattern `Pat(op, *src)` matches a node by op name and its inputs' producers, recursively; `Pat.any(name)` binds
whatever value stands there. Interior nodes of a match must not be read outside it (fusing them would drop or
duplicate work) unless marked `escape=True`, in which case the builder must remap their outputs. `build(g, m)`
creates the replacement nodes (through `g.add`) and returns {old value: new value}; uses, graph outputs and
state outputs are redirected, dead nodes removed, and the node list re-sorted topologically (stably).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import networkx as nx

from beamc.ir.graph import Graph, Node, Value


@dataclass
class Match:
    nodes: dict[str, Node] = field(default_factory=dict)  # named matched nodes
    values: dict[str, Value] = field(default_factory=dict)  # named bound values (Pat.any)
    matched: list[Node] = field(default_factory=list)  # every non-leaf node of the match, root first
    escapes: set[int] = field(default_factory=set)  # ids of matched nodes whose outputs may be used outside
    users: dict[Value, list[Node]] | None = None  # the graph's current use lists, for builders that look around

    def __getitem__(self, key: str) -> Any:
        return self.nodes[key] if key in self.nodes else self.values[key]


class Pat:
    def __init__(self, op: str | tuple[str, ...] | None, *src: "Pat", name: str | None = None,
                 out: int | None = None, escape: bool = False, where: Callable[[Node], bool] | None = None):
        self.ops = (op,) if isinstance(op, str) else op
        self.src, self.name, self.out, self.escape, self.where = src, name, out, escape, where

    @staticmethod
    def any(name: str | None = None) -> "Pat":
        return Pat(None, name=name)

    def _match_value(self, v: Value, m: Match) -> bool:
        if self.ops is None:
            if self.name:
                if self.name in m.values and m.values[self.name] is not v:
                    return False  # the same name bound twice must be the same value
                m.values[self.name] = v
            return True
        n = v.producer
        if n is None or (self.out is not None and n.outputs.index(v) != self.out):
            return False
        return self._match_node(n, m)

    def _match_node(self, n: Node, m: Match) -> bool:
        if n.op not in self.ops or (self.where and not self.where(n)) or len(self.src) > len(n.inputs):
            return False
        if self.name:
            m.nodes[self.name] = n
        if all(id(x) != id(n) for x in m.matched):
            m.matched.append(n)
        if self.escape:
            m.escapes.add(id(n))
        return all(p._match_value(v, m) for p, v in zip(self.src, n.inputs))

    def match(self, root: Node, users: dict[Value, list[Node]], protected: set[int]) -> Match | None:
        m = Match()
        if not self._match_node(root, m):
            return None
        inside = {id(n) for n in m.matched}
        for n in m.matched[1:]:  # interior nodes: their results must stay inside the match
            if id(n) in m.escapes:
                continue
            for v in n.outputs:
                if id(v) in protected or any(id(u) not in inside for u in users.get(v, [])):
                    return None
        return m


@dataclass
class Rule:
    name: str
    pattern: Pat
    build: Callable[[Graph, Match], dict[Value, Value] | None]


def replace_uses(g: Graph, mapping: dict[Value, Value], users: dict[Value, list[Node]]) -> None:
    """Redirect every use of each old value (node inputs, graph outputs, state outputs) to its new value."""
    for old, new in mapping.items():
        for n in users.pop(old, []):
            n.inputs = [new if v is old else v for v in n.inputs]
            users.setdefault(new, []).append(n)
    by_id = {id(k): v for k, v in mapping.items()}
    for d in (g.outputs, g.state_out):
        for k, v in list(d.items()):
            d[k] = by_id.get(id(v), v)


def _drop_dead(candidates: list[Node], users: dict[Value, list[Node]], protected: set[int]) -> None:
    """Take nodes left without readers out of the use lists, so later matches see true use counts."""
    work, dead = list(candidates), set()
    while work:
        n = work.pop()
        if id(n) in dead or n.op in ("input", "state"):
            continue
        if any(users.get(v) or id(v) in protected for v in n.outputs):
            continue
        dead.add(id(n))
        for v in n.inputs:
            users[v] = [u for u in users.get(v, []) if u is not n]
            if v.producer is not None:
                work.append(v.producer)


def toposort(g: Graph, keys: dict[int, float]) -> None:
    """Re-order nodes topologically, keeping the existing order wherever dependencies allow."""
    key = [keys.get(id(n), float(i)) for i, n in enumerate(g.nodes)]
    order = nx.lexicographical_topological_sort(g.to_networkx(), key=lambda i: key[i])
    g.nodes = [g.nodes[i] for i in order]


def rewrite(g: Graph, rules: list[Rule], counts: Counter | None = None) -> int:
    """Apply each rule everywhere it matches (rules in order); returns the number of rewrites."""
    kinds = g.meta.get("layer_kinds")
    total = 0
    keys: dict[int, float] = {}
    for rule in rules:
        users, consumed = g.users(), set()
        position = {id(n): float(i) for i, n in enumerate(g.nodes)}
        protected = {id(v) for v in list(g.outputs.values()) + list(g.state_out.values())}
        for node in list(g.nodes):
            if id(node) in consumed:
                continue
            m = rule.pattern.match(node, users, protected)
            if m is None or any(id(n) in consumed for n in m.matched):
                continue
            before = len(g.nodes)
            g.current_layer = node.layer
            m.users = users
            mapping = rule.build(g, m)
            g.current_layer = None
            if not mapping:
                assert len(g.nodes) == before, f"rule {rule.name} declined after building nodes"
                continue
            new_nodes = g.nodes[before:]
            for new in new_nodes:  # new nodes sit where the earliest matched node was
                keys[id(new)] = min(keys.get(id(n), position.get(id(n), 0.0)) for n in m.matched) - 0.5
                for v in new.inputs:
                    users.setdefault(v, []).append(new)
            replace_uses(g, mapping, users)
            replaced = [k.producer for k in mapping if k.producer is not None]
            consumed.update(id(n) for n in m.matched + replaced)
            protected = {id(v) for v in list(g.outputs.values()) + list(g.state_out.values())}
            _drop_dead(m.matched + replaced, users, protected)
            total += 1
            if counts is not None:
                layer = new_nodes[0].layer if new_nodes else node.layer
                kind = kinds[layer] if (kinds and layer is not None) else "head"
                counts[(rule.name, kind)] += 1
        toposort(g, keys)  # first: new nodes were appended after their users, and remove_dead walks backwards
        g.remove_dead()
        keys = {}
    return total
