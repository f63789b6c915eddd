"""Seed change 11 (issue 9: fewer launches per layer at decode): the q/k norms, RoPE / SSMax and the KV-cache write
into the decode attention.

In a decode step every sequence brings one token, so the only key a token's attention needs that the cache does not
hold yet is its own. The `qk_norm_pos_kv` whose q only the attention reads joins that `attention` (or
`attention_gate`): one `qk_attention` op on the raw q, k, v, whose kernel normalises q in every program that needs it
and k, v once, writes them into the cache, and starts the owning split's softmax from the token's own key instead of
reading it back: one launch less per layer (the separate kernel's wait, loads and stores off the step's chain).
Prefill steps keep both ops (a chunk's tokens read each other's keys from the cache). Needs `kv_write`.
"""
from beamc.passes.base import Pass
from beamc.passes.rewrite import Pat, Rule

A = Pat.any
QK = Pat("qk_norm_pos_kv", out=0, name="qk", escape=True)  # (its cache outputs go on: remapped below)
PATTERN = Pat(("attention", "attention_gate"), QK, A("kc"), A("vc"), A("slot"), A("pos"), name="attn")


def build(g, m):
    qk, attn = m["qk"], m["attn"]
    if g.meta.get("phase") != "decode":
        return None
    extras = qk.inputs[9:]  # paged: the block table; fp8: the scales
    gate = attn.op == "attention_gate"
    same = (m["kc"] is qk.outputs[1] and m["vc"] is qk.outputs[2] and m["slot"] is qk.inputs[7]
            and m["pos"] is qk.inputs[8] and len(attn.inputs) == 5 + len(extras) + 2 * gate
            and all(a is b for a, b in zip(attn.inputs[5:], extras)))
    same = same and all(qk.attrs.get(k) == attn.attrs.get(k) for k in ("window", "paged"))  # one cache layout
    q = qk.outputs[0]
    if not same or any(u is not attn for u in m.users.get(q, [])) or any(v is q for v in g.outputs.values()):
        return None  # another cache, or q read elsewhere
    out, kc, vc = g.add("qk_attention", *qk.inputs, *attn.inputs[5 + len(extras):], name="qk_attention",
                        **{**qk.attrs, **attn.attrs, "gate": gate})
    return {attn.outputs[0]: out, qk.outputs[1]: kc, qk.outputs[2]: vc}


PASS = Pass("qk_attention", __doc__, [Rule("qk_attention", PATTERN, build)])
