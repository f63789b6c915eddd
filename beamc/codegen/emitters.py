"""The emitters: for each IR op, the launches that compute it, with the constants each template is specialised with.

A launch's `args` name the buffers it reads and writes, in the kernel's (or library function's) argument order:
IR values by name, and `scratch:<name>` buffers that live only inside the step (declared with shape and dtype).
Library calls name a function of `beamc.runtime.library` and say which issue replaces them with a kernel.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from beamc.codegen.kernel import KernelSpec
from beamc.codegen.overrides import pin
from beamc.codegen.registry import Context, emits
from beamc.ir.graph import Graph, Node, Value
from beamc.ir.ops import OPS, qk_attention_parts


@dataclass(frozen=True)
class Launch:
    args: tuple[str, ...]  # buffer names: IR value names, or "scratch:<role>" (step-local and consumed by the next
    # launch, so one buffer per role serves every layer)
    kernel: KernelSpec | None = None
    library: str | None = None  # a function of beamc.runtime.library
    pending: str = ""  # why this is a library call, and which issue brings its kernel
    scratch: tuple[tuple[str, tuple, str], ...] = ()  # (name, shape, IR dtype) of scratch buffers it declares
    kwargs: tuple[tuple[str, Any], ...] = ()  # library calls: the op's attributes they need
    min_tokens: int = 0  # the launch runs for steps of min_tokens <= T <= max_tokens tokens (T: the step's token
    max_tokens: int | None = None  # count, fixed per CUDA-graph bucket); None: no upper bound
    choice: dict[str, Any] | None = None  # why this token range (`codegen.choices`), for the manifest

    def runs_for(self, T: int) -> bool:
        return T >= self.min_tokens and (self.max_tokens is None or T <= self.max_tokens)

    def condition(self) -> str:
        """The step.py condition of a token-ranged launch ("" when it always runs)."""
        parts = ([f"T >= {self.min_tokens}"] if self.min_tokens else []) + (
            [f"T <= {self.max_tokens}"] if self.max_tokens is not None else [])
        return " and ".join(parts)


def names(vals: list[Value]) -> tuple[str, ...]:
    return tuple(v.name for v in vals)


def io(node: Node) -> tuple[str, ...]:
    """The op's inputs in IR order, then its outputs (state outputs excluded: they are the state inputs, written
    in place)."""
    written = {o for _, o in OPS[node.op].state_io}
    return names(node.inputs) + names([v for i, v in enumerate(node.outputs) if i not in written])


def named_params(node: Node, ln: Launch) -> list[Value]:
    """The node's param inputs that this launch names (a launch of the node that does not name one does not read it)."""
    return [v for v in node.inputs if v.producer is not None and v.producer.op == "param" and v.name in ln.args]


def last_dim(v: Value) -> int:
    return v.shape[-1]


def kernel(node: Node, template: str, ctx: Context, args: tuple[str, ...] | None = None, **constants) -> Launch:
    """A generated kernel's launch. PDL (Programmatic Dependent Launch: griddepcontrol in the kernel, launch_pdl at the
    launch) when the package asks for it (`--pdl`), never in the fp32 instances, which run in the CPU interpreter."""
    pdl = ctx.pdl and ctx.dtype != "f32"
    emitted = {"DTYPE": ctx.dtype, "PDL": pdl, **constants}
    pinned = ctx.template_overrides.get(template, {})  # `--set`: checked, then over the emitter's constants
    return Launch(args if args is not None else io(node), KernelSpec(template, node.op, pin(
        template, emitted, pinned, ctx.overrides_from)))


def by_token_count(low: Launch, high: Launch, n: int, choice: dict) -> list[Launch]:
    """`low` for steps of fewer than n tokens, `high` from n on (the step holds both, each under its token range; no
    `low` when n <= 1), both recording `choice`."""
    high = dataclasses.replace(high, min_tokens=max(high.min_tokens, n), choice=choice)
    return ([dataclasses.replace(low, max_tokens=n - 1, choice=choice)] if n > 1 else []) + [high]


def into_scratch(ln: Launch, s: str, v: Value) -> Launch:
    """The launch writing its (last-argument) output into the step-local buffer `s`, declared like value `v`."""
    return dataclasses.replace(ln, args=ln.args[:-1] + (s,), scratch=((s, tuple(v.shape), v.dtype),))


def from_scratch(ln: Launch, s: str) -> Launch:
    """The launch reading its first input from the step-local buffer `s` (a launch before it wrote there)."""
    return dataclasses.replace(ln, args=(s,) + ln.args[1:])


def library(node: Node, fn: str, pending: str, args: tuple[str, ...] | None = None, **kw) -> Launch:
    return Launch(args if args is not None else io(node), library=fn, pending=pending, **kw)


GEMM_ISSUE = "cuBLAS through torch until the GEMM/MoE kernels (issue 8)"


# ---------------------------------------------------------------- kernels of this stage
def _reduced_first(node: Node, g: Graph, ctx: Context, sub: Value) -> tuple[list[Launch], str]:
    """At tp > 1 a boundary with `allreduce` reads the ranks' sum: the collective (NCCL, a library call until the
    fused all-reduce issue) sums `sub` in place when this boundary is its only reader (no copy; and when one GPU runs
    one rank's share with the collectives skipped, nothing at all), else into a scratch buffer. Returns (launches,
    the buffer the kernel reads)."""
    if not node.attrs["allreduce"] or g.meta.get("tp", 1) == 1:
        return [], sub.name
    if _only_reader(g, sub, node):
        return [library(node, "all_reduce_", AR_PENDING, args=(sub.name,))], sub.name
    s = "scratch:allreduce_sum"
    return [library(node, "all_reduce", AR_PENDING, args=(sub.name, s), scratch=((s, tuple(sub.shape), sub.dtype),))], s


AR_PENDING = "NCCL through torch.distributed (the fused all-reduce is a later issue)"


def _only_reader(g: Graph, v: Value, node: Node) -> bool:
    """Whether `node` is the only op reading `v`, `v` is not a step output and not a view of another buffer (so it
    may be overwritten in place)."""
    made_by = v.producer
    return ([n is node for n in g.users().get(v, [])] == [True] and all(o is not v for o in g.outputs.values())
            and made_by is not None and not OPS[made_by.op].is_view and not OPS[made_by.op].leaf)


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
    combine = kernel(node, "moe_combine", ctx, args=names(node.inputs[:3]) + (s,), H=H, TOP_K=y.shape[1],
                     ROUTED_SCALE=a["routed_scale"])
    combine = dataclasses.replace(combine, scratch=((s, tuple(part.shape), part.dtype),))
    reduce = library(node, "all_reduce_", AR_PENDING, args=(s,))  # in place: the step's own scratch, read once
    return [combine, reduce, kernel(node, "rmsnorm_boundary", ctx, args=(s,) + tail, COMBINE=False, TOP_K=0,
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


# prefill steps (sm90): two tokens a program (the template's TOKENS: their loads issued before the first norm). H100
# (s40run1; bench/results/qk-norm-prefill-2026-12-06-s40run1.json: 16,384 tokens after 100K, graph us, the sliding /
# full layers' render): 98.7 / 85.5 -> 50.4 / 31.4 (4 tokens 65.7 / 37.0, 3 tokens 60.6 / 32.4 in s40run2); the
# prefill step 363.78 -> 361.14 ms (s40run2, logits bitwise; predicted -2.6). The template takes it only where a
# token's q and k heads fit one block. Pinned back with `--set qk_norm_pos_kv.TOKENS=1`
QK_NORM_PREFILL_TILES = dict(TOKENS=2)


@emits("qk_norm_pos_kv")
def _qk_norm_pos_kv(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    q, k, v, wq, wk, kc = node.inputs[:6]
    tiles = QK_NORM_PREFILL_TILES if g.meta["phase"] != "decode" and ctx.target == "sm90" else {}
    return [kernel(node, "qk_norm_pos_kv", ctx, HQ=q.shape[1], HKV=k.shape[1], HEAD_DIM=q.shape[2],
                   **_qk_constants(node.attrs), CACHE_DTYPE=kc.dtype, PAGED=bool(node.attrs.get("paged")),
                   PAGE_SIZE=kc.shape[1] if node.attrs.get("paged") else 0, **tiles)]


def _qk_constants(a: dict) -> dict:
    """The q/k norm and RoPE / SSMax constants of a qk_norm_pos_kv (or qk_attention) node's attributes."""
    return dict(EPS=a["eps"], NORM_OFFSET=a["w_offset"], MODE=a["mode"], THETA=a.get("theta", 0.0),
                LENGTH=a.get("length", 1.0), POS_OFFSET=a.get("offset", 0.0), EXPONENT=a.get("exponent", 0.0))


# the prefill router's selection (its large path, sm90): two tokens a one-warp program (the template's BLOCK_M; 63
# registers against 49). H100 s41run1 (bench/results/router-prefill-2026-12-06-s41run1.json, 16,384 tokens, both
# launches in a graph): 258.2 -> 255.9 us (4 tokens 255.1, 8 tokens 313.5), the ids equal; the GPU cases bitwise
# against one token a program. Predicted -0.9 ms a step: the selection's chain was not what set its time. Pinned back
# with `--set moe_router.BLOCK_M=1`
ROUTER_PREFILL_TILES = dict(BLOCK_M=2)


# decode steps of at least this many tokens take the router's large (tensor-core) path, as prefill does; None: the
# small-M path at every decode step. Why: each small-path program reads its block of W once per 8 tokens. Measured in
# the decode step on an H100 (32K contexts; the router's lines by op): batch 64 2,034 -> 1,208 us a step, batch 128
# 3,377 -> 1,266 (bench/results/decode-batch-2026-12-07-s50run1-cands.json against -s50run2-default.json); batch 16
# 1,167 (large) against 793 / 812 (small), the step 10.68 -> 9.72 / 10.00 ms; batch 32 even (15.22 large, 15.21
# small, 15.05 with this bound: decode-batch-2026-12-08-s52run1.json, -s52run3-router64, -s52run4-router32)
ROUTER_DECODE_LARGE_MIN_TOKENS: int | None = 32


@emits("moe_router")
def _moe_router(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    """Decode steps take the small-M path (the weight read split over the whole GPU), prefill the tensor-core one
    (and decode steps of ROUTER_DECODE_LARGE_MIN_TOKENS tokens or more, where that is set)."""
    a = node.attrs
    x, w = node.inputs[:2]

    def router(path: str) -> Launch:
        tiles = ROUTER_PREFILL_TILES if path == "large" and ctx.target == "sm90" else {}
        return kernel(node, "moe_router", ctx, H=last_dim(x), E=w.shape[0], N_GROUP=a["n_group"],
                      TOPK_GROUP=a["topk_group"], TOP_K=a["top_k"], RENORMALIZE=bool(a["renormalize"]), EPS=a["eps"],
                      PATH=path, **tiles)

    if g.meta["phase"] != "decode":
        return [router("large")]
    n = ROUTER_DECODE_LARGE_MIN_TOKENS
    if n is None:
        return [router("small")]
    choice = {"large_from_tokens": n, "basis": "ROUTER_DECODE_LARGE_MIN_TOKENS: measured in the decode step (H100, "
              "decode-batch-2026-12-07-s50run1-cands.json, -s50run2-default.json, 2026-12-08-s52run1, -s52run3-router64, "
              "-s52run4-router32)"}
    return by_token_count(router("small"), router("large"), n, choice)


# ---------------------------------------------------------------- GEMMs: the generated small-M kernel where measured
# faster than cuBLAS (`codegen.choices`), cuBLAS through torch otherwise; large-M GEMMs stay with cuBLAS
LIBRARY_GEMM = "cuBLAS through torch: measured faster than the generated kernel at this token count, or no " \
               "generated large-M GEMM yet (issue 8)"
GEMV_EPILOGUE = {"linear": "none", "linear_packed": "split", "gate_up_swiglu": "swiglu", "linear_softcap": "softcap"}
GEMV_MAX_TOKENS = 64  # the gemv template's small-M range
# GEMV_MIN_TOKENS (None: off): decode GEMMs run the gemv up to at least this many tokens whatever `codegen.choices`
# measured (a benchmark's setting: `bench/decode_batch.py --gemv-min-tokens`). Why: the choices come from each GEMM
# alone, where cuBLAS beat the gemv from 4 tokens on for o_proj (3.62 against 3.98 us, H200 s24run5); in the step
# the library call has no PDL overlap, and o_proj there took 267-328 us a step at 2-8 tokens against the gemv's 172
# at one (s48run4, H100). Measured in the step (H100, 32K contexts, s50run1 among other candidates against s50run2):
# the linear ops 310 / 338 / 369 us a step at 2 / 4 / 8 tokens with o_proj on the gemv against 297 / 301 / 304 with
# it on cuBLAS, the boundary after it 41-74 us faster: no clear gain, off
GEMV_MIN_TOKENS = None


def _small_m(node: Node, g: Graph, ctx: Context, library_launches: list[Launch]) -> list[Launch]:
    """Decode steps: the gemv kernel for T <= the chosen bound, the library launches above it; prefill: the library."""
    if g.meta["phase"] != "decode":
        return library_launches
    from beamc.codegen.choices import choose

    x = node.inputs[0]
    K = last_dim(x)
    N = node.out.shape[-1] if node.op != "linear_packed" else sum(node.attrs["splits"])
    c = choose(ctx.target, node.op, K, N, GEMV_MAX_TOKENS)
    if GEMV_MIN_TOKENS is not None and c.max_tokens < GEMV_MIN_TOKENS:
        c = dataclasses.replace(c, max_tokens=min(GEMV_MIN_TOKENS, GEMV_MAX_TOKENS),
                                basis="GEMV_MIN_TOKENS (a benchmark's setting)")
    if c.max_tokens < 1:
        return [dataclasses.replace(ln, choice=c.record()) for ln in library_launches]
    epi = GEMV_EPILOGUE[node.op]
    extra = {"SPLITS": list(node.attrs["splits"])} if epi == "split" else {}
    if epi == "softcap":
        extra["CAP"] = node.attrs["cap"]
    gemv = kernel(node, "gemv", ctx, EPILOGUE=epi, K=K, N=N, **extra)
    return [dataclasses.replace(gemv, max_tokens=c.max_tokens, choice=c.record())] + [
        dataclasses.replace(ln, min_tokens=c.max_tokens + 1, choice=c.record()) for ln in library_launches]


@emits("linear")
def _linear(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    return _small_m(node, g, ctx, [library(node, "linear", LIBRARY_GEMM)])


@emits("linear_packed")
def _linear_packed(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    return _small_m(node, g, ctx, [library(node, "linear_packed", LIBRARY_GEMM)])


@emits("gate_up_swiglu")
def _gate_up_swiglu(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    """Decode: gemv with the SwiGLU epilogue where chosen; else two library GEMMs into scratch, then the generated
    SwiGLU kernel."""
    x, wg, wu = node.inputs
    out = node.out
    shape, dt = tuple(out.shape), out.dtype
    sg, su = "scratch:mlp_gate", "scratch:mlp_up"
    return _small_m(node, g, ctx, [
        library(node, "linear2", LIBRARY_GEMM, args=names([x, wg, wu]) + (sg, su),
                scratch=((sg, shape, dt), (su, shape, dt))),
        kernel(node, "swiglu", ctx, args=(sg, su, out.name), F=shape[-1], PACKED=False)])


@emits("linear_softcap")
def _linear_softcap(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    """Decode: gemv with the soft-cap epilogue where chosen; else the lm_head GEMM (library) into a scratch, then the
    generated fp32 soft-cap kernel."""
    x, w = node.inputs
    out = node.out
    s = "scratch:lm_head_raw"
    return _small_m(node, g, ctx, [
        library(node, "linear", LIBRARY_GEMM, args=(x.name, w.name, s), scratch=((s, tuple(out.shape), x.dtype),)),
        kernel(node, "softcap", ctx, args=(s, out.name), V=out.shape[-1], CAP=node.attrs["cap"])])


MOE_DECODE_MAX_TOKENS = 128  # moe_nvfp4_decode's range; more tokens take the grouped (sorted-by-expert) kernel
# (measured in the decode step on an H100, s47run4: with the grouped kernel from 9 tokens on the MoE took 16.3 / 27.2 /
# 34.4 ms a step at batch 16 / 32 / 64 against moe_nvfp4_decode's 8.6 / 16.4 / 34.5 (the scanning render); with the
# planned render (PLAN, s48), 32K contexts, H100 s50run1-2: batch 128 36,052 us a step on the grouped kernel against
# 16,106 on this one, the step 48.8 -> 26.7 ms: 128)
# moe_nvfp4_decode's plain render (sm90, bf16) with both stages capped at this many registers (its MAXNREG): 4 programs
# an SM instead of 3. H100, s47run5 (the kernel alone): 16 tokens 189 -> 176 us, 64 tokens 692 -> 606. The COMBINE
# render (the steps of 1-MOE_COMBINE_MAX_TOKENS tokens at TP > 1) stays uncapped, as measured in its step
MOE_DECODE_MAXNREG = 128
# From this many tokens on (sm90), the grouped kernel's DEQUANT render: each expert's gate_up weights dequantised once
# per step into bf16 scratch, then that GEMM on plain bf16 tiles. H200, 2026-12-01 (bench/results/
# moe-prefill-2026-12-01-s7run2*.json, TP-8 shapes, re-laid-out weights, us, in-loop / DEQUANT): 2,048 tokens 1,246 /
# 1,664, 4,096 2,190 / 2,217, 8,192 3,821 / 3,329, 16,384 7,189 / 5,352 (the dequantisation costs ~560 us whatever the
# token count: every expert has rows)
# Re-measured after the stores were vectorised (s8run5: bench/results/moe-prefill-2026-12-01-s8run5*.json): 2,048
# 1,165 / 1,452, 4,096 2,026 / 1,855, 8,192 3,450 / 2,662, 16,384 6,446 / 4,386.
MOE_DEQUANT_MIN_TOKENS = 4096
# From this many tokens on, the DEQUANT_DOWN render: the down weights dequantised once per step as well (0.84 GB more
# scratch at TP 8), the down GEMM on bf16 tiles over whole row blocks: 16,384 tokens 3,942 us against 4,386 (s8run5;
# the one token count measured: below it the DEQUANT render)
MOE_DEQUANT_DOWN_MIN_TOKENS = 16384
# Up to this many tokens (the combine_experts pass), the decode kernel's COMBINE render: the top-k combine in its down
# GEMM's epilogue, one launch less. Measured on the H200 2026-12-01 (bench/results/moe-combine-2026-12-01-s10run5.json,
# re-laid-out weights, us per MoE layer in a CUDA graph of 8 layers, two launches / COMBINE, bits equal): T = 1 20.4 /
# 21.1, 2 30.0 / 29.8, 4 52.0 / 46.6, 8 96.9 / 87.3. In the whole decode step at T = 1 (full-model-2026-12-01-s11run1
# against -s11run1-combine1, the experts re-laid out): 2.918 ms with two launches, 2.971 with COMBINE. Measured again
# after the late PDL triggers of the MoE experts and the decode attention (2026-12-02, bench/results/
# variants-2026-12-02-s16run2.json, variants in one run, logits bitwise): 2.597 / 2.586 ms with two launches, 2.522
# with COMBINE at T = 1 (-2.7%). At 2-8 tokens in the step (H100, 32K contexts, decode-batch-2026-12-07-s50run1-cands
# against -s50run2-default, us a step, the experts + moe_combine against COMBINE; the plain render planned from 9
# pairs): 2 tokens 1,668 / 1,578, 4 2,490 / 2,525, 8 4,250 / 4,510: COMBINE to 4 tokens, the planned plain render and
# moe_combine from 5 (moe_nvfp4_decode's PLAN_MIN_PAIRS 32). The pass moves the combine into the op either way; above
# the limit the emitter runs the two launches as before it.
MOE_COMBINE_MAX_TOKENS = 4
MOE_COMBINE_CHOICE = {"combine_in_experts_up_to_tokens": MOE_COMBINE_MAX_TOKENS, "basis": "measured",
                      "figures": [{"tokens": t, "two_launches_us": a, "combine_us": b}
                                  for t, a, b in ((1, 20.38, 21.07), (2, 29.99, 29.79), (4, 51.97, 46.64),
                                                  (8, 96.94, 87.31))],
                      "in_step": {"tokens": 1, "two_launches_ms": 2.5915, "combine_ms": 2.522},
                      "in_batch_step_us": [{"tokens": t, "planned_two_launches_us": a, "combine_us": b}
                                           for t, a, b in ((2, 1668, 1578), (4, 2490, 2525), (8, 4250, 4510))],
                      "source": "bench/results/moe-combine-2026-12-01-s10run5.json, "
                                "variants-2026-12-02-s16run2.json (in the step; 2026-12-01 s11run1: 2.918 / 2.971 "
                                "before the late PDL triggers); decode-batch-2026-12-07-s50run1-cands.json against "
                                "-s50run2-default.json (H100, 32K contexts, us a step)"}
# sm90, bf16, the relayout on (`Context.moe_wgmma`): from MOE_WGMMA_MIN_TOKENS on, moe_nvfp4_prefill's WGMMA render
# (its GEMMs warp-specialised on wgmma, the NVFP4 words copied by cp.async and decoded in the main loop by a load
# partition; no dequantisation scratch) instead of the in-loop and DEQUANT renders; from MOE_WGMMA_BM256_MIN_TOKENS on
# in its form of 256-row blocks. H200, TP-8 shapes, re-laid-out weights, us per MoE layer, each row one run:
#   2,048 tokens (s29run3, WG_V16): in-loop 1,064 (the render there before), DEQUANT 1,433, 128-row form 973
#     (994 without WG_V16), 256-row 1,547;
#   4,096 tokens (s28run2): in-loop 1,874, DEQUANT 1,836, 128-row 1,476, 256-row 1,616;
#   8,192 tokens (s29run3, WG_V16): DEQUANT_DOWN 2,566, 128-row 2,339 (2,351), 256-row 2,303 (2,336);
#   16,384 tokens (s28run2): DEQUANT 4,444, DEQUANT_DOWN 3,933, 128-row 4,256, 256-row 3,760.
# Below 2,048 tokens not measured (the in-loop render stays). WG_V16 (stage 4's words in 16-byte copies where the
# relayout's chunks are one K step: Beam's I = 320 at TP 8; the render ignores it elsewhere) saves 3-6% of stage 4.
# WG_HALF (an expert's last block's MMAs and stores on 64 / 128 rows where its real rows fit; bitwise the same
# outputs) in both forms, s31run1-2: 16,384 tokens, 256-row 3,724 -> 3,590 us, 128-row 4,185 -> 4,118; 2,048 tokens,
# 128-row 974 -> 910; the prefill step 405.36 -> 396.90 ms (logits bitwise equal).
# The 256-row form's stage 3 load partition on 8 warps (stage 4's on 4), s32run1 / s32run7 (H100): 16,384 tokens
# 3,564 -> 3,338 us, 8,192 2,087 -> 1,952; the prefill step 412.05 -> 403.87 ms. WG_AQ (the A rows copied only as far
# as WG_HALF's MMAs read them; bitwise the same outputs) in the 128-row form, s32run9-10 (H200): 2,048 tokens 912 ->
# 892 and 906 -> 891 us, 4,096 1,372 -> 1,340; in the 256-row form neutral at 16,384 (3,354 -> 3,398, 3,395 -> 3,391).
# WG_WTMA (stage 3's words and scale bytes by TMA boxes instead of the load partition's cp.async; bitwise the same
# outputs) in the 256-row form, s34run1-2 (H100): 16,384 tokens 3,380 -> 3,212 us (stage 3 2,011 -> 1,914); the
# prefill step 394.29 -> 392.38 ms (with WG_ALATE too, which alone changes nothing: 386.73; single runs). The 128-row
# form with it passed its GPU case, not timed: unchanged.
# In the 256-row form, s35run4-5 (H100, 16,384 tokens, same run, us per MoE layer): WG_WTMA 3,248; + stage 4's A rows
# by TMA (WG_ATMA) 3,126; + stage 3's A rows by the A partition beside 4 load warps instead (WG_ACOPY, 40 registers,
# WG_A32; WG_ACOPY4 off) 3,021; + stage 4's stores deferred into the next tile's K steps (WG_DSTORE) 2,906 (-10.6%,
# 443 TFLOP/s); the prefill step 394.48 -> 384.50 -> 379.72 ms (logits bitwise). WG_DSTORE in the 128-row form
# (s35run6): 4,096 tokens 1,348 -> 1,349 us, 2,048 879 -> 889: not taken there.
MOE_WGMMA_MIN_TOKENS = 2048
MOE_WGMMA_BM256_MIN_TOKENS = 8192
MOE_WGMMA_FORMS = {
    # 128-row blocks, the words two K steps a ring slot, the A rows by their own partition, stage 4's h rows resident
    # (and the A rows copied only as far as the MMAs read them: s32run9-10)
    "bm128": dict(WGMMA=True, BLOCK_M=128, WG_WSTEPS=2, WG_ACOPY=True, WG_HRES=True, WG_V16=True, WG_HALF=True,
                  WG_AQ=True),
    # 256-row blocks (half the K steps per FLOP), 3 stages and a ring 2 slots ahead (shared memory)
    # (stage 3's load partition on 8 warps, stage 4's on 4: s32run1; stage 3's words by TMA boxes where the shapes
    # take them, `wtma_shapes`: s34run1)
    # (s35run4-5: stage 3's A rows by the A partition beside 4 load warps, stage 4's by TMA, stage 4's stores
    # deferred into the next tile's K steps; WG_A32 up to `a32_max_tokens`, `_moe_experts` renders it without above)
    # (s37run1-2: the sort's stages 0-2 as a binary of their own, SORT_ALONE: the GEMM binary's 215 KB of shared
    # memory left one sorting program per SM; stage 2 149 -> 82 us)
    "bm256": dict(WGMMA=True, BLOCK_M=256, WG_STAGES=3, WG_WDEPTH=2, WG_WSTEPS=2, WG_V16=True, WG_HALF=True,
                  WG_LOAD_WARPS=4, WG_LOAD_REGS=64, WG_LOAD_WARPS4=4, WG_LOAD_REGS4=96, WG_WTMA=True,
                  WG_ACOPY=True, WG_ACOPY_REGS=40, WG_A32=True, WG_ACOPY4=False, WG_ATMA=True, WG_DSTORE=True,
                  SORT_ALONE=True, COMBINE=True)}
# (s46run1-2, H100: COMBINE, under the combine_experts pass, y in the sort's order and the top-k combine as the
# module's own last launch: the MoE at 16,384 tokens 3,299 -> 3,189 us with its combine, bitwise; the prefill step
# 355.72 -> 351.75 ms, logits bitwise; its 8 GPU cases pass. Without the pass the form renders without it.)
# the 128-row form's WG_HRES keeps a row block's h (128 x I bf16) resident in stage 4's shared memory: beside its ring
# that fits up to I / 64 = 6 K steps (the template's WG_SMEM4: 16 KB a step + 121 KB, within 227 KB); above (TP < 8
# of the full spec: I 640 .. 2,560) the form runs without it
MOE_WGMMA_HRES_MAX_STEPS = 6
MOE_WGMMA_CHOICE = {"wgmma_from_tokens": MOE_WGMMA_MIN_TOKENS, "bm256_from_tokens": MOE_WGMMA_BM256_MIN_TOKENS,
                    "basis": "measured at 2,048, 4,096, 8,192 and 16,384 tokens (the forms cross between 4,096 and "
                             "8,192: at 8,192 within 2%)",
                    "forms": MOE_WGMMA_FORMS, "bm128_hres_up_to_k_steps": MOE_WGMMA_HRES_MAX_STEPS,
                    "figures": [{"tokens": t, "in_loop_us": a, "dequant_us": b, "dequant_down_us": c, "bm128_us": d,
                                 "bm256_us": e, "wg_v16": v}
                                for t, a, b, c, d, e, v in ((2048, 1064, 1433, 1685, 973, 1547, True),
                                                            (4096, 1874, 1836, 1959, 1476, 1616, False),
                                                            (8192, 3134, 2634, 2566, 2339, 2303, True),
                                                            (16384, 5931, 4444, 3933, 4256, 3760, False))],
                    "wg_half": [{"tokens": t, "bm128_us": a, "bm128_half_us": b, "bm256_us": c, "bm256_half_us": d}
                                for t, a, b, c, d in ((2048, 974.4, 910.2, 1546.4, 1208.7),
                                                      (16384, 4185.2, 4117.7, 3723.6, 3590.3))],
                    "wg_half_in_step": {"prefill_ms": 405.36, "prefill_half_ms": 396.90, "logits": "bitwise"},
                    "bm256_load8_stage3": {"device": "H100", "us_16384": [3564.3, 3338.2], "us_8192": [2086.6, 1952.4],
                                           "prefill_step_ms": [412.05, 403.87]},
                    "bm128_wg_aq": {"device": "H200", "us_2048": [[911.9, 892.1], [906.5, 891.2]],
                                    "us_4096": [1372.2, 1340.1]},
                    "bm256_atma_acopy_dstore": {"device": "H100", "us_16384": [3248.3, 3126.5, 3020.9, 2905.7],
                                                "prefill_step_ms": [394.48, 384.50, 379.72]},
                    "bm256_wg_wtma": {"device": "H100", "us_16384": [3379.5, 3211.9],
                                      "prefill_step_ms": [394.29, 392.38]},
                    "bm256_sort_alone": {"device": "H100", "us_16384": [2938.5, 2871.6], "stage2_us": [149.4, 82.0],
                                         "prefill_step_ms": [371.91, 366.52], "logits": "bitwise",
                                         "bm128_us_2048": [901.6, 898.0]},
                    "source": "bench/results/moe-prefill-2026-12-05-s28run2.json, moe-prefill-2026-12-05-s29run3.json, "
                              "moe-prefill-2026-12-05-s31run1.json, variants-2026-12-05-s31run2.json (H200); "
                              "moe-prefill-2026-12-05-s32run1.json, variants-2026-12-05-s32run7-l{4,8}.json (H100); "
                              "moe-prefill-2026-12-05-s32run9{,-2048}.json, moe-prefill-2026-12-05-s32run10-*.json "
                              "(H200); moe-prefill-2026-12-06-s34run1.json, variants-2026-12-06-s34run2.json, "
                              "moe-prefill-2026-12-06-s35run4.json, variants-2026-12-06-s35run5.json, "
                              "moe-prefill-2026-12-06-s37run1{,-bm128}.json, variants-2026-12-06-s37run2.json (H100)"}
MOE_DEQUANT_CHOICE = {"kernel_for_tokens_from": MOE_DEQUANT_MIN_TOKENS, "basis": "measured",
                      "down_dequantised_from": MOE_DEQUANT_DOWN_MIN_TOKENS,
                      "figures": [{"tokens": t, "in_loop_us": a, "dequant_us": b, "dequant_down_us": c}
                                  for t, a, b, c in ((2048, 1165, 1452, None), (4096, 2026, 1855, None),
                                                     (8192, 3450, 2662, None), (16384, 6446, 4386, 3942))],
                      "source": "bench/results/moe-prefill-2026-12-01-s8run5-16k.json, -s8run5-tokens.txt (H200)"}


@emits("moe_experts")
def _moe_experts(node: Node, g: Graph, ctx: Context, combine: dict | None = None) -> list[Launch]:
    """NVFP4 experts, both phases: up to MOE_DECODE_MAX_TOKENS the W4A16 decode kernel (only the chosen experts'
    bytes read, one program per (token, choice) block); above, the grouped kernel (pairs sorted and block-aligned by
    expert on the device, gate_up+SwiGLU and down GEMMs on tensor cores with the dequantisation in the main loop; on sm100 its
    native block-scaled NVFP4 path); on sm90 (bf16, the relayout on) from MOE_WGMMA_MIN_TOKENS on, the same kernel's
    WGMMA render (its GEMMs warp-specialised on wgmma, the NVFP4 decode in the main loop; MOE_WGMMA_FORMS), else (or
    with --no-moe-wgmma) from MOE_DEQUANT_MIN_TOKENS on its DEQUANT render (the gate_up weights dequantised once per
    step), from MOE_DEQUANT_DOWN_MIN_TOKENS on with DEQUANT_DOWN (the down weights too). Dense (bf16) experts: the
    reference loop over experts. `combine` (from `_moe_experts_combine`: COMBINE and ROUTED_SCALE): the WGMMA forms
    that hold COMBINE render with it (y in the sort's order, the combine as their last launch); else no form does."""
    if node.attrs.get("combine"):
        return _moe_experts_combine(node, g, ctx)
    fmt = node.attrs["format"]
    if fmt != "nvfp4":
        return [library(node, f"moe_experts_{fmt}", "the reference loop over experts (torch): generated MoE kernels "
                        "take NVFP4 experts, the checkpoint format")]
    x, idx, gu_codes = node.inputs[:3]
    dims = dict(E=gu_codes.shape[0], H=last_dim(x), I=gu_codes.shape[1] // 2, TOP_K=idx.shape[1])
    # the decode kernel's module re-lays the weights out (when there is one) in chunks that follow its stage-0 warp
    # count, KSPLIT: the prefill kernels read the same bytes, so they are told a KSPLIT other than the default 4
    decodes = not (dims["H"] % 128 or dims["I"] % 32)  # (its K permutation needs chunks of >= 32 values)
    cap = {"MAXNREG": MOE_DECODE_MAXNREG} if ctx.target == "sm90" and ctx.dtype == "bf16" else {}
    small = kernel(node, "moe_nvfp4_decode", ctx, **dims, **cap) if decodes else None
    ksplit = small.kernel.constants.get("KSPLIT", 4) if small else 4
    relay = {"RELAYOUT_KSPLIT": ksplit} if ksplit != 4 else {}
    # (sm100's native NVFP4 MMAs for bf16 activations only: tl.dot_scaled is given bf16 x; an f16 model's MoE
    # dequantises in the K loop, as on sm90)
    large = kernel(node, "moe_nvfp4_prefill", ctx, **dims, **relay,
                   **({"NATIVE_FP4": True} if ctx.target == "sm100" and ctx.dtype == "bf16" else {}))
    out = [large]
    # (sm100's native NVFP4 MMAs read the packed weights as they are; a pinned WGMMA render (`--set
    # moe_nvfp4_prefill.WGMMA=...`, either way) takes every prefill size: no other renders beside it)
    pinned = "WGMMA" in ctx.template_overrides.get("moe_nvfp4_prefill", {})
    if (ctx.moe_wgmma and ctx.target == "sm90" and ctx.dtype == "bf16" and ctx.nvfp4_relayout and small is not None
            and wgmma_shapes(dims["H"], dims["I"], ksplit) and not pinned):
        # (the WGMMA render reads the re-laid-out words, the decode module's relayout, in K steps of 64; other shapes
        # keep the DEQUANT renders below)
        bm128 = dict(_combine_form(MOE_WGMMA_FORMS["bm128"], combine),
                     **({} if dims["I"] // 64 <= MOE_WGMMA_HRES_MAX_STEPS else {"WG_HRES": False}))
        mid = kernel(node, "moe_nvfp4_prefill", ctx, **dims, **relay, **bm128)
        bm256 = {k: v for k, v in _combine_form(MOE_WGMMA_FORMS["bm256"], combine).items()
                 if k != "WG_WTMA" or wtma_shapes(dims["H"], dims["I"], ksplit)}
        big = kernel(node, "moe_nvfp4_prefill", ctx, **dims, **relay, **bm256)
        out = [dataclasses.replace(large, max_tokens=MOE_WGMMA_MIN_TOKENS - 1, choice=MOE_WGMMA_CHOICE),
               dataclasses.replace(mid, min_tokens=MOE_WGMMA_MIN_TOKENS, max_tokens=MOE_WGMMA_BM256_MIN_TOKENS - 1,
                                   choice=MOE_WGMMA_CHOICE)]
        if bm256.get("WG_A32"):  # (32-bit A-row offsets up to the steps they fit, the same form without them above)
            most = a32_max_tokens(dims["H"], dims["I"], dims["TOP_K"], dims["E"], bm256["BLOCK_M"])
            wide = kernel(node, "moe_nvfp4_prefill", ctx, **dims, **relay,
                          **{k: v for k, v in bm256.items() if k != "WG_A32"})
            out += [dataclasses.replace(big, min_tokens=MOE_WGMMA_BM256_MIN_TOKENS, max_tokens=most,
                                        choice=MOE_WGMMA_CHOICE),
                    dataclasses.replace(wide, min_tokens=most + 1, choice=MOE_WGMMA_CHOICE)]
        else:
            out.append(dataclasses.replace(big, min_tokens=MOE_WGMMA_BM256_MIN_TOKENS, choice=MOE_WGMMA_CHOICE))
    elif ctx.moe_dequant and ctx.target == "sm90" and not pinned:
        long = kernel(node, "moe_nvfp4_prefill", ctx, **dims, **relay, DEQUANT=True)
        longest = kernel(node, "moe_nvfp4_prefill", ctx, **dims, **relay, DEQUANT=True, DEQUANT_DOWN=True)
        out = [dataclasses.replace(large, max_tokens=MOE_DEQUANT_MIN_TOKENS - 1, choice=MOE_DEQUANT_CHOICE),
               dataclasses.replace(long, min_tokens=MOE_DEQUANT_MIN_TOKENS, max_tokens=MOE_DEQUANT_DOWN_MIN_TOKENS - 1,
                                   choice=MOE_DEQUANT_CHOICE),
               dataclasses.replace(longest, min_tokens=MOE_DEQUANT_DOWN_MIN_TOKENS, choice=MOE_DEQUANT_CHOICE)]
    if small is None:
        return out
    return [dataclasses.replace(small, max_tokens=MOE_DECODE_MAX_TOKENS),
            dataclasses.replace(out[0], min_tokens=MOE_DECODE_MAX_TOKENS + 1)] + out[1:]


def moe_wgmma_form(name: str) -> dict:
    """The WGMMA form `name` (MOE_WGMMA_FORMS) as the experts-then-moe_combine route renders it: without COMBINE (a
    COMBINE render also takes the routing weights, out and the routed scale: the combine_experts pass's node)."""
    return _combine_form(MOE_WGMMA_FORMS[name], None)


def _combine_form(form: dict, combine: dict | None) -> dict:
    """A WGMMA form as rendered: with COMBINE (and the routed scale) where the form asks for it and the node is the
    combine_experts pass's (`combine`), else without."""
    base = {k: v for k, v in form.items() if k != "COMBINE"}
    return dict(base, **combine) if combine and form.get("COMBINE") else base


def _sorts_y(ln: Launch) -> bool:
    """Whether a launch is a moe_nvfp4_prefill COMBINE render (y in the sort's order, the combine its last launch)."""
    return ln.kernel is not None and ln.kernel.template == "moe_nvfp4_prefill" and bool(ln.kernel.constants.get("COMBINE"))


def _combine_spans(runs: list[Launch], combine: Launch) -> list[Launch]:
    """The `moe_combine` launch over the token ranges of `runs` that write y in pair order (one per contiguous span;
    the COMBINE renders combine themselves)."""
    spans: list[list] = []
    for ln in sorted((ln for ln in runs if not _sorts_y(ln)), key=lambda ln: ln.min_tokens):
        if spans and spans[-1][1] is not None and spans[-1][1] + 1 >= ln.min_tokens:
            spans[-1][1] = None if ln.max_tokens is None else max(spans[-1][1], ln.max_tokens)
        else:
            spans.append([ln.min_tokens, ln.max_tokens])
    return [dataclasses.replace(combine, min_tokens=lo, max_tokens=hi) for lo, hi in spans]


def _moe_experts_combine(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    """moe_experts with `combine` (the combine_experts pass): up to `most` tokens (`ctx.moe_combine_max_tokens`, by
    default MOE_COMBINE_MAX_TOKENS; at most the decode kernel's range) the decode kernel's COMBINE render (the combine
    in its down GEMM's epilogue); above, the experts' launches as without the pass into a scratch buffer
    [T, top_k, H], then the `moe_combine` kernel (what the boundary ran before the pass), except for the prefill
    forms that hold COMBINE (MOE_WGMMA_FORMS: the 256-row form since s46): their render writes y in the sort's order and
    combines it itself (their launch takes the routing weights and out after y)."""
    a = node.attrs
    *ins, w = node.inputs
    x, idx = ins[:2]
    most = MOE_COMBINE_MAX_TOKENS if ctx.moe_combine_max_tokens is None else ctx.moe_combine_max_tokens
    most = min(most, MOE_DECODE_MAX_TOKENS)
    out = node.outputs[0]
    y = Value("experts", (x.shape[0], idx.shape[1], last_dim(x)), x.dtype)
    s = "scratch:moe_experts"
    plain = Node("moe_experts", ins, [y], {k: v for k, v in a.items() if k not in ("combine", "routed_scale")},
                 layer=node.layer)
    runs = [into_scratch(ln, s, y) for ln in _moe_experts(plain, g, ctx, {"COMBINE": True,
                                                                           "ROUTED_SCALE": a["routed_scale"]})]
    runs = [dataclasses.replace(ln, args=ln.args + (w.name, out.name)) if _sorts_y(ln) else ln for ln in runs]
    combine = dataclasses.replace(kernel(node, "moe_combine", ctx, args=(s, w.name, idx.name, out.name),
                                         H=last_dim(x), TOP_K=idx.shape[1], ROUTED_SCALE=a["routed_scale"]),
                                  min_tokens=most + 1, choice=MOE_COMBINE_CHOICE)
    fused = next((ln for ln in runs if ln.kernel is not None and ln.kernel.template == "moe_nvfp4_decode"), None)
    if fused is None or most < 1 or idx.shape[1] > 8:  # (top-k > 8: not measured)
        return runs + _combine_spans(runs, combine)
    # the plain render's constants (its overrides already pinned and checked) with the combine in its epilogue
    plain_consts = {k: v for k, v in fused.kernel.constants.items()
                    if k != "MAXNREG" or "MAXNREG" in ctx.template_overrides.get("moe_nvfp4_decode", {})}
    spec = KernelSpec("moe_nvfp4_decode", node.op, {**plain_consts, "COMBINE": True, "ROUTED_SCALE": a["routed_scale"]})
    fused = Launch(io(node), spec, max_tokens=most, choice=MOE_COMBINE_CHOICE)
    frag = _moe_frag(node, fused.kernel.constants, ctx, most)
    if frag is not None:  # `--moe-frag-max-tokens`: the smallest steps take the Gluon fragment-load kernel
        fused = dataclasses.replace(fused, min_tokens=frag.max_tokens + 1)
    rest = []
    for ln in runs:  # the same launches from most + 1 tokens on
        if ln.max_tokens is not None and ln.max_tokens <= most:
            continue
        rest.append(dataclasses.replace(ln, min_tokens=max(ln.min_tokens, most + 1)))
    return (([frag] if frag is not None else []) + ([fused] if fused.min_tokens <= most else []) + rest
            + _combine_spans(rest, combine))


# `--moe-frag-max-tokens N` (0, off, by default): steps of up to N tokens run a moe_experts with `combine` as
# moe_nvfp4_frag (Gluon: every warp loads its re-laid-out NVFP4 words straight into MMA A fragments). Its first form
# measured slower than the COMBINE render alone on the H200 (both launches, L2 flushed, TP-8 shapes: 27.1 against 21.8
# us, s25run1); the current render (x prefetched into L1, the routing and global scales read early) is not measured
# yet
MOE_FRAG_CHOICE = {"small_steps_kernel": "moe_nvfp4_frag", "basis": "option (--moe-frag-max-tokens), not yet "
                   "faster on the H200", "source": "bench/results/moe-frag-2026-12-04-s25run1.json (H200)"}


def frag_shapes(H: int, I: int, top_k: int, relayout_ksplit: int = 4, ksplit: int = 4) -> bool:
    """Whether moe_nvfp4_frag renders for these shapes (its template's asserts): the relayout's chunks of >= 32
    values (BK0: the largest power of 2 <= 256 dividing H / relayout_ksplit; BK1: <= 64 dividing I), H in whole
    units of min(4, BK0 / 32) words over `ksplit` warps, 8 rows of I and 16 of H a program, top-k 1, 2, 4 or 8."""
    bk0, bk1 = relayout_chunks(H, I, relayout_ksplit)
    if bk0 < 32 or bk1 < 32 or top_k not in (1, 2, 4, 8) or I % 8 or H % 16:
        return False
    return H % (32 * min(4, bk0 // 32) * ksplit) == 0


def relayout_chunks(H: int, I: int, relayout_ksplit: int = 4) -> tuple[int, int]:
    """The NVFP4 relayout's chunks (moe_nvfp4_decode's BK0 / BK1, moe_nvfp4_prefill's RK0 / RK1): the largest power
    of 2 <= 256 dividing H / relayout_ksplit (0 when relayout_ksplit does not divide H), the largest <= 64 dividing I."""
    def pow2_divisor(n: int, most: int) -> int:
        b = 1
        while b * 2 <= most and n % (b * 2) == 0:
            b *= 2
        return b

    return (pow2_divisor(H // relayout_ksplit, 256) if H % relayout_ksplit == 0 else 0), pow2_divisor(I, 64)


def wgmma_shapes(H: int, I: int, relayout_ksplit: int = 4) -> bool:
    """Whether moe_nvfp4_prefill's WGMMA render takes these shapes (its template's assert): K steps of 64 values
    within the relayout's chunks, i.e. H and I multiples of 64 and so are the chunks RK0 (the largest power of 2 <= 256
    dividing H / relayout_ksplit) and RK1 (the largest <= 64 dividing I)."""
    rk0, rk1 = relayout_chunks(H, I, relayout_ksplit)
    return not (H % 64 or I % 64) and rk0 % 64 == 0 and rk0 > 0 and rk1 % 64 == 0


def a32_max_tokens(H: int, I: int, top_k: int, E: int, block_m: int) -> int:
    """The most tokens a step may have for moe_nvfp4_prefill's WG_A32 (the A rows' element offsets in 32 bits: x's T
    rows of H, h's T top_k sorted rows with up to E blocks of padding, of I; the launcher's assert)."""
    return min((2 ** 31 - 1) // H, ((2 ** 31 - 1) // I - E * block_m) // top_k)


def wtma_shapes(H: int, I: int, relayout_ksplit: int = 4) -> bool:
    """Whether moe_nvfp4_prefill's WG_WTMA (stage 3's words and scale bytes by TMA boxes) takes these shapes at
    WG_WSTEPS 2 (its template's assert): the relayout's chunks RK0 of at least 128 values and H a multiple of 256 (the
    scale bytes' 16-byte boxes)."""
    rk0, _ = relayout_chunks(H, I, relayout_ksplit)
    return rk0 >= 128 and H % 256 == 0


def _moe_frag(node: Node, constants: dict, ctx: Context, most: int) -> Launch | None:
    """The moe_nvfp4_frag launch of a moe_experts with `combine` for steps of up to min(ctx.moe_frag_max_tokens,
    most) tokens, where it applies (bf16 on sm90 with the experts re-laid out, shapes it renders for); else None."""
    if not (ctx.moe_frag_max_tokens and ctx.dtype == "bf16" and ctx.target == "sm90" and ctx.nvfp4_relayout):
        return None
    E, H, I, k = (constants[n] for n in ("E", "H", "I", "TOP_K"))
    rk = constants.get("KSPLIT", 4)  # the decode module's stage-0 warps: its relayout's chunks
    if not frag_shapes(H, I, k, rk):
        return None
    dims = dict(E=E, H=H, I=I, TOP_K=k, ROUTED_SCALE=node.attrs["routed_scale"],
                **({"RELAYOUT_KSPLIT": rk} if rk != 4 else {}))
    most = min(ctx.moe_frag_max_tokens, most)
    return dataclasses.replace(kernel(node, "moe_nvfp4_frag", ctx, **dims), max_tokens=most, choice=MOE_FRAG_CHOICE)


def attention_dot(cache_dtype: str, dtype: str) -> dict:
    """The attention templates' MMA operand type over an fp8 cache: fp16 (F16_DOT; e4m3 -> fp16 is exact and one
    packed instruction, -> bf16 one more per value: the H200, s19run2, decode fp8 100K 22.9 -> 18.2 us, 32K 10.7 ->
    8.9, sliding 4.41 -> 4.21; prefill without the mirror 23.5 -> 18.8 ms). The runtime checks at load that the
    q norms keep q inside fp16's range (`Model._check_f16_dot`)."""
    return {"F16_DOT": True} if cache_dtype == "f8e4m3" and dtype == "bf16" else {}


# sm90, bf16: the mirrored full layers' prefill pass (MIRROR's stage 2) as the WGMMA render with WG_SPLIT (a
# warp-specialised Gluon kernel: K/V by TMA into a ring, the two MMA warpgroups as two partitions whose softmaxes
# overlap each other's MMAs). H200 2026-12-05 (bench/results/attention-prefill-sweep-2026-12-05-s29run1.json; one full
# layer, 8 sequences x 2,048 new tokens over 100K of fp8 context, ms): the Triton pass 14.72 (345 TFLOP/s), WGMMA
# 11.01, WGMMA + WG_SPLIT 10.35 (491), + 6 ring slots 10.53, 3 slots 11.09; the outputs equal the Triton pass's within
# 1e-2 (13 GPU tests). Pinning `--set attention_prefill.WGMMA=false` keeps the Triton pass.
# TILE_ORDER (s37run5-6, H100, the same layer): the plan ranks the token tiles by their work and the passes take the
# most first (7 of the 781 tiles straddle two sequences: two trips each, one left in the last wave idled the other
# SMs: ncu s37run3, SMs active 84% of the cycles): 10,025 -> 9,422 us (507 -> 540 TFLOP/s), the same bits (5 GPU
# cases, graph replay too). Not yet timed in the prefill step (expected -9 x 0.6 ms).
ATTENTION_WGMMA_TILES = dict(WGMMA=True, WG_SPLIT=True, TILE_ORDER=True)
ATTENTION_WGMMA_HEAD_DIMS = (64, 128)  # (the render's wgmma tiles: two warpgroups of 64 rows, K steps of 16)


# the sliding layers (fp8 ring, sm90 bf16, the mirror on), with ATTENTION_RING_MIRROR: each step's ring rows
# converted once into a bf16 mirror (from each sequence's first window start on, in pages of 64 rows), read by the
# WGMMA pass with the window mask (attention_wgmma_tiles) instead of the Triton pass converting every tile in its
# loop. Off: measured slower. H200 2026-12-05 (bench/results/attention-prefill-sweep-2026-12-05-s30run1.json; one
# sliding layer, 8 x 2,048 new tokens over 100K, window 512, us): the Triton pass over the fp8 ring with fp16
# operands (the default) 165.7 (155 TFLOP/s), the Triton pass over the mirror 227.6, the WGMMA pass over it 196.2
# (the same run's full layer: 14,752 -> 10,158 us on the mirror and wgmma). At ~10 key blocks a tile, the mirror's
# plan and copy launches and a tile's fixed costs outweigh the conversion they save; the outputs are right (GPU tests).
# The mirror's pages cover RING_MIRROR_TOKENS new tokens and RING_MIRROR_SEQS windows (more: the ring, as before).
ATTENTION_RING_MIRROR = False
RING_MIRROR_TOKENS, RING_MIRROR_SEQS = 16384, 16


def ring_mirror_pages(window: int) -> int:
    """Mirror pages (64 rows) for RING_MIRROR_TOKENS new tokens of RING_MIRROR_SEQS sequences: each sequence's rows
    reach back a window and up to two key blocks (its first window start rounded down, its last page)."""
    return -(-(RING_MIRROR_TOKENS + RING_MIRROR_SEQS * (window + 128)) // 64)


# the sliding layers' prefill pass (the Triton pass over the fp8 ring with fp16 operands, sm90): 128-row tiles on 4
# warps instead of 8; the softmax's exp2 as one ex2.approx.ftz (EX2_FTZ: flushes only results below 2^-126, which an
# fp16 P and a sum >= 1 cannot tell apart; the WGMMA pass always does this); q's fp16 tile through the output rows
# (Q16_OUT: the score wgmma's A operand from shared memory; from registers, ptxas serialised the wgmmas at 4 warps for
# lack of registers). H100 (one sliding layer, 8 x 2,048 new tokens over 100K, window 512, us): 4 warps 164.9 -> 158.4
# (s35run2), 165.0 / 166.5 -> 158.0 (s39run2), 166.1 -> 160.1 / 158.7, with EX2_FTZ 148.4 (s39run3), **with Q16_OUT too
# 137.3 / 137.0 against 144.8 / 146.0** (s39run5; bench/results/attention-prefill-sweep-2026-12-06-s39run5.json); every
# output the same bits (GPU tests). Tried, slower or even: 2 stages, 64-row tiles, 32- and 128-key blocks (128 on 4
# warps spills: 431 us), 256-row tiles, helper programs for the straddling tiles, one masked loop a trip.
ATTENTION_SLIDING_PREFILL_TILES = dict(NUM_WARPS=4, EX2_FTZ=True, Q16_OUT=True)


def attention_wgmma_tiles(ctx: Context, head_dim: int) -> dict:
    """The mirrored prefill pass's WGMMA constants where it renders (ATTENTION_WGMMA_TILES: sm90, a bf16 model, head
    dims of 64 or 128, neither WGMMA nor a tile it cannot take pinned), else none. sm100 has no wgmma: the Triton pass there."""
    pinned = ctx.template_overrides.get("attention_prefill", {})
    if ctx.target != "sm90" or ctx.dtype != "bf16" or head_dim not in ATTENTION_WGMMA_HEAD_DIMS or "WGMMA" in pinned:
        return {}
    if pinned.get("BLOCK_M", 128) != 128 or pinned.get("NUM_WARPS", 8) != 8 or pinned.get("BLOCK_N", 64) not in (64, 128):
        return {}  # (tiles pinned for the Triton pass: the render's tiles are 128 rows on 8 warps, 64 or 128 keys)
    return {k: v for k, v in ATTENTION_WGMMA_TILES.items() if k not in pinned}


def attention_decode_tiles(window: int) -> dict:
    """The decode attention template's tile constants for a layer: over a window, blocks of 32 keys (16 splits of a
    512 window; the H200 sweeps of 2026-12-01, bench/results/attention-decode-sweep-2026-12-01-s5run{1,4}.json:
    4.44 vs 5.17 us fp8, 4.33 vs 4.64 bf16); full layers the template's default (64)."""
    return {"BLOCK_N": 32} if window else {}


# ATTENTION_DECODE_BATCH_MIN_TOKENS (None: off; a benchmark's setting, `bench/decode_batch.py --attention-batch-min-
# tokens N`): decode steps of N tokens or more run the decode attention with ATTENTION_DECODE_BATCH_TILES instead of
# the tiles above (both layer kinds; the step holds both launches, each under its token range). Why: at batch 1 a
# program walks a few blocks and fixed costs rule (the tiles above measured best there), at 16-128 tokens each walks
# 50-200 blocks; the full render's 232 registers let 2 programs of 4 warps share an SM (8 warps for a latency-bound
# loop), blocks of 32 capped at 128 registers let 4 (no spill: tests/test_kernels_attention_decode.py), and the
# splits floored to whole waves of programs (WHOLE_WAVES) keep the last wave from being a sliver. Measured on an H100
# (s50run2, the full layer alone, 64 sequences of 100K, fp8, us): the tiles above 721.5 at 8 splits, blocks of 32 at
# 128 registers 793.5, blocks of 32 uncapped 776.2, 16 1,018.8 at best; in the step from 16 tokens (s50run1) the
# attention at batch 64 / 128 3,351 / 6,385 us against 3,232 / 6,147 with the tiles above on whole waves: off
ATTENTION_DECODE_BATCH_MIN_TOKENS = None
ATTENTION_DECODE_BATCH_TILES = {"BLOCK_N": 32, "MAXNREG": 128, "WHOLE_WAVES": True}


def _decode_attention_by_batch(ln: Launch, ctx: Context) -> list[Launch]:
    """A decode attention launch, and from ATTENTION_DECODE_BATCH_MIN_TOKENS tokens on the same with the batch tiles
    (constants the user pinned with --set stay pinned in both)."""
    n = ATTENTION_DECODE_BATCH_MIN_TOKENS
    if n is None or n < 1:
        return [ln]
    pinned = ctx.template_overrides.get("attention_decode", {})
    tiles = {k: v for k, v in ATTENTION_DECODE_BATCH_TILES.items() if k not in pinned}
    choice = {"batch_tiles_from_tokens": n, "tiles": tiles,
              "basis": "ATTENTION_DECODE_BATCH_MIN_TOKENS (a benchmark's setting)"}
    batch = dataclasses.replace(ln, kernel=dataclasses.replace(ln.kernel, constants={**ln.kernel.constants, **tiles}))
    return by_token_count(ln, batch, n, choice)


@emits("attention", "attention_gate")
def _attention(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    """Decode: flash-decoding over the ring (sliding) or the pages (full), split over the context so that one
    sequence fills the GPU (`attention_decode`). Prefill: FlashAttention-style tiles of consecutive tokens with the
    query heads of a KV head folded in, over each sequence's cached context (chunked prefill; `attention_prefill`).
    `attention_gate` (the attention_gate pass): the same kernels with GATE, which apply the output gate to each row
    before storing it; in prefill steps without `ctx.prefill_attention_gate` (`--no-prefill-attention-gate`), the
    plain attention into a scratch, then the sigmoid_gate kernel (the same roundings)."""
    a = node.attrs
    if node.op == "attention_gate" and g.meta["phase"] != "decode" and not ctx.prefill_attention_gate:
        o = node.out
        s = "scratch:attn_o"
        att = Node("attention", node.inputs[:-2], [Value(s, tuple(o.shape), o.dtype)], a, layer=node.layer)
        gate = Node("sigmoid_gate", [att.out, *node.inputs[-2:]], [o], {}, layer=node.layer)
        return [into_scratch(_attention(att, g, ctx)[0], s, o),
                from_scratch(_sigmoid_gate(gate, g, ctx)[0], s)]
    paged = bool(a.get("paged"))
    q, kc = node.inputs[:2]
    template = "attention_decode" if g.meta["phase"] == "decode" else "attention_prefill"
    tiles = attention_decode_tiles(a["window"] or 0) if template == "attention_decode" else {}
    mirrored = template == "attention_prefill" and kc.dtype == "f8e4m3" and ctx.attention_mirror_pages > 0
    wgmma = attention_wgmma_tiles(ctx, q.shape[2]) if mirrored else {}
    if mirrored and paged:
        tiles = dict(MIRROR=True, MIRROR_PAGES=ctx.attention_mirror_pages, **wgmma)  # (--attention-mirror PAGES)
    elif mirrored and ATTENTION_RING_MIRROR and wgmma:
        # the sliding layers: the ring's mirror, for the WGMMA pass (off: see ATTENTION_RING_MIRROR)
        tiles = dict(MIRROR=True, MIRROR_PAGES=ring_mirror_pages(a["window"]), **wgmma)
    else:
        tiles.update(attention_dot(kc.dtype, ctx.dtype))
        if template == "attention_prefill" and a["window"] and tiles.get("F16_DOT") and ctx.target == "sm90":
            tiles.update(ATTENTION_SLIDING_PREFILL_TILES)  # (measured there; see ATTENTION_SLIDING_PREFILL_TILES)
    ln = kernel(node, template, ctx, CACHE_DTYPE=kc.dtype, HQ=q.shape[1], HKV=kc.shape[2], HEAD_DIM=q.shape[2],
                WINDOW=a["window"] or 0, SCALE=a["scale"], PAGED=paged, PAGE_SIZE=kc.shape[1] if paged else 0,
                GATE=node.op == "attention_gate", **tiles)
    return _decode_attention_by_batch(ln, ctx) if template == "attention_decode" else [ln]


@emits("qk_attention")
def _qk_attention(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    """The qk_attention pass's op (decode steps): the decode attention's QKN render, whose stage 0 normalises q and
    k, writes k and v into the cache and starts the owning split from the token's own key. In a prefill graph (the
    pass makes none there; a hand-built graph may hold one) the two launches it stands for: qk_norm_pos_kv into a
    scratch q, then the attention."""
    a = node.attrs
    q, kc, vc = (node.inputs[i] for i in (0, 5, 6))
    if g.meta["phase"] == "decode":
        paged = bool(a.get("paged"))
        ln = kernel(node, "attention_decode", ctx, CACHE_DTYPE=kc.dtype, HQ=q.shape[1], HKV=kc.shape[2],
                    HEAD_DIM=q.shape[2], WINDOW=a["window"] or 0, SCALE=a["scale"], PAGED=paged,
                    PAGE_SIZE=kc.shape[1] if paged else 0, GATE=a["gate"], QKN=True, **_qk_constants(a),
                    **attention_decode_tiles(a["window"] or 0), **attention_dot(kc.dtype, ctx.dtype))
        return _decode_attention_by_batch(ln, ctx)
    s = "scratch:qk_q"
    qn = Value("q_normed", tuple(q.shape), q.dtype)
    qk_ins, rest = qk_attention_parts(node.inputs, a["gate"])
    qk = Node("qk_norm_pos_kv", qk_ins, [qn, kc, vc], a, layer=node.layer)
    att = Node("attention_gate" if a["gate"] else "attention", [qn, kc, vc, *rest], [node.outputs[0]], a,
               layer=node.layer)
    first = _qk_norm_pos_kv(qk, g, ctx)[0]
    second, *gate = _attention(att, g, ctx)  # (gate: the sigmoid_gate launch where prefill does not fuse it)
    return [into_scratch(first, s, q), from_scratch(second, s), *gate]


@emits("all_reduce", "all_gather")
def _collective(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    return [library(node, node.op, AR_PENDING)]


@emits("gather_rows")
def _gather_rows(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    return [library(node, "gather_rows", "a row gather through torch (a few rows before lm_head; a fused gather is "
                    "for the runtime issue 10)")]


# ---------------------------------------------------------------- unfused ops (`--passes none`: the ablation's first row)
UNFUSED = ("add", "mul", "scale", "sigmoid", "embed", "rmsnorm", "rope", "q_scale", "linear_f32", "moe_select",
           "moe_combine", "qk_norm_pos", "cast")  # qk_norm_pos: until the kv_write pass makes it qk_norm_pos_kv;
# cast: the fp32 logits of a spec without a soft-cap


@emits(*UNFUSED)
def _unfused(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    """An op the fusion passes would have merged into a fused kernel: here its own launch, its torch reference (the
    unfused graph of the ablation benchmark: every IR op one kernel, as the seed's starting point)."""
    return [library(node, "reference_op", "unfused op through its torch reference (a package compiled without the "
                    "fusion pass that absorbs it)", kwargs=(("op", node.op), ("n_in", len(node.inputs)), ("attrs", dict(node.attrs))))]


@emits("swiglu")
def _swiglu(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    return [kernel(node, "swiglu", ctx, F=last_dim(node.out), PACKED=False)]


@emits("softcap")
def _softcap(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    return [kernel(node, "softcap", ctx, V=last_dim(node.out), CAP=node.attrs["cap"])]


@emits("kv_write")
def _kv_write(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    """The unfused cache write (the kv_write pass folds it into qk_norm_pos_kv): the reference's scatter, without its
    capacity check (the runtime's slot table checks every write before the step)."""
    return [library(node, "kv_write", "unfused cache write through torch (the kv_write pass fuses it)",
                    kwargs=(("paged", bool(node.attrs.get("paged"))),))]


@emits("reshape")
def _view(node: Node, g: Graph, ctx: Context) -> list[Launch]:
    return [library(node, "view", "free: a view of its input, no launch")]
