"""The verifier: a graph is well formed when every op is registered, every input is defined before use, every
node's declared output types equal its op's type rule, names are unique, outputs exist, and a state written in
place is read by nothing else (so in-place execution equals the functional meaning), and each state written back
is the buffer of that same state (not another layer's cache, not V for K)."""
from __future__ import annotations

from beamc.ir.graph import Graph, Value
from beamc.ir.ops import OPS, TypeError_


class VerifyError(Exception):
    pass


def state_origin(v: Value) -> str | None:
    """The state whose buffer `v` is: follow in-place writes (output -> the state input it was written into) back
    to a `state` leaf; None when `v` is not a state buffer."""
    while v.producer is not None:
        n = v.producer
        if n.op == "state":
            return n.attrs["name"]
        pair = next((i for i, o in OPS[n.op].state_io if n.outputs[o] is v), None) if n.op in OPS else None
        if pair is None:
            return None
        v = n.inputs[pair]
    return None


def verify(g: Graph) -> None:
    errors: list[str] = []
    defined: set[int] = set()
    names: set[str] = set()
    for i, n in enumerate(g.nodes):
        where = f"{g.name}: node {i} ({n.op}{'' if n.layer is None else f', layer {n.layer}'})"
        if n.op not in OPS:
            errors.append(f"{where}: unknown op")
            continue
        for v in n.inputs:
            if id(v) not in defined:
                errors.append(f"{where}: input {v!r} is not defined before use")
        if not OPS[n.op].leaf:
            try:
                types = OPS[n.op].infer(n.inputs, n.attrs)
            except (TypeError_, KeyError, IndexError) as e:
                errors.append(f"{where}: type rule rejects inputs: {e}")
                types = None
            if types is not None:
                got = [(tuple(v.shape), v.dtype) for v in n.outputs]
                want = [(tuple(s), d) for s, d in types]
                if got != want:
                    errors.append(f"{where}: outputs {got} but the op's rule gives {want}")
        for v in n.outputs:
            if v.name in names:
                errors.append(f"{where}: value name {v.name} defined twice")
            names.add(v.name)
            if v.producer is not n:
                errors.append(f"{where}: {v!r} does not name this node as its producer")
            defined.add(id(v))
    for kind, vals in (("output", g.outputs), ("state_out", g.state_out)):
        for k, v in vals.items():
            if id(v) not in defined:
                errors.append(f"{g.name}: {kind} {k} is not produced by any node")
    users = g.users()
    for n in g.nodes:
        if n.op in OPS and OPS[n.op].inplace_state:
            for v in n.inputs:
                if v.producer is not None and v.producer.op == "state" and len(users.get(v, [])) > 1:
                    errors.append(f"{g.name}: state {v.name} is written in place by {n.op} but read elsewhere too")
    states = g.leaves("state")
    for n in g.nodes:  # an in-place write must write into a state buffer
        for i, _ in (OPS[n.op].state_io if n.op in OPS else ()):
            if i >= len(n.inputs) or state_origin(n.inputs[i]) is None:
                errors.append(f"{g.name}: {n.op} writes input {i} in place, which is not a state")
    for name, v in g.state_out.items():
        if name not in states:
            errors.append(f"{g.name}: state_out {name} has no matching state input")
            continue
        origin = state_origin(v)
        if origin != name:  # e.g. K and V swapped, or one layer's cache written back as another's
            errors.append(f"{g.name}: state_out {name} is %{v.name}, which holds state "
                          f"{origin or '(none: not a state buffer)'}, not {name}")
    if errors:
        raise VerifyError("graph verification failed:\n  " + "\n  ".join(errors[:50]))
