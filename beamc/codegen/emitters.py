"""The emitters: for each IR op, the launches that compute it, with the constants each template is specialised with.

A launch's `args` name the buffers it reads and writes, in the kernel's (or library function's) argument order:
IR values by name, and `scratch:<name>` buffers that live only inside the step (declared with shape and dtype).
Library calls name a function of `beamc.runtime.library` and say which issue replaces them with a kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from beamc.codegen.kernel import KernelSpec
from beamc.codegen.registry import Context, emits
from beamc.ir.graph import Graph, Node, Value
from beamc.ir.ops import OPS


@dataclass(frozen=True)
class Launch:
    args: tuple[str, ...]  # buffer names: IR value names, or "scratch:<role>" (step-local and consumed by the next
    # launch, so one buffer per role serves every layer)
    kernel: KernelSpec | None = None
    library: str | None = None  # a function of beamc.runtime.library
    pending: str = ""  # why this is a library call, and which issue brings its kernel
    scratch: tuple[tuple[str, tuple, str], ...] = ()  # (name, shape, IR dtype) of scratch buffers it declares
    kwargs: tuple[tuple[str, Any], ...] = ()  # library calls: the op's attributes they need


def names(vals: list[Value]) -> tuple[str, ...]:
    return tuple(v.name for v in vals)


def io(node: Node) -> tuple[str, ...]:
    """The op's inputs in IR order, then its outputs (state outputs excluded: they are the state inputs, written
    in place)."""
    written = {o for _, o in OPS[node.op].state_io}
    return names(node.inputs) + names([v for i, v in enumerate(node.outputs) if i not in written])


def last_dim(v: Value) -> int:
    return v.shape[-1]


def kernel(node: Node, template: str, ctx: Context, args: tuple[str, ...] | None = None, **constants) -> Launch:
    """A generated kernel's launch. PDL (Programmatic Dependent Launch: griddepcontrol in the kernel, launch_pdl at the
    launch) when the package asks for it (`--pdl`), never in the fp32 instances, which run in the CPU interpreter."""
    pdl = ctx.pdl and ctx.dtype != "f32"
    return Launch(args if args is not None else io(node), KernelSpec(template, node.op, {"DTYPE": ctx.dtype,
                                                                                         "PDL": pdl, **constants}))


def library(node: Node, fn: str, pending: str, args: tuple[str, ...] | None = None, **kw) -> Launch:
    return Launch(args if args is not None else io(node), library=fn, pending=pending, **kw)


GEMM_ISSUE = "cuBLAS through torch until the GEMM/MoE kernels (issue 8)"


# ---------------------------------------------------------------- kernels of this stage
def _reduced_first(node: Node, g: Graph, ctx: Context, sub: Value) -> tuple[list[Launch], str]:
    """At tp > 1 a boundary with `allreduce` reads the ranks' sum: the collective (NCCL, a library call until the
    fused all-reduce issue) writes it into a scratch buffer first. Returns (launches, the buffer the kernel reads)."""
    if not node.attrs["allreduce"] or g.meta.get("tp", 1) == 1:
        return [], sub.name
    s = "scratch:allreduce_sum"
    return [library(node, "all_reduce", "NCCL through torch.distributed (the fused all-reduce is a later issue)",
                    args=(sub.name, s), scratch=((s, tuple(sub.shape), sub.dtype),))], s


@emits("boundary")
def _boundary(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    a = node.attrs
    H = last_dim(node.outputs[0])
    res, w_post, w_next = node.inputs[-3:]
    norm = dict(H=H, EPS=a["eps"], EPS_NEXT=a["eps_next"], W_OFFSET=a["w_offset"], S_SUB=a["s_sub"],
                S_RES=a["s_res"], W_DTYPE=w_post.dtype)
    tail = names([res, w_post, w_next]) + names(node.outputs)
    if not a["combine"]:
        pre, sub = _reduced_first(node, g, ctx, node.inputs[0])
        return pre + [kernel(node, "rmsnorm_boundary", ctx, args=(sub,) + tail, COMBINE=False, TOP_K=0,
                             ROUTED_SCALE=a["routed_scale"], **norm)]
    y = node.inputs[0]
    if not a["allreduce"] or g.meta.get("tp", 1) == 1:  # combine, x routed_scale, norms: one kernel
        return [kernel(node, "rmsnorm_boundary", ctx, COMBINE=True, TOP_K=y.shape[1],
                       ROUTED_SCALE=a["routed_scale"], **norm)]
    # tp > 1: each rank combines its partial expert outputs, the ranks' sums are all-reduced, then the norms
    part = Value("combined", (y.shape[0], H), y.dtype)
    s = "scratch:moe_combined"
    combine = library(node, "moe_combine_scale", "the reference combine through torch until the boundary kernel "
                      "does the all-reduce in-kernel (a later issue)", args=names(node.inputs[:3]) + (s,),
                      scratch=((s, tuple(part.shape), part.dtype),), kwargs=(("scale", a["routed_scale"]),))
    t = "scratch:allreduce_sum"
    reduce = library(node, "all_reduce", "NCCL through torch.distributed (the fused all-reduce is a later issue)",
                     args=(s, t), scratch=((t, tuple(part.shape), part.dtype),))
    return [combine, reduce, kernel(node, "rmsnorm_boundary", ctx, args=(t,) + tail, COMBINE=False, TOP_K=0,
                                    ROUTED_SCALE=None, **norm)]


@emits("embed_norm")
def _embed_norm(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    a = node.attrs
    return [kernel(node, "embed_norm", ctx, H=last_dim(node.outputs[0]), EPS=a["eps"], W_OFFSET=a["w_offset"],
                   W_DTYPE=node.inputs[2].dtype)]


@emits("sigmoid_gate")
def _sigmoid_gate(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    o = node.inputs[0]
    return [kernel(node, "sigmoid_gate", ctx, HEADS=o.shape[1], HEAD_DIM=o.shape[2])]


@emits("qk_norm_pos_kv")
def _qk_norm_pos_kv(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    a = node.attrs
    q, k, v, wq, wk, kc = node.inputs[:6]
    return [kernel(node, "qk_norm_pos_kv", ctx, HQ=q.shape[1], HKV=k.shape[1], HEAD_DIM=q.shape[2], EPS=a["eps"],
                   NORM_OFFSET=a["w_offset"], MODE=a["mode"], THETA=a.get("theta", 0.0),
                   LENGTH=a.get("length", 1.0), POS_OFFSET=a.get("offset", 0.0), EXPONENT=a.get("exponent", 0.0),
                   CACHE_DTYPE=kc.dtype, PAGED=bool(a.get("paged")), PAGE_SIZE=kc.shape[1] if a.get("paged") else 0)]


@emits("moe_router")
def _moe_router(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    """Decode steps take the small-M path (the weight read split over the whole GPU), prefill the tensor-core one."""
    a = node.attrs
    x, w = node.inputs[:2]
    path = "small" if g.meta["phase"] == "decode" else "large"
    return [kernel(node, "moe_router", ctx, H=last_dim(x), E=w.shape[0], N_GROUP=a["n_group"],
                   TOPK_GROUP=a["topk_group"], TOP_K=a["top_k"], RENORMALIZE=bool(a["renormalize"]), EPS=a["eps"],
                   PATH=path)]


# ---------------------------------------------------------------- GEMMs: library now, kernels in issue 8
@emits("linear")
def _linear(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    return [library(node, "linear", GEMM_ISSUE)]


@emits("linear_packed")
def _linear_packed(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    return [library(node, "linear_packed", GEMM_ISSUE)]


@emits("gate_up_swiglu")
def _gate_up_swiglu(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    """Two library GEMMs into scratch, then the generated SwiGLU kernel (the GEMM epilogue in issue 8)."""
    x, wg, wu = node.inputs
    out = node.out
    shape, dt = tuple(out.shape), out.dtype
    sg, su = "scratch:mlp_gate", "scratch:mlp_up"
    return [library(node, "linear2", GEMM_ISSUE, args=names([x, wg, wu]) + (sg, su),
                    scratch=((sg, shape, dt), (su, shape, dt))),
            kernel(node, "swiglu", ctx, args=(sg, su, out.name), F=shape[-1], PACKED=False)]


@emits("linear_softcap")
def _linear_softcap(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    """The lm_head GEMM (library) into a scratch, then the generated fp32 soft-cap kernel."""
    x, w = node.inputs
    out = node.out
    s = "scratch:lm_head_raw"
    return [library(node, "linear", GEMM_ISSUE, args=(x.name, w.name, s), scratch=((s, tuple(out.shape), x.dtype),)),
            kernel(node, "softcap", ctx, args=(s, out.name), V=out.shape[-1], CAP=node.attrs["cap"])]


@emits("moe_experts")
def _moe_experts(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    return [library(node, f"moe_experts_{node.attrs['format']}", "the reference loop over experts until the "
                    "NVFP4 MoE kernels (issue 8)")]


@emits("attention")
def _attention(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    return [library(node, "attention", "the reference attention until the attention kernels (issue 9)",
                    kwargs=(("window", node.attrs["window"]), ("scale", node.attrs["scale"]),
                            ("paged", bool(node.attrs.get("paged")))))]


@emits("all_reduce", "all_gather")
def _collective(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    return [library(node, node.op, "NCCL through torch.distributed (the fused all-reduce is a later issue)")]


@emits("gather_rows")
def _gather_rows(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    return [library(node, "gather_rows", "a row gather through torch (a few rows before lm_head; a fused gather is "
                    "for the runtime issue 10)")]


@emits("reshape")
def _view(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    return [library(node, "view", "free: a view of its input, no launch")]
