"""The Beam spec as typed data: every architectural and numerical fact of the model is a field here.

`models/beam.yaml` is parsed into `ModelSpec`. Nothing about Beam is hidden in code: lowering, the checkpoint
layout and the report read these fields only. Unknown keys are errors (`extra="forbid"`), and cross-field
consistency (heads divisible by kv heads, groups dividing experts, ...) is checked in `ModelSpec` validators so
that one message names the key path at fault.

Model dimensions (`REQUIRED`: vocabulary, hidden size, layers, heads, head dim, d_ff, experts, top-k, window) must
be written in a spec (`beamc.spec.load` checks their presence once everything else is valid; the defaults below
are Beam's and only document it). Every other default is transformers' `BeamConfig` default (or the constant its modeling
code hard-codes), documented at the field. A field with one allowed value documents a fact beamc relies on: any
other value is refused, never silently ignored.
"""
from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

AttnType = Literal["sliding_attention", "full_attention"]
MlpType = Literal["dense", "sparse"]
FloatDtype = Literal["bfloat16", "float16", "float32"]
Fp32 = Literal["float32"]  # a computation beamc (like transformers) does in fp32 and only in fp32


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, v, info):
        # YAML reads yes/no/true/false as booleans, and pydantic would quietly accept them as 1/0 in number fields.
        ann = cls.model_fields[info.field_name].annotation
        if isinstance(v, bool) and {int, float} & set(get_args(ann) or (ann,)):
            raise ValueError(f"expected a number, got {str(v).lower()}")
        return v


class LayerPattern(_Strict):
    """Per-layer types, either as a rule or as an explicit list (one entry per layer)."""

    full_every: PositiveInt | None = Field(None, description="layer i is full attention when (i+1) % full_every == 0")
    last_is_full: bool = True
    dense_first: int = Field(3, ge=0, description="the first dense_first layers have a dense SwiGLU MLP, the rest MoE")
    attention: list[AttnType] | None = Field(None, description="explicit per-layer attention types (overrides the rule)")
    mlp: list[MlpType] | None = Field(None, description="explicit per-layer MLP types (overrides dense_first)")


class RopeSpec(_Strict):
    style: Literal["neox"] = "neox"  # rotate-half over the full rotary dim
    theta: float = Field(10000.0, gt=0)
    rotary_dim: PositiveInt | None = Field(None, description="rotated dims; must equal head_dim (default)")
    table_dtype: Fp32 = "float32"  # cos/sin and the rotation are computed in fp32, rounded once


class QScaleSpec(_Strict):
    """Scalable-softmax (SSMax) q scale on NoPE layers: (1 + (pos + offset) / length) ** exponent."""

    length: float = Field(2048.0, gt=0)
    offset: float = 1.0
    exponent: float = 0.1
    dtype: Fp32 = "float32"


class SlidingSpec(_Strict):
    window: PositiveInt = 512
    # true: a token sees keys (pos - window, pos] (transformers' sliding_window); false: [pos - window, pos]
    window_includes_current: bool = True
    rope: RopeSpec = RopeSpec()


class FullSpec(_Strict):
    positional: Literal["none"] = "none"
    q_scale: QScaleSpec | None = QScaleSpec()


class NormSpec(_Strict):
    type: Literal["rmsnorm"] = "rmsnorm"
    eps: float = Field(1e-6, gt=0)
    weight_form: Literal["w", "1+w"] = "w"  # w * x_hat (Beam), or (1 + w) * x_hat computed in fp32 (Gemma)
    compute_dtype: Fp32 = "float32"

    @property
    def offset(self) -> float:
        """What the weight is offset by: 0 for `w`, 1 for `1+w`."""
        return 1.0 if self.weight_form == "1+w" else 0.0


class GateSpec(_Strict):
    activation: Literal["sigmoid"] = "sigmoid"
    width: Literal["full"] = "full"  # gate_proj: hidden -> heads * head_dim
    bias: Literal["per_head"] = "per_head"


class AttentionSpec(_Strict):
    num_heads: PositiveInt = 48
    num_kv_heads: PositiveInt = 8
    head_dim: PositiveInt = 128
    bias: bool = False
    softmax_scale: Literal["inv_sqrt_head_dim"] = "inv_sqrt_head_dim"
    softmax_dtype: Fp32 = "float32"
    qk_norm: NormSpec = NormSpec()
    output_gate: GateSpec = GateSpec()
    sliding: SlidingSpec = SlidingSpec()
    full: FullSpec = FullSpec()


class ResidualIndex(_Strict):
    """n = scale * (layer + 1) + extra; the sublayer output is scaled by 1/sqrt(n), the residual by sqrt((n-1)/n)."""

    scale: PositiveInt = 2
    extra: int = 0


class ResidualSpec(_Strict):
    type: Literal["depth_scaled"] = "depth_scaled"
    attn_n: ResidualIndex = ResidualIndex(scale=2, extra=0)
    mlp_n: ResidualIndex = ResidualIndex(scale=2, extra=1)
    round_operands: Literal[True] = True  # both scaled operands are rounded to the activation dtype before the add


class DenseMlpSpec(_Strict):
    d_ff: PositiveInt = 20480
    activation: Literal["silu"] = "silu"
    act_dtype: Fp32 = "float32"  # silu(gate) * up in fp32, one rounding


class MoeSpec(_Strict):
    num_experts: PositiveInt = 256
    d_ff: PositiveInt = 2560
    top_k: PositiveInt = 8
    n_group: PositiveInt = 8
    topk_group: PositiveInt = 4
    group_score: Literal["top2_sum"] = "top2_sum"
    score_func: Literal["sigmoid"] = "sigmoid"
    correction_bias: Literal["choice_only"] = "choice_only"
    renormalize: bool = True
    renorm_eps: float = Field(1e-20, ge=0)
    routed_scaling: float = Field(2.5, gt=0)
    scaling_point: Literal["after_aggregation"] = "after_aggregation"
    router_dtype: Literal["float32"] = "float32"
    activation: Literal["silu"] = "silu"
    act_dtype: Fp32 = "float32"
    shared_experts: Literal[0] = 0


class MlpSpec(_Strict):
    dense: DenseMlpSpec = DenseMlpSpec()
    moe: MoeSpec = MoeSpec()


class LogitsSpec(_Strict):
    softcap: float | None = Field(30.0, gt=0)
    softcap_dtype: Fp32 = "float32"
    tie_word_embeddings: bool = False


class Nvfp4Spec(_Strict):
    layout: Literal["modelopt"] = "modelopt"
    group_size: Literal[16] = 16
    scale_dtype: Literal["float8_e4m3fn"] = "float8_e4m3fn"
    global_scale_dtype: Literal["float32"] = "float32"
    nibble_order: Literal["even_low"] = "even_low"


class DtypeSpec(_Strict):
    activations: FloatDtype = "bfloat16"
    embeddings: FloatDtype = "bfloat16"
    attention_weights: FloatDtype = "bfloat16"
    dense_mlp_weights: FloatDtype = "bfloat16"
    norm_weights: FloatDtype = "bfloat16"
    lm_head: FloatDtype = "bfloat16"
    router: Literal["float32"] = "float32"
    experts: Literal["nvfp4", "bfloat16", "float16", "float32"] = "nvfp4"  # NVFP4 (ModelOpt) or unquantized
    kv_cache: Literal["bfloat16", "fp8"] = "bfloat16"


class ModelSpec(_Strict):
    name: str
    vocab_size: PositiveInt = 151936
    hidden_size: PositiveInt = 5120
    num_layers: PositiveInt = 52
    max_position_embeddings: PositiveInt = 8192
    initializer_range: float = Field(0.02, gt=0)
    layers: LayerPattern = LayerPattern(full_every=6)
    attention: AttentionSpec = AttentionSpec()
    norm: NormSpec = NormSpec()
    residual: ResidualSpec = ResidualSpec()
    mlp: MlpSpec = MlpSpec()
    logits: LogitsSpec = LogitsSpec()
    dtypes: DtypeSpec = DtypeSpec()
    nvfp4: Nvfp4Spec = Nvfp4Spec()

    @field_validator("name")
    @classmethod
    def _name_nonempty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must be a non-empty string")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "ModelSpec":
        a, moe, L = self.attention, self.mlp.moe, self.num_layers
        _require(not a.bias, "attention.bias",
                 "Beam's q/k/v/o projections have no bias and beamc has no bias tensors; set it to false")
        _require(a.num_heads % a.num_kv_heads == 0, "attention.num_heads",
                 f"num_heads ({a.num_heads}) must be a multiple of num_kv_heads ({a.num_kv_heads})")
        rd = a.sliding.rope.rotary_dim
        _require(a.head_dim % 2 == 0, "attention.head_dim", f"RoPE needs an even head_dim, got {a.head_dim}")
        _require(rd is None or rd == a.head_dim, "attention.sliding.rope.rotary_dim",
                 f"Beam rotates the full head dim ({a.head_dim}); partial rotary ({rd}) is not supported")
        _require(moe.num_experts % moe.n_group == 0, "mlp.moe.n_group",
                 f"n_group ({moe.n_group}) must divide num_experts ({moe.num_experts})")
        _require(moe.topk_group <= moe.n_group, "mlp.moe.topk_group",
                 f"topk_group ({moe.topk_group}) must be <= n_group ({moe.n_group})")
        per_group = moe.num_experts // moe.n_group
        _require(per_group >= 2, "mlp.moe.n_group",
                 f"each group needs >= 2 experts for the top2_sum group score, got {per_group}")
        _require(moe.top_k <= moe.topk_group * per_group, "mlp.moe.top_k",
                 f"top_k ({moe.top_k}) exceeds the experts in the chosen groups "
                 f"(topk_group {moe.topk_group} x {per_group} experts per group)")
        for sub in ("attn_n", "mlp_n"):  # n is >= 1 at every layer iff it is at layer 0: sqrt((n-1)/n) needs it
            idx = getattr(self.residual, sub)
            _require(idx.scale + idx.extra >= 1, f"residual.{sub}.extra",
                     f"n = scale * (layer + 1) + extra must be >= 1; at layer 0 it is {idx.scale + idx.extra}")
        if self.dtypes.experts == "nvfp4":
            g = self.nvfp4.group_size
            _require(self.hidden_size % g == 0 and moe.d_ff % g == 0, "mlp.moe.d_ff",
                     f"NVFP4 experts need hidden_size ({self.hidden_size}) and d_ff ({moe.d_ff}) divisible by {g}")
        lp = self.layers
        if lp.attention is not None:
            _require(len(lp.attention) == L, "layers.attention",
                     f"has {len(lp.attention)} entries, expected num_layers = {L}")
        else:
            _require(lp.full_every is not None, "layers.full_every",
                     "give either layers.full_every (a rule) or layers.attention (an explicit list)")
        if lp.mlp is not None:
            _require(len(lp.mlp) == L, "layers.mlp", f"has {len(lp.mlp)} entries, expected num_layers = {L}")
        else:
            _require(lp.dense_first <= L, "layers.dense_first", f"({lp.dense_first}) exceeds num_layers ({L})")
        if self.logits.tie_word_embeddings:
            _require(self.dtypes.lm_head == self.dtypes.embeddings, "dtypes.lm_head",
                     "tied embeddings need dtypes.lm_head == dtypes.embeddings")
        return self

    # ---- derived facts (read by lowering, the checkpoint layout and the report) ----
    @property
    def attention_types(self) -> list[str]:
        lp = self.layers
        if lp.attention is not None:
            return list(lp.attention)
        types = ["full_attention" if (i + 1) % lp.full_every == 0 else "sliding_attention" for i in range(self.num_layers)]
        if lp.last_is_full:
            types[-1] = "full_attention"
        return types

    @property
    def mlp_types(self) -> list[str]:
        lp = self.layers
        if lp.mlp is not None:
            return list(lp.mlp)
        return ["dense"] * lp.dense_first + ["sparse"] * (self.num_layers - lp.dense_first)

    @property
    def effective_window(self) -> int:
        """Keys a sliding-window token sees, itself included."""
        s = self.attention.sliding
        return s.window if s.window_includes_current else s.window + 1

    def residual_n(self, layer: int, sublayer: Literal["attn", "mlp"]) -> int:
        idx = self.residual.attn_n if sublayer == "attn" else self.residual.mlp_n
        return idx.scale * (layer + 1) + idx.extra


# Key paths a spec must write (model dimensions): never implied from Beam's values. Dense d_ff is needed only when
# some layer is dense (checked in `missing_dimensions`).
REQUIRED = (("vocab_size",), ("hidden_size",), ("num_layers",), ("attention", "num_heads"),
            ("attention", "num_kv_heads"), ("attention", "head_dim"), ("attention", "sliding", "window"),
            ("mlp", "dense", "d_ff"), ("mlp", "moe", "num_experts"), ("mlp", "moe", "d_ff"), ("mlp", "moe", "top_k"))


def missing_dimensions(data: dict, spec: "ModelSpec") -> list[tuple]:
    """The REQUIRED key paths that the raw spec data does not write."""
    out = []
    for path in REQUIRED:
        if path == ("mlp", "dense", "d_ff") and "dense" not in spec.mlp_types:
            continue
        if path[:2] == ("mlp", "moe") and "sparse" not in spec.mlp_types:
            continue
        node = data
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            out.append(path)
    return out


class SpecError(ValueError):
    """A consistency problem at a key path; `beamc.spec.load` turns it into one located message."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path, self.message = path, message


def _require(cond: bool, path: str, message: str) -> None:
    if not cond:
        raise SpecError(path, message)
