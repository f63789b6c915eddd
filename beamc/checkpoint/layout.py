"""The checkpoint's tensors, derived from the spec: HF names exactly as transformers saves `BeamForCausalLM`, their
shapes and dtypes, and how tensor parallelism splits each one (transformers' `base_model_tp_plan` for Beam).

Two name spaces:
- *file* tensors: what lies in the safetensors files (per-expert `mlp.experts.{e}.gate_proj.weight`, ..., and
  for NVFP4 experts the ModelOpt quartet weight / weight_scale / weight_scale_2 / input_scale);
- *graph* params: what the IR's `param` ops name. Equal to the file names, except the experts, which the graph sees
  stacked as transformers holds them in memory: `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from beamc.errors import BeamcError
from beamc.spec.schema import ModelSpec

# How tensor parallelism cuts a tensor: replicated, split into tp equal contiguous parts along `dim`,
# or (kv projections) split by kv head while tp <= kv heads and replicated per group of ranks beyond.
ShardKind = Literal["rep", "split", "kv"]


@dataclass(frozen=True)
class Shard:
    kind: ShardKind = "rep"
    dim: int = 0


REP = Shard()


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name: bfloat16, float32, uint8, float8_e4m3fn
    shard: Shard = REP
    group: str = ""  # embeddings | attention | norms | dense_mlp | router | experts | lm_head


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}"


def _attn_tensors(spec: ModelSpec, L: int) -> list[TensorInfo]:
    a, H, dt = spec.attention, spec.hidden_size, spec.dtypes.attention_weights
    p = f"{layer_prefix(L)}.self_attn"
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    nd = spec.dtypes.norm_weights
    return [
        TensorInfo(f"{p}.q_proj.weight", (q, H), dt, Shard("split", 0), "attention"),
        TensorInfo(f"{p}.k_proj.weight", (kv, H), dt, Shard("kv", 0), "attention"),
        TensorInfo(f"{p}.v_proj.weight", (kv, H), dt, Shard("kv", 0), "attention"),
        TensorInfo(f"{p}.o_proj.weight", (H, q), dt, Shard("split", 1), "attention"),
        TensorInfo(f"{p}.gate_proj.weight", (q, H), dt, Shard("split", 0), "attention"),
        TensorInfo(f"{p}.gate_bias", (a.num_heads,), dt, Shard("split", 0), "attention"),
        TensorInfo(f"{p}.q_norm.weight", (a.head_dim,), nd, REP, "norms"),
        TensorInfo(f"{p}.k_norm.weight", (a.head_dim,), nd, REP, "norms"),
    ]


def _norm_tensors(spec: ModelSpec, L: int) -> list[TensorInfo]:
    names = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
    return [TensorInfo(f"{layer_prefix(L)}.{n}.weight", (spec.hidden_size,), spec.dtypes.norm_weights, REP, "norms")
            for n in names]


def _dense_tensors(spec: ModelSpec, L: int) -> list[TensorInfo]:
    H, F, dt = spec.hidden_size, spec.mlp.dense.d_ff, spec.dtypes.dense_mlp_weights
    p = f"{layer_prefix(L)}.mlp"
    return [
        TensorInfo(f"{p}.gate_proj.weight", (F, H), dt, Shard("split", 0), "dense_mlp"),
        TensorInfo(f"{p}.up_proj.weight", (F, H), dt, Shard("split", 0), "dense_mlp"),
        TensorInfo(f"{p}.down_proj.weight", (H, F), dt, Shard("split", 1), "dense_mlp"),
    ]


def expert_file_tensors(spec: ModelSpec, L: int, e: int) -> list[TensorInfo]:
    """The file tensors of one expert: bf16 weights, or the ModelOpt NVFP4 quartet per projection."""
    H, I = spec.hidden_size, spec.mlp.moe.d_ff
    p = f"{layer_prefix(L)}.mlp.experts.{e}"
    projs = [("gate_proj", (I, H), 0), ("up_proj", (I, H), 0), ("down_proj", (H, I), 1)]
    out: list[TensorInfo] = []
    for proj, (n, k), dim in projs:
        shard = Shard("split", dim)
        if spec.dtypes.experts == "bfloat16":
            out.append(TensorInfo(f"{p}.{proj}.weight", (n, k), "bfloat16", shard, "experts"))
        else:
            g = spec.nvfp4.group_size
            out += [
                TensorInfo(f"{p}.{proj}.weight", (n, k // 2), "uint8", shard, "experts"),
                TensorInfo(f"{p}.{proj}.weight_scale", (n, k // g), "float8_e4m3fn", shard, "experts"),
                TensorInfo(f"{p}.{proj}.weight_scale_2", (), "float32", REP, "experts"),
                TensorInfo(f"{p}.{proj}.input_scale", (), "float32", REP, "experts"),
            ]
    return out


def _moe_tensors(spec: ModelSpec, L: int, experts: bool) -> list[TensorInfo]:
    m, H = spec.mlp.moe, spec.hidden_size
    p = f"{layer_prefix(L)}.mlp.gate"
    out = [
        TensorInfo(f"{p}.weight", (m.num_experts, H), "float32", REP, "router"),
        TensorInfo(f"{p}.e_score_correction_bias", (m.num_experts,), "float32", REP, "router"),
    ]
    for e in range(m.num_experts if experts else 0):
        out += expert_file_tensors(spec, L, e)
    return out


def file_tensors(spec: ModelSpec, experts: bool = True) -> list[TensorInfo]:
    """Every tensor a complete HF checkpoint of this spec holds, in a stable order (without the per-expert
    tensors when `experts` is False: the graph sees those stacked, see `expert_graph_params`)."""
    out = [TensorInfo("model.embed_tokens.weight", (spec.vocab_size, spec.hidden_size), spec.dtypes.embeddings,
                      REP, "embeddings")]
    for L, mlp in enumerate(spec.mlp_types):
        out += _attn_tensors(spec, L) + _norm_tensors(spec, L)
        out += _dense_tensors(spec, L) if mlp == "dense" else _moe_tensors(spec, L, experts)
    out.append(TensorInfo("model.norm.weight", (spec.hidden_size,), spec.dtypes.norm_weights, REP, "norms"))
    if not spec.logits.tie_word_embeddings:
        out.append(TensorInfo("lm_head.weight", (spec.vocab_size, spec.hidden_size), spec.dtypes.lm_head,
                              Shard("split", 0), "lm_head"))
    return out


def expert_graph_params(spec: ModelSpec, L: int) -> list[TensorInfo]:
    """The stacked expert params the graph uses (dequantised values when the file holds NVFP4)."""
    m, H = spec.mlp.moe, spec.hidden_size
    p = f"{layer_prefix(L)}.mlp.experts"
    return [
        TensorInfo(f"{p}.gate_up_proj", (m.num_experts, 2 * m.d_ff, H), spec.dtypes.experts, Shard("split", 1), "experts"),
        TensorInfo(f"{p}.down_proj", (m.num_experts, H, m.d_ff), spec.dtypes.experts, Shard("split", 2), "experts"),
    ]


def check_tp(spec: ModelSpec, tp: int, rank: int = 0) -> None:
    """Raise one BeamcError naming the first dimension that `--tp tp` cannot split evenly."""
    a, m = spec.attention, spec.mlp.moe
    if tp < 1:
        raise BeamcError("--tp", f"must be >= 1, got {tp}")
    if not 0 <= rank < tp:
        raise BeamcError("--rank", f"must be in [0, {tp}), got {rank}")
    checks = [
        ("attention.num_heads", a.num_heads),
        ("vocab_size", spec.vocab_size),
        ("mlp.moe.d_ff", m.d_ff),
    ]
    if "dense" in spec.mlp_types:
        checks.append(("mlp.dense.d_ff", spec.mlp.dense.d_ff))
    for path, n in checks:
        if n % tp:
            raise BeamcError("--tp", f"{tp} does not divide {path} = {n}", "choose a tp that divides it")
    if tp <= a.num_kv_heads:
        if a.num_kv_heads % tp:
            raise BeamcError("--tp", f"{tp} does not divide attention.num_kv_heads = {a.num_kv_heads}")
    elif tp % a.num_kv_heads:
        raise BeamcError("--tp", f"{tp} > num_kv_heads ({a.num_kv_heads}) must be a multiple of it "
                                 "so that kv heads replicate evenly")
    if spec.dtypes.experts == "nvfp4" and (m.d_ff // tp) % spec.nvfp4.group_size:
        raise BeamcError("--tp", f"each rank's expert d_ff ({m.d_ff}/{tp}) must be a multiple of the NVFP4 "
                                 f"group size {spec.nvfp4.group_size}")


def shard_range(spec: ModelSpec, info: TensorInfo, tp: int, rank: int, packed: int = 1) -> tuple[int, int, int] | None:
    """(dim, start, stop) of this rank's slice of a tensor, or None when the rank holds all of it.

    `packed` divides the logical size along the dim when the file stores several values per element (NVFP4 weight:
    shape already halved, so the split is simply proportional)."""
    if info.shard.kind == "rep" or tp == 1:
        return None
    d = info.shard.dim
    size = info.shape[d]
    if info.shard.kind == "split":
        step = size // tp
        return d, rank * step, (rank + 1) * step
    nkv = spec.attention.num_kv_heads
    per_head = size // nkv
    if tp <= nkv:
        step = size // tp
        return d, rank * step, (rank + 1) * step
    head = rank * nkv // tp  # ranks sharing one kv head hold copies of it
    return d, head * per_head, (head + 1) * per_head


def rank_shape(spec: ModelSpec, info: TensorInfo, tp: int, rank: int) -> tuple[int, ...]:
    """The shape of this rank's slice of a tensor."""
    shape = list(info.shape)
    r = shard_range(spec, info, tp, rank)
    if r is not None:
        shape[r[0]] = r[2] - r[1]
    return tuple(shape)


@dataclass(frozen=True)
class RankDims:
    """One tensor-parallel rank's share of every split dimension."""

    tp: int
    rank: int
    heads: int
    kv_heads: int
    dense_ff: int
    moe_ff: int
    vocab: int


def rank_dims(spec: ModelSpec, tp: int, rank: int = 0) -> RankDims:
    check_tp(spec, tp, rank)
    a = spec.attention
    return RankDims(tp, rank, a.num_heads // tp, max(1, a.num_kv_heads // tp), spec.mlp.dense.d_ff // tp,
                    spec.mlp.moe.d_ff // tp, spec.vocab_size // tp)
