"""The torch reference of every op, keyed by op name (signatures are in `beamc.ir.ops`).

References follow transformers' Beam (modeling_beam.py) expression by expression, so that the interpreter
reproduces its rounding points: an op that rounds to bf16 in transformers rounds here at the same place. Fused ops
(added by passes) compose their parts' references in the same order with the same roundings, so a fused graph's
interpretation is bit-identical to the unfused one's. Kernels are judged against these functions.

`REFS[op](inputs, attrs)` takes torch tensors and returns a tuple of tensors. Ops with `state_io` write into the
state tensors they receive and return them. Collectives have `RANK_REFS[op](inputs per rank, attrs)` instead.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from beamc.checkpoint import nvfp4
from beamc.errors import BeamcError
from beamc.ir.dtypes import torch_dtype
from beamc.ir.ops import OPS, qk_attention_parts

REFS: dict[str, Callable[[list[torch.Tensor], dict[str, Any]], tuple[torch.Tensor, ...]]] = {}
RANK_REFS: dict[str, Callable[[list[list[torch.Tensor]], dict[str, Any]], list[tuple[torch.Tensor, ...]]]] = {}
FP8_MAX = 448.0


def ref(name: str):
    """Register the decorated function as op `name`'s reference (the op must have a signature)."""
    assert name in OPS, f"no signature for {name}"

    def deco(fn):
        REFS[name] = fn
        return fn
    return deco


# ---------------------------------------------------------------- elementwise and views
REFS["add"] = lambda t, a: (t[0] + t[1],)
REFS["mul"] = lambda t, a: (t[0] * t[1],)
REFS["scale"] = lambda t, a: (t[0] * a["s"],)
REFS["sigmoid"] = lambda t, a: (torch.sigmoid(t[0]),)
REFS["cast"] = lambda t, a: (t[0].to(torch_dtype(a["dtype"])),)
REFS["reshape"] = lambda t, a: (t[0].reshape([-1 if isinstance(d, str) else d for d in a["shape"]]),)
REFS["embed"] = lambda t, a: (F.embedding(t[0], t[1]),)


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """transformers' BeamRMSNorm: fp32 statistics, w * normalised in fp32, one rounding to x's dtype. With
    offset 1 (IR attr `w_offset`; spec `weight_form: "1+w"`, Gemma's form) the weight is (1 + w) computed in fp32."""
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    scale = w if offset == 0 else offset + w.float()
    return (scale * h).to(x.dtype)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself, or a copy where its data does not start on a 64-byte boundary. A CPU GEMM's summation order can
    follow its operands' alignment (vector loads), so a weight read as a view at an odd offset (a part of a packed
    weight; a tensor mmapped from a safetensors file, whose offsets are 8-byte aligned) would give other bits than
    the same values in their own allocation: the passes' graphs equal the unfused ones bit for bit only with this."""
    return t if t.device.type != "cpu" or t.data_ptr() % 64 == 0 else t.clone()


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T (F.linear) on 64-byte aligned operands: the same bits wherever w lies."""
    return F.linear(_aligned(x), _aligned(w))


REFS["rmsnorm"] = lambda t, a: (rmsnorm_ref(t[0], t[1], a["eps"], a["w_offset"]),)
REFS["linear"] = lambda t, a: (linear(t[0], t[1]),)
REFS["linear_f32"] = lambda t, a: (linear(t[0].float(), t[1].float()),)


# ---------------------------------------------------------------- attention pieces
def rope_tables(pos: torch.Tensor, theta: float, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, dim] in fp32, as transformers' BeamRotaryEmbedding computes them."""
    # made on pos's device: no host-to-device copy, which a CUDA-graph capture of an unfused step would refuse
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=pos.device).float() / dim))
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


REFS["rope"] = lambda t, a: (rope_ref(t[0], t[1], a["theta"]),)
REFS["q_scale"] = lambda t, a: (q_scale_ref(t[0], t[1], a),)


def check_kv_capacity(slot: torch.Tensor, pos: torch.Tensor, cap: int, window: int | None,
                      block_table: torch.Tensor | None = None, pages: int = 0) -> None:
    """Refuse a step whose writes would overwrite keys it still reads, or land outside the cache, BEFORE anything is
    written.

    Ring caches: a sequence's tokens at positions lo..hi read keys from lo - window + 1 (sliding) or 0 (full) on;
    the ring (pos % cap) keeps them all only if that span fits. Paged caches: every position's page index must lie in
    the sequence's block table and its page in the pool, and no two tokens of the step may land on one row. Distinct
    rows make the scatter deterministic on every device."""
    if block_table is not None:
        idx = pos // cap
        far = idx >= block_table.shape[1]
        if bool(far.any()):
            i = int(far.nonzero()[0])
            raise _far_page(int(slot[i]), int(pos[i]), cap, block_table.shape[1])
        page = block_table[slot, idx].long()
        bad = (page < 0) | (page >= pages)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise _page_outside(int(slot[i]), int(pos[i]), int(page[i]), pages)
        rows = page * cap + pos % cap
        if torch.unique(rows).numel() != rows.numel():
            raise _shared_row()
        return
    for s in torch.unique(slot).tolist():
        p = pos[slot == s]
        _check_span(s, int(p.min()), int(p.max()), torch.unique(p).numel() == p.numel(), cap, window)


def check_kv_capacity_lists(slot: list[int], pos: list[int], cap: int, window: int | None,
                            block_table: torch.Tensor | None = None, pages: int = 0) -> None:
    """`check_kv_capacity` on plain int lists (the same checks, the same first error and message): for the runtime's
    small steps (a decode batch), where a few Python comparisons cost less than torch's per-op overhead."""
    if block_table is not None:
        width = block_table.shape[1]
        for s, p in zip(slot, pos):
            if p // cap >= width:
                raise _far_page(s, p, cap, width)
        # the step's table entries in one gather (not the whole table: 100K contexts have thousands of pages a row)
        entries = block_table.cpu().numpy()[slot, [p // cap for p in pos]].tolist()
        for s, p, page in zip(slot, pos, entries):
            if page < 0 or page >= pages:
                raise _page_outside(s, p, page, pages)
        if len({page * cap + p % cap for p, page in zip(pos, entries)}) != len(pos):
            raise _shared_row()
        return
    per: dict[int, list[int]] = {}
    for s, p in zip(slot, pos):
        per.setdefault(s, []).append(p)
    for s in sorted(per):  # torch.unique's order: ascending slots
        ps = per[s]
        _check_span(s, min(ps), max(ps), len(set(ps)) == len(ps), cap, window)


def _check_span(s: int, lo: int, hi: int, distinct: bool, cap: int, window: int | None) -> None:
    """Slot s's positions lo..hi of one step (`distinct`: no position twice) in a ring of cap positions."""
    if not distinct:
        raise BeamcError("kv cache", f"slot {s} is given position {lo}..{hi} twice in one step",
                         "each token of a sequence needs its own position")
    first = max(lo - window + 1, 0) if window else 0
    if hi + 1 - first > cap:
        raise BeamcError("kv cache", f"slot {s} needs positions {first}..{hi} in one step but the cache holds "
                         f"{cap}", "give sliding caches >= window - 1 + chunk positions, full ones the context")


def _far_page(s: int, p: int, page_size: int, width: int) -> BeamcError:
    return BeamcError("kv cache", f"slot {s} position {p} needs page {p // page_size} of its block table, which has "
                      f"{width}", "give the sequence a longer block table")


def _page_outside(s: int, p: int, page: int, pages: int) -> BeamcError:
    return BeamcError("kv cache", f"slot {s} position {p}: its block table points at page {page}, outside the pool "
                      f"of {pages} pages", "fix the block table")


def _shared_row() -> BeamcError:
    return BeamcError("kv cache", "two tokens of one step write the same cache row (a position given twice, or two "
                      "sequences sharing a page)", "give each token its own position and page")


# ops that write a KV cache: input index of (cache, slot, pos, block table if paged)
KV_WRITERS = {"kv_write": (0, 4, 5, 6), "qk_norm_pos_kv": (5, 7, 8, 9), "qk_attention": (5, 7, 8, 9)}


def check_step_caches(nodes, value_of) -> None:
    """Every cache write of a step checked before the step runs (so a refused step writes no layer's cache).
    `value_of(v)` gives the tensor of a leaf value (the step's inputs and states)."""
    for n in nodes:
        if n.op not in KV_WRITERS:
            continue
        c, s, p, b = KV_WRITERS[n.op]
        kc = value_of(n.inputs[c])
        bt = value_of(n.inputs[b]) if n.attrs.get("paged") else None
        check_kv_capacity(value_of(n.inputs[s]), value_of(n.inputs[p]), kc.shape[1], n.attrs.get("window"), bt,
                          kc.shape[0])


def cache_rows(c: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, block_table: torch.Tensor | None):
    """Index of each (slot, position) into a cache: [slot, pos % C] (ring) or [page, pos % page] (paged)."""
    if block_table is None:
        return slot, pos % c.shape[1]
    return block_table[slot, pos // c.shape[1]].long(), pos % c.shape[1]


def _split_extras(extras, paged: bool):
    """(block table or None, k scale, v scale) from the inputs after (slot, pos)."""
    bt = extras[0] if paged else None
    scales = list(extras[1:] if paged else extras) + [None, None]
    return bt, scales[0], scales[1]


def kv_store(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """A value as the cache stores it: fp8 as x / scale, clamped to the e4m3 range (no NaN from overflow)."""
    if scale is None:
        return x.to(cache_dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def kv_load(c: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cached values in fp32 (fp8 times its scale)."""
    return c.float() if scale is None else c.float() * scale


def kv_write_ref(kc, vc, k, v, slot, pos, *extras, window=None, paged=False):
    """Write this step's K/V: a ring for sliding layers (capacity >= window - 1 + chunk) at [slot, pos % C], pages
    for full layers at [block_table[slot, pos // page], pos % page]. Everything is checked before the write."""
    bt, k_scale, v_scale = _split_extras(extras, paged)
    check_kv_capacity(slot, pos, kc.shape[1], window, bt, kc.shape[0])
    rows = cache_rows(kc, slot, pos, bt)
    kc[rows] = kv_store(k, kc.dtype, k_scale)
    vc[rows] = kv_store(v, vc.dtype, v_scale)
    return kc, vc


REFS["kv_write"] = lambda t, a: kv_write_ref(*t, window=a.get("window"), paged=a.get("paged", False))


def attention_ref(q, kc, vc, slot, pos, *extras, window: int | None, scale: float, paged: bool = False):
    """Causal GQA attention of each token over its sequence's cached keys (this step's included).

    A token at position p attends to positions (p - window, p] (sliding) or [0, p] (full). Scores, softmax and the
    P @ V product are fp32; the output is rounded once to q's dtype (flash-attention numerics)."""
    bt, k_scale, v_scale = _split_extras(extras, paged)
    T, hq, d = q.shape
    hkv, cap = kc.shape[2], kc.shape[1]
    group = hq // hkv
    out = torch.empty_like(q)
    for s in torch.unique(slot).tolist():
        rows = (slot == s).nonzero().flatten()
        qp = pos[rows]
        lo = max(int(qp.min()) - (window - 1 if window else int(qp.min())), 0)
        if bt is None and int(qp.max()) + 1 - lo > cap:  # kv_write checks this first; a direct call must not misread
            raise BeamcError("attention", f"slot {s} needs positions {lo}..{int(qp.max())} but the cache holds "
                             f"{cap}", "give sliding caches >= window - 1 + chunk positions, full ones the context")
        kpos = torch.arange(lo, int(qp.max()) + 1, device=q.device)
        at = cache_rows(kc, torch.full_like(kpos, s), kpos, bt)
        k = kv_load(kc[at], k_scale).repeat_interleave(group, dim=1)  # [K, hq, d]
        v = kv_load(vc[at], v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,khd->htk", q[rows].float(), k) * scale
        allowed = kpos[None, :] <= qp[:, None]
        if window:
            allowed &= kpos[None, :] > qp[:, None] - window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out[rows] = torch.einsum("htk,khd->thd", p, v).to(q.dtype)
    return out


REFS["attention"] = lambda t, a: (attention_ref(*t, window=a["window"], scale=a["scale"],
                                                paged=a.get("paged", False)),)


# ---------------------------------------------------------------- MLPs
def swiglu_ref(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, one rounding (transformers' BeamMLP and BeamExperts._apply_gate)."""
    return (F.silu(g.float()) * u.float()).to(g.dtype)


REFS["swiglu"] = lambda t, a: (swiglu_ref(t[0], t[1]),)


def _grouped_choice(logits: torch.Tensor, bias: torch.Tensor, a) -> tuple[torch.Tensor, ...]:
    """DeepSeek-V3 grouped routing up to the expert choice: (scores, group scores, the choice values of the experts
    in the kept groups, -inf elsewhere)."""
    E, G = logits.shape[-1], a["n_group"]
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=a["topk_group"], dim=-1)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
    return scores, group_scores, choice.masked_fill(~score_mask.bool(), float("-inf"))


def moe_select_ref(logits, bias, a) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 grouped sigmoid routing, as transformers' BeamTopKRouter (fp32 throughout)."""
    scores, _, choice = _grouped_choice(logits, bias, a)
    idx = torch.topk(choice, k=a["top_k"], dim=-1)[1]
    w = scores.gather(1, idx)
    if a["renormalize"]:
        w = w / (w.sum(dim=-1, keepdim=True) + a["eps"])
    return w, idx


REFS["moe_select"] = lambda t, a: moe_select_ref(t[0], t[1], a)


def moe_select_margin(logits: torch.Tensor, bias: torch.Tensor, a) -> torch.Tensor:
    """Per token, how far moe_select_ref's choice is from a tie: the smaller of the gap between the last kept group
    and the next (group scores) and between the last chosen expert and the next one of the kept groups (choice
    values); inf where nothing is left to choose from. A kernel whose fp32 router logits differ in the last bits
    (another summation order) may route differently only where this is ~1e-7: tests judge exact agreement only on
    sequences whose every token routes decisively."""
    _, group_scores, choice = _grouped_choice(logits.float(), bias, a)
    k, top_k = a["topk_group"], a["top_k"]
    inf = torch.full_like(group_scores[:, 0], float("inf"))
    ranked = group_scores.sort(dim=-1, descending=True)[0]
    group_gap = ranked[:, k - 1] - ranked[:, k] if k < ranked.shape[-1] else inf
    ranked = choice.sort(dim=-1, descending=True)[0]
    expert_gap = ranked[:, top_k - 1] - ranked[:, top_k] if top_k < ranked.shape[-1] else inf
    return torch.minimum(group_gap, expert_gap)


def expert_weights(params: list[torch.Tensor], fmt: str, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Expert e's (gate_up [2I, H], down [H, I]) in `dtype`. NVFP4: code x block scale x global scale in fp32
    (exact), rounded once, each row block (gate, up; down) with its own global scale."""
    if fmt == "dense":
        return params[0][e], params[1][e]
    out = []
    for codes, block, glob in (params[:3], params[3:]):
        rows = codes.shape[1]
        g = glob[e].float().repeat_interleave(rows // glob.shape[1])[:, None]  # [rows, 1]
        out.append(nvfp4.dequantize(codes[e], block[e], g, dtype))
    return tuple(out)


def moe_experts_ref(x, idx, *params, fmt: str = "dense") -> torch.Tensor:
    """Each token's top-k experts' SwiGLU FFN outputs [T, k, H], unweighted; rows batched per expert in
    transformers' order so every GEMM sees the same operands."""
    T, k = idx.shape
    H = x.shape[-1]
    out = torch.empty(T, k, H, dtype=x.dtype, device=x.device)
    for e in torch.unique(idx).tolist():
        w_gu, w_down = expert_weights(list(params), fmt, e, x.dtype)
        kpos, tok = torch.where((idx == e).T)
        gate, up = linear(x[tok], w_gu).chunk(2, dim=-1)
        out[tok, kpos] = linear(swiglu_ref(gate, up), w_down)
    return out


def _moe_experts(t, a):
    """moe_experts; with `combine` (inputs ..., w last) the rank's combine and routed scale, as `boundary` does them."""
    if not a.get("combine"):
        return (moe_experts_ref(*t, fmt=a["format"]),)
    *ins, w = t
    sub = moe_combine_ref(moe_experts_ref(*ins, fmt=a["format"]), w, ins[1])
    return (sub * a["routed_scale"] if a.get("routed_scale") is not None else sub,)


REFS["moe_experts"] = _moe_experts


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


REFS["moe_combine"] = lambda t, a: (moe_combine_ref(*t),)


# ---------------------------------------------------------------- head
def softcap_ref(x, cap: float) -> torch.Tensor:
    return torch.tanh(x.float() / cap) * cap


REFS["softcap"] = lambda t, a: (softcap_ref(t[0], a["cap"]),)
REFS["gather_rows"] = lambda t, a: (t[0][t[1]],)


# ---------------------------------------------------------------- collectives (over simulated ranks)
def run_collective(op: str, per_rank: list[torch.Tensor], attrs: dict[str, Any]) -> list[torch.Tensor]:
    """Reference collectives for simulated ranks: a sum in rank order, or a concatenation (cut to `valid`)."""
    if op == "all_reduce":
        total = per_rank[0].clone()
        for t in per_rank[1:]:
            total = total + t
        return [total] * len(per_rank)
    if op == "all_gather":
        cat = torch.cat(per_rank, dim=attrs["dim"])
        if attrs.get("valid"):
            cat = cat.narrow(attrs["dim"], 0, attrs["valid"])
        return [cat] * len(per_rank)
    raise KeyError(op)


for _op in ("all_reduce", "all_gather"):
    RANK_REFS[_op] = (lambda op: lambda ins, attrs: [(t,) for t in run_collective(op, [x[0] for x in ins], attrs)])(_op)


def _single(ranks_fn):
    """The one-rank reference of an op defined over ranks."""
    return lambda ins, attrs: ranks_fn([ins], attrs)[0]


# ---------------------------------------------------------------- fused ops (passes 1 and 3: sublayer boundary)
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
    off = a["w_offset"]
    outs = []
    for sub, ins in zip(subs, ins_per_rank):
        res, w_post, w_next = ins[-3:]
        h = rmsnorm_ref(sub, w_post, a["eps"], off) * a["s_sub"] + res * a["s_res"]
        outs.append((h, rmsnorm_ref(h, w_next, a["eps_next"], off)))
    return outs


RANK_REFS["boundary"] = boundary_ranks
REFS["boundary"] = _single(boundary_ranks)


def embed_norm_ref(ids, table, w, a):
    h = F.embedding(ids, table)
    return h, rmsnorm_ref(h, w, a["eps"], a["w_offset"])


REFS["embed_norm"] = lambda t, a: embed_norm_ref(*t, a)


# ---------------------------------------------------------------- fused attention pieces (passes 2 and 6)
def qk_norm_pos_ref(q, k, wq, wk, pos, a):
    """per-head RMSNorm of q and k, then RoPE on both (sliding) or the SSMax q-scale (NoPE)."""
    off = a["w_offset"]
    q, k = rmsnorm_ref(q, wq, a["eps"], off), rmsnorm_ref(k, wk, a["eps"], off)
    if a["mode"] == "rope":
        q, k = rope_ref(q, pos, a["theta"]), rope_ref(k, pos, a["theta"])
    elif a["mode"] == "ssmax":
        q = q_scale_ref(q, pos, a)
    return q, k


REFS["qk_norm_pos"] = lambda t, a: qk_norm_pos_ref(*t, a)


def qk_norm_pos_kv_ref(q, k, v, wq, wk, kc, vc, slot, pos, *extras, a):
    q, k = qk_norm_pos_ref(q, k, wq, wk, pos, a)
    kc, vc = kv_write_ref(kc, vc, k, v, slot, pos, *extras, window=a.get("window"), paged=a.get("paged", False))
    return q, kc, vc


REFS["qk_norm_pos_kv"] = lambda t, a: qk_norm_pos_kv_ref(*t, a=a)
REFS["sigmoid_gate"] = lambda t, a: (t[0] * torch.sigmoid(t[1] + t[2]),)
# attention then the gate, each exactly as its own op computes it (the attention_gate pass's fusion is bitwise)
REFS["attention_gate"] = lambda t, a: (REFS["sigmoid_gate"]([REFS["attention"](t[:-2], a)[0], t[-2], t[-1]], a)[0],)


def qk_attention_ref(t, a):
    """The qk_attention pass's op: qk_norm_pos_kv, then attention (gate: attention_gate) over the written caches,
    each exactly as its own op computes it (the fusion is bitwise)."""
    qk_ins, rest = qk_attention_parts(t, a.get("gate", False))
    q, kc, vc = qk_norm_pos_kv_ref(*qk_ins, a=a)
    return REFS["attention_gate" if a.get("gate") else "attention"]([q, kc, vc, *rest], a)[0], kc, vc


REFS["qk_attention"] = qk_attention_ref


# ---------------------------------------------------------------- fused GEMMs (passes 4, 5, 7, fold)
def linear_packed_ref(x, w, a):
    """One GEMM over a load-time packed weight; by reference, one product per part (same bits as unpacked)."""
    outs, lo = [], 0
    for n in a["splits"]:
        outs.append(linear(x, w[lo:lo + n]))
        lo += n
    return tuple(outs)


REFS["linear_packed"] = lambda t, a: linear_packed_ref(*t, a)
REFS["moe_router"] = lambda t, a: moe_select_ref(linear(t[0].float(), t[1].float()), t[2], a)
REFS["gate_up_swiglu"] = lambda t, a: (swiglu_ref(linear(t[0], t[1]), linear(t[0], t[2])),)
REFS["linear_softcap"] = lambda t, a: (softcap_ref(linear(t[0], t[1]), a["cap"]),)

_missing = [n for n, d in OPS.items() if not d.leaf and n not in REFS and n not in RANK_REFS]
assert not _missing, f"ops without a reference: {_missing}"
