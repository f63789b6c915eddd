"""Generated kernels `qk_norm_pos_kv` and `moe_router` on CPU.

fp32 instances of the templates run under Triton's interpreter against the torch references on random fp32 inputs,
outputs and caches poisoned with NaN first (a few rendered with PDL on: the gdc calls are skipped there); every bf16
variant is compiled ahead of time for sm_90a and sm_100a at the full spec's TP-8 shapes and the tiny spec's, with
Programmatic Dependent Launch (the default for bf16) and, for the tiny spec, without: the PTX holds
griddepcontrol.launch_dependents and griddepcontrol.wait exactly when PDL is on, with no store before a wait, and no
flush-to-zero arithmetic. Bitwise checks on bf16 are the GPU test's (tests/gpu/).

Why a subprocess: triton.jit picks the interpreter at decoration time, for our kernels and for Triton's own
`tl.sum`/`tl.max`/... (decorated when triton.language is first imported); the two kinds cannot call each other. So
the interpreter cases run in one child process started with TRITON_INTERPRET=1 (this file run as a script), and
the ahead-of-time compiles in fresh spawned processes without it; this process never imports triton.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import re
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import networkx as nx
import pytest
import torch
import torch.nn.functional as F

from beamc.codegen.kernel import KernelSpec, aot_compile, launch_options, load_kernel
from beamc.ir.reference import REFS, kv_store, q_scale_ref, rmsnorm_ref, rope_ref
from beamc.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
SMEM_LIMIT = 232448  # bytes of shared memory a block may use on sm_90 / sm_100


# ---------------------------------------------------------------- constants of the kernels, from a spec
def qk_constants(spec, tp: int, mode: str, dtype: str = "bf16", cache: str = "bf16", page: int | None = None) -> dict:
    """The qk_norm_pos_kv template's constants for one attention layer kind of `spec` at tensor-parallel size tp."""
    a = spec.attention
    c = dict(DTYPE=dtype, CACHE_DTYPE=cache, HQ=a.num_heads // tp, HKV=max(a.num_kv_heads // tp, 1),
             HEAD_DIM=a.head_dim, EPS=a.qk_norm.eps, NORM_OFFSET=a.qk_norm.offset, MODE=mode, PAGED=page is not None)
    if mode == "rope":
        c["THETA"] = a.sliding.rope.theta
    else:
        qs = a.full.q_scale
        c.update(LENGTH=qs.length, POS_OFFSET=qs.offset, EXPONENT=qs.exponent)
    if page is not None:
        c["PAGE_SIZE"] = page
    return c


def router_constants(spec, path: str, dtype: str = "bf16") -> dict:
    m = spec.mlp.moe
    return dict(DTYPE=dtype, H=spec.hidden_size, E=m.num_experts, N_GROUP=m.n_group, TOPK_GROUP=m.topk_group,
                TOP_K=m.top_k, RENORMALIZE=m.renormalize, EPS=m.renorm_eps, PATH=path)


# An odd attention spec: head_dim 64, window 5, (1 + w) norm weights, another theta, a length that is no power of 2.
ODD_QK = dict(HQ=6, HKV=3, HEAD_DIM=64, EPS=1e-5, NORM_OFFSET=1.0, THETA=1e6, LENGTH=1000.0, POS_OFFSET=3.0,
              EXPONENT=0.3)
ODD_WINDOW = 5
# An odd router: K not a multiple of the chunk, experts / groups / top-k no powers of 2, no renormalisation.
ODD_ROUTER = dict(H=320, E=24, N_GROUP=3, TOPK_GROUP=2, TOP_K=3, RENORMALIZE=False, EPS=1e-20)
# one expert from one group of four (top_k 1, topk_group 1: widths tl.topk cannot take, padded to 2 by the template)
K1_ROUTER = dict(H=96, E=16, N_GROUP=4, TOPK_GROUP=1, TOP_K=1, RENORMALIZE=True, EPS=1e-20)


def odd_qk_constants(mode: str, dtype: str = "bf16", cache: str = "bf16", page: int | None = None) -> dict:
    c = dict(ODD_QK, DTYPE=dtype, CACHE_DTYPE=cache, MODE=mode, PAGED=page is not None)
    for k in (("LENGTH", "POS_OFFSET", "EXPONENT") if mode == "rope" else ("THETA",)):
        c.pop(k)
    if page is not None:
        c["PAGE_SIZE"] = page
    return c


# ---------------------------------------------------------------- references
def qk_reference(c: dict, q, k, v, wq, wk, pos, cache_dtype=None, k_scale=None, v_scale=None):
    """(q_out, K row, V row) per token, composed from the parts REFS['qk_norm_pos_kv'] composes (rmsnorm ->
    rope / q_scale -> kv_store), with the norm's weight offset and the SSMax offset kept apart."""
    qn = rmsnorm_ref(q, wq, c["EPS"], c["NORM_OFFSET"])
    kn = rmsnorm_ref(k, wk, c["EPS"], c["NORM_OFFSET"])
    if c["MODE"] == "rope":
        qo, kn = rope_ref(qn, pos, c["THETA"]), rope_ref(kn, pos, c["THETA"])
    else:
        qo = q_scale_ref(qn, pos, dict(length=c["LENGTH"], offset=c["POS_OFFSET"], exponent=c["EXPONENT"]))
    cd = cache_dtype or q.dtype
    return qo, kv_store(kn, cd, k_scale), kv_store(v, cd, v_scale)


def router_ties(logits: torch.Tensor, bias: torch.Tensor, c: dict, tol: float) -> torch.Tensor:
    """Tokens whose choice hangs on near-equal values (torch.topk's order among ties is unspecified, and logits
    summed in another order move by ~1e-7): adjacent sorted group scores within the kept groups (+1), or adjacent
    sorted choices within the top-k (+1), closer than tol."""
    E, G = c["E"], c["N_GROUP"]
    choice = logits.float().sigmoid() + bias
    gs = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1).sort(-1, descending=True)[0]
    n = min(c["TOPK_GROUP"] + 1, G)
    tie = ((gs[:, : n - 1] - gs[:, 1:n]).abs().min(-1)[0] < tol if n > 1
           else torch.zeros(len(gs), dtype=torch.bool, device=gs.device))
    gidx = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1).topk(c["TOPK_GROUP"], dim=-1)[1]
    keep = torch.zeros(len(choice), G, dtype=torch.bool, device=choice.device).scatter_(1, gidx, True)
    keep = keep.repeat_interleave(E // G, dim=1)
    cs = choice.masked_fill(~keep, float("-inf")).sort(-1, descending=True)[0][:, : c["TOP_K"] + 1]
    d = (cs[:, :-1] - cs[:, 1:]).abs()
    return tie | (d[:, : c["TOP_K"]].min(-1)[0] < tol)


# ---------------------------------------------------------------- loading
def load_interpreted(template: str, constants: dict, directory: Path):
    """The kernel module, in the interpreter child (TRITON_INTERPRET=1 was set before triton was imported)."""
    mod = load_kernel(KernelSpec(template, template, constants), directory)
    assert mod._interpreted(), "triton did not pick the interpreter"
    return mod


def tiny_spec_():
    return load_spec(ROOT / "models/beam-tiny.yaml")


@pytest.fixture(scope="module")
def tiny():
    return tiny_spec_()


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Results of every interpreter case, run in one child process (see the module docstring)."""
    from conftest import run_interpreted  # not at the top: this file is also the child's script

    d = tmp_path_factory.mktemp("interpreted")
    return run_interpreted([__file__, str(d / "results.json"), str(d)], d / "results.json")


def pdl_facts(ptx: str) -> dict:
    """What a kernel's PTX shows about Programmatic Dependent Launch and flush-to-zero:
    - waits / launch_dependents: how many griddepcontrol.wait and griddepcontrol.launch_dependents it holds, and
      whether launch_dependents comes before the first wait;
    - loads / stores before each wait: the global ld / st that may be issued before the previous grid is known
      complete, i.e. in the blocks of the control-flow graph from which the wait's block can be reached (but not
      those it reaches: a loop around it), and in its own block above it. Every path counts, so a branch ahead of
      the wait (a late trigger's `if stage ...`) hides nothing;
    - ftz: the flush-to-zero instructions other than those libdevice always uses (its expf's ex2.approx.ftz, its
      tanhf's rcp.approx.ftz): none when the kernel is compiled with enable_reflect_ftz=False."""
    body = ptx.split(".entry", 1)[1]
    blocks, labels, jumps, falls = [[]], {}, [set()], [True]  # events, label -> block, branch targets, fall-through

    def new_block(fall: bool):
        falls[-1] = fall
        blocks.append([])
        jumps.append(set())
        falls.append(True)

    order = []
    for line in body.splitlines():
        s = line.strip()
        m = re.match(r"(\$L__BB\d+_\d+):", s)
        if m:
            if blocks[-1] or jumps[-1]:
                new_block(True)
            labels[m.group(1)] = len(blocks) - 1
            continue
        m = re.search(r"\b(ld|st|atom|red)\.global", s)
        if m:
            blocks[-1].append("ld" if m.group(1) == "ld" else "st")
        if "griddepcontrol.launch_dependents" in s:
            order.append("launch_dependents")
        if "griddepcontrol.wait" in s:
            order.append("wait")
            blocks[-1].append("wait")
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+)", s)
        if m:
            jumps[-1].add(m.group(1))
            new_block(s.startswith("@"))  # a predicated branch may fall through
        elif re.match(r"(@\S+\s+)?(ret|exit)\b", s):
            new_block(s.startswith("@"))
    cfg = nx.DiGraph()
    cfg.add_nodes_from(range(len(blocks)))
    cfg.add_edges_from((i, labels[t]) for i in range(len(blocks)) for t in jumps[i] if t in labels)
    cfg.add_edges_from((i, i + 1) for i in range(len(blocks) - 1) if falls[i])
    before = []
    for b, events in enumerate(blocks):
        above = nx.ancestors(cfg, b) - nx.descendants(cfg, b)  # (a loop around the wait's block: not before it)
        head = []
        for e in events:
            if e == "wait":
                before.append(head + [x for a in sorted(above) for x in blocks[a] if x != "wait"])
            else:
                head.append(e)
    ftz = set(re.findall(r"\b[a-z0-9]+(?:\.[a-z0-9]+)*\.ftz(?:\.[a-z0-9]+)*", ptx))
    return dict(waits=order.count("wait"), launch_dependents=order.count("launch_dependents"),
                launch_dependents_first=bool(order) and order[0] == "launch_dependents",
                loads_before_wait=[b.count("ld") for b in before], stores_before_wait=[b.count("st") for b in before],
                ftz=sorted(ftz - {"ex2.approx.ftz.f32", "rcp.approx.ftz.f32"}))


def check_pdl_ptx(facts: dict, pdl: bool, label: str = "", late: bool = False) -> None:
    """PDL on: one launch_dependents, first (late: a render option's trigger after a main loop, so one or two of them,
    on each stage's path, anywhere); waits, each with no store before it. Off: neither. No FTZ either way."""
    if pdl and late:
        assert 1 <= facts["launch_dependents"] <= 2 and facts["waits"] >= 1, (label, facts)
        assert not any(facts["stores_before_wait"]), (label, facts)
    elif pdl:
        assert facts["launch_dependents"] == 1 and facts["launch_dependents_first"] and facts["waits"] >= 1, (label, facts)
        assert not any(facts["stores_before_wait"]), (label, facts)
    else:
        assert facts["launch_dependents"] == 0 and facts["waits"] == 0, (label, facts)
    assert not facts["ftz"], (label, facts)


def _check(interpreted: dict, case: str) -> None:
    r = interpreted[case]
    assert r["ok"], f"{case}:\n{r['error']}"


# ---------------------------------------------------------------- qk_norm_pos_kv
def _qk_case(c: dict, window: int, paged: bool, seed: int):
    """Random fp32 inputs: 3 sequences, one chunk crossing the ring's wrap (or page boundaries), one decode token
    far into its sequence, one at the start."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d = c["HQ"], c["HKV"], c["HEAD_DIM"]
    chunk = 6
    cap = window - 1 + chunk
    pos = torch.tensor([cap - 3 + i for i in range(chunk)] + [5 * cap + 2] + [0])
    slot = torch.tensor([2] * chunk + [0] + [1])
    T = len(pos)
    q = torch.randn(T, hq, d, generator=g) * 2
    k = torch.randn(T, hkv, d, generator=g)
    v = torch.randn(T, hkv, d, generator=g)
    w0 = 0.0 if c["NORM_OFFSET"] else 1.0
    wq = w0 + 0.1 * torch.randn(d, generator=g)
    wk = w0 + 0.1 * torch.randn(d, generator=g)
    if paged:
        max_pages = triton_cdiv(int(pos.max()) + 1, c["PAGE_SIZE"])
        P = 3 * max_pages + 5
        kc = torch.full((P, c["PAGE_SIZE"], hkv, d), float("nan"))
        block_table = torch.randperm(P, generator=g)[: 3 * max_pages].view(3, max_pages).to(torch.int32)
        rows = lambda: (block_table[slot, pos // c["PAGE_SIZE"]].long(), pos % c["PAGE_SIZE"])  # noqa: E731
    else:
        kc = torch.full((3, cap, hkv, d), float("nan"))
        block_table = None
        rows = lambda: (slot, pos % cap)  # noqa: E731
    return q, k, v, wq, wk, kc, kc.clone(), slot, pos, block_table, rows()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


QK_CASES = [(spec, mode, layout) for spec in ("tiny", "odd") for mode in ("rope", "ssmax") for layout in ("ring", "paged")]
# more KV heads than one block of heads (HEAD_BLOCK 8): the k / v loop, where one block is loaded up front otherwise
QK_CASES += [("wide", "rope", "paged"), ("wide", "ssmax", "ring")]
# rendered with PDL on (gdc calls in the source; the interpreter skips them): the same results
QK_PDL_CASES = [("odd", "rope", "paged"), ("tiny", "ssmax", "ring")]
# TOKENS (tokens a program): 3 over the cases' 8 tokens (the last program's third token masked), 8 (one program);
# "wide" (20 q heads: more than a block) keeps one token a program
QK_TOKENS_CASES = [("tiny", "rope", "ring", 3), ("odd", "ssmax", "paged", 3), ("odd", "rope", "ring", 8),
                   ("wide", "rope", "paged", 3)]


def check_qk(spec_name, mode, layout, tiny, kdir, pdl: bool = False, tokens: int = 1) -> dict:
    page = (4 if spec_name == "tiny" else 3) if layout == "paged" else None
    if spec_name == "tiny":
        c, window = qk_constants(tiny, 1, mode, "f32", "f32", page), tiny.effective_window
    else:
        c, window = odd_qk_constants(mode, "f32", "f32", page), ODD_WINDOW
        if spec_name == "wide":
            c.update(HQ=20, HKV=10)
    if pdl:
        c["PDL"] = True
    mod = load_interpreted("qk_norm_pos_kv", dict(c, TOKENS=tokens), kdir)
    q, k, v, wq, wk, kc, vc, slot, pos, block_table, (r0, r1) = _qk_case(c, window, layout == "paged", seed=len(c))
    bt = [block_table] if block_table is not None else []
    if tokens > 1:  # the render with TOKENS tokens a program (where q's and k's heads each fit a block) gives the
        # bits of the one-token render
        assert mod.TOKENS == (tokens if c["HQ"] <= 8 and c["HKV"] <= 8 else 1), mod.TOKENS
        one = load_interpreted("qk_norm_pos_kv", c, kdir)
        kc1, vc1, q1 = kc.clone(), vc.clone(), torch.full_like(q, float("nan"))
        one.launch(q, k, v, wq, wk, kc1, vc1, slot, pos, *bt, q1)
    q_out = torch.full_like(q, float("nan"))
    mod.launch(q, k, v, wq, wk, kc, vc, slot, pos, *bt, q_out)
    if tokens > 1:
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in ((q_out, q1), (kc, kc1), (vc, vc1)))

    q_ref, k_ref, v_ref = qk_reference(c, q, k, v, wq, wk, pos)
    assert torch.isfinite(q_out).all()
    assert ((q_out - q_ref).abs().max() / q_ref.abs().max()).item() < 1e-5
    assert ((kc[r0, r1] - k_ref).abs().max() / k_ref.abs().max()).item() < 1e-5
    assert torch.equal(vc[r0, r1], v_ref)
    written = torch.zeros(kc.shape[:2], dtype=torch.bool)
    written[r0, r1] = True
    assert torch.isnan(kc[~written]).all() and torch.isnan(vc[~written]).all(), "a write outside the token rows"
    return dict(q_rel_err=((q_out - q_ref).abs().max() / q_ref.abs().max()).item())


@pytest.mark.parametrize("spec_name,mode,layout", QK_CASES)
def test_qk_norm_pos_kv_matches_reference(spec_name, mode, layout, interpreted):
    _check(interpreted, f"qk[{spec_name}-{mode}-{layout}]")


@pytest.mark.parametrize("spec_name,mode,layout", QK_PDL_CASES)
def test_qk_norm_pos_kv_pdl_render_interpreted(spec_name, mode, layout, interpreted):
    """A PDL render (gdc calls in the kernel, launch_pdl in OPTIONS) runs in the interpreter and still matches."""
    _check(interpreted, f"qk[{spec_name}-{mode}-{layout}+pdl]")


@pytest.mark.parametrize("spec_name,mode,layout,tokens", QK_TOKENS_CASES)
def test_qk_norm_pos_kv_tokens_render_gives_the_same_bits(spec_name, mode, layout, tokens, interpreted):
    """TOKENS tokens a program (their loads issued before the first norm): the one-token render's bits."""
    _check(interpreted, f"qk[{spec_name}-{mode}-{layout}+tokens{tokens}]")


@pytest.mark.parametrize("mode", ["rope", "ssmax"])
def test_reference_parts_compose_like_refs(mode, tiny):
    """qk_reference (parts, offsets kept apart) equals REFS['qk_norm_pos_kv'] given the attrs the kv_write pass
    builds, on the tiny spec (norm weights `w`, SSMax offset 1): the kernels are judged against the IR's reference."""
    c = qk_constants(tiny, 1, mode, "f32", "f32")
    q, k, v, wq, wk, kc, vc, slot, pos, _, (r0, r1) = _qk_case(c, tiny.effective_window, False, seed=1)
    attrs = {"eps": c["EPS"], "w_offset": c["NORM_OFFSET"], "mode": mode, "window": tiny.effective_window}
    if mode == "rope":
        attrs.update(theta=c["THETA"])
    else:
        attrs.update(length=c["LENGTH"], offset=c["POS_OFFSET"], exponent=c["EXPONENT"])
    q_ir, kc_ir, vc_ir = REFS["qk_norm_pos_kv"]([q, k, v, wq, wk, kc, vc, slot, pos], attrs)
    q_ref, k_ref, v_ref = qk_reference(c, q, k, v, wq, wk, pos)
    assert torch.equal(q_ir, q_ref) and torch.equal(kc_ir[r0, r1], k_ref) and torch.equal(vc_ir[r0, r1], v_ref)


def check_qk_fp8(tiny, kdir) -> dict:
    """fp8 e4m3 cache with scales. The interpreter's fp32 -> e4m3 conversion loses the carry when rounding up into
    the next binade (it returns half the value): every other element must equal the reference's bits."""
    c = qk_constants(tiny, 1, "rope", "f32", "f8e4m3")
    mod = load_interpreted("qk_norm_pos_kv", c, kdir)
    q, k, v, wq, wk, kc, vc, slot, pos, _, (r0, r1) = _qk_case(c, tiny.effective_window, False, seed=3)
    v = v * 300  # exercise the clamp
    kc = torch.full(kc.shape, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaN
    vc = kc.clone()
    ks, vs = torch.tensor(0.01), torch.tensor(0.5)
    q_out = torch.full_like(q, float("nan"))
    mod.launch(q, k, v, wq, wk, kc, vc, slot, pos, ks, vs, q_out)
    _, k_ref, v_ref = qk_reference(c, q, k, v, wq, wk, pos, torch.float8_e4m3fn, ks, vs)
    for got, ref in ((kc[r0, r1], k_ref), (vc[r0, r1], v_ref)):
        g, r = got.float(), ref.float()
        bad = got.view(torch.uint8) != ref.view(torch.uint8)
        pow2 = torch.frexp(r.abs())[0] == 0.5
        assert (bad.sum() < 0.1 * bad.numel()) and torch.equal(g[bad] * 2, r[bad]) and pow2[bad].all()
    assert (vc[r0, r1].float().abs().max() == 448) and torch.isnan(kc.float()).sum() == kc.numel() - k_ref.numel()
    return {}


def test_qk_fp8_cache_interpreted(interpreted):
    _check(interpreted, "qk_fp8")


# ---------------------------------------------------------------- moe_router
ROUTER_CASES = [(spec, path, T) for spec in ("tiny", "odd") for path, Ts in (("small", (1, 5, 37)), ("large", (1, 70)))
                for T in Ts] + [("odd-bk128", "large", 70)]  # (K steps of 128 over H 320: the masked last step)
ROUTER_CASES += [("k1", "small", 1), ("k1", "small", 5), ("k1", "large", 70)]
ROUTER_PDL_CASES = [("odd", "small", 5), ("odd", "large", 70)]
ROUTER_ONE_LAUNCH_CASES = [("tiny", "small", 1), ("odd", "small", 1)]  # ONE_LAUNCH on (off by default)
# TF32X2 (large path, bf16 x; the default there): W split by hand into two TF32 parts, two MMAs a step
ROUTER_TF32X2_CASES = [("tiny", "large", 70), ("odd", "large", 70), ("odd-bk128", "large", 70)]
# BF16X3 (large path, bf16 x): W split by a first launch into three exact bf16 parts, three MMAs a step
ROUTER_BF16X3_CASES = [("tiny", "large", 1), ("tiny", "large", 70), ("odd", "large", 70), ("odd-bk128", "large", 70)]
# SPLIT_K (large path): K split over programs below a wave of tiles, the partials summed by the selection
ROUTER_SPLIT_K_CASES = [("tiny", "large", 70), ("odd", "large", 70), ("odd-bk128", "large", 70), ("tiny", "large", 1)]
# BLOCK_M tokens a selection program (the last program's rows masked: 37 tokens), split partials summed too
ROUTER_BLOCK_M_CASES = [("tiny", "large", 37, 2, False), ("odd", "large", 37, 4, False), ("odd", "large", 70, 2, True)]
# SELECT_SORT (the selection by bitonic top-k): bitwise equal to the iterative render, exact ties included
ROUTER_SORT_CASES = [("tiny", "small", 1), ("tiny", "small", 37), ("tiny", "large", 70), ("odd", "small", 5),
                     ("odd", "large", 70)]


def check_router(spec_name, path, T, tiny, kdir, pdl: bool = False, one_launch: bool = False,
                 tf32x2: bool = False, select_sort: bool = False, ties: bool = False, w_split: bool = False,
                 bf16x3: bool = False, split_k: bool = False, block_m: int = 1) -> dict:
    # (TF32X2 and BF16X3 are 16-bit-x renders; the interpreter's dot is fp32 either way)
    dtype = "bf16" if tf32x2 or bf16x3 else "f32"
    c = (router_constants(tiny, path, dtype) if spec_name == "tiny" else
         dict(K1_ROUTER if spec_name == "k1" else ODD_ROUTER, DTYPE=dtype, PATH=path))
    if tf32x2:
        c.update(TF32X2=True, BF16X3=False, PDL=False)
    if bf16x3:
        c.update(BF16X3=True, PDL=pdl)
    c["SPLIT_K"] = split_k  # (the default; off here but in the split cases: the others check the unsplit loop)
    if spec_name == "odd-bk128":
        c["BLOCK_K"] = 128
    if pdl:
        c["PDL"] = True
    if one_launch:
        c["ONE_LAUNCH"] = True
    per_tile = dict(c)  # (w_split: the render splitting W per tile, compared bit for bit)
    if w_split:
        c["W_SPLIT"] = True
    plain = dict(c, SELECT_SORT=False)  # the iterative render (select_sort: compared bit for bit)
    one_row = dict(c)  # (block_m: the render selecting one token a program, compared bit for bit)
    if block_m > 1:
        c["BLOCK_M"] = block_m
    if select_sort:
        c["SELECT_SORT"] = True  # (the default; explicit here)
    mod = load_interpreted("moe_router", c, kdir)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, c["H"], generator=g)
    x = x.bfloat16() if tf32x2 or bf16x3 else x
    W = torch.randn(c["E"], c["H"], generator=g) * 0.05
    bias = torch.randn(c["E"], generator=g) * 0.02
    if ties:  # exact ties: experts 1 and 2 (one group) copy expert 0, and group 1 copies group 0 (equal group scores)
        gsz = c["E"] // c["N_GROUP"]
        W[1:3], bias[1:3] = W[0], bias[0]
        W[gsz:2 * gsz], bias[gsz:2 * gsz] = W[:gsz], bias[:gsz]
    weights = torch.full((T, c["TOP_K"]), float("nan"))
    ids = torch.full((T, c["TOP_K"]), -1, dtype=torch.int64)
    n = mod.scratch_numel(T)
    scratch = torch.full((n + 64,), float("nan"))  # 64 canaries past the end
    mod.launch(x, W, bias, weights, ids, scratch)
    assert torch.isnan(scratch[n:]).all(), "a write past scratch_numel(T)"
    assert int(mod.counters("cpu").abs().sum()) == 0, "the counter is not back at 0"
    assert mod.constexprs(T)["ONE_LAUNCH"] == (one_launch and T == 1)
    assert mod.TF32X2 == tf32x2 and mod.W_SPLIT == w_split and mod.BF16X3 == bf16x3
    assert mod.SPLIT_K == (split_k and path == "large")
    if split_k:  # K split over programs (few tokens): partials after the logits, summed by the selection
        assert mod.constexprs(T)["SPLITS"] == mod.k_splits(T) > 1
        assert n >= T * c["E"] * (1 + mod.k_splits(T))
    if bf16x3:  # W's three bf16 parts in the scratch, from a multiple of 64 after the logits: their sum is W exactly
        o = mod._parts_offset(T)
        assert o % 64 == 0 and o >= T * c["E"] and n == o + (3 * W.numel() + 1) // 2
        parts = scratch[o:n].view(torch.bfloat16)[:3 * W.numel()].view(3, *W.shape).float()
        assert torch.equal(parts[0] + parts[1] + parts[2], W) and parts[2].abs().max() > 0
    if w_split:  # W split once into the scratch: the per-tile split's operands, so the same logits, ids and weights
        tile_mod = load_interpreted("moe_router", per_tile, kdir)
        w0, i0, s0 = torch.full_like(weights, float("nan")), torch.full_like(ids, -1), torch.full((n + 64,), float("nan"))
        tile_mod.launch(x, W, bias, w0, i0, s0)
        assert torch.equal(mod.logits(scratch, T).view(torch.int32), tile_mod.logits(s0, T).view(torch.int32))
        assert torch.equal(ids, i0) and torch.equal(weights.view(torch.int32), w0.view(torch.int32))

    if select_sort or block_m > 1:  # the other render on the same inputs: the same ids and weights, bit for bit
        ref_mod = load_interpreted("moe_router", plain if select_sort else one_row, kdir)
        w0, i0 = torch.full_like(weights, float("nan")), torch.full_like(ids, -1)
        ref_mod.launch(x, W, bias, w0, i0, torch.full((n + 64,), float("nan")))
        assert torch.equal(ids, i0), (ids, i0)
        assert torch.equal(weights.view(torch.int32), w0.view(torch.int32)), (weights, w0)
        if ties:
            return dict(ties="all")
    exact = (x.double() @ W.double().T)
    assert ((mod.logits(scratch, T) - exact).abs().max() / exact.abs().max()).item() < 1e-6
    attrs = dict(n_group=c["N_GROUP"], topk_group=c["TOPK_GROUP"], top_k=c["TOP_K"], renormalize=c["RENORMALIZE"],
                 eps=c["EPS"])
    w_ref, ids_ref = REFS["moe_router"]([x, W, bias], attrs)
    ok = ~router_ties(F.linear(x.float(), W), bias, c, 1e-6)
    assert ok.float().mean() > 0.9
    assert torch.equal(ids[ok], ids_ref[ok])
    assert ((weights[ok] - w_ref[ok]).abs() / w_ref[ok]).max().item() < 1e-6
    return dict(ties=int((~ok).sum()))


@pytest.mark.parametrize("spec_name,path,T", ROUTER_CASES)
def test_moe_router_matches_reference(spec_name, path, T, interpreted):
    _check(interpreted, f"router[{spec_name}-{path}-{T}]")


@pytest.mark.parametrize("spec_name,path,T", ROUTER_ONE_LAUNCH_CASES)
def test_moe_router_one_launch_interpreted(spec_name, path, T, interpreted):
    """The one-launch option at T = 1 (the last program to finish selects; its counter back at 0) matches."""
    _check(interpreted, f"router[{spec_name}-{path}-{T}+one]")


@pytest.mark.parametrize("spec_name,path,T", ROUTER_TF32X2_CASES)
def test_moe_router_w_split_interpreted(spec_name, path, T, interpreted):
    """W_SPLIT (TF32X2 with W's head and rest split once per launch into the scratch, by a first launch): the logits,
    ids and weights of the per-tile split bit for bit, and the reference's (the checks of every case)."""
    _check(interpreted, f"router[{spec_name}-{path}-{T}+wsplit]")


@pytest.mark.parametrize("spec_name,path,T", ROUTER_TF32X2_CASES)
def test_moe_router_tf32x2_render_interpreted(spec_name, path, T, interpreted):
    """TF32X2 (bf16 x: W's tile split by hand into a TF32 head and the TF32-rounded rest, two MMAs a step): the
    logits within 1e-6 of the exact product, the selection equal to the reference's away from near-ties."""
    _check(interpreted, f"router[{spec_name}-{path}-{T}+tf32x2]")


@pytest.mark.parametrize("spec_name,path,T", ROUTER_BF16X3_CASES)
def test_moe_router_bf16x3_render_interpreted(spec_name, path, T, interpreted):
    """BF16X3 (bf16 x: W split by a first launch into three bf16 parts summing to W exactly, three MMAs a step; PDL
    on): the parts' sum equal to W, the logits within 1e-6 of the exact product, the selection equal to the
    reference's away from near-ties."""
    _check(interpreted, f"router[{spec_name}-{path}-{T}+bf16x3]")


@pytest.mark.parametrize("spec_name,path,T", ROUTER_SPLIT_K_CASES)
@pytest.mark.parametrize("bf16x3", [False, True])
def test_moe_router_split_k_interpreted(spec_name, path, T, bf16x3, interpreted):
    """SPLIT_K (the large path's K split over programs when T's tiles are fewer than a wave; the selection sums each
    token's partials; fp32 x, and bf16 x with BF16X3 and PDL): the logits within 1e-6 of the exact product, the
    selection equal to the reference's away from near-ties."""
    _check(interpreted, f"router[{spec_name}-{path}-{T}+splitk{'+bf16x3' if bf16x3 else ''}]")


@pytest.mark.parametrize("spec_name,path,T,block_m,split_k", ROUTER_BLOCK_M_CASES)
def test_moe_router_block_m_interpreted(spec_name, path, T, block_m, split_k, interpreted):
    """BLOCK_M tokens a selection program: the same ids and weights as one token a program, bit for bit, and the
    reference's selection."""
    _check(interpreted, f"router[{spec_name}-{path}-{T}+m{block_m}{'+splitk' if split_k else ''}]")


@pytest.mark.parametrize("spec_name,path,T", ROUTER_SORT_CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_moe_router_select_sort_interpreted(spec_name, path, T, ties, interpreted):
    """SELECT_SORT (the groups and the experts each by one bitonic top-k over packed keys, the weights from the
    chosen logits again): the same ids and weights as the iterative render, bit for bit, exact ties included (experts
    with equal choices, groups with equal scores: the lower index first in both), and the reference's selection."""
    _check(interpreted, f"router[{spec_name}-{path}-{T}+sort{'+ties' if ties else ''}]")


@pytest.mark.parametrize("spec_name,path,T", ROUTER_PDL_CASES)
def test_moe_router_pdl_render_interpreted(spec_name, path, T, interpreted):
    """Both stages of a PDL render (each waits before it reads x or the scratch) run in the interpreter and match."""
    _check(interpreted, f"router[{spec_name}-{path}-{T}+pdl]")


# ---------------------------------------------------------------- ahead-of-time compilation of every variant
def _variants() -> list[tuple[str, str, dict]]:
    """Every bf16 variant at the full spec's TP-8 shapes and the tiny spec's, as rendered by default (PDL on), and
    the tiny spec's again with PDL off."""
    full, tiny = load_spec(ROOT / "models/beam.yaml"), load_spec(ROOT / "models/beam-tiny.yaml")
    out = []
    for name, spec, tp, page, pdls in (("full-tp8", full, 8, 64, (None,)), ("tiny", tiny, 1, 4, (None, False))):
        for pdl in pdls:
            extra, tag = ({}, "") if pdl is None else ({"PDL": pdl}, ",no-pdl")
            for mode in ("rope", "ssmax"):
                for paged in (False, True):
                    for cache in ("bf16", "f8e4m3"):
                        c = qk_constants(spec, tp, mode, "bf16", cache, page if paged else None)
                        out.append((f"qk_norm_pos_kv[{name},{mode},{'paged' if paged else 'ring'},{cache}{tag}]",
                                    "qk_norm_pos_kv", {**c, **extra}))
            for path in ("small", "large"):
                out.append((f"moe_router[{name},{path}{tag}]", "moe_router", {**router_constants(spec, path), **extra}))
                # the selection's own binary (the launcher's second set of options: one warp)
                out.append((f"moe_router[{name},{path},select{tag}]", "moe_router",
                            {**router_constants(spec, path), **extra, "_OPTS": 1}))
            # T = 1: the small path's one launch (the last program to finish selects; an option, off by default)
            out.append((f"moe_router[{name},small,T1{tag}]", "moe_router",
                        {**router_constants(spec, "small"), **extra, "ONE_LAUNCH": True, "_T": 1}))
        if name == "tiny":  # one expert of one group (top_k 1, topk_group 1): the selection's binaries compile
            for path in ("small", "large"):
                out.append((f"moe_router[k1,{path},select]", "moe_router",
                            {**K1_ROUTER, "DTYPE": "bf16", "PATH": path, "_OPTS": 1}))
        if name == "full-tp8":  # SELECT_SORT=False (the iterative selection; the default sorts): both paths' binaries
            for path in ("small", "large"):
                out.append((f"moe_router[{name},{path},select,iterative]", "moe_router",
                            {**router_constants(spec, path), "SELECT_SORT": False, "_OPTS": 1}))
        if name == "full-tp8":  # BF16X3=False (BF16X3, W's three bf16 parts, is the bf16 default): TF32X2 (W split
            # by hand), tf32x3 (cvt.rna), and TF32X2 with W split once by a first launch
            out.append((f"moe_router[{name},large,tf32x2]", "moe_router",
                        {**router_constants(spec, "large"), "BF16X3": False}))
            out.append((f"moe_router[{name},large,tf32x3]", "moe_router",
                        {**router_constants(spec, "large"), "BF16X3": False, "TF32X2": False}))
            out.append((f"moe_router[{name},large,w-split]", "moe_router",
                        {**router_constants(spec, "large"), "BF16X3": False, "W_SPLIT": True}))
            # the first launch of each (stage 2: W split into the scratch), a binary of its own
            out.append((f"moe_router[{name},large,split]", "moe_router", {**router_constants(spec, "large"), "_OPTS": 2}))
            out.append((f"moe_router[{name},large,w-split,split]", "moe_router",
                        {**router_constants(spec, "large"), "BF16X3": False, "W_SPLIT": True, "_OPTS": 2}))
            # SPLIT_K at 512 tokens (8 K splits; the selection sums the partials)
            out.append((f"moe_router[{name},large,split-k,T512]", "moe_router",
                        {**router_constants(spec, "large"), "SPLIT_K": True, "_T": 512}))
            # TOKENS (8 tokens a program, their loads before the first norm): a sliding and a full layer's render
            for mode, cache in (("rope", "f8e4m3"), ("ssmax", "f8e4m3")):
                out.append((f"qk_norm_pos_kv[{name},{mode},ring,{cache},tokens8]", "qk_norm_pos_kv",
                            {**qk_constants(spec, tp, mode, "bf16", cache, None), "TOKENS": 8}))
    return out


def _compile(args) -> dict:
    """One AOT compile in a worker process (the interpreter off); what the test asserts about its output."""
    label, template, constants, arch, directory = args
    os.environ.pop("TRITON_INTERPRET", None)
    constants = dict(constants)
    T = constants.pop("_T", None)
    which = constants.pop("_OPTS", 0)  # which of the launcher's option sets
    mod = load_kernel(KernelSpec(template, template, constants), directory)
    if T is not None:  # the constexprs the launcher launches T tokens with
        mod.CONSTEXPRS = dict(mod.constexprs(T), INTERPRET=False)
    options = launch_options(mod)[which]
    ck = aot_compile(mod, arch, options)
    ptx = ck.asm["ptx"]
    from test_kernels_gemv import local_bytes

    return dict(label=f"{label}@sm_{arch}", cubin=len(ck.asm["cubin"]), shared=ck.metadata.shared,
                local=local_bytes(ck.asm["cubin"], Path(directory)), stage=options.get("constexprs", {}).get("STAGE"),
                mma=bool(re.search(r"\bw?mma", ptx)), fp8_cvt="cvt.rn.satfinite.e4m3x2.f32" in ptx,
                div_rn="div.rn.f32" in ptx, fp8=constants.get("CACHE_DTYPE") == "f8e4m3",
                router=template == "moe_router", router_path=constants.get("PATH"),
                tf32_split=ptx.count("cvt.rna.tf32.f32"), tf32x2=bool(getattr(mod, "TF32X2", False)),
                w_split=bool(getattr(mod, "W_SPLIT", False)) or bool(getattr(mod, "BF16X3", False)),
                bf16x3=bool(getattr(mod, "BF16X3", False)), bf16_mma=bool(re.search(r"mma\S*\.bf16\.bf16", ptx)),
                pdl=constants.get("PDL", True), options=options,
                launch_pdl=bool(ck.metadata.launch_pdl), one_launch=T == 1,
                atomic=bool(re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx)), fence="fence.acq_rel.gpu" in ptx,
                **pdl_facts(ptx))


def test_aot_compile_every_variant(tmp_path):
    """All variants at the full spec's TP-8 shapes and the tiny spec's (and the tiny spec's without PDL), for sm_90a
    and sm_100a (2 processes). The options contract: the launcher's OPTIONS, compiled with by aot_compile. PDL:
    griddepcontrol.launch_dependents first, then one wait (the router: each stage a binary of its own), no global
    store before it, and the parameters loaded before it where a binary reads any (norm weights / W / the bias); none
    of it without PDL. No binary spills (local memory a thread <= SMALL_LOCAL)."""
    from test_kernels_gemv import SMALL_LOCAL

    jobs = [(label, t, c, arch, str(tmp_path / f"sm{arch}")) for label, t, c in _variants() for arch in (90, 100)]
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_compile, jobs))
    for r in results:
        # no spills: a launched binary's local memory is reserved for every thread slot of the GPU (the router's
        # selection, compiled ahead of time with a runtime stage, held stage 0's GEMM at one warp: 25 KB a thread;
        # libdevice's pow takes a 32-byte frame)
        assert r["cubin"] > 0 and r["shared"] <= SMEM_LIMIT and (r["local"] or 0) <= SMALL_LOCAL, r
        # the router: each launch its own binary (STAGE pinned), the selection's (stage 1) without stage 0's GEMM and
        # stage 0's without the selection (its sigmoid's division); the one-launch path: both in one
        if r["router"] and r["router_path"] == "small":
            assert not r["mma"], f"{r['label']}: small-M fp32 router on tensor cores (TF32?)"
        if r["router"] and r["router_path"] == "large" and r["stage"] is None:  # tensor cores, operands split
            assert r["mma"] and (r["tf32_split"] == 0 if r["tf32x2"] or r["bf16x3"] else r["tf32_split"] >= 2), r
            if r["label"].endswith("@sm_90"):  # BF16X3: bf16 wgmma (the others: TF32; sm_100's tcgen05 says f16)
                assert r["bf16_mma"] == r["bf16x3"], r
        if r["router"] and r["stage"] is not None:
            assert not r["mma"], r
        assert r["fp8_cvt"] == r["fp8"], r
        if r["router"]:
            assert r["div_rn"] == (r["stage"] == 1 or r["one_launch"]), r  # IEEE division: the sigmoid
        else:
            assert r["div_rn"] or not r["fp8"], r  # / scale
        want = dict(num_warps=r["options"]["num_warps"], enable_fp_fusion=False, enable_reflect_ftz=False,
                    launch_pdl=r["pdl"], **({"num_stages": 2} if r["router"] else {}),
                    **({"constexprs": {"STAGE": r["stage"]}} if r["stage"] is not None else {}))
        assert r["options"] == want and r["launch_pdl"] == r["pdl"], r
        check_pdl_ptx(r, r["pdl"], r["label"])
        # the one-launch router: an acq_rel atomic at GPU scope and fences (the last program reads the others' logits)
        assert r["atomic"] == r["fence"] == r["one_launch"], r
        if r["pdl"]:
            assert r["waits"] == 1, r  # (the router: each stage's binary of its own)
            # parameters first (qk: the weights; the router's selection the bias, its small path's stage 0 its block
            # of W); the large path's stage 0 reads W (or its parts, the split's output) step by step with x
            if not (r["router"] and r["router_path"] == "large" and r["stage"] is None):
                assert max(r["loads_before_wait"]) > 0, r
    assert len(results) == 2 * len(_variants()) == 102
    assert sum(r["pdl"] for r in results) == 76
    # the router's launcher: its first launch with OPTIONS (4 warps), the selection with OPTIONS_SELECT (1 warp)
    assert {r["options"]["num_warps"] for r in results if r["router"] and ",select" in r["label"]} == {1}
    assert {r["stage"] for r in results if r["router"] and ",select" in r["label"]} == {1}
    assert {r["stage"] for r in results if r["router"] and ",split]" in r["label"]} == {2}


# ---------------------------------------------------------------- the interpreter child: python THIS_FILE OUT.json DIR
def _interpreter_cases(tiny):
    yield from ((f"qk[{a}-{b}-{c}]", check_qk, (a, b, c)) for a, b, c in QK_CASES)
    yield "qk_fp8", check_qk_fp8, ()
    yield from ((f"router[{a}-{b}-{t}]", check_router, (a, b, t)) for a, b, t in ROUTER_CASES)
    yield from ((f"qk[{a}-{b}-{c}+pdl]", lambda *x: check_qk(*x, pdl=True), (a, b, c)) for a, b, c in QK_PDL_CASES)
    yield from ((f"qk[{a}-{b}-{c}+tokens{n}]", lambda *x, n=n: check_qk(*x, tokens=n), (a, b, c))
                for a, b, c, n in QK_TOKENS_CASES)
    yield from ((f"router[{a}-{b}-{t}+pdl]", lambda *x: check_router(*x, pdl=True), (a, b, t))
                for a, b, t in ROUTER_PDL_CASES)
    yield from ((f"router[{a}-{b}-{t}+one]", lambda *x: check_router(*x, one_launch=True), (a, b, t))
                for a, b, t in ROUTER_ONE_LAUNCH_CASES)
    yield from ((f"router[{a}-{b}-{t}+tf32x2]", lambda *x: check_router(*x, tf32x2=True), (a, b, t))
                for a, b, t in ROUTER_TF32X2_CASES)
    yield from ((f"router[{a}-{b}-{t}+wsplit]", lambda *x: check_router(*x, tf32x2=True, w_split=True), (a, b, t))
                for a, b, t in ROUTER_TF32X2_CASES)
    yield from ((f"router[{a}-{b}-{t}+bf16x3]", lambda *x: check_router(*x, bf16x3=True, pdl=True), (a, b, t))
                for a, b, t in ROUTER_BF16X3_CASES)
    yield from ((f"router[{a}-{b}-{t}+splitk]", lambda *x: check_router(*x, split_k=True), (a, b, t))
                for a, b, t in ROUTER_SPLIT_K_CASES)
    yield from ((f"router[{a}-{b}-{t}+splitk+bf16x3]", lambda *x: check_router(*x, split_k=True, bf16x3=True, pdl=True),
                 (a, b, t)) for a, b, t in ROUTER_SPLIT_K_CASES)
    yield from ((f"router[{a}-{b}-{t}+m{m}{'+splitk' if sk else ''}]",
                 lambda *x, m=m, sk=sk: check_router(*x, block_m=m, split_k=sk), (a, b, t))
                for a, b, t, m, sk in ROUTER_BLOCK_M_CASES)
    for ties in (False, True):
        yield from ((f"router[{a}-{b}-{t}+sort{'+ties' if ties else ''}]",
                     lambda *x, ties=ties: check_router(*x, select_sort=True, ties=ties), (a, b, t))
                    for a, b, t in ROUTER_SORT_CASES)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1" and "triton" not in sys.modules
    out, kdir = Path(sys.argv[1]), Path(sys.argv[2])
    tiny_spec = tiny_spec_()
    results = {}
    for case, fn, args in _interpreter_cases(tiny_spec):
        try:
            results[case] = dict(ok=True, **fn(*args, tiny_spec, kdir))
        except Exception:  # noqa: BLE001 - reported by the test of that case
            results[case] = dict(ok=False, error=traceback.format_exc())
    out.write_text(json.dumps(results, indent=1))
