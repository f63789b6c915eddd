"""The op registry. Every op has a type rule (`infer`) and a reference implementation in torch (`ref`).

References follow transformers' Beam (modeling_beam.py) expression by expression, so that the interpreter
reproduces its rounding points: an op that rounds to bf16 in transformers rounds here at the same place. Fused ops
(added by passes) define their reference as the composition of their parts' references.

`ref(inputs, attrs)` takes torch tensors and returns a tuple of tensors. Ops marked `inplace_state` write into the
state tensor they receive and return it (the graph stays functional: the written value is a new SSA value, and the
verifier checks that nothing else reads the old one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from beamc.errors import BeamcError
from beamc.ir.graph import Shape, Value

TORCH_DTYPE = {
    "bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "i64": torch.int64, "i32": torch.int32,
    "u8": torch.uint8, "f8e4m3": torch.float8_e4m3fn, "bool": torch.bool,
}
IR_DTYPE = {v: k for k, v in TORCH_DTYPE.items()}
FLOAT_RANK = {"f8e4m3": 0, "bf16": 1, "f16": 1, "f32": 2}

Types = list[tuple[Shape, str]]


@dataclass(frozen=True)
class OpDef:
    name: str
    infer: Callable[[list[Value], dict[str, Any]], Types]
    ref: Callable[[list[torch.Tensor], dict[str, Any]], tuple[torch.Tensor, ...]] | None
    doc: str = ""
    is_view: bool = False  # free: metadata only, never a kernel
    collective: bool | Callable[[dict[str, Any]], bool] = False  # needs the other ranks' values
    inplace_state: bool = False  # ref writes into its state inputs
    # collective ops: ref over all ranks at once, [inputs of rank r] -> [outputs of rank r]
    ref_ranks: Callable[[list[list[torch.Tensor]], dict[str, Any]], list[tuple[torch.Tensor, ...]]] | None = None

    def is_collective(self, attrs: dict[str, Any]) -> bool:
        return self.collective(attrs) if callable(self.collective) else self.collective


OPS: dict[str, OpDef] = {}


def register(name: str, infer, ref=None, doc: str = "", **flags) -> OpDef:
    if name in OPS:
        raise ValueError(f"op {name!r} registered twice")
    OPS[name] = OpDef(name, infer, ref, doc, **flags)
    return OPS[name]


class TypeError_(Exception):
    """An op was given inputs its type rule rejects (a lowering or pass bug; the verifier reports it)."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise TypeError_(msg)


def _dim_eq(a, b) -> bool:
    return a == b or isinstance(a, str) or isinstance(b, str)


def _broadcast(a: Shape, b: Shape) -> Shape:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        _check(x == y or x == 1 or y == 1, f"shapes {a} and {b} do not broadcast")
        out.append(y if x == 1 else x)
    return tuple(out)


def _promote(a: str, b: str) -> str:
    return a if FLOAT_RANK.get(a, 3) >= FLOAT_RANK.get(b, 3) else b


def same(ins, attrs) -> Types:
    return [(ins[0].shape, ins[0].dtype)]


# ---------------------------------------------------------------- leaves (executed by the interpreter itself)
for _leaf in ("input", "param", "state"):
    register(_leaf, lambda ins, attrs: [], None, f"graph leaf: {_leaf}")


# ---------------------------------------------------------------- elementwise and views
register("add", lambda i, a: [(_broadcast(i[0].shape, i[1].shape), _promote(i[0].dtype, i[1].dtype))],
         lambda t, a: (t[0] + t[1],), "x + y (torch promotion and rounding)")
register("mul", lambda i, a: [(_broadcast(i[0].shape, i[1].shape), _promote(i[0].dtype, i[1].dtype))],
         lambda t, a: (t[0] * t[1],), "x * y")
register("scale", same, lambda t, a: (t[0] * a["s"],), "x * s for a python float s (computed in fp32, rounded once)")
register("sigmoid", same, lambda t, a: (torch.sigmoid(t[0]),), "sigmoid(x)")
register("cast", lambda i, a: [(i[0].shape, a["dtype"])], lambda t, a: (t[0].to(TORCH_DTYPE[a["dtype"]]),))


def _reshape_infer(ins, attrs) -> Types:
    return [(tuple(attrs["shape"]), ins[0].dtype)]


def _reshape_ref(t, attrs):
    shape = [-1 if isinstance(d, str) else d for d in attrs["shape"]]
    return (t[0].reshape(shape),)


register("reshape", _reshape_infer, _reshape_ref, "view with a new shape (one symbolic dim allowed)", is_view=True)


# ---------------------------------------------------------------- embedding, norms, GEMMs
def _embed_infer(ins, attrs) -> Types:
    ids, table = ins
    return [(tuple(ids.shape) + (table.shape[1],), table.dtype)]


register("embed", _embed_infer, lambda t, a: (F.embedding(t[0], t[1]),), "table[ids]")


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' BeamRMSNorm: fp32 statistics, w * normalised in fp32, one rounding to x's dtype."""
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return (w * h).to(x.dtype)


def _rmsnorm_infer(ins, attrs) -> Types:
    _check(_dim_eq(ins[0].shape[-1], ins[1].shape[-1]), f"rmsnorm weight {ins[1].shape} vs x {ins[0].shape}")
    return [(ins[0].shape, ins[0].dtype)]


register("rmsnorm", _rmsnorm_infer, lambda t, a: (rmsnorm_ref(t[0], t[1], a["eps"]),), "RMSNorm over the last dim")


def _linear_infer(out_dtype: str | None):
    def infer(ins, attrs) -> Types:
        x, w = ins
        _check(len(w.shape) == 2 and _dim_eq(x.shape[-1], w.shape[1]), f"linear: x {x.shape} @ w{w.shape}^T")
        return [(tuple(x.shape[:-1]) + (w.shape[0],), out_dtype or x.dtype)]
    return infer


register("linear", _linear_infer(None), lambda t, a: (F.linear(t[0], t[1]),), "x @ w^T in x's dtype (fp32 accum)")
register("linear_f32", _linear_infer("f32"), lambda t, a: (F.linear(t[0].float(), t[1].float()),),
         "x @ w^T with fp32 operands, accumulation and output (the FP32 router)")


# ---------------------------------------------------------------- attention pieces
def rope_tables(pos: torch.Tensor, theta: float, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, dim] in fp32, as transformers' BeamRotaryEmbedding computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=pos.device, dtype=torch.float) / dim))
    freqs = pos[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * 1.0, emb.sin() * 1.0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    cos, sin = rope_tables(pos, theta, x.shape[-1])
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, d]: broadcast over heads
    return ((x * cos) + (rotate_half(x) * sin)).to(x.dtype)


def q_scale_factor(pos: torch.Tensor, length: float, offset: float, exponent: float) -> torch.Tensor:
    """SSMax scale (1 + (pos+offset)/length) ** exponent in fp32, written as transformers writes it."""
    return torch.exp(exponent * torch.log1p((pos.float() + offset) / length))


def q_scale_ref(x, pos, a) -> torch.Tensor:
    s = q_scale_factor(pos, a["length"], a["offset"], a["exponent"])
    return (x.float() * s[:, None, None]).to(x.dtype)


register("rope", same, lambda t, a: (rope_ref(t[0], t[1], a["theta"]),),
         "NeoX rotate-half RoPE on [T, heads, d] at per-token positions; fp32 tables, one rounding")
register("q_scale", same, lambda t, a: (q_scale_ref(t[0], t[1], a),),
         "NoPE layers: q * (1 + (pos+offset)/length) ** exponent in fp32, one rounding")


def kv_write_ref(kc, vc, k, v, slot, pos):
    """Write this step's K/V at [slot, pos % capacity]: a ring for sliding layers (capacity >= window - 1 + chunk),
    plain positions for full layers (capacity >= max context)."""
    cap = kc.shape[1]
    idx = pos % cap
    kc[slot, idx] = k.to(kc.dtype)
    vc[slot, idx] = v.to(vc.dtype)
    return kc, vc


register("kv_write", lambda i, a: [(i[0].shape, i[0].dtype), (i[1].shape, i[1].dtype)],
         lambda t, a: kv_write_ref(*t), "write K, V [T, kv, d] into the layer's caches [S, C, kv, d]",
         inplace_state=True)


def attention_ref(q, kc, vc, slot, pos, window: int | None, scale: float) -> torch.Tensor:
    """Causal GQA attention of each token over its sequence's cached keys (this step's included).

    A token at position p attends to positions (p - window, p] (sliding) or [0, p] (full). Scores, softmax and the
    P @ V product are fp32; the output is rounded once to q's dtype (flash-attention numerics)."""
    T, hq, d = q.shape
    hkv, cap = kc.shape[2], kc.shape[1]
    group = hq // hkv
    out = torch.empty_like(q)
    for s in torch.unique(slot).tolist():
        rows = (slot == s).nonzero().flatten()
        qp = pos[rows]
        lo = max(int(qp.min()) - (window - 1 if window else int(qp.min())), 0)
        if int(qp.max()) + 1 - lo > cap:  # a ring this small has overwritten keys this step still needs
            raise BeamcError("attention", f"slot {s} needs positions {lo}..{int(qp.max())} but the cache holds "
                             f"{cap}", "give sliding caches >= window - 1 + chunk positions, full ones the context")
        kpos = torch.arange(lo, int(qp.max()) + 1, device=q.device)
        k = kc[s, kpos % cap].float().repeat_interleave(group, dim=1)  # [K, hq, d]
        v = vc[s, kpos % cap].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,khd->htk", q[rows].float(), k) * scale
        allowed = kpos[None, :] <= qp[:, None]
        if window:
            allowed &= kpos[None, :] > qp[:, None] - window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out[rows] = torch.einsum("htk,khd->thd", p, v).to(q.dtype)
    return out


register("attention", same, lambda t, a: (attention_ref(*t, a["window"], a["scale"]),),
         "softmax(q K^T * scale + causal/window mask) V over the cache, per token")


# ---------------------------------------------------------------- MLPs
def swiglu_ref(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, one rounding (transformers' BeamMLP and BeamExperts._apply_gate)."""
    return (F.silu(g.float()) * u.float()).to(g.dtype)


register("swiglu", same, lambda t, a: (swiglu_ref(t[0], t[1]),), "silu(gate) * up in fp32, rounded once")


def moe_select_ref(logits, bias, a) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 grouped sigmoid routing, as transformers' BeamTopKRouter (fp32 throughout)."""
    E, G = logits.shape[-1], a["n_group"]
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=a["topk_group"], dim=-1)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    idx = torch.topk(choice, k=a["top_k"], dim=-1)[1]
    w = scores.gather(1, idx)
    if a["renormalize"]:
        w = w / (w.sum(dim=-1, keepdim=True) + a["eps"])
    return w, idx


def _select_infer(ins, attrs) -> Types:
    T = ins[0].shape[0]
    return [((T, attrs["top_k"]), "f32"), ((T, attrs["top_k"]), "i64")]


register("moe_select", _select_infer, lambda t, a: moe_select_ref(t[0], t[1], a),
         "grouped top-k expert choice from fp32 router logits -> (weights f32, ids)")


def moe_experts_ref(x, idx, w_gu, w_down) -> torch.Tensor:
    """Each token's top-k experts' SwiGLU FFN outputs [T, k, H], unweighted; rows batched per expert in
    transformers' order so every GEMM sees the same operands."""
    T, k = idx.shape
    out = torch.empty(T, k, w_down.shape[1], dtype=x.dtype, device=x.device)
    for e in torch.unique(idx).tolist():
        kpos, tok = torch.where((idx == e).T)
        gate, up = F.linear(x[tok], w_gu[e]).chunk(2, dim=-1)
        out[tok, kpos] = F.linear(swiglu_ref(gate, up), w_down[e])
    return out


def _experts_infer(ins, attrs) -> Types:
    x, idx, w_gu, w_down = ins
    _check(_dim_eq(w_gu.shape[2], x.shape[-1]) and _dim_eq(w_down.shape[2] * 2, w_gu.shape[1]),
           f"moe_experts: x {x.shape}, gate_up {w_gu.shape}, down {w_down.shape}")
    return [((x.shape[0], idx.shape[1], w_down.shape[1]), x.dtype)]


register("moe_experts", _experts_infer, lambda t, a: (moe_experts_ref(*t),),
         "per (token, choice): down(swiglu(gate_up(x))) of the chosen expert")


def moe_combine_ref(y, w, idx) -> torch.Tensor:
    """sum_k round(y_k * w_k), added in ascending expert id with a rounding after each add (transformers'
    index_add_ into a bf16 buffer, one expert at a time)."""
    order = idx.argsort(dim=-1)
    contrib = (y * w[..., None]).to(y.dtype)
    contrib = contrib.gather(1, order[..., None].expand_as(contrib))
    acc = torch.zeros_like(y[:, 0])
    for j in range(contrib.shape[1]):
        acc = acc + contrib[:, j]
    return acc


register("moe_combine", lambda i, a: [((i[0].shape[0], i[0].shape[2]), i[0].dtype)],
         lambda t, a: (moe_combine_ref(*t),), "weighted sum of the top-k expert outputs")


# ---------------------------------------------------------------- head
def softcap_ref(x, cap: float) -> torch.Tensor:
    return torch.tanh(x.float() / cap) * cap


register("softcap", lambda i, a: [(i[0].shape, "f32")], lambda t, a: (softcap_ref(t[0], a["cap"]),),
         "cap * tanh(x / cap) in fp32")
register("gather_rows", lambda i, a: [((i[1].shape[0],) + tuple(i[0].shape[1:]), i[0].dtype)],
         lambda t, a: (t[0][t[1]],), "x[idx]: keep the rows whose logits are wanted")


# ---------------------------------------------------------------- collectives (run across ranks by the interpreter)
def _collective_ranks(op: str):
    return lambda ins, attrs: [(t,) for t in run_collective(op, [x[0] for x in ins], attrs)]


register("all_reduce", same, None, "sum over the tensor-parallel ranks", collective=True,
         ref_ranks=_collective_ranks("all_reduce"))


def _gather_infer(ins, attrs) -> Types:
    shape = list(ins[0].shape)
    d = attrs["dim"]
    shape[d] = shape[d] * attrs["tp"] if isinstance(shape[d], int) else shape[d]
    return [(tuple(shape), ins[0].dtype)]


register("all_gather", _gather_infer, None, "concatenate the ranks' shards along dim", collective=True,
         ref_ranks=_collective_ranks("all_gather"))


def run_collective(op: str, per_rank: list[torch.Tensor], attrs: dict[str, Any]) -> list[torch.Tensor]:
    """Reference collectives for simulated ranks: a sum in rank order, or a concatenation."""
    if op == "all_reduce":
        total = per_rank[0].clone()
        for t in per_rank[1:]:
            total = total + t
        return [total] * len(per_rank)
    if op == "all_gather":
        cat = torch.cat(per_rank, dim=attrs["dim"])
        return [cat] * len(per_rank)
    raise KeyError(op)


import beamc.ir.fused_ops  # noqa: E402,F401  (registers the ops that passes create)
