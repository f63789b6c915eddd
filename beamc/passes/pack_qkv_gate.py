"""Seed change 5: QKV + gate packing.

The four projections of a layer's attention input (q, k, v, gate) become one GEMM over a weight packed at load
time. The packing is recorded in the plan as the packed param's `pack` attribute (this rank's slices of the four
weights, concatenated along the output dim); the runtime builds it once when it loads the weights.
"""
from beamc.passes.base import Pass
from beamc.passes.rewrite import Pat, Rule

A = Pat.any
PARTS = ("q_proj", "k_proj", "v_proj", "gate_proj")


def _is(part: str):
    return lambda n: n.attrs["name"].endswith(f".self_attn.{part}.weight")


PATTERN = Pat("linear", A("x"), Pat("param", name="wq", where=_is("q_proj")), name="q")


def build(g, m):
    x, prefix = m["x"], m["wq"].attrs["name"][: -len("q_proj.weight")]
    found = {}
    for n in m.users[x]:
        w = n.inputs[1] if n.op == "linear" else None
        if w is not None and w.producer.op == "param":
            for part in PARTS:
                if w.producer.attrs["name"] == f"{prefix}{part}.weight":
                    found[part] = n
    if len(found) != len(PARTS):
        return None
    ws = [found[p].inputs[1] for p in PARTS]
    shape = (sum(w.shape[0] for w in ws), ws[0].shape[1])
    packed = g.param(f"{prefix}qkvg_proj.weight", shape, ws[0].dtype, pack=[w.producer.attrs["name"] for w in ws],
                     dim=0, storage=ws[0].producer.attrs.get("storage"), group="attention")
    outs = g.add("linear_packed", x, packed, splits=[w.shape[0] for w in ws], name="qkvg_proj")
    return {found[p].out: o for p, o in zip(PARTS, outs)}


PASS = Pass("pack_qkv_gate", __doc__, [Rule("qkvg", PATTERN, build)])
