"""Seed change 9: the output gate into attention's epilogue.

The `sigmoid_gate` that reads an attention output (o * sigmoid(gate + bias[head]), three roundings, as
`qk_norm_pos` made it) joins its producer: one `attention_gate` op, whose kernel applies the gate to each output
row before it stores it (attention's own rounding of o first, then the gate's three), so the rounded attention
output never goes through memory and the step has one launch less per layer.
"""
from beamc.passes.base import Pass
from beamc.passes.rewrite import Pat, Rule

A = Pat.any
PATTERN = Pat("sigmoid_gate", Pat("attention", name="attn"), A("g"), A("b"), name="gate")


def build(g, m):
    attn = m["attn"]
    out = g.add("attention_gate", *attn.inputs, m["g"], m["b"], name="attention_gate", **attn.attrs)
    return {m["gate"].out: out}


PASS = Pass("attention_gate", __doc__, [Rule("attention_gate", PATTERN, build)])
