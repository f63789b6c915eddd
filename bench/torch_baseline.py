"""Plain PyTorch baseline (issue 11): one TP rank's share of Beam written gpt-fast style, on the ablation's weights.

    from torch_baseline import TorchBaseline, run_baseline      # bench/ on sys.path
    facts = run_baseline(spec, weights, tp=8, device="cuda", context=102400, chunk=2048, batch=8, steps=30, reps=3)

What a user would otherwise pick: an nn.Module per block whose forward is a few lines of torch, static KV caches
allocated once, torch.compile'd decode replayed as a CUDA graph (`run_baseline(compile=...)`: "blocks", the
default, compiles each block kind once and captures the whole step in one CUDA graph by hand, ~10x less compile
time than "model", torch.compile(mode="reduce-overhead") of the whole 52-layer step; measured on a CPU: 15 s vs
203 s for the 52-layer graph), eager prefill.
Semantics are transformers' Beam (modeling_beam.py) as beamc's IR lowers it for one rank (`beamc/ir/lower.py`,
`beamc/ir/reference.py`): sandwich RMSNorms (fp32 statistics), per-head q/k RMSNorm, RoPE on sliding-window layers,
NoPE + q *= (1 + (pos + 1) / 2048) ** 0.1 (fp32) on full layers, fp32 softmax attention, output gate
sigmoid(gate_proj(x) + gate_bias[head]), depth-scaled residuals (each scaled operand rounded), dense SwiGLU
layers, DeepSeek-V3 grouped sigmoid routing in fp32 (correction bias picks, never weights; renormalised),
experts x routed_scaling after aggregation, final soft-cap in fp32. The test (tests/test_torch_baseline.py) holds
its fp32 logits to beamc's interpreter at rel. err < 1e-5, TP 1 and the TP-2 rank-0 share.

One rank on one GPU: the all-reduces after o_proj and after the MLP/MoE are skipped (each rank's partial sums are
used as they are, what bench/full_model.py's simulated collectives compute), and the logits are this rank's
vocabulary share (the padded lm_head rows included: soft-capped zeros).

Weights: the dict `beamc.runtime.random_weights.random_rank_weights` gives for the unfused graphs (checkpoint names,
unpacked q/k/v/gate, NVFP4 experts in ModelOpt layout, fp32 router). Dense tensors are used in place (registered as
module buffers, no copies). The experts are converted ONCE, layer by layer, in chunks of experts:
- `experts="fp8"`: e4m3 weights with one fp32 scale per output row (row amax / 448); bf16 experts of one TP-8 rank
  would be ~74 GB, fp8 ~62 GB. The values used are bf16(q * scale) (one rounding);
- `experts="exact"`: the exact dequantised values in the compute dtype (what the reference multiplies); for tests.
Unquantized expert dicts (`dtypes.experts` bf16/fp32, the ablation's --dry run) are taken as they are ("exact",
no copy when the dtype matches) or quantised the same way ("fp8").

KV cache: one contiguous tensor per layer for K and one for V, [max_batch, kv_heads, max_context, head_dim] in the
compute dtype (bf16 at full size; sliding layers keep the full length too), sequences in slots 0..B-1.
- decode (one token per sequence, positions a tensor: static shapes): K/V written at [slot, :, pos]; sliding
  layers gather the window's rows (pos - window, pos] by index, full layers attend over the static length with a
  mask (keys <= pos); the group of q heads sharing a KV head is folded into the query length, so SDPA sees
  [B, kv_heads, group, head_dim] against the cache without copying K/V per q head. `decode_attention="math"`:
  matmul + fp32 softmax + matmul instead of SDPA (an alternative to time: SDPA with a mask cannot use flash
  attention, and its memory-efficient kernel has no split over keys, so one query row per KV head over ~100K
  keys runs on very few SMs);
  MoE: the chosen experts' weights gathered by index and dequantised, batched matmuls;
- prefill (B sequences x T tokens at start..start+T-1, over the cached context): full layers SDPA over
  [0, start + T) with `causal_lower_right` (flash attention where it applies), sliding layers SDPA over
  [start - window + 1, start + T) with a band mask; K/V repeated per q head (`repeat_interleave`, gpt-fast);
  MoE: (token, expert) pairs sorted by expert, `torch._grouped_mm` on the layer's dequantised experts (a per-expert
  loop where _grouped_mm refuses), rows scattered back; eager (no torch.compile: its shapes change with start).
"""
from __future__ import annotations

import gc
import math
import statistics
import time

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: full_model's timing helpers
from full_model import sync as _sync  # noqa: E402
from full_model import timed as _timed  # noqa: E402

FP8_MAX = 448.0
CHUNK_ELEMS = 1 << 26  # expert conversion: at most this many fp32 values of temporaries per chunk of experts
GB = 1e9


# ---------------------------------------------------------------- the few functions every block uses
def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """fp32 statistics, weight * normalised in fp32, one rounding to x's dtype (weight_form "1+w": offset 1)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return ((w if offset == 0 else offset + w.float()) * h).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE with fp32 tables (broadcast over heads), one rounding."""
    return ((x * cos) + (rotate_half(x) * sin)).to(x.dtype)


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return (F.silu(g.float()) * u.float()).to(g.dtype)


def residual(sub: torch.Tensor, res: torch.Tensor, s_sub: torch.Tensor, s_res: torch.Tensor) -> torch.Tensor:
    """Depth-scaled residual: sub / sqrt(n) + res * sqrt((n - 1) / n), each product rounded. The two fp32 scales
    are 0-dim tensors (a buffer per block), not Python floats, so that every block of one kind is the same
    program to torch.compile (no recompilation per layer index)."""
    return sub * s_sub + res * s_res


def residual_scales(n: int) -> torch.Tensor:
    return torch.tensor([1.0 / math.sqrt(n), math.sqrt((n - 1) / n)], dtype=torch.float32)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x.float() if cap is None else torch.tanh(x.float() / cap) * cap


def route(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
          renormalize: bool, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 grouped sigmoid routing in fp32 (transformers' BeamTopKRouter): (weights, expert ids) [N, k]."""
    E = logits.shape[-1]
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(-1, E)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    idx = torch.topk(choice, k=top_k, dim=-1)[1]
    w = scores.gather(1, idx)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + eps)
    return w, idx


def attend(q, k, v, mask, scale: float, impl: str = "sdpa") -> torch.Tensor:
    """softmax(q k^T * scale, masked) v. `mask`: bool (True = attend) broadcast to the scores, or a CausalBias."""
    if impl == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(p.to(v.dtype), v)


# ---------------------------------------------------------------- experts: conversion once, at construction
def _expert_values(weights: dict, p: str, part: str):
    """(n_experts, fn(a, b) -> fp32 values of experts a..b-1 [n, N, K], stored tensor if unquantized else None)."""
    from beamc.checkpoint import nvfp4

    if f"{p}.{part}.weight" in weights:  # NVFP4 (ModelOpt): codes, e4m3 block scales, fp32 global scale per part
        w, s, s2 = (weights[f"{p}.{part}.{n}"] for n in ("weight", "weight_scale", "weight_scale_2"))
        return w.shape[0], lambda a, b: nvfp4.dequantize_stacked(w[a:b], s[a:b], s2[a:b]), None
    t = weights[f"{p}.{part}"]  # unquantized [E, N, K]
    return t.shape[0], lambda a, b: t[a:b].float(), t


def convert_experts(weights: dict, p: str, part: str, mode: str, dtype: torch.dtype):
    """(values, per-row scale or None, owned): fp8 e4m3 [E, N, K] + fp32 [E, N] (scale = row amax / 448), or the
    exact values in `dtype` [E, N, K] (the dict's tensor itself, owned=False, when it already is one)."""
    E, values, stored = _expert_values(weights, p, part)
    if mode == "exact" and stored is not None and stored.dtype == dtype:
        return stored, None, False
    first = values(0, 1)
    N, K = first.shape[1:]
    step = max(1, CHUNK_ELEMS // (N * K))
    out = torch.empty(E, N, K, dtype=torch.float8_e4m3fn if mode == "fp8" else dtype, device=first.device)
    scale = torch.empty(E, N, dtype=torch.float32, device=first.device) if mode == "fp8" else None
    for a in range(0, E, step):
        b = min(a + step, E)
        w = values(a, b)
        if mode == "fp8":
            s = w.abs().amax(-1) / FP8_MAX
            s = torch.where(s == 0, torch.ones_like(s), s)
            out[a:b] = (w / s[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            scale[a:b] = s
        else:
            out[a:b] = w.to(dtype)
        del w
    return out, scale, True


def dequant(w: torch.Tensor, s: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Expert weights in the compute dtype: bf16(q * scale) for fp8 (one rounding), as they are otherwise."""
    return w if s is None else (w.float() * s[..., None]).to(dtype)


# ---------------------------------------------------------------- the model
class Attention(nn.Module):
    def __init__(self, spec, W: dict, L: int, max_batch: int, max_context: int, impl: str):
        super().__init__()
        a, p = spec.attention, f"model.layers.{L}.self_attn"
        for n, key in (("wq", "q_proj.weight"), ("wk", "k_proj.weight"), ("wv", "v_proj.weight"),
                       ("wg", "gate_proj.weight"), ("bg", "gate_bias"), ("wo", "o_proj.weight"),
                       ("qn", "q_norm.weight"), ("kn", "k_norm.weight")):
            self.register_buffer(n, W[f"{p}.{key}"], persistent=False)
        self.hd = a.head_dim
        self.hq, self.hkv = self.wq.shape[0] // self.hd, self.wk.shape[0] // self.hd
        self.group = self.hq // self.hkv
        self.scale = self.hd ** -0.5
        self.eps, self.off = a.qk_norm.eps, a.qk_norm.offset
        self.sliding = spec.attention_types[L] == "sliding_attention"
        self.window = spec.effective_window if self.sliding else None
        self.qs = None if self.sliding else a.full.q_scale
        self.impl = impl
        dt, dev = self.wq.dtype, self.wq.device
        self.register_buffer("kc", torch.zeros(max_batch, self.hkv, max_context, self.hd, dtype=dt, device=dev),
                             persistent=False)
        self.register_buffer("vc", torch.zeros_like(self.kc), persistent=False)
        if self.sliding:  # decode: the window's row offsets -(window - 1)..0
            self.register_buffer("woff", torch.arange(1 - self.window, 1, device=dev), persistent=False)

    def _qkv(self, x: torch.Tensor, pos: torch.Tensor, cos, sin):
        """q [.., hq, hd], k, v [.., hkv, hd] of x [.., H] after q/k norm and RoPE / the NoPE q scale."""
        q = F.linear(x, self.wq).unflatten(-1, (self.hq, self.hd))
        k = F.linear(x, self.wk).unflatten(-1, (self.hkv, self.hd))
        v = F.linear(x, self.wv).unflatten(-1, (self.hkv, self.hd))
        q, k = rmsnorm(q, self.qn, self.eps, self.off), rmsnorm(k, self.kn, self.eps, self.off)
        if self.sliding:
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        elif self.qs is not None:
            s = torch.exp(self.qs.exponent * torch.log1p((pos.float() + self.qs.offset) / self.qs.length))
            q = (q.float() * s[..., None, None]).to(q.dtype)
        return q, k, v

    def _out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Output gate sigmoid(gate_proj(x) + bias[head]) * o, then o_proj (the all-reduce is skipped)."""
        gate = F.linear(x, self.wg).unflatten(-1, (self.hq, self.hd)) + self.bg[:, None]
        return F.linear((o * torch.sigmoid(gate)).flatten(-2), self.wo)

    def decode(self, x: torch.Tensor, pos: torch.Tensor, cos, sin, kpos: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]  # x [B, H], pos [B]: one token per sequence, sequence b in slot b
        q, k, v = self._qkv(x, pos, cos, sin)
        slots = torch.arange(B, device=x.device)
        self.kc[slots, :, pos] = k
        self.vc[slots, :, pos] = v
        if self.sliding:  # the window's rows (pos - window, pos], gathered: a static [B, hkv, window, hd]
            rows = pos[:, None] + self.woff
            mask = rows >= 0
            at = rows.clamp(min=0)[:, None, :, None].expand(B, self.hkv, self.window, self.hd)
            kk, vv = self.kc[:B].gather(2, at), self.vc[:B].gather(2, at)
        else:  # every cached row, keys <= pos
            kk, vv = self.kc[:B], self.vc[:B]
            mask = kpos[None, :] <= pos[:, None]
        qg = q.view(B, self.hkv, self.group, self.hd)  # q heads h = kv * group + g share kv head `kv`
        o = attend(qg, kk, vv, mask[:, None, None, :], self.scale, self.impl)
        return self._out(x, o.reshape(B, self.hq, self.hd))

    def prefill(self, x: torch.Tensor, start: int, cos, sin) -> torch.Tensor:
        B, T = x.shape[:2]  # x [B, T, H] at positions start..start+T-1 of slots 0..B-1
        pos = torch.arange(start, start + T, device=x.device)
        q, k, v = self._qkv(x, pos, cos[:, None], sin[:, None])
        self.kc[:B, :, start:start + T] = k.transpose(1, 2)
        self.vc[:B, :, start:start + T] = v.transpose(1, 2)
        lo = max(start - self.window + 1, 0) if self.sliding else 0
        kk = self.kc[:B, :, lo:start + T].repeat_interleave(self.group, dim=1)
        vv = self.vc[:B, :, lo:start + T].repeat_interleave(self.group, dim=1)
        if self.sliding:
            kp = torch.arange(lo, start + T, device=x.device)
            mask = (kp[None, :] <= pos[:, None]) & (kp[None, :] > pos[:, None] - self.window)
        else:
            mask = causal_lower_right(T, start + T)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=mask, scale=self.scale)
        return self._out(x, o.transpose(1, 2))


class DenseMLP(nn.Module):
    def __init__(self, W: dict, L: int):
        super().__init__()
        p = f"model.layers.{L}.mlp"
        for n in ("gate", "up", "down"):
            self.register_buffer(n, W[f"{p}.{n}_proj.weight"], persistent=False)

    def forward(self, x: torch.Tensor, decode: bool) -> torch.Tensor:
        return F.linear(swiglu(F.linear(x, self.gate), F.linear(x, self.up)), self.down)


class MoE(nn.Module):
    grouped = hasattr(torch, "_grouped_mm")  # prefill through torch._grouped_mm; False (with a note) once it refuses

    def __init__(self, spec, W: dict, L: int, experts: str, dtype: torch.dtype):
        super().__init__()
        m, p = spec.mlp.moe, f"model.layers.{L}.mlp"
        self.m, self.dtype = m, dtype
        self.register_buffer("router", W[f"{p}.gate.weight"], persistent=False)
        self.register_buffer("bias", W[f"{p}.gate.e_score_correction_bias"], persistent=False)
        self.owned = 0  # bytes of the converted experts (0 when the dict's tensors are used as they are)
        for n, part in (("gu", "gate_up_proj"), ("dn", "down_proj")):
            w, s, owned = convert_experts(W, f"{p}.experts", part, experts, dtype)
            self.register_buffer(n, w, persistent=False)
            self.register_buffer(f"{n}_s", s, persistent=False)
            self.owned += sum(t.numel() * t.element_size() for t in (w, s) if t is not None and owned)
        self.I = self.dn.shape[-1]

    def forward(self, x: torch.Tensor, decode: bool) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, H]: every token of the step
        w, idx = route(F.linear(x.float(), self.router.float()), self.bias, self.m.n_group, self.m.topk_group,
                       self.m.top_k, self.m.renormalize, self.m.renorm_eps)
        y = self.experts_gathered(x, idx) if decode else self.experts_sorted(x, idx)  # [N, k, H]
        acc = y[:, 0].float() * w[:, :1]
        for j in range(1, idx.shape[1]):
            acc = acc + y[:, j].float() * w[:, j:j + 1]
        return (acc.to(x.dtype) * self.m.routed_scaling).view(shape)

    def experts_gathered(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Decode: each token's k experts' weights gathered by index, batched matmuls."""
        gu = dequant(self.gu[idx], None if self.gu_s is None else self.gu_s[idx], x.dtype)  # [N, k, 2I, H]
        dn = dequant(self.dn[idx], None if self.dn_s is None else self.dn_s[idx], x.dtype)  # [N, k, H, I]
        h = torch.matmul(x[:, None, None, :], gu.transpose(-1, -2)).squeeze(-2)  # [N, k, 2I]
        a = swiglu(h[..., : self.I], h[..., self.I:])
        return torch.matmul(a[..., None, :], dn.transpose(-1, -2)).squeeze(-2)

    def _layer_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts of the layer in the compute dtype: fp8 ones dequantised into one buffer reused by every layer."""
        if self.gu_s is None:
            return self.gu, self.dn
        bufs = _prefill_buffers(self.gu.shape, self.dn.shape, dtype, self.gu.device)
        for src, s, buf in ((self.gu, self.gu_s, bufs[0]), (self.dn, self.dn_s, bufs[1])):
            step = max(1, CHUNK_ELEMS // (src.shape[1] * src.shape[2]))
            for a in range(0, src.shape[0], step):
                buf[a:a + step] = dequant(src[a:a + step], s[a:a + step], dtype)
        return bufs

    def experts_sorted(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Prefill: (token, expert) pairs sorted by expert, one grouped GEMM per projection, rows scattered back."""
        N, k = idx.shape
        E = self.gu.shape[0]
        gu, dn = self._layer_weights(x.dtype)
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(E, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        xs = x[order // k]
        y = torch.empty(N * k, x.shape[-1], dtype=x.dtype, device=x.device)
        if MoE.grouped:
            try:
                offs = torch.cumsum(counts, 0, dtype=torch.int32)
                h = torch._grouped_mm(xs, gu.transpose(-2, -1), offs=offs)
                a = swiglu(h[:, : self.I], h[:, self.I:])
                y[order] = torch._grouped_mm(a, dn.transpose(-2, -1), offs=offs)
                return y.view(N, k, -1)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - e.g. a dtype or GPU it does not support: the loop below
                MoE.grouped = False
                NOTES.append(f"torch._grouped_mm refused ({type(e).__name__}: {str(e).splitlines()[0][:120]}): "
                             "prefill experts run as one matmul per expert")
        ends = torch.cumsum(counts, 0).tolist()  # host sync: the loop needs the row ranges
        lo = 0
        ys = torch.empty_like(y)
        for e, hi in enumerate(ends):
            if hi > lo:
                h = F.linear(xs[lo:hi], gu[e])
                ys[lo:hi] = F.linear(swiglu(h[:, : self.I], h[:, self.I:]), dn[e])
            lo = hi
        y[order] = ys
        return y.view(N, k, -1)


NOTES: list[str] = []  # what happened at run time that the results should say (cleared by run_baseline)
_PREFILL_BUFS: dict = {}


def _prefill_buffers(gu_shape, dn_shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (tuple(gu_shape), tuple(dn_shape), dtype, str(device))
    if key not in _PREFILL_BUFS:
        _PREFILL_BUFS.clear()
        _PREFILL_BUFS[key] = (torch.empty(gu_shape, dtype=dtype, device=device),
                              torch.empty(dn_shape, dtype=dtype, device=device))
    return _PREFILL_BUFS[key]


class Block(nn.Module):
    def __init__(self, spec, W: dict, L: int, max_batch: int, max_context: int, experts: str, impl: str):
        super().__init__()
        p, dt = f"model.layers.{L}", W["model.embed_tokens.weight"].dtype
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            self.register_buffer(n, W[f"{p}.{n}.weight"], persistent=False)
        self.eps, self.off = spec.norm.eps, spec.norm.offset
        dev = W[f"{p}.input_layernorm.weight"].device
        self.register_buffer("rs_attn", residual_scales(spec.residual_n(L, "attn")).to(dev), persistent=False)
        self.register_buffer("rs_mlp", residual_scales(spec.residual_n(L, "mlp")).to(dev), persistent=False)
        self.attn = Attention(spec, W, L, max_batch, max_context, impl)
        self.mlp = DenseMLP(W, L) if spec.mlp_types[L] == "dense" else MoE(spec, W, L, experts, dt)

    def decode(self, h: torch.Tensor, pos: torch.Tensor, cos, sin, kpos) -> torch.Tensor:
        a = self.attn.decode(rmsnorm(h, self.input_layernorm, self.eps, self.off), pos, cos, sin, kpos)
        return self._ffn(h, a, True)

    def prefill(self, h: torch.Tensor, start: int, cos, sin) -> torch.Tensor:
        a = self.attn.prefill(rmsnorm(h, self.input_layernorm, self.eps, self.off), start, cos, sin)
        return self._ffn(h, a, False)

    def _ffn(self, h: torch.Tensor, a: torch.Tensor, decode: bool) -> torch.Tensor:
        h = residual(rmsnorm(a, self.post_attention_layernorm, self.eps, self.off), h, *self.rs_attn)
        m = self.mlp(rmsnorm(h, self.pre_feedforward_layernorm, self.eps, self.off), decode)
        return residual(rmsnorm(m, self.post_feedforward_layernorm, self.eps, self.off), h, *self.rs_mlp)


class TorchBaseline(nn.Module):
    """One TP rank's share of Beam in plain PyTorch (see the module docstring).

    decode(tokens [B], positions [B]) -> fp32 logits [B, vocab share]; prefill(tokens [B, T], start) -> fp32
    logits of each sequence's last token [B, vocab share]; fill_context(length, seed): random cache rows."""

    def __init__(self, spec, weights: dict, tp: int, rank: int, device, max_batch: int, max_context: int,
                 experts: str = "fp8", decode_attention: str = "sdpa", consume: bool = False):
        """consume: drop each MoE layer's expert tensors from `weights` once converted (the dict's last user: the
        peak then holds one layer of both forms, not all of both)."""
        super().__init__()
        if experts not in ("fp8", "exact"):
            raise ValueError(f"experts={experts!r}: 'fp8' or 'exact'")
        if decode_attention not in ("sdpa", "math"):
            raise ValueError(f"decode_attention={decode_attention!r}: 'sdpa' or 'math'")
        self.spec, self.tp, self.rank = spec, tp, rank
        self.max_batch, self.max_context, self.experts = max_batch, max_context, experts
        W = weights
        embed = W["model.embed_tokens.weight"]
        self.device, self.dtype = torch.device(device), embed.dtype
        if embed.device.type != self.device.type:
            raise ValueError(f"weights are on {embed.device}, the model is asked for {self.device}")
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("norm", W["model.norm.weight"], persistent=False)
        head = "model.embed_tokens.weight" if spec.logits.tie_word_embeddings else "lm_head.weight"
        self.register_buffer("lm_head", W[head], persistent=False)
        self.layers = nn.ModuleList()
        for L in range(spec.num_layers):  # experts converted here, one layer at a time
            self.layers.append(Block(spec, W, L, max_batch, max_context, experts, decode_attention))
            if consume and spec.mlp_types[L] == "sparse":
                for name in [n for n in W if n.startswith(f"model.layers.{L}.mlp.experts.")]:
                    if not any(t is W[name] for t in self.layers[-1].buffers()):  # (unless used as they are)
                        del W[name]
        hd, theta = spec.attention.head_dim, spec.attention.sliding.rope.theta
        kpos = torch.arange(max_context, device=self.device)
        inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=self.device).float() / hd))
        freqs = kpos[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)  # [max_context, hd] fp32
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.register_buffer("kpos", kpos, persistent=False)
        self.cap = spec.logits.softcap

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        h = rmsnorm(h, self.norm, self.spec.norm.eps, self.spec.norm.offset)
        return softcap(F.linear(h, self.lm_head), self.cap)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() and not (positions.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._check(tokens.shape[0], int(positions.max()) + 1)  # eager only: a host sync
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [B, 1, hd]: over heads
        h = F.embedding(tokens, self.embed)
        for blk in self.layers:
            h = blk.decode(h, positions, cos, sin, self.kpos)
        return self._head(h)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        B, T = tokens.shape
        self._check(B, start + T)
        cos, sin = self.cos[start:start + T], self.sin[start:start + T]
        h = F.embedding(tokens, self.embed)
        for blk in self.layers:
            h = blk.prefill(h, start, cos, sin)
        return self._head(h[:, -1])

    @torch.no_grad()
    def fill_context(self, length: int, seed: int = 0) -> None:
        """Benchmarks: cache rows [0, length) of every slot and layer set to N(0, 1) (no compute)."""
        self._check(self.max_batch, length)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for blk in self.layers:
            for c in (blk.attn.kc, blk.attn.vc):
                c[:, :, :length].normal_(generator=gen)

    def compile_blocks(self, **kw) -> None:
        """torch.compile each block's decode (fullgraph): blocks of one kind share one compilation (their tensors
        are inputs, their residual scales buffers), so the 52-layer step costs three compilations, not one huge."""
        for blk in self.layers:
            blk.decode = torch.compile(blk.decode, fullgraph=True, **kw)

    def uncompile_blocks(self) -> None:
        for blk in self.layers:
            blk.__dict__.pop("decode", None)

    def _check(self, batch: int, end: int) -> None:
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch {batch} outside [1, max_batch={self.max_batch}]")
        if end > self.max_context:
            raise ValueError(f"positions up to {end - 1} do not fit max_context={self.max_context}")

    def owned_nbytes(self) -> int:
        """Bytes this model allocated itself (converted experts, KV caches), not the weights dict's."""
        n = 0
        for blk in self.layers:
            n += sum(t.numel() * t.element_size() for t in (blk.attn.kc, blk.attn.vc))
            n += getattr(blk.mlp, "owned", 0)
        return n


# ---------------------------------------------------------------- the benchmark row
def _graphed(fn, *args):
    """(replay, output tensor): fn(*args) captured by hand into one CUDA graph after two warm-up calls on a side
    stream (where torch.compile'd parts compile and autotune), replayed once so that the output holds values."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*args)
    g.replay()
    return g.replay, out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _msg(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


COMPILE_MODES = ("blocks", "model", "none")


def _decode_runner(model: TorchBaseline, tok, pos, device: torch.device, how: str):
    """(fn() replaying one batch-1 decode step, its output tensor or None, what it is) for `how`:
    - "blocks": every block's decode through torch.compile (default mode, fullgraph): one compilation per kind of
      block (sliding+dense, sliding+MoE, full+MoE) instead of one of the whole 52-layer step; the step (embedding,
      the compiled blocks, head) captured into ONE CUDA graph by hand (what vLLM does with inductor's output);
    - "model": torch.compile(model.decode, mode="reduce-overhead", fullgraph=True): the whole step one inductor
      graph, replayed by torch's CUDA graph trees;
    - "none": the eager step captured into one CUDA graph.
    A failing compilation falls back to "none" (said in NOTES). On a CPU: the eager step, no graph."""
    if device.type != "cuda":
        return (lambda: model.decode(tok, pos)), None, "eager (CPU: no torch.compile, no CUDA graph)"
    try:
        if how == "model":
            compiled = torch.compile(model.decode, mode="reduce-overhead", fullgraph=True)

            def fn():
                torch.compiler.cudagraph_mark_step_begin()
                return compiled(tok, pos)
            for _ in range(3):  # compile, warm-up run, CUDA graph recording
                out = fn()
            return fn, out, ("torch.compile(model.decode, mode='reduce-overhead', fullgraph=True): the whole step "
                             "one inductor graph, CUDA graph trees")
        if how == "blocks":
            model.compile_blocks()
            replay, out = _graphed(model.decode, tok, pos)  # its warm-up calls compile
            return replay, out, ("torch.compile (default mode, fullgraph) of each block's decode (one compilation "
                                 "per block kind), the whole step captured into one CUDA graph by hand")
    except Exception as e:  # noqa: BLE001 - the row must survive: fall back to the eager step in a CUDA graph
        NOTES.append(f"torch.compile ({how}) failed ({_msg(e)}): decode is the eager step captured into one CUDA "
                     "graph by hand")
        model.uncompile_blocks()
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        how = "failed"
    replay, out = _graphed(model.decode, tok, pos)
    return replay, out, ("eager step captured into one CUDA graph by hand" +
                         (" (torch.compile failed, see notes)" if how == "failed" else ""))


def run_baseline(spec, weights: dict, tp: int, device, context: int, chunk: int, batch: int, steps: int, reps: int,
                 *, rank: int = 0, seed: int = 0, experts: str = "fp8", decode_attention: str = "sdpa",
                 compile: str = "blocks", consume: bool = False) -> dict:
    """The baseline row: build the model on `weights`, fill `context` random cache rows, time batch-1 decode at
    position `context` (`steps` calls, median ms) and `batch` x `chunk` prefill after `context` (`reps` calls,
    median ms). GPU: decode compiled as `compile` says (see `_decode_runner`: "blocks" by default, "model" for
    torch.compile(mode="reduce-overhead") of the whole step, "none") and replayed as a CUDA graph; prefill eager.
    CPU: both eager.
    Never raises: {"error": "<type>: <message>", "partial": {...}} instead. Frees its memory before returning."""
    device = torch.device(device)
    NOTES.clear()
    t0 = time.perf_counter()
    res: dict = {"tp": tp, "rank": rank, "context": context, "chunk": chunk, "batch": batch}
    model = fn = None
    try:
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile={compile!r}: one of {COMPILE_MODES}")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        max_context = -(-(context + max(chunk, 1)) // 64) * 64  # room for the prefill chunk, 64-aligned rows
        t = time.perf_counter()
        model = TorchBaseline(spec, weights, tp, rank, device, max_batch=batch, max_context=max_context,
                              experts=experts, decode_attention=decode_attention, consume=consume)
        model.fill_context(context, seed)
        _sync(device)
        res["build_s"] = round(time.perf_counter() - t, 1)
        res["owned_gb"] = round(model.owned_nbytes() / GB, 2)
        res["max_context"] = max_context
        gen = torch.Generator(device=device).manual_seed(seed)
        tok = torch.randint(0, spec.vocab_size, (1,), generator=gen, device=device)
        pos = torch.full((1,), context, dtype=torch.long, device=device)
        ref = model.decode(tok, pos).clone()  # eager; decode at a fixed position is idempotent (same row written)
        # ---- decode: batch 1 at `context`
        t = time.perf_counter()
        fn, out, dec_mode = _decode_runner(model, tok, pos, device, compile)
        _sync(device)
        res["compile_s"] = round(time.perf_counter() - t, 1)
        if out is not None:
            res["decode_check_rel_err"] = _rel(out, ref)  # the timed graph's logits vs the eager step's
        dec = _timed(fn, device, steps)
        res["decode_ms"] = statistics.median(dec)
        res["decode_steps"] = steps
        fn = out = None
        # ---- prefill: batch x chunk tokens after `context` each
        toks = torch.randint(0, spec.vocab_size, (batch, chunk), generator=gen, device=device)
        t = time.perf_counter()
        model.prefill(toks, context)  # warm-up (library handles, workspaces)
        _sync(device)
        res["prefill_first_s"] = round(time.perf_counter() - t, 2)
        pre = _timed(lambda: model.prefill(toks, context), device, reps)
        res["prefill_ms"] = statistics.median(pre)
        res["prefill_reps"] = reps
        res["prefill_tokens"] = batch * chunk
        res["mode"] = f"decode: {dec_mode}; prefill: eager"
        dt = str(model.dtype).replace("torch.", "").replace("bfloat16", "bf16")
        res["experts"] = "fp8 e4m3 per-row scales" if experts == "fp8" else f"exact ({dt})"
        res["kv"] = f"{dt} contiguous"
        res["attention"] = (f"decode: {'SDPA' if decode_attention == 'sdpa' else 'matmul + fp32 softmax'}, q heads of "
                            "a KV head folded into the query length, full layers over the static length with a "
                            "mask, sliding layers over the gathered window; prefill: SDPA, causal_lower_right (full) "
                            "/ band mask (sliding), K/V repeat_interleave'd per q head")
        res["moe"] = ("decode: chosen experts' weights gathered by index + batched matmul; prefill: pairs sorted by "
                      "expert, " + ("torch._grouped_mm" if MoE.grouped else "one matmul per expert") +
                      " on the layer's dequantised experts")
        if device.type == "cuda":
            res["max_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / GB, 2)
            res["max_memory_above_start_gb"] = round((torch.cuda.max_memory_allocated(device) - base) / GB, 2)
        res["notes"] = [
            "one rank on one device: the all-reduces are skipped (partial sums used as they are); logits are this "
            "rank's vocabulary share (padded rows included)",
            "KV cache: one contiguous [max_batch, kv_heads, max_context, head_dim] tensor per layer for K and for V "
            "(sliding layers too); the fp8 KV scales of the weights dict are not used",
            "decode is timed at a fixed position (context): each call rewrites the same cache row",
            *NOTES]
        res["total_s"] = round(time.perf_counter() - t0, 1)
        return res
    except Exception as e:  # noqa: BLE001 - the ablation run must survive
        partial = {k: v for k, v in res.items() if k not in ("tp", "rank", "context", "chunk", "batch")}
        return {"error": _msg(e), "partial": partial, "notes": list(NOTES)}
    finally:
        fn = out = model = None  # noqa: F841 - drop the graphs and the model before emptying the cache
        _PREFILL_BUFS.clear()
        if device.type == "cuda" and compile != "none":
            torch._dynamo.reset()  # compiled code (and the CUDA graph trees' memory pool)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
