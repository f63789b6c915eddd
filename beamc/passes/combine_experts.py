"""Seed change 10 (issue 8: "the top-k weighting and x2.5 ... move into the down epilogue if that measures faster —
then the IR says so"): the MoE combine into the experts.

At tp > 1 a `boundary` with `combine` and `allreduce` (made by allreduce_norm) first combines this rank's top-k
expert outputs with their routing weights and applies the routed scaling, then all-reduces, then norms: three
launches (moe_combine, the all-reduce, rmsnorm_boundary). The combine and the scaling move into the `moe_experts`
op that made those outputs (`combine=True`, the routing weights as its last input, out [T, H] instead of
[T, top_k, H]); the boundary keeps the all-reduce and the norms. The decode kernel then combines in its down
GEMM's epilogue (the expert outputs never go through memory, one launch less per MoE layer); at token counts
where that does not pay, the emitter runs the experts into a scratch buffer and the same `moe_combine` kernel
as before. At tp = 1 the boundary does the combine in its own kernel already: not matched.
"""
from beamc.passes.base import Pass
from beamc.passes.rewrite import Pat, Rule

A = Pat.any
EXPERTS = Pat("moe_experts", A("x"), A("idx"), name="ex", where=lambda n: not n.attrs.get("combine"))
PATTERN = Pat("boundary", EXPERTS, A("w"), A("idx"), A("res"), A("w_post"), A("w_next"), name="b",
              where=lambda n: n.attrs["combine"] and n.attrs["allreduce"])


def build(g, m):
    ex, b = m["ex"], m["b"]
    out = g.add("moe_experts", *ex.inputs, m["w"], name="moe_experts",
                **{**ex.attrs, "combine": True, "routed_scale": b.attrs["routed_scale"]})
    h, y = g.add("boundary", out, m["res"], m["w_post"], m["w_next"], name="boundary",
                 **{**b.attrs, "combine": False, "routed_scale": None})
    return {b.outputs[0]: h, b.outputs[1]: y}


PASS = Pass("combine_experts", __doc__, [Rule("combine_into_experts", PATTERN, build)])
