"""Seed change 7: the dense MLP activation.

In the dense layers, SwiGLU (silu(gate) * up in fp32, one rounding) joins its GEMM neighbours: the gate and up
projections and the activation become one `gate_up_swiglu` op (a GEMM with an activation epilogue).
"""
from beamc.passes.base import Pass
from beamc.passes.rewrite import Pat, Rule

A = Pat.any
PATTERN = Pat("swiglu", Pat("linear", A("x"), A("wg")), Pat("linear", A("x"), A("wu")), name="act")


def build(g, m):
    return {m["act"].out: g.add("gate_up_swiglu", m["x"], m["wg"], m["wu"], name="gate_up_swiglu")}


PASS = Pass("dense_swiglu", __doc__, [Rule("gate_up_swiglu", PATTERN, build)])
