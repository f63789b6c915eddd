"""Folds of what remains small: the embedding lookup with layer 0's input norm, and the final soft-cap into the
lm_head GEMM's epilogue (before the vocab all-gather: the soft-cap is elementwise, so it commutes with it)."""
from beamc.passes.base import Pass
from beamc.passes.rewrite import Pat, Rule

A = Pat.any
SOFTCAP_TP = Pat("softcap", Pat("all_gather", Pat("linear", A("h"), A("w")), name="ag"), name="cap")
SOFTCAP = Pat("softcap", Pat("linear", A("h"), A("w")), name="cap")
EMBED = Pat("rmsnorm", Pat("embed", A("ids"), A("table"), name="emb", escape=True), A("w"), name="norm")


def build_softcap(g, m):
    out = g.add("linear_softcap", m["h"], m["w"], cap=m["cap"].attrs["cap"], name="lm_head_softcap")
    if "ag" in m.nodes:
        out = g.add("all_gather", out, name="lm_head.gather", **m["ag"].attrs)
    return {m["cap"].out: out}


def build_embed(g, m):
    h, y = g.add("embed_norm", m["ids"], m["table"], m["w"], eps=m["norm"].attrs["eps"],
                 w_offset=m["norm"].attrs["w_offset"], name="embed_norm")
    return {m["emb"].out: h, m["norm"].out: y}


PASS = Pass("fold_small", __doc__, [
    Rule("lm_head_softcap", SOFTCAP_TP, build_softcap),
    Rule("lm_head_softcap", SOFTCAP, build_softcap),
    Rule("embed_norm", EMBED, build_embed),
])
