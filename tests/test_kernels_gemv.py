"""The small-M (decode) GEMM template `gemv` (IR ops linear, linear_packed, gate_up_swiglu, linear_softcap) on CPU.

1. fp32 instances of each EPILOGUE (none, split, swiglu, softcap) at tiny shapes (K 256, N 96; K 200, N 90 for a
   masked K tail and partial row blocks; K 600, N 90 rendered with SMS = 4, which makes the tensor-core path split K
   and loop over several K blocks per program, with a partly and a wholly masked K block) run under Triton's CPU
   interpreter and match `beamc.ir.reference.REFS[op]` on the same inputs (max relative error < 1e-5), outputs
   poisoned with NaN: T = 1 (the CUDA-core path) and T = 2, 5, 17 (the tensor-core path, tl.dot in fp32, token
   blocks 16 and 32 with masked tokens; T = 70 too at K 200: two token blocks of 64). Each with PDL off (the fp32
   default) and on (gdc calls and the L2 prefetch do nothing in the interpreter), into a caller's NaN-poisoned
   scratch (nothing written past scratch_numel(T)) and once into the launcher's own.
2. bf16 instances at the full spec's TP-8 shapes compile ahead of time for sm_90a and sm_100a (no GPU needed), on both
   paths (T = 1 and T = 8; T = 32 and 64 too for two shapes on sm_90a):
   packed QKVG K 5120 -> [768, 128, 128, 768], o_proj K 768 -> 5120, gate_up K 5120 -> F 2560 (swiglu),
   down K 2560 -> 5120, lm_head K 5120 -> 18992 (softcap). With PDL, launch_dependents first, no store before a
   wait; the CUDA-core path loads its W tile before stage 0's wait, the tensor-core path prefetches its first W
   blocks into L2 there (and copies nothing before it); no flush-to-zero; IEEE divisions. The tensor-core path
   holds wgmma (sm_90a) / tcgen05.mma (sm_100a) and 16-byte cp.async copies; with cuobjdump (Triton ships one) its
   sm_90a SASS holds HGMMA and LDGSTS.128 and no local memory (no spills).
3. The rendered modules keep the contract of `beamc.codegen.kernel` (launcher args = IR inputs, outputs, scratch),
   and the tensor-core split rule gives every TP-8 shape one wave of >= 132 programs.

Triton's interpreter runs in a subprocess (see `interpreted`): the compiled copies here never see TRITON_INTERPRET.
"""
from __future__ import annotations

import inspect
import json
import os
import re
from pathlib import Path

import pytest
import torch

from beamc.codegen.kernel import KernelSpec, aot_compile, load_kernel
from beamc.ir.reference import REFS
from conftest import assert_template_contract, rel_err, run_interpreted_main
from test_kernels_attn_router import check_pdl_ptx, pdl_facts

ROOT = Path(__file__).resolve().parents[1]

OPS = {"none": "linear", "split": "linear_packed", "swiglu": "gate_up_swiglu", "softcap": "linear_softcap"}
IR_ARGS = {"none": ["x", "w", "out"], "split": ["x", "w", "q", "k", "v", "gate"],
           "swiglu": ["x", "wg", "wu", "out"], "softcap": ["x", "w", "out"]}
CAP = 30.0


def kernel_spec(epi: str, K: int, N: int, dtype: str, splits=None, pdl: bool | None = None,
                **extra) -> tuple[KernelSpec, dict]:
    """(KernelSpec, IR attrs) of one gemv instance: N is the output columns (F for swiglu, sum(splits) for split);
    extra: more template constants (SMS, TC_MIN_T)."""
    c = dict(EPILOGUE=epi, K=K, N=N, DTYPE=dtype, **extra)
    attrs = {}
    if epi == "split":
        splits = splits or [N // 3, N // 6, N // 6, N - N // 3 - 2 * (N // 6)]
        assert sum(splits) == N
        c["SPLITS"] = list(splits)
        attrs["splits"] = list(splits)
    if epi == "softcap":
        c["CAP"] = CAP
        attrs["cap"] = CAP
    if pdl is not None:
        c["PDL"] = pdl
    return KernelSpec("gemv", OPS[epi], c), attrs


def make_inputs(epi: str, K: int, N: int, T: int, dtype: torch.dtype, device="cpu", gen=None, attrs=None):
    """(IR inputs, output (shape, dtype)s), x ~ N(0, 1), W ~ N(0, 1/K) (outputs ~ N(0, 1))."""
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    x = randn(T, K)
    if epi == "swiglu":
        ins = [x, randn(N, K, scale=2.0 / K ** 0.5), randn(N, K, scale=K ** -0.5)]
    elif epi == "softcap":
        ins = [x, randn(N, K, scale=40.0 / K ** 0.5)]  # logits ~ N(0, 40): the cap (30) matters
    else:
        ins = [x, randn(N, K, scale=K ** -0.5)]
    if epi == "split":
        outs = [((T, n), dtype) for n in attrs["splits"]]
    else:
        outs = [((T, N), torch.float32 if epi == "softcap" else dtype)]
    return ins, outs


# ---------------------------------------------------------------- 1. fp32 instances under the interpreter
# (K, N, SMS): aligned; a masked K tail and partial row and column blocks; SMS = 4 -> split K and several K blocks;
# K 1280 -> five K chunks of the one-pass path (T = 1); "split-t1": ONE_PASS off (T = 1 through partials + stage 1);
# "x-late": the one-pass path without X_EARLY (each chunk of x loaded after the previous chunk's sum: the old default)
SHAPES_FP32 = ((256, 96, None), (200, 90, None), (600, 90, 4), (1280, 40, None), (600, 90, "split-t1"),
               (1280, 40, "x-late"))
CASES = [(epi, K, N, sms, pdl) for epi in OPS for K, N, sms in SHAPES_FP32 for pdl in (False, True)]
T_INTERPRETED = (1, 2, 5, 17)  # 1: CUDA-core path; 2, 5: token block 16; 17: token block 32
T_TWO_BLOCKS = 70  # token block 64, twice (the second one partly masked), at K 200 only (interpreter time)


def _case_id(epi, K, N, sms, pdl) -> str:
    return f"{epi}-K{K}-N{N}{f'-sms{sms}' if sms else ''}-{'pdl' if pdl else 'nopdl'}"


def _interpreted_main(out: str) -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: every fp32 case against its reference ->
    {case: {"errs": [...], "paths": [[T, BLOCK_T, SPLIT_K, K blocks per program, K % K_CHUNK], ...]}}."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    results = {}
    directory = Path(out).parent / "interpreted"
    for epi, K, N, sms, pdl in CASES:
        extra = ({"ONE_PASS": False} if sms == "split-t1" else {"X_EARLY": False} if sms == "x-late"
                 else {"SMS": sms} if sms else {})
        ks, attrs = kernel_spec(epi, K, N, "f32", pdl=pdl, **extra)
        mod = load_kernel(ks, directory)
        gen = torch.Generator().manual_seed(11)
        errs, paths = [], []
        runs = [(T, True) for T in T_INTERPRETED] + [(5, False)]  # a caller's scratch, then the launcher's own
        if K == 200:
            runs.append((T_TWO_BLOCKS, True))
        for T, fixed in runs:
            ins, outs = make_inputs(epi, K, N, T, torch.float32, gen=gen, attrs=attrs)
            got = [torch.full(shape, float("nan"), dtype=dt) for shape, dt in outs]
            n = mod.scratch_numel(T)
            scratch = torch.full((n + 64,), float("nan")) if fixed else None
            mod.launch(*ins, *got, scratch=scratch)
            want = REFS[ks.op](ins, attrs)
            assert len(want) == len(got) and all(g.shape == w.shape and g.dtype == w.dtype
                                                 for g, w in zip(got, want)), _case_id(epi, K, N, sms, pdl)
            errs += [float("inf") if g.isnan().any() else rel_err(g, w) for g, w in zip(got, want)]
            if fixed and not scratch[n:].isnan().all():
                errs.append(float("inf"))  # a write past scratch_numel(T)
            c = mod.constexprs(T)
            paths.append([T, c["BLOCK_T"], c["SPLIT_K"], c["K_CHUNK"] // c["BLOCK_K"], K % c["K_CHUNK"]])
        results[_case_id(epi, K, N, sms, pdl)] = dict(errs=errs, paths=paths)
    Path(out).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Triton's interpreter in its own process (see tests/test_kernels_pointwise.py: `interpreted`)."""
    return run_interpreted_main("test_kernels_gemv", tmp_path_factory.mktemp("interpreted_gemv") / "results.json")


@pytest.mark.parametrize("case", CASES, ids=[_case_id(*c) for c in CASES])
def test_interpreted_fp32_matches_reference(case, interpreted):
    """fp32 instance vs REFS[op] on both paths (T = 1; T = 2, 5, 17 and 70), outputs and a caller's scratch
    poisoned with NaN, nothing written past scratch_numel(T)."""
    errs = interpreted[_case_id(*case)]["errs"]
    assert errs and max(errs) < 1e-5, errs


def test_interpreted_cases_cover_both_paths(interpreted):
    """The cases reach: the CUDA-core path (T = 1); the tensor-core path at token blocks 16, 32 and 64 (two blocks),
    with split K, with several K blocks per program, and with a masked K tail."""
    paths = [p for r in interpreted.values() for p in r["paths"]]
    assert {bt for T, bt, *_ in paths if T == 1} == {0}
    tc = [p for p in paths if p[0] > 1]
    assert all(bt > 0 for _, bt, *_ in tc) and {bt for _, bt, *_ in tc} == {16, 32, 64}
    assert any(split > 1 for _, _, split, _, _ in tc)
    assert any(nk > 1 for _, _, _, nk, _ in tc)
    assert any(split > 1 and nk > 1 for _, _, split, nk, _ in tc)
    assert any(tail for *_, tail in tc)


# ---------------------------------------------------------------- 2. bf16 at the full spec's TP-8 shapes, AOT
def _tp8_shapes() -> dict:
    """{name: (epilogue, K, N, splits)} of rank 0 at TP 8, from the full spec."""
    from beamc.checkpoint.layout import rank_dims
    from beamc.spec import load_spec

    s = load_spec(ROOT / "models" / "beam.yaml")
    r = rank_dims(s, 8)
    H, d = s.hidden_size, s.attention.head_dim
    q = r.heads * d
    kv = r.kv_heads * d
    return dict(H=H, q=q, kv=kv, F=r.dense_ff, V=r.vocab, cap=s.logits.softcap)


# the task's shapes (rank 0 at TP 8); test_tp8_shapes_match_spec checks them against the spec
TP8 = {
    "qkvg": ("split", 5120, 1792, [768, 128, 128, 768]),
    "o_proj": ("none", 768, 5120, None),
    "gate_up": ("swiglu", 5120, 2560, None),
    "down": ("none", 2560, 5120, None),
    "lm_head": ("softcap", 5120, 18992, None),
}


def test_tp8_shapes_match_spec():
    d = _tp8_shapes()
    assert (d["H"], d["q"], d["kv"], d["F"], d["V"]) == (5120, 768, 128, 2560, 18992), d
    assert TP8["qkvg"][3] == [d["q"], d["kv"], d["kv"], d["q"]] and TP8["lm_head"][2] == d["V"]


@pytest.fixture(scope="module")
def kdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gemv_kernels")


# (name, arch, T): both paths (T = 1: CUDA cores; T = 8: tensor cores, token block 16) for every shape and arch, and
# the token blocks 32 and 64 for two shapes on sm_90a (CPU time)
AOT_CASES = ([(name, arch, T) for name in TP8 for arch in (90, 100) for T in (1, 8)]
             + [("qkvg", 90, 32), ("lm_head", 90, 64)])


def _variant(mod, T: int):
    """The module as aot_compile sees it, with the constexprs the launcher launches T tokens with."""
    from types import SimpleNamespace

    return SimpleNamespace(kernel=mod.kernel, SIGNATURE=mod.SIGNATURE, CONSTEXPRS=mod.constexprs(T),
                           OPTIONS=mod.OPTIONS)


def _before_waits(ptx: str) -> list[dict]:
    """Per griddepcontrol.wait: the L2 prefetches, cp.async copies and global loads in its basic block before it."""
    body = ptx.split(".entry", 1)[1]
    out, block = [], []
    for line in body.splitlines():
        s = line.strip()
        if re.match(r"\$L__BB\d+_\d+:", s):
            block = []
        elif "griddepcontrol.wait" in s:
            text = "\n".join(block)
            out.append(dict(prefetch=text.count("prefetch.global.L2"), cp_async=text.count("cp.async"),
                            ld=len(re.findall(r"\bld\.global", text))))
        else:
            block.append(s)
    return out


def _cuobjdump() -> str | None:
    """cuobjdump: on the PATH, else the one Triton ships."""
    import shutil

    import triton

    found = shutil.which("cuobjdump")
    shipped = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return found or (str(shipped) if shipped.exists() else None)


def cuobjdump_text(cubin: bytes, tmp: Path, flag: str = "-sass") -> str | None:
    """cuobjdump's `flag` listing (-sass, -res-usage) of a cubin (written under tmp, in a file of its own: worker
    processes compiling into the same directory must not read each other's); None without cuobjdump."""
    import subprocess
    import tempfile

    tool = _cuobjdump()
    if tool is None:
        return None
    fd, name = tempfile.mkstemp(suffix=".cubin", dir=tmp)
    with os.fdopen(fd, "wb") as f:
        f.write(cubin)
    try:
        return subprocess.run([tool, flag, name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(name)


# local memory a thread that a kernel's binary may take: ABI frames of a few bytes (libdevice's pow: 32) pass; a spill
# of kilobytes does not (the driver reserves a launched binary's local memory for every thread slot of the GPU: 256
# bytes a thread is ~70 MB of an H100, 25 KB ~7 GB)
SMALL_LOCAL = 256


def local_bytes(cubin: bytes, tmp: Path) -> int | None:
    """Per-thread local memory of a cubin by cuobjdump -res-usage: its STACK (where ptxas puts spills: a spilling
    binary shows LOCAL:0) plus LOCAL; None without cuobjdump. The driver reserves this for every thread slot of the
    GPU once a binary needing it is launched (25 KB a thread: ~7 GB of an H100)."""
    import re

    res = cuobjdump_text(cubin, tmp, "-res-usage")
    found = [re.search(rf"{key}:(\d+)", res) if res else None for key in ("STACK", "LOCAL")]
    return sum(int(m.group(1)) for m in found) if all(found) else None


def _sass_facts(cubin: bytes, tmp: Path) -> dict | None:
    """From the cubin's SASS and resource usage: HGMMA / LDGSTS.128 counts, local memory (spills) and stack."""
    sass = cuobjdump_text(cubin, tmp)
    if sass is None:
        return None
    res = cuobjdump_text(cubin, tmp, "-res-usage")
    local = re.search(r"LOCAL:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    return dict(hgmma=len(re.findall(r"\bHGMMA\.", sass)), ldgsts128=len(re.findall(r"LDGSTS\.E\.BYPASS\.128", sass)),
                stl=len(re.findall(r"\b(?:STL|LDL)\b", sass)), local=int(local.group(1)) if local else None,
                stack=int(stack.group(1)) if stack else None)


@pytest.mark.parametrize("name,arch,T", AOT_CASES, ids=[f"{n}-sm{a}-T{t}" for n, a, t in AOT_CASES])
def test_bf16_aot_compiles(name, arch, T, kdir, tmp_path):
    """The bf16 (PDL on) instance compiles for sm_<arch>a with the launcher's constexprs for T tokens; PDL facts;
    the CUDA-core path's grid rule (T = 1) or the tensor-core path's instructions (T > 1); PDL off: no griddepcontrol."""
    epi, K, N, splits = TP8[name]
    ks, _ = kernel_spec(epi, K, N, "bf16", splits=splits)
    mod = load_kernel(ks, kdir)
    assert mod.PDL is True
    tc = T >= mod.TC_MIN_T
    cx = mod.constexprs(T)
    assert (cx["BLOCK_T"] > 0) == tc and (cx is mod.CONSTEXPRS1) == (not tc) and mod.ONE_PASS
    if not tc:  # the split rule (T = 1 runs one pass: whole rows, one launch, its own grid rule)
        assert mod.WEIGHTS * triton_cdiv(N, mod.BLOCK_N) * mod.SPLIT_K >= 2 * 132
        assert mod.BLOCK_N * mod.K_CHUNK <= mod.TILE and mod.SPLIT_K * mod.K_CHUNK >= K
        # one pass: >= 4 x 132 programs (or one row each), each <= TILE1 weights, the chunks covering K
        assert cx["ONE_PASS"] and cx["SPLIT_K"] == 1 and cx["K_CHUNK"] == mod.KC1 and cx["BLOCK_N"] == mod.ROWS1
        assert triton_cdiv(N, mod.ROWS1) >= 4 * 132 or mod.ROWS1 == 1
        assert mod.WEIGHTS * mod.ROWS1 * mod.N_KC1 * mod.KC1 <= mod.TILE1 or mod.ROWS1 == 1
        assert (mod.N_KC1 - 1) * mod.KC1 < K <= mod.N_KC1 * mod.KC1
    ck = aot_compile(_variant(mod, T), arch)
    ptx = ck.asm["ptx"]
    assert f".target sm_{arch}a" in ptx
    assert "div.full" not in ptx and "div.approx" not in ptx
    facts = pdl_facts(ptx)
    check_pdl_ptx(facts, True, ks.name)
    assert bool(ck.metadata.launch_pdl)
    assert facts["waits"] == (2 if tc else 1), facts  # (T = 1: the one-pass kernel has no stage 1)
    if not tc:
        assert max(facts["loads_before_wait"]) > 0, facts  # stage 0: W loaded before its wait
    else:
        waits = _before_waits(ptx)
        assert any(w["prefetch"] > 0 for w in waits), waits  # stage 0: W blocks prefetched into L2 before its wait
        assert not any(w["cp_async"] or w["ld"] for w in waits), waits  # nothing copied from x before a wait
        bt = cx["BLOCK_T"]
        if arch == 90:
            assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{bt}k16\.f32\.bf16\.bf16", ptx)
        else:
            assert "tcgen05.mma" in ptx
        assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 0x10", ptx)  # 16-byte copies
        assert ".local" not in ptx
        sass = _sass_facts(ck.asm["cubin"], tmp_path) if arch == 90 else None
        if sass is not None:
            assert sass["hgmma"] > 0 and sass["ldgsts128"] > 0, sass
            assert sass["stl"] == 0 and sass["local"] == 0 and sass["stack"] == 0, sass  # no spills
    if epi == "swiglu":
        assert "div.rn.f32" in ptx and "ex2.approx" in ptx
    if epi == "softcap":
        assert "tanh.approx" not in ptx
    if epi in ("none", "split"):  # (libdevice's expf and tanhf use fma themselves)
        assert "fma.rn.f32" not in ptx  # no contraction of the products into the sums
    if arch == 90 and (name in ("qkvg", "o_proj") and T == 1 or name == "qkvg" and T == 8):
        # PDL off: no griddepcontrol, no prefetch (three variants: CPU time)
        off = load_kernel(kernel_spec(epi, K, N, "bf16", splits=splits, pdl=False)[0], kdir)
        ck_off = aot_compile(_variant(off, T), arch)
        check_pdl_ptx(pdl_facts(ck_off.asm["ptx"]), False, ks.name)
        assert not ck_off.metadata.launch_pdl and "prefetch" not in ck_off.asm["ptx"]


@pytest.mark.parametrize("T", [1, 8])
def test_late_trigger_aot_compiles(T, kdir):
    """LATE_TRIGGER (a render option, off by default): at one token the one-pass kernel triggers the next launch
    once, after its sums (not first); at T = 8 the split-K partials' launch triggers at once and the reduction's
    after its sums: two on two paths. The waits and the loads before them as without it."""
    epi, K, N, splits = TP8["qkvg"]
    ks, _ = kernel_spec(epi, K, N, "bf16", splits=splits, LATE_TRIGGER=True)
    mod = load_kernel(ks, kdir)
    assert mod.LATE_TRIGGER is True
    facts = pdl_facts(aot_compile(_variant(mod, T), 90).asm["ptx"])
    check_pdl_ptx(facts, True, ks.name, late=True)
    if T == 1:
        assert (facts["launch_dependents"], facts["launch_dependents_first"], facts["waits"]) == (1, False, 1), facts
    else:  # (which path comes first in the PTX is the compiler's choice)
        assert (facts["launch_dependents"], facts["waits"]) == (2, 2), facts
    if T == 1:
        assert max(facts["loads_before_wait"]) > 0, facts  # W still loaded before the wait


def _loads_after_wait_before_barrier(ptx: str) -> int:
    """Global loads between the (one) griddepcontrol.wait and the first bar.sync after it, in PTX order."""
    body = ptx.split("griddepcontrol.wait", 1)[1]
    return len(re.findall(r"\bld\.global", body.split("bar.sync", 1)[0]))


@pytest.mark.parametrize("name", ["qkvg", "o_proj", "lm_head"])
def test_x_early_loads_every_chunk_of_x_before_the_first_sum(name, kdir):
    """X_EARLY (the one-pass path's default since s24run1): at one token every one of x's N_KC1 chunks is loaded
    between the PDL wait and the first barrier (one L2 round trip), where the render without it loads one chunk
    there and each next one after the previous chunk's cross-warp sum; no global load after the first barrier; the
    W tiles still before the wait; both sm_90a and sm_100a compile."""
    epi, K, N, splits = TP8[name]
    base = load_kernel(kernel_spec(epi, K, N, "bf16", splits=splits, X_EARLY=False)[0], kdir)
    early = load_kernel(kernel_spec(epi, K, N, "bf16", splits=splits)[0], kdir)
    assert early.X_EARLY is True and base.X_EARLY is False and base.N_KC1 >= 3
    ptx = {m: aot_compile(_variant(m, 1), 90).asm["ptx"] for m in (base, early)}
    assert _loads_after_wait_before_barrier(ptx[base]) == 1
    # every chunk (one load per W-tile row a thread holds) before the first barrier, and no global load after it
    assert _loads_after_wait_before_barrier(ptx[early]) >= early.N_KC1
    after_wait = ptx[early].split("griddepcontrol.wait", 1)[1]
    assert not re.search(r"\bld\.global", after_wait.split("bar.sync", 1)[1] if "bar.sync" in after_wait else "")
    facts = pdl_facts(ptx[early])
    check_pdl_ptx(facts, True, name)
    assert max(facts["loads_before_wait"]) > 0, facts  # W still loaded before the wait
    assert aot_compile(_variant(early, 1), 100).asm["cubin"]


@pytest.mark.parametrize("name", list(TP8))
def test_tensor_core_split_rule(name, kdir):
    """At every TP-8 shape and token block: the programs fill the GPU in one wave (132 <= programs <= resident x 132,
    resident from the pipeline's shared memory), the chunks tile K, the L2 prefetch stays within a chunk, and the
    fp32 partials written at T = 16 are at most 1/8 of the weight bytes."""
    epi, K, N, splits = TP8[name]
    mod = load_kernel(kernel_spec(epi, K, N, "bf16", splits=splits)[0], kdir)
    for bt, c in mod.TC.items():
        assert c["BLOCK_T"] == bt and mod.constexprs(bt)["BLOCK_T"] == bt
        smem = c["STAGES"] * (c["BLOCK_N"] + bt) * c["BLOCK_K"] * 2
        resident = mod.SMEM_PER_SM // (smem + 1024)
        assert smem <= 227 * 1024 and resident >= 2, (bt, c)
        progs = mod.WEIGHTS * triton_cdiv(N, c["BLOCK_N"]) * c["SPLIT_K"]
        assert 132 <= progs <= resident * 132, (bt, c, progs)
        assert c["K_CHUNK"] % c["BLOCK_K"] == 0 and (c["SPLIT_K"] - 1) * c["K_CHUNK"] < K <= c["SPLIT_K"] * c["K_CHUNK"]
        assert c["PF_K"] <= c["K_CHUNK"] and c["PF_LINES"] * 64 >= c["PF_K"]
        assert c["SPLIT_K"] <= mod.SCRATCH_SPLIT
    c16 = mod.TC[16]
    assert c16["SPLIT_K"] * 16 * mod.N_W * 4 <= mod.N_W * K * 2 / 8
    assert mod.constexprs(1) is mod.CONSTEXPRS1 and mod.constexprs(2)["BLOCK_T"] == 16
    assert mod.constexprs(17)["BLOCK_T"] == 32 and mod.constexprs(33)["BLOCK_T"] == 64
    assert mod.constexprs(1000)["BLOCK_T"] == 64


def test_one_pass_rows_follow_the_pinned_tile_and_program_floor(kdir):
    """The one-pass path's rows per program at the TP-8 shapes (QKVG 2 rows: 896 programs, o_proj 8: 640), and with
    `--set gemv.TILE1` / `gemv.MIN_PROGRAMS1` pinned (what `bench/variants.py` tries in the step): a larger tile gives
    more rows per program where the floor allows, a lower floor fewer, larger programs; the pins pass the override
    checks and keep the launcher's arguments."""
    from beamc.codegen.overrides import parse_overrides, pin

    epi, K, N, splits = TP8["qkvg"]
    spec = kernel_spec(epi, K, N, "bf16", splits=splits)[0]
    assert load_kernel(spec, kdir).CONSTEXPRS1["BLOCK_N"] == 2
    over = parse_overrides(["gemv.TILE1=32768", "gemv.MIN_PROGRAMS1=132"])
    c = pin("gemv", spec.constants, over["gemv"])
    mod = load_kernel(KernelSpec("gemv", spec.op, c), kdir)
    assert (mod.TILE1, mod.MIN_PROGRAMS1, mod.CONSTEXPRS1["BLOCK_N"]) == (32768, 132, 4)  # 448 programs of 4 rows
    epi, K, N, _ = TP8["o_proj"]
    spec = kernel_spec(epi, K, N, "bf16")[0]
    assert load_kernel(spec, kdir).CONSTEXPRS1["BLOCK_N"] == 8
    mod = load_kernel(KernelSpec("gemv", spec.op, pin("gemv", spec.constants, {"MIN_PROGRAMS1": 132})), kdir)
    assert mod.CONSTEXPRS1["BLOCK_N"] == 16  # (TILE1's 16 rows of 768, 320 programs: the floor no longer halves it)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------- 3. the rendered modules keep the contract
@pytest.mark.parametrize("epi", list(OPS))
def test_rendered_module_contract(epi, kdir):
    ks, _ = kernel_spec(epi, 256, 96, "bf16")
    mod = load_kernel(ks, kdir)
    assert mod.__doc__ and ks.op in mod.__doc__ and isinstance(mod.GRID, str)
    assert list(inspect.signature(mod.launch).parameters) == IR_ARGS[epi] + ["scratch"]
    assert inspect.signature(mod.launch).parameters["scratch"].default is None
    assert_template_contract(mod)
    assert mod.scratch_numel(3) == mod.SCRATCH_SPLIT * 3 * mod.N_W
    assert all(mod.scratch_numel(T) >= mod.constexprs(T)["SPLIT_K"] * T * mod.N_W for T in (1, 2, 16, 17, 64, 65))
    assert set(mod.constexprs(5)) == set(mod.CONSTEXPRS)
    off = load_kernel(kernel_spec(epi, 256, 96, "bf16", pdl=False)[0], kdir)
    assert off.OPTIONS == dict(mod.OPTIONS, launch_pdl=False) and "gdc_" not in inspect.getsource(off)
    assert load_kernel(kernel_spec(epi, 256, 96, "f32")[0], kdir).OPTIONS["launch_pdl"] is False
