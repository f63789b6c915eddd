"""Seed change 6: the fused KV-cache write.

The `qk_norm_pos` op (from `qk_norm_pos`) also writes K and V into the layer's cache (the ring slot pos % capacity
on sliding layers, the position on full layers; fp8 caches divided by their scales), removing the separate cache
write. Needs `qk_norm_pos`.
"""
from beamc.passes.base import Pass
from beamc.passes.rewrite import Pat, Rule

A = Pat.any
PATTERN = Pat("kv_write", A("kc"), A("vc"),
              Pat("qk_norm_pos", A("q"), A("k"), A("wq"), A("wk"), A("pos"), out=1, name="qk", escape=True),
              A("v"), A("slot"), A("pos"), name="kvw")


def build(g, m):
    qk, kvw = m["qk"], m["kvw"]
    extras = kvw.inputs[6:]  # paged caches: the block table; fp8 caches: the k and v scales
    q, kc, vc = g.add("qk_norm_pos_kv", m["q"], m["k"], m["v"], m["wq"], m["wk"], m["kc"], m["vc"], m["slot"],
                      m["pos"], *extras, name="qk_norm_pos_kv", **qk.attrs, window=kvw.attrs.get("window"),
                      paged=kvw.attrs.get("paged", False))
    return {qk.outputs[0]: q, kvw.outputs[0]: kc, kvw.outputs[1]: vc}


PASS = Pass("kv_write", __doc__, [Rule("qk_norm_pos_kv", PATTERN, build)])
