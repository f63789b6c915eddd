"""Seed change 12 (issues 9 and 10: fewer launches per layer at decode): the sliding layers' split merge into o_proj.

A decode step's flash-decoding attention ends with a merge: a second launch that combines each head's partial
softmax states, gates and rounds the output, and stores it for the o_proj GEMV, a third launch, to read back. Over a
window the partial states are few (the window's blocks: 16 of 32 keys at 512), so each o_proj program can merge
them itself and multiply the result with its weight rows: the `qk_attention` of a sliding layer whose output only
o_proj reads (through the flattening reshape) joins that `linear` as one `qk_attention_linear` op, whose kernels are
the attention's stage 0 and one GEMV with the merge in its prologue: one launch and one round trip through memory
less per sliding layer. Full-attention layers keep theirs (their splits grow with the context: a merge per GEMV
program would read every split's state). Needs `qk_attention`.
"""
from beamc.passes.base import Pass
from beamc.passes.rewrite import Pat, Rule

A = Pat.any
ATT = Pat("qk_attention", out=0, name="att", escape=True, where=lambda n: bool(n.attrs.get("window")))
PATTERN = Pat("linear", Pat("reshape", ATT, name="flat"), A("w"), name="lin")


def build(g, m):
    att, lin = m["att"], m["lin"]
    out = att.outputs[0]
    if any(u is not m["flat"] for u in m.users.get(out, [])) or any(v is out for v in g.outputs.values()):
        return None  # the attention output read elsewhere too
    y, kc, vc = g.add("qk_attention_linear", *att.inputs, m["w"], name="qk_attention_linear", **att.attrs)
    return {lin.out: y, att.outputs[1]: kc, att.outputs[2]: vc}


PASS = Pass("attention_o_proj", __doc__, [Rule("attention_o_proj", PATTERN, build)])
