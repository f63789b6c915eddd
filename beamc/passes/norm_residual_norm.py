"""Seed change 1: norm -> scaled residual -> norm.

At each of the 2 x num_layers sublayer boundaries, the sublayer's post-norm, the depth-scaled residual add
(sub * 1/sqrt(n) + res * sqrt((n-1)/n), both products rounded, then the add) and the next pre-norm (the next
sublayer's, or the final norm after the last one) become one `boundary` op with two outputs: the new residual
stream and its normed copy.
"""
from beamc.passes.base import Pass
from beamc.passes.rewrite import Pat, Rule

A = Pat.any

PATTERN = Pat("rmsnorm",
              Pat("add",
                  Pat("scale", Pat("rmsnorm", A("sub"), A("w_post"), name="post"), name="s_sub"),
                  Pat("scale", A("res"), name="s_res"),
                  name="add", escape=True),
              A("w_next"), name="next")


def build(g, m):
    if m["post"].attrs["w_offset"] != m["next"].attrs["w_offset"]:
        return None  # one weight form per boundary kernel
    g.current_layer = m["post"].layer  # the boundary belongs to the sublayer it closes
    h, y = g.add("boundary", m["sub"], m["res"], m["w_post"], m["w_next"], combine=False, routed_scale=None,
                 allreduce=False, eps=m["post"].attrs["eps"], eps_next=m["next"].attrs["eps"],
                 w_offset=m["post"].attrs["w_offset"],
                 s_sub=m["s_sub"].attrs["s"], s_res=m["s_res"].attrs["s"], name="boundary")
    return {m["add"].out: h, m["next"].out: y}


PASS = Pass("norm_residual_norm", __doc__, [Rule("boundary", PATTERN, build)])
