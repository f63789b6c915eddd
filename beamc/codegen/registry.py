"""Codegen's registry: IR op name -> emitter, beside the reference registry (`beamc.ir.reference.REFS`) keyed by the
same names. An emitter turns one IR node into its launches: generated kernels (a template specialised with the
node's constants) and, where this stage has no kernel yet, named library calls (cuBLAS through torch, NCCL through
torch.distributed) that the step file and the manifest say are library calls. An op with no emitter is a compile
error naming the op and the layer: never a silent fallback to the interpreter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from beamc.errors import BeamcError
from beamc.ir.graph import Graph, Node


@dataclass(frozen=True)
class Context:
    target: str  # "sm90" | "sm100"
    dtype: str  # activation IR dtype (bf16 for real packages; f32 for CPU test instances)
    pdl: bool = True  # Programmatic Dependent Launch in every bf16 kernel (verified on the H200: same bits, faster)
    moe_dequant: bool = True  # long prefills: the MoE gate_up weights dequantised once per step (`emitters`)
    moe_wgmma: bool = True  # sm90 prefills from emitters.MOE_WGMMA_MIN_TOKENS: the MoE GEMMs on wgmma (`emitters`)
    moe_combine_max_tokens: int | None = None  # up to this many tokens the MoE decode kernel's COMBINE render (a
    # moe_experts op with `combine`); None: `emitters.MOE_COMBINE_MAX_TOKENS`
    nvfp4_relayout: bool = True  # the runtime re-lays out NVFP4 experts at load (`Package.nvfp4_relayout`)
    moe_frag_max_tokens: int = 0  # steps of up to this many tokens run a moe_experts with `combine` as the
    # moe_nvfp4_frag kernel (Gluon; needs the relayout, sm90, bf16; 0, the default: off until it measures faster on
    # the H200: `emitters.MOE_FRAG_CHOICE`)
    attention_mirror_pages: int = 0  # > 0: full-attention prefill over fp8 caches through a bf16 mirror of this many
    # pages (attention_prefill's MIRROR; off by default until measured on the H200)
    prefill_attention_gate: bool = False  # prefill steps: True, the output gate in the attention kernel's epilogue
    # (an attention_gate op: attention_prefill's GATE render); False (the default, measured faster on the H200:
    # `package.PREFILL_ATTENTION_GATE_CHOICE`): the attention, then the sigmoid_gate kernel
    overrides_from: str = "--set"  # where the overrides came from, for their errors (a CLI flag, a manifest)
    template_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)  # `--set TEMPLATE.CONSTANT=VALUE`
    # (`codegen.overrides`): pinned in every kernel rendered from that template, over the emitter's constants


if TYPE_CHECKING:
    from beamc.codegen.emitters import Launch

Emitter = Callable[[Node, Graph, Context], "list[Launch]"]
EMITTERS: dict[str, Emitter] = {}


def emits(*ops: str):
    def deco(fn: Emitter) -> Emitter:
        for op in ops:
            EMITTERS[op] = fn
        return fn
    return deco


def launches(node: Node, g: Graph, ctx: Context) -> "list[Launch]":
    """The launches of one node, or one BeamcError naming the op and layer that nothing can compile."""
    if node.op not in EMITTERS:
        where = "embedding/head" if node.layer is None else f"layer {node.layer}"
        raise BeamcError(f"{g.name}: {where}, op {node.op}", "no kernel or library emitter for this op",
                         "run the fusion passes that produce the fused ops (--passes all), or add an emitter in "
                         "beamc/codegen/emitters.py")
    return EMITTERS[node.op](node, g, ctx)


import beamc.codegen.emitters  # noqa: E402,F401  (registers the emitters)
