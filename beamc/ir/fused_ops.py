"""Ops created by fusion passes. Each reference is the composition of its parts' references, in the same order
and with the same rounding points, so a fused graph's interpretation is bit-identical to the unfused one's."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from beamc.ir.ops import (
    _broadcast, kv_write_ref, moe_combine_ref, moe_select_ref, q_scale_ref, register, rmsnorm_ref, rope_ref,
    run_collective, softcap_ref, swiglu_ref,
)


def _single(ranks_fn):
    """The one-rank reference of an op defined over ranks."""
    return lambda ins, attrs: ranks_fn([ins], attrs)[0]


# ---------------------------------------------------------------- sublayer boundary (passes 1 and 3)
def boundary_ranks(ins_per_rank: list[list[torch.Tensor]], a: dict[str, Any]) -> list[tuple[torch.Tensor, ...]]:
    """[combine top-k -> x routed_scale] -> [all-reduce] -> post-norm -> depth-scaled residual -> next pre-norm.
    Inputs: (sub | y, w, idx), res, w_post, w_next. Outputs: (new residual stream h, normed h)."""
    subs = []
    for ins in ins_per_rank:
        sub = moe_combine_ref(*ins[:3]) if a["combine"] else ins[0]
        if a["routed_scale"] is not None:
            sub = sub * a["routed_scale"]
        subs.append(sub)
    if a["allreduce"]:
        subs = run_collective("all_reduce", subs, {})
    outs = []
    for sub, ins in zip(subs, ins_per_rank):
        res, w_post, w_next = ins[-3:]
        h = rmsnorm_ref(sub, w_post, a["eps"]) * a["s_sub"] + res * a["s_res"]
        outs.append((h, rmsnorm_ref(h, w_next, a["eps_next"])))
    return outs


def _boundary_infer(ins, attrs):
    res = ins[-3]
    return [(res.shape, res.dtype), (res.shape, res.dtype)]


register("boundary", _boundary_infer, _single(boundary_ranks),
         "post-norm + depth-scaled residual + next pre-norm (+ MoE combine, x routed_scale, all-reduce)",
         collective=lambda a: a["allreduce"], ref_ranks=boundary_ranks)


def embed_norm_ref(ids, table, w, a):
    h = F.embedding(ids, table)
    return h, rmsnorm_ref(h, w, a["eps"])


register("embed_norm", lambda i, a: [(tuple(i[0].shape) + (i[1].shape[1],), i[1].dtype)] * 2,
         lambda t, a: embed_norm_ref(*t, a), "embedding lookup + layer 0's input norm")


# ---------------------------------------------------------------- attention (passes 2 and 6)
def qk_norm_pos_ref(q, k, wq, wk, pos, a):
    """per-head RMSNorm of q and k, then RoPE on both (sliding) or the SSMax q-scale (NoPE)."""
    q, k = rmsnorm_ref(q, wq, a["eps"]), rmsnorm_ref(k, wk, a["eps"])
    if a["mode"] == "rope":
        q, k = rope_ref(q, pos, a["theta"]), rope_ref(k, pos, a["theta"])
    elif a["mode"] == "ssmax":
        q = q_scale_ref(q, pos, a)
    return q, k


register("qk_norm_pos", lambda i, a: [(i[0].shape, i[0].dtype), (i[1].shape, i[1].dtype)],
         lambda t, a: qk_norm_pos_ref(*t, a), "q/k head RMSNorm + RoPE or SSMax q-scale")


def qk_norm_pos_kv_ref(q, k, v, wq, wk, kc, vc, slot, pos, a):
    q, k = qk_norm_pos_ref(q, k, wq, wk, pos, a)
    kc, vc = kv_write_ref(kc, vc, k, v, slot, pos)
    return q, kc, vc


register("qk_norm_pos_kv", lambda i, a: [(i[0].shape, i[0].dtype), (i[5].shape, i[5].dtype), (i[6].shape, i[6].dtype)],
         lambda t, a: qk_norm_pos_kv_ref(*t, a), "q/k norm + RoPE/SSMax, and K/V written into the layer's cache",
         inplace_state=True)


def sigmoid_gate_ref(o, g, b):
    return (o * torch.sigmoid(g + b),)


register("sigmoid_gate", lambda i, a: [(_broadcast(i[0].shape, i[1].shape), i[0].dtype)],
         lambda t, a: sigmoid_gate_ref(*t), "o * sigmoid(gate + bias[head]), rounding after each step")


# ---------------------------------------------------------------- GEMMs (passes 4, 5, 7, fold)
def linear_packed_ref(x, w, a):
    """One GEMM over a load-time packed weight; by reference, one product per part (same bits as unpacked)."""
    outs, lo = [], 0
    for n in a["splits"]:
        outs.append(F.linear(x, w[lo:lo + n]))
        lo += n
    return tuple(outs)


register("linear_packed", lambda i, a: [(tuple(i[0].shape[:-1]) + (n,), i[0].dtype) for n in a["splits"]],
         lambda t, a: linear_packed_ref(*t, a), "x @ [Wq; Wk; Wv; Wg]^T, split into the four projections")
register("moe_router", lambda i, a: [((i[0].shape[0], a["top_k"]), "f32"), ((i[0].shape[0], a["top_k"]), "i64")],
         lambda t, a: moe_select_ref(F.linear(t[0].float(), t[1].float()), t[2], a),
         "FP32 router GEMM + grouped top-k selection")
register("gate_up_swiglu", lambda i, a: [(tuple(i[0].shape[:-1]) + (i[1].shape[0],), i[0].dtype)],
         lambda t, a: (swiglu_ref(F.linear(t[0], t[1]), F.linear(t[0], t[2])),),
         "gate and up GEMMs with the fp32 SwiGLU epilogue")
register("linear_softcap", lambda i, a: [(tuple(i[0].shape[:-1]) + (i[1].shape[0],), "f32")],
         lambda t, a: (softcap_ref(F.linear(t[0], t[1]), a["cap"]),), "lm_head GEMM with the fp32 soft-cap epilogue")
