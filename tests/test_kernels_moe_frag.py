"""moe_nvfp4_frag (the NVFP4 MoE experts + combine of small decode steps in Gluon, `beamc compile
--moe-frag-max-tokens N`) on the CPU: its renders compile ahead of time for sm_90a and sm_100a at the full spec's TP-8
shapes and the tiny spec's TP-1 / TP-2 shapes (both stages' binaries, the launcher's options, no local memory); the PTX
holds the fragment MMAs, the decode, the L1 prefetches and PDL's wait before any load; its fragment mapping meets the
relayout's definition; the emitter picks it only where it applies; its launcher refuses what it cannot take. A Gluon
kernel does not run in Triton's CPU interpreter: its numerics are checked on the H200
(tests/gpu/test_kernels_moe_gpu.py::test_moe_nvfp4_frag: against the fp32 reference and the decode kernel's COMBINE
render, which the interpreter checks here)."""
from __future__ import annotations

import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

from beamc.codegen.emitters import MOE_COMBINE_MAX_TOKENS, frag_shapes
from beamc.codegen.kernel import KernelSpec, aot_compile, launch_options, load_kernel
from beamc.codegen.package import compile_package
from beamc.errors import BeamcError
from beamc.passes.manager import PASSES
from beamc.spec import load_spec
from test_kernels_gemv import local_bytes, SMALL_LOCAL

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"full-tp8": dict(E=256, H=5120, I=320, TOP_K=8), "tiny-tp1": dict(E=16, H=256, I=64, TOP_K=4),
          "tiny-tp2": dict(E=16, H=256, I=32, TOP_K=4)}


def _constants(shape: str, **extra) -> dict:
    return dict(DTYPE="bf16", ROUTED_SCALE=2.5, **SHAPES[shape], **extra)


def _compile(args) -> list[dict]:
    """Both stages' binaries of one render for one arch, in a worker process: what the test asserts about them."""
    label, constants, arch, directory = args
    os.environ.pop("TRITON_INTERPRET", None)
    mod = load_kernel(KernelSpec("moe_nvfp4_frag", "moe_experts", constants), directory)
    out = []
    for stage, opts in enumerate(launch_options(mod)):
        ck = aot_compile(mod, arch, opts)
        ptx = ck.asm["ptx"]
        body = ptx[ptx.index("griddepcontrol.wait"):] if "griddepcontrol.wait" in ptx else ""
        head = ptx[:ptx.index("griddepcontrol.wait")] if body else ptx
        out.append(dict(label=f"{label}@sm_{arch}/stage{stage}", stage=stage, options=opts,
                        launch_pdl=bool(ck.metadata.launch_pdl), local=local_bytes(ck.asm["cubin"], Path(directory)),
                        mma=len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16", ptx)),
                        bf16x2=ptx.count("mul.rn.bf16x2"), prefetch_l1=ptx.count("prefetch.global.L1"),
                        waits=ptx.count("griddepcontrol.wait"), triggers=ptx.count("griddepcontrol.launch_dependents"),
                        loads_before_wait=len(re.findall(r"\bld\.global", head)),
                        loads_after_wait=len(re.findall(r"\bld\.global", body)),
                        cp_async=len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx)),
                        group_waits=len(re.findall(r"cp\.async\.wait_group", ptx)),
                        units=(mod.NU0, mod.NU1), words=(mod.U0, mod.U1), top_k=mod.TOP_K))
    return out


def test_frag_renders_compile_for_sm90a_and_sm100a(tmp_path):
    """Every shape, as by default and with CP_ASYNC, for sm_90a and sm_100a (2 processes): two binaries (stage 0 on
    KSPLIT warps capped for 3 programs an SM at the TP-8 shapes, stage 1 on TOP_K warps), PDL launches, no local
    memory; the PTX has 2 MMAs and 8 bf16x2 scale multiplies per unit word pair, one L1 prefetch per stage; stage 0
    waits (PDL) before its first load, stage 1 reads its weights and routing before its wait and only h after it."""
    jobs = [(label + tag, _constants(label, **extra), arch, str(tmp_path / f"sm{arch}"))
            for label in SHAPES for tag, extra in (("", {}), ("/cp.async", dict(CP_ASYNC=True)),
                                                   ("/cp.async-groups", dict(CP_ASYNC=True, CP_GROUPS=2)))
            for arch in (90, 100) if label.startswith("full") or "groups" not in tag]  # (tiny: 1 unit a warp)
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = [r for rs in pool.map(_compile, jobs) for r in rs]
    assert len(results) == 2 * len(jobs) == 2 * 2 * (3 * 2 + 1)
    for r in results:
        assert r["launch_pdl"] and (r["local"] or 0) <= SMALL_LOCAL, r
        assert r["mma"] >= 2 and r["mma"] % 2 == 0 and r["bf16x2"] == 4 * r["mma"], r
        assert r["prefetch_l1"] == 1 and r["waits"] == 1 and r["triggers"] == 1, r
        assert ("cp.async" in r["label"]) == (r["cp_async"] > 0), r  # (CP_ASYNC: the words through cp.async)
        if r["stage"] == 0 and "cp.async" in r["label"]:  # one wait a commit group (CP_GROUPS 2: 2 on 2+ units)
            assert r["group_waits"] == (2 if "groups" in r["label"] else 1), r
        if r["stage"] == 0:
            assert r["loads_before_wait"] == 0 and r["options"]["num_warps"] == 4, r
            if r["label"].startswith("full"):
                assert r["options"]["maxnreg"] == 168 and r["units"] == (10, 5), r
        else:
            assert r["loads_before_wait"] > 0 and r["loads_after_wait"] > 0, r
            assert r["options"]["num_warps"] == r["top_k"], r


def test_frag_shapes_follow_the_template():
    """`emitters.frag_shapes` (the emitter's test) agrees with what the template renders: the full spec's and the
    tiny spec's ranks render; shapes whose relayout chunks are below 32 values, odd top-k or rows do not."""
    spec, tiny = load_spec(ROOT / "models/beam.yaml"), load_spec(ROOT / "models/beam-tiny.yaml")
    for s, tp in ((spec, 8), (spec, 1), (tiny, 1), (tiny, 2)):
        H, I, k = s.hidden_size, s.mlp.moe.d_ff // tp, s.mlp.moe.top_k
        assert frag_shapes(H, I, k), (H, I, k)
    assert not frag_shapes(256, 48, 4)  # I: 16-value chunks
    assert not frag_shapes(256, 64, 6)  # top-k 6
    assert not frag_shapes(200, 64, 4)  # H / 4 = 50
    for label, c in SHAPES.items():
        load_kernel(KernelSpec("moe_nvfp4_frag", "moe_experts", _constants(label)), None)


def test_frag_is_an_option_of_small_bf16_sm90_steps():
    """`--moe-frag-max-tokens N`: at TP 2 (the combine_experts pass's op), the tiny spec's decode steps of up to N
    tokens take moe_nvfp4_frag, then up to emitters.MOE_COMBINE_MAX_TOKENS the COMBINE render as before (N at or
    above it: none of it); recorded in the manifest; the experts' relayout unchanged (the frag kernel reads it). Off
    by default, and never for fp32 instances, sm100 or without the relayout (it reads only the re-laid-out words); a
    negative count refused."""
    tiny = load_spec(ROOT / "models/beam-tiny.yaml")

    def moe(pkg):
        return [(ln.kernel.template, ln.min_tokens, ln.max_tokens) for n, ln in pkg.steps["decode"].launches
                if n.op == "moe_experts" and ln.kernel is not None]

    on = compile_package(tiny, tp=2, passes=list(PASSES), phases=("decode",), dtype="bf16", moe_frag_max_tokens=1)
    got = moe(on)
    most = MOE_COMBINE_MAX_TOKENS
    assert got[:2] == [("moe_nvfp4_frag", 0, 1), ("moe_nvfp4_decode", 2, most)], got
    assert on.manifest()["moe_frag_max_tokens"] == 1 and on.nvfp4_relayouts()
    capped = moe(compile_package(tiny, tp=2, passes=list(PASSES), phases=("decode",), dtype="bf16",
                                 moe_frag_max_tokens=20))
    assert capped[0] == ("moe_nvfp4_frag", 0, most) and capped[1][1] == most + 1, capped  # (the COMBINE range)
    with pytest.raises(BeamcError, match="--moe-frag-max-tokens"):
        compile_package(tiny, tp=2, passes=list(PASSES), phases=("decode",), moe_frag_max_tokens=-1)
    frag = next(ln.kernel for n, ln in on.steps["decode"].launches
                if ln.kernel and ln.kernel.template == "moe_nvfp4_frag")
    assert frag.constants["ROUTED_SCALE"] == 2.5 and frag.constants["TOP_K"] == 4
    off = compile_package(tiny, tp=2, passes=list(PASSES), phases=("decode",), dtype="bf16")
    assert all(t != "moe_nvfp4_frag" for t, *_ in moe(off)) and off.manifest()["moe_frag_max_tokens"] == 0
    for kw in (dict(dtype="f32"), dict(dtype="bf16", target="sm100"), dict(dtype="bf16", nvfp4_relayout=False)):
        pkg = compile_package(tiny, tp=2, passes=list(PASSES), phases=("decode",), moe_frag_max_tokens=1, **kw)
        assert all(t != "moe_nvfp4_frag" for t, *_ in moe(pkg)), kw


def test_frag_launcher_refuses_what_it_cannot_take():
    """ModelOpt (uint8) codes, fp32 activations, a wrong-size output: refused before any launch."""
    mod = load_kernel(KernelSpec("moe_nvfp4_frag", "moe_experts", _constants("tiny-tp2")), None)
    E, H, I, k = 16, 256, 32, 4
    ps = [torch.zeros(E, 2 * I, H // 8, dtype=torch.int32), torch.zeros(E, 2 * I, H // 16, dtype=torch.uint8),
          torch.ones(E, 2), torch.zeros(E, H, I // 8, dtype=torch.int32), torch.zeros(E, H, I // 16, dtype=torch.uint8),
          torch.ones(E, 1)]
    x, idx, w = torch.zeros(2, H, dtype=torch.bfloat16), torch.zeros(2, k, dtype=torch.int64), torch.zeros(2, k)
    with pytest.raises(AssertionError):
        mod.launch(x, idx, *ps, w, torch.zeros(1, H, dtype=torch.bfloat16))
    raw = [ps[0].view(torch.uint8)[..., : H // 2].contiguous()] + ps[1:]
    with pytest.raises(AssertionError, match="re-laid-out"):
        mod.launch(x[:1], idx[:1], *raw, w[:1], torch.zeros(1, H, dtype=torch.bfloat16))
    with pytest.raises(AssertionError):
        mod.launch(x[:1].float(), idx[:1], *ps, w[:1], torch.zeros(1, H, dtype=torch.bfloat16))
    with pytest.raises(AssertionError, match="bf16 only"):
        load_kernel(KernelSpec("moe_nvfp4_frag", "moe_experts", dict(_constants("tiny-tp2"), DTYPE="f32")), None)


def _unit_words(q: int, c: int, m: int, NG: int, U: int) -> tuple[int, int, int]:
    """The template's `_word_ptrs` / `_xload` for word m of unit q of a lane of column c: (word offset in the row,
    block-scale byte offset in the row, k0 of the x values it is multiplied with)."""
    G = (q % (NG // U)) * U + m
    kw0 = (q // (NG // U)) * (NG * 4)
    k0 = (q // (NG // U)) * (NG * 32) + 32 * G + 8 * c
    return kw0 + c * NG + G, kw0 // 2 + (c // 2) * NG + G, k0


@pytest.mark.parametrize("label", sorted(SHAPES))
def test_fragment_words_meet_their_x(label):
    """The fragment mapping against the relayout's definition (moe_nvfp4_decode.RELAYOUT: word c' * NG + G' of a
    chunk of BK values holds k = 32 G' + 8 c' .. + 7; block 2 G' + c1 is byte c1 * NG + G'), for both stages of each
    shape: every word a lane loads holds exactly the 8 values of x it is multiplied with, its block-scale byte is
    that block's, and a row pair's lanes, units and warps cover each k of the row once."""
    mod = load_kernel(KernelSpec("moe_nvfp4_frag", "moe_experts", _constants(label)), None)
    for K, BK, U, NU, warps in ((mod.H, mod.BK0, mod.U0, mod.NU0, mod.KSPLIT), (mod.I, mod.BK1, mod.U1, mod.NU1, 1)):
        NG = BK // 32
        seen = []
        for w in range(warps):
            for c in range(4):  # (the lane's g picks the rows, not the k)
                for u in range(NU):
                    q = w * NU + u if warps > 1 else u
                    for m in range(U):
                        wo, so, k0 = _unit_words(q, c, m, NG, U)
                        ch, s = divmod(wo, BK // 8)
                        cc, gg = divmod(s, NG)
                        assert ch * BK + 32 * gg + 8 * cc == k0, (label, K, w, c, u, m)
                        chs, b = divmod(so, BK // 16)
                        c1, g2 = divmod(b, NG)
                        assert chs == ch and 16 * (2 * g2 + c1) <= 32 * gg + 8 * cc < 16 * (2 * g2 + c1) + 16, (wo, so)
                        seen.append(k0)
        assert sorted(seen) == list(range(0, K, 8)), (label, K)
