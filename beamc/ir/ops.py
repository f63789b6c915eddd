"""Op signatures: for each op its type rule (`infer`: input values + attributes -> output shapes and dtypes), its
documentation and its flags. No torch here: planning (`beamc compile`) needs only these. What an op computes lives
in `beamc.ir.reference` (torch, keyed by the same op names); the kernels that implement it will live in
`beamc.codegen.registry`, keyed by the same names again.

Storage formats are explicit: NVFP4 expert weights enter `moe_experts` as what is stored (packed `e2m1x2` codes,
`f8e4m3` block scales, `f32` global scales), fp8 KV caches enter `kv_write`/`attention` with their fp32 scales.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from beamc.ir.dtypes import promote

if TYPE_CHECKING:  # the graph imports this registry; signatures only name its types
    from beamc.ir.graph import Shape, Value

Types = "list[tuple[Shape, str]]"


@dataclass(frozen=True)
class OpDef:
    name: str
    infer: Callable[[list[Value], dict[str, Any]], Types]
    doc: str = ""
    leaf: bool = False  # graph leaf (input, param, state): bound by the runtime, never executed
    is_view: bool = False  # free: metadata only, never a kernel
    collective: bool | Callable[[dict[str, Any]], bool] = False  # needs the other ranks' values
    # (state input index, output index): the op writes that state input in place and returns it as that output
    state_io: tuple[tuple[int, int], ...] = ()

    def is_collective(self, attrs: dict[str, Any]) -> bool:
        return self.collective(attrs) if callable(self.collective) else self.collective

    @property
    def inplace_state(self) -> bool:
        return bool(self.state_io)


OPS: dict[str, OpDef] = {}


def register(name: str, infer, doc: str = "", **flags) -> OpDef:
    if name in OPS:
        raise ValueError(f"op {name!r} registered twice")
    OPS[name] = OpDef(name, infer, doc, **flags)
    return OPS[name]


class TypeError_(Exception):
    """An op was given inputs its type rule rejects (a lowering or pass bug; the verifier reports it)."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise TypeError_(msg)


def _dim_eq(a, b) -> bool:
    return a == b or isinstance(a, str) or isinstance(b, str)


def broadcast(a: Shape, b: Shape) -> Shape:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        _check(x == y or x == 1 or y == 1, f"shapes {a} and {b} do not broadcast")
        out.append(y if x == 1 else x)
    return tuple(out)


def same(ins, attrs) -> Types:
    return [(ins[0].shape, ins[0].dtype)]


def _binary(ins, attrs) -> Types:
    return [(broadcast(ins[0].shape, ins[1].shape), promote(ins[0].dtype, ins[1].dtype))]


def _rows(ins, n, dtype=None) -> Types:
    return [(tuple(ins[0].shape[:-1]) + (n,), dtype or ins[0].dtype)]


# ---------------------------------------------------------------- leaves
for _leaf in ("input", "param", "state"):
    register(_leaf, lambda ins, attrs: [], f"graph leaf: {_leaf}", leaf=True)

# ---------------------------------------------------------------- elementwise and views
register("add", _binary, "x + y (torch promotion and rounding)")
register("mul", _binary, "x * y")
register("scale", same, "x * s for a python float s (computed in fp32, rounded once)")
register("sigmoid", same, "sigmoid(x)")
register("cast", lambda i, a: [(i[0].shape, a["dtype"])], "x converted to attrs['dtype']")
register("reshape", lambda i, a: [(tuple(a["shape"]), i[0].dtype)],
         "view with a new shape (one symbolic dim allowed)", is_view=True)


# ---------------------------------------------------------------- embedding, norms, GEMMs
register("embed", lambda i, a: [(tuple(i[0].shape) + (i[1].shape[1],), i[1].dtype)], "table[ids]")


def _rmsnorm_infer(ins, attrs) -> Types:
    _check(_dim_eq(ins[0].shape[-1], ins[1].shape[-1]), f"rmsnorm weight {ins[1].shape} vs x {ins[0].shape}")
    return same(ins, attrs)


register("rmsnorm", _rmsnorm_infer, "RMSNorm over the last dim: fp32 statistics, (offset + w) * x_hat, one rounding")


def _linear_infer(out_dtype: str | None):
    def infer(ins, attrs) -> Types:
        x, w = ins
        _check(len(w.shape) == 2 and _dim_eq(x.shape[-1], w.shape[1]), f"linear: x {x.shape} @ w{w.shape}^T")
        return _rows(ins, w.shape[0], out_dtype)
    return infer


register("linear", _linear_infer(None), "x @ w^T in x's dtype (fp32 accum)")
register("linear_f32", _linear_infer("f32"), "x @ w^T with fp32 operands, accumulation and output (the FP32 router)")

# ---------------------------------------------------------------- attention pieces
register("rope", same, "NeoX rotate-half RoPE on [T, heads, d] at per-token positions; fp32 tables, one rounding")
register("q_scale", same, "NoPE layers: q * (1 + (pos+offset)/length) ** exponent in fp32, one rounding")


def _kv_extras_ok(ins, first: int, kc: Value, attrs) -> None:
    """After (slot, pos): a paged cache's block table [S, max_pages] i32, then an fp8 cache's two fp32 scalar
    scales (k, v)."""
    extra = ins[first:]
    if attrs.get("paged"):
        _check(bool(extra) and extra[0].dtype == "i32" and len(extra[0].shape) == 2,
               f"a paged cache needs an i32 block table [S, max_pages] after the positions, got {extra[:1]}")
        extra = extra[1:]
    if kc.dtype == "f8e4m3":
        _check(len(extra) == 2 and all(v.dtype == "f32" and v.shape == () for v in extra),
               f"an fp8 cache needs fp32 scalar k/v scales, got {extra}")
    else:
        _check(not extra, f"a {kc.dtype} cache takes no scales, got {extra}")


def _kv_write_infer(ins, attrs) -> Types:
    kc, vc, k, v = ins[:4]
    _check(kc.dtype == vc.dtype and kc.shape == vc.shape, f"k cache {kc!r} and v cache {vc!r} differ")
    _check(tuple(k.shape[1:]) == tuple(kc.shape[2:]) and tuple(v.shape[1:]) == tuple(kc.shape[2:]),
           f"k {k.shape} / v {v.shape} do not fit the cache {kc.shape}")
    _kv_extras_ok(ins, 6, kc, attrs)
    return [(kc.shape, kc.dtype), (vc.shape, vc.dtype)]


register("kv_write", _kv_write_infer,
         "write K, V [T, kv, d] into the layer's caches: ring [S, C, kv, d] at [slot, pos % C], or paged "
         "[P, page, kv, d] at [block_table[slot, pos // page], pos % page] (/ scale for fp8)",
         state_io=((0, 0), (1, 1)))


def _attention_infer(ins, attrs) -> Types:
    _kv_extras_ok(ins, 5, ins[1], attrs)
    return same(ins, attrs)


register("attention", _attention_infer, "softmax(q K^T * scale + causal/window mask) V over the cache, per token")


def _attention_gate_infer(ins, attrs) -> Types:
    _attention_infer(ins[:-2], attrs)
    o, g, b = ins[0], ins[-2], ins[-1]
    _check(tuple(g.shape) == tuple(o.shape) and g.dtype == o.dtype,
           f"the gate must be [T, heads, d] like the attention output {o.shape} {o.dtype}, got {g.shape} {g.dtype}")
    _check(len(b.shape) == 2 and b.shape[0] == o.shape[1] and b.shape[1] == 1,
           f"the gate bias must be [heads, 1], got {b.shape}")
    return same(ins, attrs)


register("attention_gate", _attention_gate_infer,
         "attention's inputs, then gate [T, heads, d] and bias [heads, 1]: attention(...) * sigmoid(gate + bias), "
         "the attention output rounded, then the gate's three roundings (sigmoid_gate)")

# ---------------------------------------------------------------- MLPs
register("swiglu", same, "silu(gate) * up in fp32, rounded once")
register("moe_select", lambda i, a: [((i[0].shape[0], a["top_k"]), "f32"), ((i[0].shape[0], a["top_k"]), "i64")],
         "grouped top-k expert choice from fp32 router logits -> (weights f32, ids)")

# The expert params of each storage format, in order: gate_up [E, 2I, H] then down [E, H, I] (I: this rank's d_ff).
EXPERT_FORMATS = {
    "dense": ("gate_up", "down"),
    "nvfp4": ("gate_up.codes", "gate_up.block_scale", "gate_up.global_scale",
              "down.codes", "down.block_scale", "down.global_scale"),
}


def expert_dims(ins: list[Value], fmt: str) -> tuple:
    """(E, 2I, H, I) of moe_experts' weight inputs, whatever their storage format."""
    p = ins[2:]
    if fmt == "dense":
        E, two_i, H = p[0].shape
        return E, two_i, H, p[1].shape[2]
    E, two_i, half_h = p[0].shape
    return E, two_i, half_h * 2, p[3].shape[2] * 2


def _experts_infer(ins, attrs) -> Types:
    fmt = attrs["format"]
    combine = attrs.get("combine", False)  # (the combine_experts pass: w [T, top_k] f32 last, out [T, H])
    if combine:
        w, ins = ins[-1], ins[:-1]
        _check(w.dtype == "f32" and tuple(w.shape) == tuple(ins[1].shape),
               f"moe_experts with combine: routing weights {w.shape} {w.dtype}, ids {ins[1].shape}")
    _check(fmt in EXPERT_FORMATS and len(ins) == 2 + len(EXPERT_FORMATS[fmt]),
           f"moe_experts: format {fmt!r} with {len(ins) - 2} weight inputs")
    x, idx = ins[:2]
    E, two_i, H, I = expert_dims(ins, fmt)
    _check(_dim_eq(H, x.shape[-1]) and _dim_eq(two_i, 2 * I), f"moe_experts: x {x.shape}, weights {ins[2:]}")
    if fmt == "nvfp4":
        codes, bs, gs = ins[2:5]
        _check(codes.dtype == "e2m1x2" and bs.dtype == "f8e4m3" and gs.dtype == "f32",
               f"nvfp4 gate_up: codes {codes.dtype}, block scales {bs.dtype}, global scales {gs.dtype}")
        _check(ins[5].shape[:2] == (E, H) and tuple(ins[6].shape[:2]) == (E, H), "nvfp4 down: shape")
    return [((x.shape[0], H) if combine else (x.shape[0], idx.shape[1], H), x.dtype)]


register("moe_experts", _experts_infer,
         "per (token, choice): down(swiglu(gate_up(x))) of the chosen expert; NVFP4 weights dequantised in place "
         "(with `combine`: then the rank's top-k combine with the routing weights, x routed_scale)")
register("moe_combine", lambda i, a: [((i[0].shape[0], i[0].shape[2]), i[0].dtype)],
         "weighted sum of the top-k expert outputs")

# ---------------------------------------------------------------- head
register("softcap", lambda i, a: [(i[0].shape, "f32")], "cap * tanh(x / cap) in fp32")
register("gather_rows", lambda i, a: [((i[1].shape[0],) + tuple(i[0].shape[1:]), i[0].dtype)],
         "x[idx]: keep the rows whose logits are wanted")

# ---------------------------------------------------------------- collectives
register("all_reduce", same, "sum over the tensor-parallel ranks", collective=True)


def _gather_infer(ins, attrs) -> Types:
    shape = list(ins[0].shape)
    d = attrs["dim"]
    if isinstance(shape[d], int):
        shape[d] = attrs.get("valid") or shape[d] * attrs["tp"]
    return [(tuple(shape), ins[0].dtype)]


register("all_gather", _gather_infer,
         "concatenate the ranks' shards along dim (then keep the first `valid`: a padded vocabulary)", collective=True)

# ---------------------------------------------------------------- fused ops (created by passes)
register("boundary", lambda i, a: [(i[-3].shape, i[-3].dtype)] * 2,
         "post-norm + depth-scaled residual + next pre-norm (+ MoE combine, x routed_scale, all-reduce)",
         collective=lambda a: a["allreduce"])
register("embed_norm", lambda i, a: [(tuple(i[0].shape) + (i[1].shape[1],), i[1].dtype)] * 2,
         "embedding lookup + layer 0's input norm")
register("qk_norm_pos", lambda i, a: [(i[0].shape, i[0].dtype), (i[1].shape, i[1].dtype)],
         "q/k head RMSNorm + RoPE or SSMax q-scale")


def _qk_kv_infer(ins, attrs) -> Types:
    q, k, v, wq, wk, kc, vc, slot, pos = ins[:9]
    _kv_write_infer([kc, vc, k, v, slot, pos] + list(ins[9:]), attrs)
    return [(q.shape, q.dtype), (kc.shape, kc.dtype), (vc.shape, vc.dtype)]


register("qk_norm_pos_kv", _qk_kv_infer, "q/k norm + RoPE/SSMax, and K/V written into the layer's cache",
         state_io=((5, 1), (6, 2)))


def qk_attention_parts(ins: list, gate: bool) -> tuple[list, list]:
    """A qk_attention's inputs (qk_norm_pos_kv's, then with `gate` the output gate's g and b) as (qk_norm_pos_kv's
    inputs, the attention's inputs after q and the two caches: slot, pos, the extras, g and b)."""
    n = len(ins) - (2 if gate else 0)
    return list(ins[:n]), [ins[7], ins[8], *ins[9:n], *ins[n:]]


def _qk_attention_infer(ins, attrs) -> Types:
    qk_ins, rest = qk_attention_parts(ins, attrs.get("gate", False))
    q, kc, vc = _qk_kv_infer(qk_ins, attrs)
    att = [ins[0], ins[5], ins[6], *rest]  # (q's shape is the normed q's)
    (_attention_gate_infer if attrs.get("gate") else _attention_infer)(att, attrs)
    return [q, kc, vc]


register("qk_attention", _qk_attention_infer,
         "qk_norm_pos_kv then attention (gate: attention_gate) of a decode step: out, and K/V written into the "
         "layer's cache", state_io=((5, 1), (6, 2)))
register("sigmoid_gate", lambda i, a: [(broadcast(i[0].shape, i[1].shape), i[0].dtype)],
         "o * sigmoid(gate + bias[head]), rounding after each step")
register("linear_packed", lambda i, a: [(tuple(i[0].shape[:-1]) + (n,), i[0].dtype) for n in a["splits"]],
         "x @ [Wq; Wk; Wv; Wg]^T, split into the four projections")
register("moe_router", lambda i, a: [((i[0].shape[0], a["top_k"]), "f32"), ((i[0].shape[0], a["top_k"]), "i64")],
         "FP32 router GEMM + grouped top-k selection")
register("gate_up_swiglu", lambda i, a: _rows(i, i[1].shape[0]), "gate and up GEMMs with the fp32 SwiGLU epilogue")
register("linear_softcap", lambda i, a: _rows(i, i[1].shape[0], "f32"), "lm_head GEMM with the fp32 soft-cap epilogue")
