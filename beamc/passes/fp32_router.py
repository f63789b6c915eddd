"""Seed change 4: the FP32 router.

The hidden -> experts router GEMM with fp32 weight, accumulation and logits, and the grouped top-k selection
(sigmoid scores, correction bias for choice only, group top-2 sums, top groups, top-k, renormalisation) become
one specialised `moe_router` op.
"""
from beamc.passes.base import Pass
from beamc.passes.rewrite import Pat, Rule

A = Pat.any
PATTERN = Pat("moe_select", Pat("linear_f32", A("x"), A("w")), A("bias"), name="sel")


def build(g, m):
    sel = m["sel"]
    w, idx = g.add("moe_router", m["x"], m["w"], m["bias"], name="moe_router", **sel.attrs)
    return {sel.outputs[0]: w, sel.outputs[1]: idx}


PASS = Pass("fp32_router", __doc__, [Rule("router", PATTERN, build)])
