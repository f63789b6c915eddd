"""Seed change 3: all-reduce fused into the norms.

Both tensor-parallel all-reduces of a layer (after o_proj, after the MLP/MoE) move into the following `boundary`
op (all-reduce + post-norm + residual + next pre-norm); after the MoE the same op also combines the top-k expert
outputs with their routing weights and applies the routed scaling (x2.5), in the reference's order: combine,
scale, all-reduce, norm. Needs `norm_residual_norm` (it extends its `boundary` ops).
"""
from beamc.passes.base import Pass
from beamc.passes.rewrite import Pat, Rule

A = Pat.any
TAIL = (A("res"), A("w_post"), A("w_next"))


def _boundary(g, m, sub_inputs, **changes):
    b = m["b"]
    h, y = g.add("boundary", *sub_inputs, m["res"], m["w_post"], m["w_next"], name="boundary", **{**b.attrs, **changes})
    return {b.outputs[0]: h, b.outputs[1]: y}


ALLREDUCE = Pat("boundary", Pat("all_reduce", A("x")), *TAIL, name="b",
                where=lambda n: not n.attrs["allreduce"] and not n.attrs["combine"] and n.attrs["routed_scale"] is None)
COMBINE = Pat("boundary", Pat("scale", Pat("moe_combine", A("y"), A("w"), A("idx")), name="s"), *TAIL, name="b",
              where=lambda n: not n.attrs["combine"])


def build_allreduce(g, m):
    return _boundary(g, m, [m["x"]], allreduce=True)


def build_combine(g, m):
    return _boundary(g, m, [m["y"], m["w"], m["idx"]], combine=True, routed_scale=m["s"].attrs["s"])


PASS = Pass("allreduce_norm", __doc__, [
    Rule("allreduce_into_norm", ALLREDUCE, build_allreduce),
    Rule("moe_combine_into_norm", COMBINE, build_combine),
])
