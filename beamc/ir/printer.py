"""Text and DOT renderings of a graph (for `--dump-ir` and for reading)."""
from __future__ import annotations

from beamc.ir.graph import Graph
from beamc.ir.ops import OPS


def _fmt_attr(v) -> str:
    if isinstance(v, float):
        return f"{v:.9g}"
    return repr(v)


def to_text(g: Graph, leaves: bool = False) -> str:
    lines = [f"graph {g.name} {g.meta}"]
    for n in g.nodes:
        if OPS[n.op].leaf and not leaves:
            continue
        outs = ", ".join(repr(v) for v in n.outputs)
        ins = ", ".join(f"%{v.name}" for v in n.inputs)
        attrs = {k: v for k, v in n.attrs.items()}
        attr_s = (" {" + ", ".join(f"{k}={_fmt_attr(v)}" for k, v in attrs.items()) + "}") if attrs else ""
        layer = "" if n.layer is None else f"  # L{n.layer}"
        lines.append(f"  {outs} = {n.op}({ins}){attr_s}{layer}")
    for k, v in g.outputs.items():
        lines.append(f"  output {k} = %{v.name}")
    for k, v in g.state_out.items():
        lines.append(f"  state {k} <- %{v.name}")
    return "\n".join(lines) + "\n"


def to_dot(g: Graph) -> str:
    ids = {id(n): f"n{i}" for i, n in enumerate(g.nodes)}
    lines = [f'digraph "{g.name}" {{', "  rankdir=TB; node [shape=box, fontname=monospace, fontsize=10];"]
    for n in g.nodes:
        leaf = OPS[n.op].leaf
        label = f"{n.op}\\n{n.attrs['name']}" if leaf else n.op
        shape = "ellipse" if leaf else "box"
        lines.append(f'  {ids[id(n)]} [label="{label}", shape={shape}];')
    for n in g.nodes:
        for v in n.inputs:
            if v.producer is not None:
                lines.append(f'  {ids[id(v.producer)]} -> {ids[id(n)]} [label="{v.dtype}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"
