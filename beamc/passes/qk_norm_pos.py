"""Seed change 2: QK-norm + RoPE / SSMax, and the sigmoid output gate.

Per-head q/k RMSNorm followed by RoPE on q and k (sliding layers) or by the SSMax q-scale (NoPE layers) become
one `qk_norm_pos` op; the output gate (gate_proj(x) + gate_bias[head], sigmoid, multiply: three bf16 roundings,
as transformers does) becomes one `sigmoid_gate` op.
"""
from beamc.passes.base import Pass
from beamc.passes.rewrite import Pat, Rule

A = Pat.any


def _qk_pattern(q_pos: str | None, k_pos: str | None) -> Pat:
    qn = Pat("rmsnorm", A("q"), A("wq"), name="qn")
    kn = Pat("rmsnorm", A("k"), A("wk"), name="kn")
    Q = Pat(q_pos, qn, A("pos"), name="qp") if q_pos else qn
    K = Pat(k_pos, kn, A("pos"), name="kp") if k_pos else kn
    kvw = Pat("kv_write", A("kc"), A("vc"), K, A("v"), A("slot"), A("pos"), out=0, name="kvw", escape=True)
    return Pat("attention", Q, kvw, name="attn")


def _build(mode: str):
    def build(g, m):
        qn, kn = m["qn"], m["kn"]
        if qn.attrs != kn.attrs:  # one eps and weight form for q and k
            return None
        attrs = {"eps": qn.attrs["eps"], "w_offset": qn.attrs["w_offset"], "mode": mode}
        if mode == "rope":
            if m["qp"].attrs != m["kp"].attrs:
                return None
            attrs["theta"] = m["qp"].attrs["theta"]
        else:
            attrs.update({k: m["qp"].attrs[k] for k in ("length", "offset", "exponent")})
        q, k = g.add("qk_norm_pos", m["q"], m["k"], m["wq"], m["wk"], m["pos"], name="qk_norm_pos", **attrs)
        q_old = (m["qp"] if "qp" in m.nodes else qn).out
        k_old = (m["kp"] if "kp" in m.nodes else kn).out
        return {q_old: q, k_old: k}
    return build


GATE = Pat("mul", A("o"), Pat("sigmoid", Pat("add", A("g"), A("b"))), name="mul")


def build_gate(g, m):
    return {m["mul"].out: g.add("sigmoid_gate", m["o"], m["g"], m["b"], name="sigmoid_gate")}


PASS = Pass("qk_norm_pos", __doc__, [
    Rule("qk_norm_rope", _qk_pattern("rope", "rope"), _build("rope")),
    Rule("qk_norm_ssmax", _qk_pattern("q_scale", None), _build("ssmax")),
    Rule("sigmoid_gate", GATE, build_gate),
])
