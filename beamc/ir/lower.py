"""Lowering: spec -> one step's graph (prefill or decode) for one tensor-parallel rank.

The graph is transformers' Beam forward written as IR ops, one op per torch expression that rounds, so that the
interpreter reproduces the reference bit for bit where the op order matches. A step processes T tokens, each with
its own position and sequence slot: prefill is ragged (several sequences, each from its own start position),
decode is one token per sequence. Rank graphs carry their collectives as ops: an all-reduce after o_proj and after
the MLP/MoE, an all-gather of the vocab-parallel logits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from beamc.checkpoint.layout import (TensorInfo, expert_graph_params, file_tensors, kept_as_stored, kv_scale_params,
                                     layer_prefix, rank_dims, rank_shape)
from beamc.ir.dtypes import ir_dtype
from beamc.ir.graph import Graph, Value
from beamc.spec.schema import ModelSpec


@dataclass(frozen=True)
class LowerOptions:
    phase: Literal["prefill", "decode"] = "prefill"
    tp: int = 1
    rank: int = 0
    dtype: Literal["bf16", "f16", "f32"] | None = None  # "f32": every float in fp32 (logic checks); else the spec's
    logits: Literal["all", "last"] = "all"  # "last": only the rows named by the `logit_rows` input
    page_size: int = 16  # positions per page of the full layers' paged KV caches


class _Lowerer:
    def __init__(self, spec: ModelSpec, opt: LowerOptions):
        self.spec, self.opt = spec, opt
        self.dims = rank_dims(spec, opt.tp, opt.rank)
        self.f32 = opt.dtype == "f32"
        self.act = "f32" if self.f32 else ir_dtype(spec.dtypes.activations)
        self.T = "T" if opt.phase == "prefill" else "B"
        self.g = Graph(f"{spec.name}.{opt.phase}.tp{opt.tp}.r{opt.rank}",
                       {"spec": spec.name, "phase": opt.phase, "tp": opt.tp, "rank": opt.rank, "dtype": self.act,
                        "logits": opt.logits, "layer_kinds": [layer_kind(spec, L) for L in range(spec.num_layers)]})
        self.infos = {t.name: t for t in file_tensors(spec, experts=False)}
        self._params: dict[str, Value] = {}

    # ---- params: per-rank shapes from the layout's shard rules ----
    def W(self, name: str, info: TensorInfo | None = None) -> Value:
        if name in self._params:
            return self._params[name]
        info = info or self.infos[name]
        shape = rank_shape(self.spec, info, self.opt.tp, self.opt.rank)
        storage = info.dtype
        if info.group == "experts" and self.spec.dtypes.experts == "nvfp4":
            # stored formats stay as stored, in every mode: packed codes, e4m3 block scales, fp32 global scales
            dtype = "e2m1x2" if storage == "uint8" else ir_dtype(storage)
        elif kept_as_stored(self.spec, info):  # the fp32 router and KV scales
            dtype = "f32" if self.f32 else ir_dtype(storage)
        else:  # float weights: converted at load to the activations dtype (fp32 in logic-check mode)
            dtype = self.act
        v = self.g.param(name, shape, dtype, storage=storage, group=info.group)
        self._params[name] = v
        return v

    # ---- the model ----
    def lower(self) -> Graph:
        g, s = self.g, self.spec
        T = self.T
        ids = g.input("input_ids", (T,), "i64")
        self.pos = g.input("positions", (T,), "i64")
        self.slot = g.input("slots", (T,), "i64")
        # full-attention layers keep their KV in pages of a shared pool, addressed per sequence by a block table
        self.block_table = g.input("block_table", ("S", "MP"), "i32") if "full_attention" in s.attention_types else None
        h = g.add("embed", ids, self.W("model.embed_tokens.weight"), name="embed")
        for L in range(s.num_layers):
            g.current_layer = L
            h = self.layer(L, h)
        g.current_layer = None
        h = self.norm(h, "model.norm.weight", "final_norm")
        if self.opt.logits == "last":
            rows = g.input("logit_rows", ("R",), "i64")
            h = g.add("gather_rows", h, rows)
        # tied embeddings: every rank holds the whole (replicated) embedding matrix, so each computes every logit and
        # nothing is gathered (the vocabulary's GEMM repeated on each rank; Beam's lm_head is untied and split)
        tied = s.logits.tie_word_embeddings
        logits = g.add("linear", h, self.W("model.embed_tokens.weight" if tied else "lm_head.weight"), name="lm_head")
        if self.opt.tp > 1 and not tied:  # a padded vocabulary's extra rows (zero weights) are cut after the gather
            valid = s.vocab_size if self.dims.vocab * self.opt.tp != s.vocab_size else None
            logits = g.add("all_gather", logits, dim=-1, tp=self.opt.tp, valid=valid, name="lm_head.gather")
        if s.logits.softcap is not None:
            logits = g.add("softcap", logits, cap=float(s.logits.softcap), name="softcap")
        else:
            logits = g.add("cast", logits, dtype="f32")
        g.outputs["logits"] = logits
        return g

    def norm(self, x: Value, weight: str, name: str) -> Value:
        n = self.spec.norm
        return self.g.add("rmsnorm", x, self.W(weight), eps=n.eps, w_offset=n.offset, name=name)

    def residual(self, sub: Value, res: Value, n: int, name: str) -> Value:
        # transformers: sub * (1/sqrt(n)) + res * sqrt((n-1)/n); each product rounds, then the add rounds
        a = self.g.add("scale", sub, s=1.0 / math.sqrt(n), name=f"{name}.scale_sub")
        b = self.g.add("scale", res, s=math.sqrt((n - 1) / n), name=f"{name}.scale_res")
        return self.g.add("add", a, b, name=f"{name}.add")

    def reduce(self, x: Value, name: str) -> Value:
        return self.g.add("all_reduce", x, name=name) if self.opt.tp > 1 else x

    def layer(self, L: int, h: Value) -> Value:
        p, s = layer_prefix(L), self.spec
        x = self.norm(h, f"{p}.input_layernorm.weight", f"L{L}.input_norm")
        a = self.attention(L, x)
        a = self.norm(a, f"{p}.post_attention_layernorm.weight", f"L{L}.post_attn_norm")
        h = self.residual(a, h, s.residual_n(L, "attn"), f"L{L}.attn_residual")
        x = self.norm(h, f"{p}.pre_feedforward_layernorm.weight", f"L{L}.pre_ffn_norm")
        m = self.dense_mlp(L, x) if s.mlp_types[L] == "dense" else self.moe(L, x)
        m = self.norm(m, f"{p}.post_feedforward_layernorm.weight", f"L{L}.post_ffn_norm")
        return self.residual(m, h, s.residual_n(L, "mlp"), f"L{L}.mlp_residual")

    def attention(self, L: int, x: Value) -> Value:
        g, s, d, T = self.g, self.spec, self.dims, self.T
        a = s.attention
        hd, p = a.head_dim, f"{layer_prefix(L)}.self_attn"
        sliding = s.attention_types[L] == "sliding_attention"
        q = g.add("linear", x, self.W(f"{p}.q_proj.weight"), name=f"L{L}.q_proj")
        k = g.add("linear", x, self.W(f"{p}.k_proj.weight"), name=f"L{L}.k_proj")
        v = g.add("linear", x, self.W(f"{p}.v_proj.weight"), name=f"L{L}.v_proj")
        gate = g.add("linear", x, self.W(f"{p}.gate_proj.weight"), name=f"L{L}.gate_proj")
        q = g.add("reshape", q, shape=(T, d.heads, hd), name="q_heads")
        k = g.add("reshape", k, shape=(T, d.kv_heads, hd), name="k_heads")
        v = g.add("reshape", v, shape=(T, d.kv_heads, hd), name="v_heads")
        qkn = dict(eps=a.qk_norm.eps, w_offset=a.qk_norm.offset)
        q = g.add("rmsnorm", q, self.W(f"{p}.q_norm.weight"), **qkn, name=f"L{L}.q_norm")
        k = g.add("rmsnorm", k, self.W(f"{p}.k_norm.weight"), **qkn, name=f"L{L}.k_norm")
        if sliding:
            theta = a.sliding.rope.theta
            q = g.add("rope", q, self.pos, theta=theta, name=f"L{L}.q_rope")
            k = g.add("rope", k, self.pos, theta=theta, name=f"L{L}.k_rope")
        elif a.full.q_scale is not None:
            qs = a.full.q_scale
            q = g.add("q_scale", q, self.pos, length=qs.length, offset=qs.offset, exponent=qs.exponent,
                      name=f"L{L}.q_ssmax")
        kv_dtype = "f32" if self.f32 else ("f8e4m3" if s.dtypes.kv_cache == "fp8" else self.act)
        cache = ("S", "Cs") if sliding else ("P", self.opt.page_size)  # a ring per sequence, or pages of a pool
        kc = g.state(f"kv.{L}.k", cache + (d.kv_heads, hd), kv_dtype)
        vc = g.state(f"kv.{L}.v", cache + (d.kv_heads, hd), kv_dtype)
        scales = [self.W(t.name, t) for t in kv_scale_params(s, L)] if kv_dtype == "f8e4m3" else []
        window = s.effective_window if sliding else None
        pages = [] if sliding else [self.block_table]
        kc, vc = g.add("kv_write", kc, vc, k, v, self.slot, self.pos, *pages, *scales, window=window,
                       paged=not sliding, name=f"L{L}.kv_write")
        g.state_out[f"kv.{L}.k"], g.state_out[f"kv.{L}.v"] = kc, vc
        o = g.add("attention", q, kc, vc, self.slot, self.pos, *pages, *scales, window=window, scale=hd ** -0.5,
                  paged=not sliding, name=f"L{L}.attn")
        # output gate: sigmoid(gate_proj(x) + gate_bias[head]) * o, each step rounding as transformers does
        gate = g.add("reshape", gate, shape=(T, d.heads, hd), name="gate_heads")
        bias = g.add("reshape", self.W(f"{p}.gate_bias"), shape=(d.heads, 1), name="gate_bias_heads")
        gate = g.add("add", gate, bias, name=f"L{L}.gate_bias")
        gate = g.add("sigmoid", gate, name=f"L{L}.gate_sigmoid")
        o = g.add("mul", o, gate, name=f"L{L}.gate_mul")
        o = g.add("reshape", o, shape=(T, d.heads * hd), name="attn_flat")
        o = g.add("linear", o, self.W(f"{p}.o_proj.weight"), name=f"L{L}.o_proj")
        return self.reduce(o, f"L{L}.attn_allreduce")

    def dense_mlp(self, L: int, x: Value) -> Value:
        g, p = self.g, f"{layer_prefix(L)}.mlp"
        gate = g.add("linear", x, self.W(f"{p}.gate_proj.weight"), name=f"L{L}.mlp_gate")
        up = g.add("linear", x, self.W(f"{p}.up_proj.weight"), name=f"L{L}.mlp_up")
        act = g.add("swiglu", gate, up, name=f"L{L}.mlp_act")
        out = g.add("linear", act, self.W(f"{p}.down_proj.weight"), name=f"L{L}.mlp_down")
        return self.reduce(out, f"L{L}.mlp_allreduce")

    def moe(self, L: int, x: Value) -> Value:
        g, m, p = self.g, self.spec.mlp.moe, f"{layer_prefix(L)}.mlp"
        logits = g.add("linear_f32", x, self.W(f"{p}.gate.weight"), name=f"L{L}.router")
        w, idx = g.add("moe_select", logits, self.W(f"{p}.gate.e_score_correction_bias"), n_group=m.n_group,
                       topk_group=m.topk_group, top_k=m.top_k, renormalize=m.renormalize, eps=m.renorm_eps,
                       name=f"L{L}.select")
        experts = [self.W(t.name, t) for t in expert_graph_params(self.spec, L)]
        fmt = "nvfp4" if self.spec.dtypes.experts == "nvfp4" else "dense"
        y = g.add("moe_experts", x, idx, *experts, format=fmt, name=f"L{L}.experts")
        out = g.add("moe_combine", y, w, idx, name=f"L{L}.combine")
        out = g.add("scale", out, s=float(m.routed_scaling), name=f"L{L}.routed_scale")
        return self.reduce(out, f"L{L}.moe_allreduce")


def layer_kind(spec: ModelSpec, L: int) -> str:
    """sliding+dense, sliding+sparse, full+sparse ...: the unit in which op counts are reported."""
    att = "sliding" if spec.attention_types[L] == "sliding_attention" else "full"
    return f"{att}+{spec.mlp_types[L]}"


def lower(spec: ModelSpec, opt: LowerOptions = LowerOptions()) -> Graph:
    """The step graph of `opt.phase` for rank `opt.rank` of `opt.tp`."""
    return _Lowerer(spec, opt).lower()
