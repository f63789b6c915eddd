"""The checkpoint's tensors, derived from the spec: HF names exactly as transformers saves `BeamForCausalLM`, their
shapes and dtypes, and how tensor parallelism splits each one (transformers' `base_model_tp_plan` for Beam).

Two name spaces:
- *file* tensors: what lies in the safetensors files (per-expert `mlp.experts.{e}.gate_proj.weight`, ..., and
  for NVFP4 experts the ModelOpt quartet weight / weight_scale / weight_scale_2 / input_scale);
- *graph* params: what the IR's `param` ops name. Equal to the file names, except
  - the experts, which the graph sees stacked over experts (see `expert_graph_params`): as transformers holds them
    in memory (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) for unquantized experts,
    and still in ModelOpt's NVFP4 storage format (packed codes and both scales) for NVFP4 experts, so that the IR
    says what the kernels read;
  - the fp8 KV cache's per-layer scales (`kv_scale_params`), optional in the files.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from beamc.errors import BeamcError
from beamc.spec.schema import ModelSpec

# How tensor parallelism cuts a tensor along `dim`:
# - "rep": replicated;
# - "split": into tp equal contiguous parts; with pad=True the size need not divide: each rank holds ceil(size/tp)
#   rows, the last ranks' rows past the end are zeros (the vocab-parallel lm_head, as serving stacks pad it);
# - "split_halves": the two halves of the dim (gate rows, then up rows of the stacked experts' gate_up) are each
#   split into tp parts; rank r holds part r of the first half followed by part r of the second (transformers'
#   "packed_colwise");
# - "kv": by kv head while tp <= kv heads, and replicated per group of ranks beyond.
ShardKind = Literal["rep", "split", "split_halves", "kv"]


@dataclass(frozen=True)
class Shard:
    kind: ShardKind = "rep"
    dim: int = 0
    pad: bool = False  # "split" only: zero-pad the last ranks when tp does not divide the size


REP = Shard()


@dataclass(frozen=True)
class RankSlice:
    """Where one rank's slice of a tensor comes from: along `dim`, the `pieces` of the full tensor ([start, stop)
    ranges) concatenated in order, then `pad` rows of zeros."""

    dim: int
    pieces: tuple[tuple[int, int], ...]
    pad: int = 0

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.pieces) + self.pad


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
        if spec.dtypes.experts != "nvfp4":
            out.append(TensorInfo(f"{p}.{proj}.weight", (n, k), spec.dtypes.experts, shard, "experts"))
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
                              Shard("split", 0, pad=True), "lm_head"))
    return out


def expert_graph_params(spec: ModelSpec, L: int) -> list[TensorInfo]:
    """The stacked expert params of MoE layer L, stacked over experts (dim 0), in the order the graph lists them.

    Unquantized: `P.gate_up_proj` [E, 2I, H] (gate rows, then up rows, as transformers' BeamExperts) and
    `P.down_proj` [E, H, I], P = model.layers.L.mlp.experts. NVFP4: the same two matrices left in storage format,
    each as weight (uint8, two E2M1 codes a byte) / weight_scale (e4m3, one per 16 values of a row) /
    weight_scale_2 (fp32 global scales, one per file tensor: [E, 2] = gate's and up's for gate_up, [E, 1] for down);
    `nvfp4.dequantize_stacked` gives their values. The input_scale of the files is not used (weight-only NVFP4).
    A rank holds its gate rows then its up rows of gate_up ("split_halves") and its columns of down.
    """
    H, E, I = spec.hidden_size, spec.mlp.moe.num_experts, spec.mlp.moe.d_ff
    p = f"{layer_prefix(L)}.mlp.experts"
    halves, cols = Shard("split_halves", 1), Shard("split", 2)
    if spec.dtypes.experts != "nvfp4":
        dt = spec.dtypes.experts
        return [TensorInfo(f"{p}.gate_up_proj", (E, 2 * I, H), dt, halves, "experts"),
                TensorInfo(f"{p}.down_proj", (E, H, I), dt, cols, "experts")]
    g = spec.nvfp4.group_size
    return [
        TensorInfo(f"{p}.gate_up_proj.weight", (E, 2 * I, H // 2), "uint8", halves, "experts"),
        TensorInfo(f"{p}.gate_up_proj.weight_scale", (E, 2 * I, H // g), "float8_e4m3fn", halves, "experts"),
        TensorInfo(f"{p}.gate_up_proj.weight_scale_2", (E, 2), "float32", REP, "experts"),
        TensorInfo(f"{p}.down_proj.weight", (E, H, I // 2), "uint8", cols, "experts"),
        TensorInfo(f"{p}.down_proj.weight_scale", (E, H, I // g), "float8_e4m3fn", cols, "experts"),
        TensorInfo(f"{p}.down_proj.weight_scale_2", (E, 1), "float32", REP, "experts"),
    ]


def graph_params(spec: ModelSpec) -> list[TensorInfo]:
    """Every param the graph of this spec names, with its full shape and shard rule: the file tensors except the
    experts, then per layer the stacked experts (MoE layers) and the KV cache scales (fp8 cache)."""
    out = file_tensors(spec, experts=False)
    for L, mlp in enumerate(spec.mlp_types):
        out += (expert_graph_params(spec, L) if mlp == "sparse" else []) + kv_scale_params(spec, L)
    return out


def kept_as_stored(spec: ModelSpec, info: TensorInfo) -> bool:
    """Whether a param keeps its stored dtype in the graph: the fp32 router (transformers keeps it in fp32 too), the
    fp32 KV scales and the NVFP4 experts (codes and scales: what the kernels read). Every other weight is a float
    tensor converted at load to the activations dtype, as transformers loads a checkpoint in its model dtype: the
    `dtypes.*` of weight groups say how the checkpoint stores them, `dtypes.activations` what the model computes in."""
    return info.group in ("router", "kv_scales") or (info.group == "experts" and spec.dtypes.experts == "nvfp4")


def kv_scale_params(spec: ModelSpec, L: int) -> list[TensorInfo]:
    """The fp8 KV cache's scales of layer L (fp32 scalars: stored = value / scale), none for a bf16 cache.

    Graph names are ModelOpt's (`model.layers.L.self_attn.k_scale` / `v_scale`); the files may hold them under
    either name of `kv_scale_file_names`, or not at all (the loader then gives 1.0)."""
    if spec.dtypes.kv_cache != "fp8":
        return []
    p = f"{layer_prefix(L)}.self_attn"
    return [TensorInfo(f"{p}.{w}_scale", (), "float32", REP, "kv_scales") for w in "kv"]


def kv_scale_file_names(L: int) -> dict[str, tuple[str, ...]]:
    """Graph name of each KV scale of layer L -> the file names it may have, preferred first: ModelOpt's, then the
    one some exports use on the projection (`self_attn.k_proj.k_scale`). Whatever the spec's KV cache dtype, these
    names are expected in a checkpoint, never unexpected."""
    p = f"{layer_prefix(L)}.self_attn"
    return {f"{p}.{w}_scale": (f"{p}.{w}_scale", f"{p}.{w}_proj.{w}_scale") for w in "kv"}


def check_tp(spec: ModelSpec, tp: int, rank: int = 0) -> None:
    """Raise one BeamcError naming the first dimension that `--tp tp` cannot split evenly."""
    a, m = spec.attention, spec.mlp.moe
    if tp < 1:
        raise BeamcError("--tp", f"must be >= 1, got {tp}")
    if not 0 <= rank < tp:
        raise BeamcError("--rank", f"must be in [0, {tp}), got {rank}")
    checks = [  # vocab_size need not divide: the lm_head split is padded (Shard pad=True)
        ("attention.num_heads", a.num_heads),
    ]
    has_moe = "sparse" in spec.mlp_types  # (a spec of dense layers only holds no experts to shard)
    if has_moe:
        checks.append(("mlp.moe.d_ff", m.d_ff))
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
    if has_moe and spec.dtypes.experts == "nvfp4" and (m.d_ff // tp) % spec.nvfp4.group_size:
        raise BeamcError("--tp", f"each rank's expert d_ff ({m.d_ff}/{tp}) must be a multiple of the NVFP4 "
                                 f"group size {spec.nvfp4.group_size}")


def shard_range(spec: ModelSpec, info: TensorInfo, tp: int, rank: int) -> RankSlice | None:
    """Where this rank's slice of a tensor comes from, or None when the rank holds all of it.

    Packed storage (NVFP4 codes, two a byte; one scale per 16 values) splits proportionally: its shape is already
    the stored one, and check_tp makes each rank's share a whole number of bytes and scale groups."""
    if info.shard.kind == "rep" or tp == 1:
        return None
    d, kind = info.shard.dim, info.shard.kind
    size = info.shape[d]
    if kind == "split" and info.shard.pad:
        step = -(-size // tp)  # ceil: the last ranks end past the tensor, in zeros
        start, stop = min(rank * step, size), min((rank + 1) * step, size)
        return RankSlice(d, ((start, stop),), step - (stop - start))
    if kind == "split_halves":
        half = size // 2
        step = half // tp
        return RankSlice(d, ((rank * step, (rank + 1) * step), (half + rank * step, half + (rank + 1) * step)))
    nkv = spec.attention.num_kv_heads
    if kind == "split" or tp <= nkv:
        step = size // tp
        return RankSlice(d, ((rank * step, (rank + 1) * step),))
    per_head = size // nkv
    head = rank * nkv // tp  # ranks sharing one kv head hold copies of it
    return RankSlice(d, ((head * per_head, (head + 1) * per_head),))


def rank_shape(spec: ModelSpec, info: TensorInfo, tp: int, rank: int) -> tuple[int, ...]:
    """The shape of this rank's slice of a tensor."""
    shape = list(info.shape)
    r = shard_range(spec, info, tp, rank)
    if r is not None:
        shape[r.dim] = r.size
    return tuple(shape)


@dataclass(frozen=True)
class RankDims:
    """One tensor-parallel rank's share of every split dimension.

    `vocab` is the rank's lm_head rows, ceil(vocab_size / tp) on every rank; `vocab_valid` of them are real, the
    rest zero padding (on the last ranks). After the all-gather of the tp * vocab logits, only the first
    `vocab_size` are the model's."""

    tp: int
    rank: int
    heads: int
    kv_heads: int
    dense_ff: int
    moe_ff: int
    vocab: int
    vocab_valid: int
    vocab_size: int


def rank_dims(spec: ModelSpec, tp: int, rank: int = 0) -> RankDims:
    check_tp(spec, tp, rank)
    a, V = spec.attention, spec.vocab_size
    vocab = -(-V // tp)
    return RankDims(tp, rank, a.num_heads // tp, max(1, a.num_kv_heads // tp), spec.mlp.dense.d_ff // tp,
                    spec.mlp.moe.d_ff // tp, vocab, max(0, min(vocab, V - rank * vocab)), V)
