"""The code generator: `beamc compile -o` writes an importable package; every kernel of a package equals its op's
reference (fp32 instances under Triton's CPU interpreter) and compiles ahead of time for sm_90a and sm_100a."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from beamc.codegen.emitters import MOE_COMBINE_MAX_TOKENS
from beamc.codegen.kernel import aot_compile
from beamc.codegen.package import compile_package, render_steps
from beamc.errors import BeamcError
from beamc.passes.manager import PASSES
from beamc.spec import load_spec
from beamc.spec.hf import spec_to_yaml

ROOT = Path(__file__).resolve().parents[1]
ALL = list(PASSES)


def test_compile_writes_an_importable_package(tmp_path, capsys):
    from beamc.cli import main

    assert main(["compile", str(ROOT / "models/beam-tiny.yaml"), "-o", str(tmp_path / "pkg")]) == 0
    assert "generated kernels (sm90)" in capsys.readouterr().out
    man = json.loads((tmp_path / "pkg/manifest.json").read_text())
    assert man["target"] == "sm90" and man["passes"] == ALL and man["spec"]["name"] == "Beam-tiny"
    templates = {k["template"] for k in man["kernels"].values()}
    assert {"rmsnorm_boundary.py.j2", "qk_norm_pos_kv.py.j2", "moe_router.py.j2",
            "embed_norm.py.j2", "swiglu.py.j2", "softcap.py.j2"} <= templates
    # the attention_gate pass: in decode the gate is in the attention kernel's epilogue; in prefill (measured faster,
    # `prefill_attention_gate`) the attention then the sigmoid_gate kernel
    gate = [k for k in man["kernels"].values() if k["template"] == "sigmoid_gate.py.j2"]
    assert gate and all(k["launches_per_step"].keys() == {"prefill"} for k in gate)
    assert all(bool(k["constants"].get("GATE")) == (k["template"] == "attention_decode.py.j2")
               for k in man["kernels"].values() if k["template"].startswith("attention"))
    k = next(v for v in man["kernels"].values() if v["op"] == "qk_norm_pos_kv")
    assert k["constants"]["MODE"] in ("rope", "ssmax") and k["grid"] and k["weights"][0]["param"].endswith("q_norm.weight")
    phases = {name: sorted(v["launches_per_step"]) for name, v in man["kernels"].items()}
    router = sorted(p for name, p in phases.items() if name.startswith("moe_router"))
    # the small-M path for decode steps below ROUTER_DECODE_LARGE_MIN_TOKENS, tensor cores for prefill and above it
    assert router == [["decode"], ["decode", "prefill"]]
    decode_only = ("moe_router", "gemv", "attention_decode", "attention_prefill", "qk_norm_pos_kv",  # per phase
                   "sigmoid_gate")
    assert all(p == ["prefill"] for name, p in phases.items() if name.startswith("qk_norm_pos_kv"))
    # (the qk_attention pass: at decode the norms, RoPE / SSMax and the cache write run in the attention kernel)
    assert all(v["constants"].get("QKN") for v in man["kernels"].values() if v["template"].startswith("attention_d"))
    assert all(p == ["decode", "prefill"] for name, p in phases.items() if not name.startswith(decode_only))
    assert all(p == ["decode"] for name, p in phases.items() if name.startswith(("gemv", "attention_decode")))
    assert all(p == ["prefill"] for name, p in phases.items() if name.startswith("attention_prefill"))
    moe = sorted((v["template"], v["runs_when"], bool(v["constants"].get("DEQUANT")),
                  bool(v["constants"].get("WGMMA")), v["constants"].get("BLOCK_M"))
                 for v in man["kernels"].values() if v["op"] == "moe_experts")
    assert moe == [("moe_nvfp4_decode.py.j2", "T <= 128", False, False, None),  # (long prefills: the WGMMA renders)
                   ("moe_nvfp4_prefill.py.j2", "T >= 129 and T <= 2047", False, False, None),
                   ("moe_nvfp4_prefill.py.j2", "T >= 2048 and T <= 8191", False, True, 128),
                   ("moe_nvfp4_prefill.py.j2", "T >= 8192 and T <= 8387583", False, True, 256),  # (WG_A32)
                   ("moe_nvfp4_prefill.py.j2", "T >= 8387584", False, True, 256)]  # (its offsets past 32 bits)
    assert man["moe_wgmma"] is True and all(v["choice"]["wgmma_from_tokens"] == 2048 for v in man["kernels"].values()
                                            if v["template"].startswith("moe_nvfp4_prefill"))
    # the gemv / cuBLAS choice: each gemv kernel runs for T <= its bound, the library call above it, and says why
    gemv = [v for name, v in man["kernels"].items() if name.startswith("gemv")]
    assert gemv and all(v["runs_when"] == "T <= 1" and v["choice"]["basis"] == "rule" for v in gemv)
    assert "moe_experts_nvfp4" not in man["library_calls"] and "issue 8" in man["library_calls"]["linear"]["pending"]
    assert man["library_calls"]["linear"]["when"]["linear"] == "T >= 2"
    step = (tmp_path / "pkg/step.py").read_text()
    assert "def decode(v):" in step and "def prefill(v):" in step and "# ---- layer 7 (full+sparse)" in step
    assert step.count("K[") == sum(sum(v["launches_per_step"].values()) for v in man["kernels"].values())
    assert "    if T <= 1: K['gemv_" in step and "    if T >= 2: L.linear(" in step
    r = subprocess.run([sys.executable, "-c", "import pkg.step as s; print(len(s.K), callable(s.decode))"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split() == [str(len(man["kernels"])), "True"], r.stderr[-2000:]


def test_sm100_package_says_it_was_never_measured():
    pkg = compile_package(load_spec(ROOT / "models/beam-tiny.yaml"), target="sm100", passes=ALL, phases=("decode",))
    man = pkg.manifest()
    assert man["arch"] == "sm_100a"
    assert all(v["measured_on_hardware"].startswith("never") for v in man["kernels"].values())


def test_manifest_records_the_experts_relayout(tiny_spec_bf16):
    """sm90 (by default; `nvfp4_relayout=False` turns it off): each MoE layer's NVFP4 experts are re-laid out at load (both MoE kernels read that layout), named in
    `load_transforms` and in the MoE kernels' weight layouts; not on sm100 (its prefill kernel's tl.dot_scaled reads
    the ModelOpt bytes) nor for bf16 experts (a library call)."""
    tiny = load_spec(ROOT / "models/beam-tiny.yaml")
    off = compile_package(tiny, passes=ALL, phases=("decode",), nvfp4_relayout=False).manifest()
    assert off["load_transforms"] == {} and off["nvfp4_relayout"] is False
    man = compile_package(tiny, passes=ALL, phases=("decode",)).manifest()  # on by default
    assert man["nvfp4_relayout"] is True
    lt = man["load_transforms"]["moe_experts"]
    assert lt["transform"] == "nvfp4 relayout (moe_nvfp4_decode.relayout)" and lt["layers"] == [3, 4, 5, 6, 7]
    assert lt["params"][:6] == [f"model.layers.3.mlp.experts.{p}" for p in (
        "gate_up_proj.weight", "gate_up_proj.weight_scale", "gate_up_proj.weight_scale_2", "down_proj.weight",
        "down_proj.weight_scale", "down_proj.weight_scale_2")] and len(lt["params"]) == 30
    decode = [n for n, k in man["kernels"].items() if k["template"] == "moe_nvfp4_decode.py.j2"]
    assert lt["function"] == [f"kernels/{decode[0]}.py: relayout"]
    # at TP 2 the combine_experts pass gives the experts' op a moe_combine launch too (it reads no expert weight):
    # every MoE layer is still re-laid out (a reader of the op's other inputs once kept them in ModelOpt's bytes)
    tp2 = compile_package(tiny, tp=2, passes=ALL, phases=("decode", "prefill")).manifest()
    assert tp2["load_transforms"]["moe_experts"]["layers"] == [3, 4, 5, 6, 7]
    for k in man["kernels"].values():
        if k["template"].startswith("moe_nvfp4"):
            layouts = {w["param"].rsplit(".", 1)[-1]: w["layout"] for w in k["weights"]}
            assert layouts == {"weight": "nvfp4 relayout (moe_nvfp4_decode.relayout) at load",
                               "weight_scale": "nvfp4 relayout (moe_nvfp4_decode.relayout) at load",
                               "weight_scale_2": "as stored (this rank's slice)"}, layouts
    assert compile_package(tiny, target="sm100", passes=ALL, phases=("decode",),
                           nvfp4_relayout=True).manifest()["load_transforms"] == {}
    assert compile_package(tiny_spec_bf16, passes=ALL, phases=("decode",),
                           nvfp4_relayout=True).manifest()["load_transforms"] == {}


def test_an_f16_model_on_sm100_dequantises_its_moe_prefill_in_the_k_loop(tiny_spec):
    """sm100's native NVFP4 MMAs (tl.dot_scaled) are given bf16 activations only: an f16 model's MoE prefill kernel
    dequantises in the K loop (as on sm90) and compiles for sm_100a (with NATIVE_FP4 it did not: "Unexpected dtype
    for bf16. Got fp16"; found by a random-spec sweep), and its experts are then re-laid out at load."""
    from conftest import spec_variant

    for act, native in (("float16", False), ("bfloat16", True)):
        pkg = compile_package(spec_variant(tiny_spec, {"dtypes.activations": act}), target="sm100", passes=ALL)
        moes = [k for k in pkg.kernels.values() if k.template == "moe_nvfp4_prefill"]
        assert moes and all(bool(k.constants.get("NATIVE_FP4")) == native for k in moes), act
        assert bool(pkg.manifest()["load_transforms"]) == (not native), act
        if not native:
            assert all(_aot((k.name, k.source(), 100))[2] > 0 for k in moes)


def test_an_op_without_emitter_is_a_compile_error_naming_op_and_layer(monkeypatch):
    from beamc.codegen.registry import EMITTERS

    monkeypatch.delitem(EMITTERS, "rmsnorm")
    with pytest.raises(BeamcError, match=r"layer 0, op rmsnorm: no kernel or library emitter .*--passes all"):
        compile_package(load_spec(ROOT / "models/beam-tiny.yaml"), phases=("decode",),
                        passes=[p for p in ALL if p != "norm_residual_norm"])


def test_the_unfused_graph_compiles_every_op_its_own_launch():
    """--passes none (the ablation's first row): each op its own launch; ops that only exist fused elsewhere run
    their torch reference as named library calls, swiglu and softcap their kernels."""
    pkg = compile_package(load_spec(ROOT / "models/beam-tiny.yaml"), passes=[], phases=("decode",))
    man = pkg.manifest()
    ref_ops = set(man["library_calls"]["reference_op"]["ops"])
    assert {"embed", "rmsnorm", "add", "mul", "rope", "q_scale", "sigmoid", "moe_select", "moe_combine"} <= ref_ops
    assert "kv_write" in man["library_calls"] and {"swiglu.py.j2", "softcap.py.j2"} <= {
        k["template"] for k in man["kernels"].values()}
    step = render_steps(pkg)
    assert "L.reference_op(" in step and "op='rmsnorm', n_in=2" in step


def test_unknown_target():
    with pytest.raises(BeamcError, match="--target: unknown target 'sm80'"):
        compile_package(load_spec(ROOT / "models/beam-tiny.yaml"), target="sm80")


ODD = {"hidden_size": 320, "attention.head_dim": 64, "attention.sliding.window": 5, "attention.num_heads": 4,
       "attention.num_kv_heads": 2, "mlp.moe.d_ff": 48, "mlp.dense.d_ff": 96}


def _spec(name: str):
    spec = load_spec(ROOT / "models/beam-tiny.yaml")
    if name == "odd":
        from test_hardening import _variant

        spec = _variant(spec, **{"attention.sliding.rope.rotary_dim": 64, **ODD})
    return spec


@pytest.mark.parametrize("spec_name", ["tiny", "odd"])
def test_every_kernel_of_the_package_equals_its_reference_fp32(spec_name, tmp_path):
    """fp32 instances of every distinct kernel of the package (decode and prefill at 1 and 9 tokens: the gemv / cuBLAS choice takes both sides), under
    TRITON_INTERPRET=1 in a process of their own (the interpreter and compiled kernels do not mix in one process),
    on fresh random inputs with poisoned outputs vs the op's reference: the templates compute what the IR ops mean."""
    spec = _spec(spec_name)
    (tmp_path / "spec.yaml").write_text(spec_to_yaml(spec))
    r = subprocess.run([sys.executable, "-m", "beamc.codegen.selfcheck", str(tmp_path / "spec.yaml"), "--dtype", "f32",
                        "--tokens", "1,9", "--json", str(tmp_path / "rows.json")],
                       env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    for row in rows:
        assert row["nan"] == 0 and row["int_mismatches"] == 0 and row["max_rel"] < 1e-5, row
    ops = {row["op"] for row in rows}
    assert {"embed_norm", "boundary", "qk_norm_pos_kv", "attention_gate", "moe_router", "gate_up_swiglu",
            "linear_softcap"} <= ops
    assert len({row["kernel"] for row in rows if row["op"] == "boundary"}) == 2 * spec.num_layers


def _aot(job: tuple[str, str, int]) -> tuple[str, int, int, list]:
    """Compile one generated module for one arch (in a worker process: fresh Triton state, no interpreter): the
    smallest cubin's size and each binary's local memory a thread (cuobjdump's STACK + LOCAL; None without it)."""
    name, source, arch = job
    os.environ["TRITON_INTERPRET"] = "0"
    import sys
    import tempfile

    from beamc.codegen.kernel import launch_options, load_source

    sys.path.insert(0, str(ROOT / "tests"))
    from test_kernels_gemv import local_bytes

    d = tempfile.mkdtemp()
    mod = load_source(source, name, d)
    # every binary the launcher launches (the router's selection has options of its own)
    cubins = [aot_compile(mod, arch, o).asm["cubin"] for o in launch_options(mod)]
    return name, arch, min(len(c) for c in cubins), [local_bytes(c, Path(d)) for c in cubins]


# local memory a thread that a launched binary may take (the largest now, sm_90a: the MoE prefill's all-stages binary at
# 255 registers, 2,864 bytes, launched only for weights not re-laid-out; the rest <= 332)
LOCAL_LIMIT = 4096


def test_every_kernel_compiles_ahead_of_time_for_sm90a_and_sm100a():
    """Every bf16 kernel of the tiny spec's package and of the full spec's TP-8 rank-0 package (L2 prefetches on), compiled for sm_90a
    (Hopper) and sm_100a (Blackwell) with no GPU: any compile error fails here."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs = []
    for spec_path, tp in (("models/beam-tiny.yaml", 1), ("models/beam.yaml", 8)):
        for target, arch in (("sm90", 90), ("sm100", 100)):
            # (with the decode step's L2 prefetches: their kernel, whatever the default budget)
            pkg = compile_package(load_spec(ROOT / spec_path), target=target, tp=tp, passes=ALL, l2_prefetch_mb=24)
            jobs += [(name, k.source(), arch) for name, k in pkg.kernels.items()]
    assert any(name.startswith("l2_prefetch_") for name, _, _ in jobs)
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = list(pool.map(_aot, jobs, chunksize=4))
    assert len(done) == len(jobs) > 200 and all(n > 0 for _, _, n, _ in done)
    # no binary spills kilobytes a thread: once a binary needing local memory is launched, the driver keeps that much
    # for every thread slot of the GPU (4 KB a thread: ~1.1 GB of an H100; the router's selection binary compiled
    # ahead of time with a runtime stage held stage 0's GEMM at one warp: 25 KB a thread)
    big = [(name, arch, i, b) for name, arch, _, local in done for i, b in enumerate(local) if (b or 0) > LOCAL_LIMIT]
    assert not big, f"binaries with more than {LOCAL_LIMIT} bytes of local memory a thread (name, arch, option set, bytes): {big}"


def test_every_op_has_an_emitter():
    """Any subset of passes, any valid spec (e.g. no logit soft-cap: a cast) compiles: every op the IR can hold has an
    emitter (a kernel or a named library call)."""
    from beamc.codegen.registry import EMITTERS
    from beamc.ir.ops import OPS

    assert sorted(o for o, d in OPS.items() if not d.leaf and o not in EMITTERS) == []


def test_qk_attention_emits_the_qkn_render_at_decode_and_two_launches_elsewhere():
    """qk_attention (the qk_attention pass, decode graphs): one launch of attention_decode's QKN render on the op's
    inputs and output; in a prefill graph (the pass makes none there; a hand-built graph could) the two launches it
    stands for, qk_norm_pos_kv into a scratch q that the attention then reads."""
    from beamc.codegen.registry import Context, launches
    from beamc.compiler import compile_graphs
    from beamc.codegen.emitters import io

    g = compile_graphs(load_spec(ROOT / "models/beam-tiny.yaml"), tp=1, dtype="bf16", passes=ALL)["decode"][0]
    node = next(n for n in g.compute_nodes() if n.op == "qk_attention")
    ctx = Context(target="sm90", dtype="bf16")
    (one,) = launches(node, g, ctx)
    assert one.kernel.template == "attention_decode" and one.kernel.constants["QKN"] and one.args == io(node)
    assert one.kernel.constants["MODE"] == node.attrs["mode"] and one.kernel.constants["GATE"]
    g.meta["phase"] = "prefill"
    try:
        first, second = launches(node, g, Context(target="sm90", dtype="bf16", prefill_attention_gate=True))
        first2, second2, gate = launches(node, g, ctx)  # (the default: the gate after the attention in prefill)
    finally:
        g.meta["phase"] = "decode"
    assert first.kernel.template == "qk_norm_pos_kv" and second.kernel.template == "attention_prefill"
    assert first.args[-1] == second.args[0] == "scratch:qk_q" and first.scratch[0][0] == "scratch:qk_q"
    assert first.args[:-1] == io(node)[:len(first.args) - 1] and second.args[-1] == node.outputs[0].name
    assert second.args[-3:-1] == tuple(v.name for v in node.inputs[-2:])  # the gate's g and b
    assert first2 == first and second2.args[0] == "scratch:qk_q" and not second2.kernel.constants["GATE"]
    assert gate.kernel.template == "sigmoid_gate" and second2.args[-1] == gate.args[0] == "scratch:attn_o"
    assert gate.args[1:] == tuple(v.name for v in node.inputs[-2:]) + (node.outputs[0].name,)


def test_prefill_options_reach_the_kernels_and_the_manifest():
    """--no-moe-wgmma: the DEQUANT renders for long prefills (by default the WGMMA renders, no DEQUANT);
    --no-moe-wgmma --no-moe-dequant: neither, the in-loop kernel for every T >= 65; --attention-mirror PAGES: the
    full-attention prefill kernels over an fp8 cache take MIRROR with that many pages (the sliding ones and the decode
    ones do not); auto (the default): pages for 8 sequences of max_position_embeddings; 0: none; all recorded in the
    manifest, and a negative page count is one clear error."""
    from beamc.spec import parse_spec

    data = load_spec(ROOT / "models/beam-tiny.yaml").model_dump()
    data["dtypes"]["kv_cache"] = "fp8"
    spec = parse_spec(data)
    default = compile_package(spec, passes=ALL)
    off = compile_package(spec, passes=ALL, moe_dequant=False, moe_wgmma=False, attention_mirror_pages=96)
    none = compile_package(spec, passes=ALL, moe_wgmma=False, attention_mirror_pages=0)
    auto = 8 * -(-spec.max_position_embeddings // default.page_size)
    for pkg, dequant, wgmma, pages in ((default, True, True, auto), (off, False, False, 96), (none, True, False, 0)):
        man = pkg.manifest()
        assert man["moe_dequant"] is dequant and man["moe_wgmma"] is wgmma and man["attention_mirror_pages"] == pages
        ks = list(pkg.kernels.values())
        assert any(k.constants.get("WGMMA") for k in ks) is wgmma
        assert any(k.constants.get("DEQUANT") for k in ks) is (dequant and not wgmma)
        mirrors = [k for k in ks if k.constants.get("MIRROR")]
        full_prefill = [k for k in ks if k.template == "attention_prefill" and k.constants["PAGED"]]
        assert full_prefill and all(k.constants["CACHE_DTYPE"] == "f8e4m3" for k in full_prefill)
        assert mirrors == (full_prefill if pages else []) and all(k.constants["MIRROR_PAGES"] == pages for k in mirrors)
    with pytest.raises(BeamcError, match="attention-mirror"):
        compile_package(spec, passes=ALL, attention_mirror_pages=-1)
    # auto: at most MIRROR_AUTO_BYTES of mirror for long contexts; nothing for a bf16 cache (MIRROR is fp8's)
    from beamc.codegen.package import MIRROR_AUTO_BYTES

    data["max_position_embeddings"] = 1 << 22
    long = compile_package(parse_spec(data), passes=ALL, phases=("prefill",))
    per_page = 2 * long.page_size * spec.attention.num_kv_heads * spec.attention.head_dim * 2
    assert 0 < long.attention_mirror_pages * per_page <= MIRROR_AUTO_BYTES < (long.attention_mirror_pages + 1) * per_page
    data["dtypes"]["kv_cache"] = "bfloat16"
    assert compile_package(parse_spec(data), passes=ALL, phases=("prefill",)).attention_mirror_pages == 0


def test_mirrored_prefill_attention_on_wgmma_on_sm90_bf16(monkeypatch):
    """The mirrored full layers' prefill pass is attention_prefill's WGMMA render with WG_SPLIT
    (emitters.ATTENTION_WGMMA_TILES) on sm90 with a bf16 model and head dims of 64 or 128 (the full spec's 128); with
    emitters.ATTENTION_RING_MIRROR (off: measured slower) so are the sliding layers', over the ring's mirror (pages for
    RING_MIRROR_TOKENS tokens); not on sm100 (no wgmma: no mirror for rings either), not at the tiny spec's head dim
    32, not in the fp32 instances; `--set attention_prefill.WGMMA=false` keeps the Triton pass (and the sliding
    layers' in-loop conversion), a pinned WG_SPLIT=false the one-partition form, a pinned BLOCK_N=32 (a Triton tile
    the render cannot take) the Triton pass; the decode kernels never take it."""
    import beamc.codegen.emitters as em
    from beamc.spec import parse_spec

    data = load_spec(ROOT / "models/beam.yaml").model_dump()
    data["dtypes"]["kv_cache"] = "fp8"  # (the mirror is fp8's; head dim 128)
    full = parse_spec(data)

    def prefill(spec, **kw):
        pkg = compile_package(spec, passes=ALL, phases=("prefill",), **kw)
        return [k.constants for k in pkg.kernels.values() if k.template == "attention_prefill"]

    assert em.ATTENTION_RING_MIRROR is False  # (the default: the sliding layers read the ring in the loop)
    ks = prefill(full, tp=8)
    assert [(c["WINDOW"], bool(c.get("MIRROR")), bool(c.get("WGMMA"))) for c in ks] == [(512, False, False),
                                                                                       (0, True, True)]
    monkeypatch.setattr(em, "ATTENTION_RING_MIRROR", True)
    ks = prefill(full, tp=8)
    assert len(ks) == 2 and all(c.get("MIRROR") for c in ks)
    assert all(all(c.get(k) == v for k, v in em.ATTENTION_WGMMA_TILES.items()) for c in ks)
    sliding = [c for c in ks if c["WINDOW"]]
    assert len(sliding) == 1 and sliding[0]["MIRROR_PAGES"] == em.ring_mirror_pages(512) == 416
    for kw in (dict(target="sm100"), dict(dtype="f32"), dict(template_overrides={"attention_prefill": {"WGMMA": False}}),
               dict(template_overrides={"attention_prefill": {"BLOCK_N": 32}})):
        ks = prefill(full, tp=8, **kw)
        assert not any(c.get("WGMMA") for c in ks), kw
        assert [c["WINDOW"] for c in ks if c.get("MIRROR")] == ([] if kw.get("dtype") else [0]), kw
    one = prefill(full, tp=8, template_overrides={"attention_prefill": {"WG_SPLIT": False}})
    assert len(one) == 2 and all(c["WGMMA"] is True and c["WG_SPLIT"] is False for c in one)
    data = load_spec(ROOT / "models/beam-tiny.yaml").model_dump()
    data["dtypes"]["kv_cache"] = "fp8"
    tiny = prefill(parse_spec(data))
    assert any(c.get("MIRROR") for c in tiny) and not any(c.get("WGMMA") for c in tiny)  # (head dim 32)


def test_fp8_cache_attention_kernels_multiply_in_fp16():
    """F16_DOT (`emitters.attention_dot`): over an fp8 cache every decode attention kernel and the unmirrored prefill
    ones take fp16 MMA operands (the mirrored prefill reads bf16 mirrors: not there); over a bf16 cache none; `--set
    attention_decode.F16_DOT=false` turns it off in the decode kernels only."""
    from beamc.spec import parse_spec

    data = load_spec(ROOT / "models/beam-tiny.yaml").model_dump()
    data["dtypes"]["kv_cache"] = "fp8"
    spec = parse_spec(data)

    def attn(pkg):
        return [k for k in pkg.kernels.values() if k.template in ("attention_decode", "attention_prefill")]

    plain = attn(compile_package(spec, passes=ALL, attention_mirror_pages=0))
    assert plain and all(k.constants.get("F16_DOT") is True for k in plain)
    mirrored = attn(compile_package(spec, passes=ALL))
    assert any(k.constants.get("MIRROR") for k in mirrored)
    assert all(bool(k.constants.get("F16_DOT")) is not bool(k.constants.get("MIRROR")) for k in mirrored)
    off = attn(compile_package(spec, passes=ALL, attention_mirror_pages=0,
                               template_overrides={"attention_decode": {"F16_DOT": False}}))
    assert all(k.constants["F16_DOT"] is (k.template == "attention_prefill") for k in off)
    data["dtypes"]["kv_cache"] = "bfloat16"
    assert not any("F16_DOT" in k.constants for k in attn(compile_package(parse_spec(data), passes=ALL)))


def test_sliding_prefill_attention_runs_on_four_warps():
    """emitters.ATTENTION_SLIDING_PREFILL_TILES: on sm90 the sliding layers' prefill pass over an fp8 ring (F16_DOT)
    renders 4 warps, EX2_FTZ and Q16_OUT; the full layers' kernels and sm100 keep the template's; a pin wins."""
    from beamc.spec import parse_spec

    data = load_spec(ROOT / "models/beam-tiny.yaml").model_dump()
    data["dtypes"]["kv_cache"] = "fp8"
    spec = parse_spec(data)

    def prefill_attn(pkg):
        return [k for k in pkg.kernels.values() if k.template == "attention_prefill"]

    ks = prefill_attn(compile_package(spec, passes=ALL, attention_mirror_pages=0))
    sliding = [k for k in ks if k.constants["WINDOW"]]
    assert sliding and all(k.constants.get("NUM_WARPS") == 4 and "NUM_WARPS = 4" in k.source() and
                           k.constants.get("EX2_FTZ") is True and "EX2_FTZ = True" in k.source() and
                           "Q16_OUT = True" in k.source() for k in sliding)
    assert all(not {"NUM_WARPS", "EX2_FTZ", "Q16_OUT"} & set(k.constants) for k in ks if not k.constants["WINDOW"])
    assert not any("NUM_WARPS" in k.constants for k in prefill_attn(compile_package(spec, passes=ALL, target="sm100",
                                                                                     attention_mirror_pages=0)))
    pinned = prefill_attn(compile_package(spec, passes=ALL, attention_mirror_pages=0, template_overrides={
        "attention_prefill": {"NUM_WARPS": 8, "EX2_FTZ": False, "Q16_OUT": False}}))
    assert all(k.constants["NUM_WARPS"] == 8 and not k.constants["EX2_FTZ"] and "Q16_OUT = False" in k.source()
               for k in pinned)


def test_window_block_n_pins_the_sliding_layers_only():
    """`--set attention_decode.WINDOW_BLOCK_N=16`: the sliding layers' decode attention takes blocks of 16 keys, the
    full layers keep the emitted 64 (BLOCK_N would pin both)."""
    tiny = load_spec(ROOT / "models/beam-tiny.yaml")
    pkg = compile_package(tiny, passes=ALL, phases=("decode",),
                          template_overrides={"attention_decode": {"WINDOW_BLOCK_N": 16}})
    att = [k for k in pkg.kernels.values() if k.template == "attention_decode"]
    sliding = [k for k in att if k.constants["WINDOW"]]
    assert sliding and len(sliding) < len(att)
    for k in att:
        assert f"\nBLOCK_N = {16 if k.constants['WINDOW'] else 64}\n" in k.source(), k.name


def test_moe_decode_plain_render_is_register_capped_on_sm90(tiny_spec_bf16):
    """moe_nvfp4_decode's plain render (the decode steps past MOE_COMBINE_MAX_TOKENS, to MOE_DECODE_MAX_TOKENS, at
    TP > 1) has both stages capped at emitters.MOE_DECODE_MAXNREG registers on sm90 in bf16 (4 programs an SM:
    s47run5), in its launch options; the COMBINE render (the steps below) stays uncapped, so does sm100;
    `--set moe_nvfp4_decode.MAXNREG=0` takes the cap off."""
    from beamc.codegen.emitters import MOE_COMBINE_MAX_TOKENS as most, MOE_DECODE_MAX_TOKENS, MOE_DECODE_MAXNREG
    from beamc.codegen.overrides import parse_overrides

    tiny = load_spec(ROOT / "models/beam-tiny.yaml")

    def decode_renders(**kw):
        pkg = compile_package(tiny, tp=2, passes=ALL, phases=("decode",), **kw)
        lns = [ln for n, ln in pkg.steps["decode"].launches
               if n.op == "moe_experts" and ln.kernel is not None and ln.kernel.template == "moe_nvfp4_decode"]
        return {bool(ln.kernel.constants.get("COMBINE")): ln for ln in lns}

    sm90 = decode_renders()
    assert sm90[False].runs_for(most + 1) and sm90[False].runs_for(MOE_DECODE_MAX_TOKENS)
    assert sm90[True].runs_for(most) and not sm90[True].runs_for(most + 1)
    assert sm90[False].kernel.constants.get("MAXNREG") == MOE_DECODE_MAXNREG == 128
    assert f"maxnreg={MOE_DECODE_MAXNREG})" in sm90[False].kernel.source()
    assert "MAXNREG" not in sm90[True].kernel.constants and "maxnreg" not in sm90[True].kernel.source()
    sm100 = decode_renders(target="sm100")
    assert "MAXNREG" not in sm100[False].kernel.constants
    off = decode_renders(template_overrides=parse_overrides(["moe_nvfp4_decode.MAXNREG=0"]))
    assert off[False].kernel.constants["MAXNREG"] == 0 and "maxnreg" not in off[False].kernel.source()


def test_moe_combine_max_tokens_is_a_compile_option(tiny_spec_bf16):
    """`moe_combine_max_tokens` (`beamc compile --moe-combine-max-tokens N`): at TP 2, steps of up to N tokens take the
    MoE decode kernel's COMBINE render and no moe_combine launch, larger steps the experts then moe_combine; 0 the
    latter at every size; by default (None) up to emitters.MOE_COMBINE_MAX_TOKENS (4) tokens; the manifest records
    it; a negative count is refused by name."""
    tiny = load_spec(ROOT / "models/beam-tiny.yaml")
    pkg = compile_package(tiny, tp=2, passes=ALL, phases=("decode",), moe_combine_max_tokens=6)
    moe = [ln for n, ln in pkg.steps["decode"].launches if n.op == "moe_experts"]
    fused = [ln for ln in moe if ln.kernel is not None and ln.kernel.constants.get("COMBINE")]
    combine = [ln for ln in moe if ln.kernel is not None and ln.kernel.template == "moe_combine"]
    assert fused and all(ln.runs_for(6) and not ln.runs_for(7) for ln in fused)
    assert combine and all(ln.runs_for(7) and not ln.runs_for(6) for ln in combine)
    for T in (1, 6, 7, 128, 129, 20000):  # every token count runs the experts exactly once per MoE layer
        assert sum(ln.runs_for(T) and ln.kernel.template.startswith("moe_nvfp4") for ln in moe) == len(combine), T
    assert pkg.manifest()["moe_combine_max_tokens"] == 6
    off = compile_package(tiny, tp=2, passes=ALL, phases=("decode",), moe_combine_max_tokens=0)
    assert not any(ln.kernel is not None and ln.kernel.constants.get("COMBINE")
                   for _, ln in off.steps["decode"].launches)
    default = compile_package(tiny, tp=2, passes=ALL, phases=("decode",))
    fused = [ln for n, ln in default.steps["decode"].launches
             if n.op == "moe_experts" and ln.kernel is not None and ln.kernel.constants.get("COMBINE")]
    assert MOE_COMBINE_MAX_TOKENS == 4 and fused and all(ln.runs_for(4) and not ln.runs_for(5) for ln in fused)
    with pytest.raises(BeamcError, match="--moe-combine-max-tokens"):
        compile_package(tiny, tp=2, passes=ALL, phases=("decode",), moe_combine_max_tokens=-1)


def test_a_wgmma_form_with_combine_combines_in_the_prefill_experts():
    """A WGMMA form holding COMBINE (emitters.MOE_WGMMA_FORMS: the 256-row form's, the default since s46): under the
    combine_experts pass its prefill launches render with COMBINE and the node's routed scale and take the routing
    weights and out after y (the scratch), and no moe_combine runs at their token counts, while the others keep the
    experts then moe_combine: at every token count the experts once and the combine once. Without the pass no launch
    has it."""
    import beamc.codegen.emitters as em

    full = load_spec(ROOT / "models/beam.yaml")
    assert em.MOE_WGMMA_FORMS["bm256"].get("COMBINE") and "COMBINE" not in em.MOE_WGMMA_FORMS["bm128"]

    def moe_launches(passes):
        pkg = compile_package(full, tp=8, passes=passes, phases=("prefill",))
        moe = [(n, ln) for n, ln in pkg.steps["prefill"].launches if n.op in ("moe_experts", "boundary")]
        layer = next(n.layer for n, _ in moe if n.op == "moe_experts")
        return [(n, ln) for n, ln in moe if n.layer == layer]

    lns = moe_launches(ALL)
    node = next(n for n, _ in lns if n.op == "moe_experts")
    w, out = node.inputs[-1].name, node.outputs[0].name
    sorting = [ln for _, ln in lns if ln.kernel is not None and ln.kernel.constants.get("COMBINE")
               and ln.kernel.template == "moe_nvfp4_prefill"]
    assert sorting and all(ln.kernel.constants["ROUTED_SCALE"] == node.attrs["routed_scale"] and
                           ln.args[-3:] == ("scratch:moe_experts", w, out) for ln in sorting)
    for T in (1, 65, 2048, em.MOE_WGMMA_BM256_MIN_TOKENS - 1, em.MOE_WGMMA_BM256_MIN_TOKENS, 16384, 10 ** 6):
        run = [ln for _, ln in lns if ln.runs_for(T) and ln.kernel is not None]
        experts = [ln for ln in run if ln.kernel.template.startswith("moe_nvfp4")]
        combines = [ln for ln in run if ln.kernel.template == "moe_combine"]
        combined = experts[0].kernel.constants.get("COMBINE")
        assert len(experts) == 1 and len(combines) == (0 if combined else 1), (T, experts, combines)
        assert bool(combined and experts[0].kernel.template == "moe_nvfp4_prefill") == (
            T >= em.MOE_WGMMA_BM256_MIN_TOKENS), T
    off = moe_launches([p for p in ALL if p != "combine_experts"])
    assert not any(ln.kernel is not None and ln.kernel.template == "moe_nvfp4_prefill"
                   and ln.kernel.constants.get("COMBINE") for _, ln in off)


def test_template_overrides_pin_constants_in_every_kernel_of_their_template(tmp_path):
    """`template_overrides` (`beamc compile --set TEMPLATE.CONSTANT=VALUE`): every kernel rendered from the template
    takes the value (its source says so), the other templates' kernels are untouched, the manifest records it, and
    the manifest's record rebuilds the same package (what the runtime does at load)."""
    import json

    tiny = load_spec(ROOT / "models/beam-tiny.yaml")
    base = compile_package(tiny, passes=ALL, phases=("decode",))
    over = compile_package(tiny, passes=ALL, phases=("decode",),
                           template_overrides={"attention_decode": {"NUM_WARPS": 2, "PREFETCH": False}})
    att = [k for k in over.kernels.values() if k.template == "attention_decode"]
    assert att and all(k.constants["NUM_WARPS"] == 2 and k.constants["PREFETCH"] is False for k in att)
    assert all("NUM_WARPS = 2" in k.source() for k in att)
    others = lambda p: sorted(n for n, k in p.kernels.items() if k.template != "attention_decode")  # noqa: E731
    assert others(over) == others(base)  # (names hash the constants: the same kernels)
    assert not set(n for n, k in base.kernels.items() if k.template == "attention_decode") & set(over.kernels)
    man = json.loads(json.dumps(over.manifest(), default=str))
    assert man["template_overrides"] == {"attention_decode": {"NUM_WARPS": 2, "PREFETCH": False}}
    assert base.manifest()["template_overrides"] == {}
    again = compile_package(tiny, passes=ALL, phases=("decode",), template_overrides=man["template_overrides"])
    assert sorted(again.kernels) == sorted(over.kernels) and render_steps(again) == render_steps(over)
    # the boundary's warp count (a render option with a computed default)
    w8 = compile_package(tiny, passes=ALL, phases=("decode",), template_overrides={"rmsnorm_boundary": {"NUM_WARPS": 8}})
    bnd = [k for k in w8.kernels.values() if k.template == "rmsnorm_boundary"]
    assert bnd and all("NUM_WARPS = 8" in k.source() for k in bnd)
    assert all("NUM_WARPS = max(1, min(16," in k.source() for k in base.kernels.values() if k.template == "rmsnorm_boundary")


def test_moe_decode_ksplit_tells_the_prefill_kernels_its_relayout():
    """`--set moe_nvfp4_decode.KSPLIT=8` (stage 0 on 8 warps) re-lays gate_up out in chunks of H / 8: the prefill
    kernels of the same layer, which read those bytes, are rendered with RELAYOUT_KSPLIT 8 (and their RK0 agrees with
    the decode kernel's BK0); by default neither constant is passed (the kernels' names unchanged). A user cannot
    pin RELAYOUT_KSPLIT alone."""
    tiny = load_spec(ROOT / "models/beam-tiny.yaml")
    base = compile_package(tiny, passes=ALL, phases=("decode", "prefill"))
    ks8 = compile_package(tiny, passes=ALL, phases=("decode", "prefill"),
                          template_overrides={"moe_nvfp4_decode": {"KSPLIT": 8}})
    for pkg, want in ((base, None), (ks8, 8)):
        dec = [k for k in pkg.kernels.values() if k.template == "moe_nvfp4_decode"]
        pre = [k for k in pkg.kernels.values() if k.template == "moe_nvfp4_prefill"]
        assert dec and pre
        assert all(k.constants.get("KSPLIT") == want for k in dec)
        assert all(k.constants.get("RELAYOUT_KSPLIT") == want for k in pre)
    assert sorted(n for n, k in base.kernels.items() if k.template == "moe_nvfp4_prefill") != sorted(
        n for n, k in ks8.kernels.items() if k.template == "moe_nvfp4_prefill")
    with pytest.raises(BeamcError, match="says what the kernel computes"):
        compile_package(tiny, passes=ALL, phases=("prefill",),
                        template_overrides={"moe_nvfp4_prefill": {"RELAYOUT_KSPLIT": 8}})


@pytest.mark.parametrize("overrides,match", [
    ({"attention": {"NUM_WARPS": 2}}, "no kernel template 'attention'"),
    ({"attention_decode": {"NUM_WARP": 2}}, "reads no constant 'NUM_WARP'"),
    ({"attention_prefill": {"NUM_WARPS": 8}}, "no kernel of this package is rendered from this template"),
    ({"attention_decode": {"HEAD_DIM": 64}}, "attention_decode.HEAD_DIM: set by the compiler from the op's shapes"),
    ({"rmsnorm_boundary": {"EPS": 0.5}}, "rmsnorm_boundary.EPS: set by the compiler"),
    ({"attention_decode": {"GATE": False}}, "says what the kernel computes"),
    ({"attention_decode": {"NUM_WARPS": "abc"}}, "does not render with it"),
    ({"attention_decode": {"MERGE_D": None}}, "does not render with it"),
])
def test_template_overrides_refuse_what_would_do_nothing(overrides, match):
    """A misspelt template or constant, or a template the package does not use, is one error naming it: an override
    that silently changed nothing would make a benchmark measure the default under another name. So is one that
    would compute another op (a constant the compiler derives from the IR, or one that says which fused form the
    kernel is) or that the template cannot be rendered and imported with."""
    tiny = load_spec(ROOT / "models/beam-tiny.yaml")
    with pytest.raises(BeamcError, match=match):
        compile_package(tiny, passes=ALL, phases=("decode",), template_overrides=overrides)


def test_parse_overrides_reads_yaml_scalars():
    from beamc.codegen.overrides import parse_overrides

    from beamc.codegen.overrides import parse_value

    got = parse_overrides(["attention_decode.KV_TILES=true", "attention_decode.NUM_WARPS=8",
                           "gemv.SMS=132", "attention_decode.MERGE_D=16", "moe_router.SELECT_WARPS=2"])
    assert got == {"attention_decode": {"KV_TILES": True, "NUM_WARPS": 8, "MERGE_D": 16}, "gemv": {"SMS": 132},
                   "moe_router": {"SELECT_WARPS": 2}}
    assert [parse_value(v) for v in ("1e-6", "False", "none", "8:30", "yes", "0x10")] == [
        1e-6, False, None, "8:30", "yes", "0x10"]
    for bad in ("attention_decode.NUM_WARPS", "NUM_WARPS=8", "attention_decode.=8", "attention_decode.NUM_WARPS="):
        with pytest.raises(BeamcError, match="TEMPLATE.CONSTANT=VALUE"):
            parse_overrides([bad])
    for structural in ("attention_decode.GATE=true", "moe_nvfp4_decode.COMBINE=true", "gemv.DTYPE=f32"):
        with pytest.raises(BeamcError, match="says what the kernel computes"):
            parse_overrides([structural])


def test_gemm_choices_follow_the_measured_table():
    """`codegen.choices`: per measured shape, the generated kernel up to the first token count where the step's
    library route was faster; an unmeasured shape takes the kernel at one token (the rule). The H200 table of the
    twenty-fourth session (s24run5; library = the route a step runs: gate_up's two cuBLAS GEMMs + the SwiGLU kernel):
    the dense gate_up+SwiGLU takes the kernel up to 64 tokens, the dense down up to 4 (with X_EARLY: 5.6 against
    cuBLAS's 7.4 us at one token; it stayed with cuBLAS before)."""
    from beamc.codegen.choices import choose

    assert choose("sm90", "gate_up_swiglu", 5120, 2560).max_tokens == 64
    assert choose("sm90", "linear", 2560, 5120).max_tokens == 4
    assert choose("sm90", "linear", 768, 5120).max_tokens == 1
    c = choose("sm90", "linear", 1234, 567)
    assert (c.max_tokens, c.basis) == (1, "rule")
    assert "library route" in choose("sm90", "linear", 768, 5120).source


_UNGATED_PREFILL = """
import json, sys
from beamc.codegen.check import check_node
from beamc.codegen.package import compile_package
from beamc.passes.manager import PASSES
from beamc.spec import load_spec
spec = load_spec(sys.argv[1])
pkg = compile_package(spec, passes=list(PASSES), dtype="f32", phases=("prefill",), prefill_attention_gate=False)
rows = []
for node, lns in pkg.steps["prefill"].by_node():
    if node.op == "attention_gate" and node.layer in (0, 5):  # a sliding and a full layer of the tiny spec
        mp = (530 + 37) // 16 + 2
        sizes = {"T": 37, "B": 37, "S": 3, "Cs": spec.effective_window - 1 + 37, "P": 3 * mp, "MP": mp, "R": 2,
                 "V": spec.vocab_size, "E": spec.mlp.moe.num_experts, "P0": 530}
        c = check_node(node, lns, sizes, seed=node.layer)
        rows.append(dict(c.as_dict(), templates=[ln.kernel.template for ln in lns]))
json.dump(rows, open(sys.argv[2], "w"))
"""


def test_prefill_attention_gate_off_is_the_attention_then_the_gate_kernel(tmp_path):
    """`prefill_attention_gate=False` (the default since the twelfth session; `--prefill-attention-gate` fuses): a
    prefill step runs an attention_gate op as the plain attention into a scratch, then the sigmoid_gate kernel; decode
    keeps the fused render; the manifest records the choice and its figures. fp32, Triton interpreter: the chain equals the op's reference (a sliding and a full layer)."""
    from conftest import run_interpreted

    tiny = load_spec(ROOT / "models/beam-tiny.yaml")
    pkg = compile_package(tiny, passes=ALL, prefill_attention_gate=False)
    pre = [(n.layer, ln) for n, ln in pkg.steps["prefill"].launches if n.op == "attention_gate"]
    assert [ln.kernel.template for _, ln in pre[:2]] == ["attention_prefill", "sigmoid_gate"]
    assert not any(ln.kernel.constants.get("GATE") for _, ln in pre if ln.kernel.template == "attention_prefill")
    assert pre[0][1].args[-1] == pre[1][1].args[0] == "scratch:attn_o"
    dec = [ln for n, ln in pkg.steps["decode"].launches if n.op == "qk_attention"]
    assert dec and all(ln.kernel.constants["GATE"] for ln in dec)
    assert pkg.manifest()["prefill_attention_gate"]["fused"] is False
    fused = compile_package(tiny, passes=ALL, prefill_attention_gate=True)
    assert fused.manifest()["prefill_attention_gate"]["fused"] is True
    assert all(ln.kernel.constants["GATE"] for n, ln in fused.steps["prefill"].launches if n.op == "attention_gate")
    out = tmp_path / "ungated.json"
    rows = run_interpreted(["-c", _UNGATED_PREFILL, str(ROOT / "models/beam-tiny.yaml"), str(out)], out)
    assert len(rows) == 2, rows
    for r in rows:
        assert r["templates"] == ["attention_prefill", "sigmoid_gate"] and r["nan"] == 0, r
        assert r["max_rel"] < 1e-5, r
