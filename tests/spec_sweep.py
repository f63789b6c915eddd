"""Random valid specs through the back end: what CI's fixed variants miss (the project is checked against
configurations it does not see). Not a pytest module (minutes per run); a line per spec, "ok" or what failed.

    python tests/spec_sweep.py aot --seed 1 --count 10 [--arch 100]   # full-size specs: every kernel compiled for
                                                                      # sm_90a (or sm_100a), no GPU
    python tests/spec_sweep.py runtime --seed 1 --count 10 [--odd]    # small specs: `beamc logits --backend compiled`
                                                                      # (fp32 kernels, Triton's interpreter) against
                                                                      # the interpreter backend, within 1e-5
    python tests/spec_sweep.py runtime --seed 1 --count 10 --tp 2     # the interpreter backend at TP 2 (simulated
                                                                      # ranks) against itself at TP 1
    python tests/spec_sweep.py hf --seed 1 --count 10 [--wide]        # the interpreter (fp32) against transformers'
                                                                      # Beam on the same random checkpoint, 1e-5
    python tests/spec_sweep.py passes --seed 1 --count 10 [--wide] [--tp 2]  # the interpreter at the spec's own
                                                                      # dtypes: every pass against none, bitwise
`--odd`: head dims, widths and vocabularies that are not powers of 2. `--wide`: also explicit per-layer
attention / MLP lists, mixed storage dtypes, other norm eps, SSMax constants and renorm eps (hf: only what
config.json can carry). `--edge`: --wide at the schema's small extremes (one layer, a window of 1, head dim 2, two
experts, a vocabulary of 2). A spec that the schema or the TP split refuses is reported as such (one clear error: not a failure). Found so far, each fixed with a test: the router at top_k 1 /
topk_group 1, non-power-of-2 head dims in the prefill attention, f16 models' MoE on sm100 (forty-fifth session);
weights stored in another dtype than the activations (the graph kept their storage dtype, promoting the residual
stream to fp32 and failing the passes' verification; f16 models refused by the loader), a q / k norm eps apart from
norm.eps refused by `init-weights`, the passes' graphs a few ulps apart at fp32 activations (the reference's GEMMs
read unaligned weight views) (fifty-first session).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def router(rng: random.Random, experts: list[int], groups=(1, 2, 3, 4, 8)) -> dict:
    """A valid grouped top-k: E experts in n_group groups (>= 2 experts each), topk_group of them, top_k <= 8."""
    E = rng.choice(experts)
    ng = rng.choice([g for g in groups if E % g == 0 and E // g >= 2])
    tg = rng.randint(1, ng)
    return {"mlp.moe.num_experts": E, "mlp.moe.n_group": ng, "mlp.moe.topk_group": tg,
            "mlp.moe.top_k": rng.randint(1, min(8, tg * (E // ng)))}


def full_size(rng: random.Random) -> dict:
    hd = rng.choice([64, 80, 96, 128, 192, 256])
    nkv = rng.choice([1, 2, 4, 8])
    return {"hidden_size": rng.choice([2048, 3072, 4096, 7168]), "num_layers": 7,
            "attention.num_heads": nkv * rng.choice([1, 2, 4, 6, 8]), "attention.num_kv_heads": nkv,
            "attention.head_dim": hd, "attention.sliding.rope.rotary_dim": hd,
            "attention.sliding.window": rng.choice([128, 1000, 4096]), "layers.dense_first": rng.choice([0, 1]),
            "layers.full_every": rng.choice([2, 6]), **router(rng, [8, 16, 64, 128, 160, 256, 384]),
            "mlp.moe.d_ff": rng.choice([512, 768, 1408, 2048]), "mlp.dense.d_ff": rng.choice([8192, 11008]),
            "logits.tie_word_embeddings": rng.random() < 0.3, "logits.softcap": rng.choice([None, 30.0]),
            "dtypes.kv_cache": rng.choice(["bfloat16", "fp8"]), "vocab_size": rng.choice([32000, 151936]),
            "dtypes.experts": rng.choice(["nvfp4", "nvfp4", "bfloat16"]),
            "dtypes.activations": rng.choice(["bfloat16", "bfloat16", "float16"])}


def _dtypes(rng: random.Random, c: dict, hf: bool) -> None:
    """Draw the activations dtype and each weight group's storage dtype into c (hf: one dtype, as config.json has)."""
    act = rng.choice(["bfloat16", "float16", "float32"])
    c["dtypes.activations"] = act
    for k in ("embeddings", "attention_weights", "dense_mlp_weights", "norm_weights", "lm_head"):
        c[f"dtypes.{k}"] = act if hf else rng.choice(["bfloat16", "float16", "float32", act])
    if c["logits.tie_word_embeddings"]:
        c["dtypes.lm_head"] = c["dtypes.embeddings"]
    if c["dtypes.experts"] != "nvfp4":
        c["dtypes.experts"] = act if hf else rng.choice(["bfloat16", "float16", "float32"])


def full_size_wide(rng: random.Random) -> dict:
    """full_size() plus the spec's other free fields (as wide() for small specs): fp32 activations, mixed storage
    dtypes, explicit layer lists, SSMax off, (1 + w) norms."""
    c = full_size(rng)
    n = c["num_layers"]
    _dtypes(rng, c, hf=False)
    if rng.random() < 0.5:
        c["layers.attention"] = [rng.choice(["sliding_attention", "full_attention"]) for _ in range(n)]
    if rng.random() < 0.5:
        c["layers.mlp"] = [rng.choice(["dense", "sparse"]) for _ in range(n)]
    c["attention.full.q_scale"] = rng.choice([None, {"length": 2048.0, "offset": 1.0, "exponent": 0.1}])
    c["norm.weight_form"] = rng.choice(["w", "1+w"])
    c["attention.qk_norm.weight_form"] = rng.choice(["w", "1+w"])
    c["attention.sliding.window_includes_current"] = rng.random() < 0.7
    return c


def small(rng: random.Random, odd: bool) -> dict:
    hd = rng.choice([8, 24, 40, 48] if odd else [16, 32, 64])
    nkv = rng.choice([1, 2, 4])
    return {"hidden_size": rng.choice([80, 112, 208] if odd else [64, 96, 128, 192, 256]),
            "num_layers": rng.choice([2, 3, 5, 7]), "attention.num_heads": nkv * rng.choice([1, 2, 3, 4]),
            "attention.num_kv_heads": nkv, "attention.head_dim": hd, "attention.sliding.rope.rotary_dim": hd,
            "attention.sliding.window": rng.choice([3, 5, 16, 17]),
            "attention.sliding.window_includes_current": rng.random() < 0.7,
            "layers.dense_first": rng.choice([0, 1, 2]), "layers.full_every": rng.choice([2, 3, 6]),
            **router(rng, [4, 6, 8, 12, 16, 20], (1, 2, 3, 4)),
            "mlp.moe.d_ff": rng.choice([32, 48, 80] if odd else [16, 32, 48, 96]),
            "mlp.dense.d_ff": rng.choice([72, 200] if odd else [64, 128, 320]),
            "mlp.moe.renormalize": rng.random() < 0.7, "norm.weight_form": rng.choice(["w", "1+w"]),
            "logits.tie_word_embeddings": rng.random() < 0.3, "logits.softcap": rng.choice([None, 30.0]),
            "dtypes.kv_cache": rng.choice(["bfloat16", "fp8"]),
            "vocab_size": rng.choice([257, 301, 1001] if odd else [300, 512, 1000]),
            "dtypes.experts": rng.choice(["nvfp4", "nvfp4", "bfloat16"]), "mlp.moe.routed_scaling": rng.choice([1.0, 2.5]),
            "residual.attn_n.extra": rng.choice([0, 1]), "residual.mlp_n.scale": rng.choice([1, 2]),
            "attention.sliding.rope.theta": rng.choice([10000.0, 500000.0])}


def edge(rng: random.Random, hf: bool) -> dict:
    """wide() at the schema's small extremes: one layer, a window of 1, head dim 2, two experts, top-1 routing,
    vocabularies and widths of a few entries."""
    c = wide(rng, False, hf)
    nkv = rng.choice([1, 2])
    E = rng.choice([2, 3, 4])
    ng = rng.choice([g for g in (1, 2) if E % g == 0 and E // g >= 2])
    c.update({"num_layers": rng.choice([1, 2]), "hidden_size": rng.choice([16, 32, 48]),
              "attention.num_kv_heads": nkv, "attention.num_heads": nkv * rng.choice([1, 3]),
              "attention.head_dim": rng.choice([2, 4, 6]), "attention.sliding.window": rng.choice([1, 2]),
              "mlp.moe.num_experts": E, "mlp.moe.n_group": ng, "mlp.moe.topk_group": rng.randint(1, ng),
              "mlp.moe.d_ff": 16, "mlp.dense.d_ff": rng.choice([16, 24]), "vocab_size": rng.choice([2, 7, 33])})
    c["attention.sliding.rope.rotary_dim"] = c["attention.head_dim"]
    c["mlp.moe.top_k"] = rng.randint(1, c["mlp.moe.topk_group"] * (E // ng))
    n = c["num_layers"]
    for k in ("layers.attention", "layers.mlp"):
        if k in c:
            c[k] = c[k][:n] + [c[k][-1]] * (n - len(c[k]))
    c["layers.dense_first"] = min(c["layers.dense_first"], n)
    return c


# small()'s draws of fields transformers' Beam hard-codes, pinned to its values for the hf mode
HF_FIXED = {"norm.weight_form": "w", "residual.attn_n.extra": 0, "residual.mlp_n.scale": 2}


def for_hf(changes: dict) -> dict:
    """A draw as transformers can run it: HF_FIXED, the q / k norms on norm.eps (config.json has one eps), and
    unquantized experts (transformers cannot read packed NVFP4; test_parity checks them by their dequantised
    values)."""
    return {**changes, **HF_FIXED, "attention.qk_norm.eps": changes.get("norm.eps", 1e-6),
            "dtypes.experts": changes.get("dtypes.activations", "bfloat16")}


def wide(rng: random.Random, odd: bool, hf: bool) -> dict:
    """small() plus the spec's other free fields: explicit layer lists, mixed storage dtypes, eps and SSMax values;
    with hf, only what config.json carries (transformers hard-codes the rest)."""
    c = small(rng, odd)
    n = c["num_layers"]
    if hf:
        c.update(HF_FIXED)
    if rng.random() < 0.5:
        c["layers.attention"] = [rng.choice(["sliding_attention", "full_attention"]) for _ in range(n)]
    else:
        c["layers.last_is_full"] = rng.random() < 0.7
    if rng.random() < 0.5:
        c["layers.mlp"] = [rng.choice(["dense", "sparse"]) for _ in range(n)]
    eps = rng.choice([1e-6, 1e-5, 1e-3])
    c["norm.eps"] = eps
    c["attention.qk_norm.eps"] = eps if hf or rng.random() < 0.5 else rng.choice([1e-6, 1e-5])
    _dtypes(rng, c, hf)
    if not hf:
        c["mlp.moe.renorm_eps"] = rng.choice([1e-20, 1e-6])
        c["attention.full.q_scale"] = rng.choice([None, {"length": 64.0, "offset": 0.0, "exponent": 0.5},
                                                  {"length": 2048.0, "offset": 1.0, "exponent": 0.1}])
        c["attention.qk_norm.weight_form"] = rng.choice(["w", "1+w"])
    c["max_position_embeddings"] = rng.choice([64, 8192])
    return c


def hf_parity(spec, rng: random.Random, seed: int) -> str:
    """The interpreter's fp32 prefill of a ragged batch against transformers' Beam (fp32, eager experts, sdpa) on
    the same random checkpoint."""
    import torch

    from conftest import hf_logits, hf_model, rel_err

    from beamc.checkpoint.init import init_weights
    from beamc.runtime.session import ReferenceSession
    from beamc.spec.hf import hf_config_to_spec, hf_unexpressed, spec_to_hf_config

    if hf_unexpressed(spec):
        return "skipped: " + "; ".join(hf_unexpressed(spec))
    # config.json and back (`beamc import-hf`): the same model (the layer lists may come back as rules)
    back = hf_config_to_spec(spec_to_hf_config(spec), spec.name)
    facts = lambda s: (s.model_dump(exclude={"layers": True, "attention": {"sliding": {"window",  # noqa: E731
                       "window_includes_current"}}}), s.attention_types, s.mlp_types, s.effective_window)
    if facts(back) != facts(spec):
        return "FAILED: the spec through config.json and back differs"
    d = Path(tempfile.mkdtemp())
    init_weights(spec, d, seed=seed)
    n = min(spec.max_position_embeddings, 40)
    seqs = [[rng.randrange(spec.vocab_size) for _ in range(rng.randint(1, n))] for _ in range(rng.randint(1, 3))]
    # a ragged prefill of each sequence's first part, then decode steps of the sequences still going (one token each)
    cut = [rng.randint(1, len(ids)) for ids in seqs]
    sess = ReferenceSession.from_checkpoint(spec, d, dtype="f32", max_len=n, max_chunk=n * 3)
    outs = [[o] for o in sess.prefill([(i, ids[:c]) for i, (ids, c) in enumerate(zip(seqs, cut))])]
    for t in range(max(len(ids) - c for ids, c in zip(seqs, cut))):
        step = {i: ids[c + t] for i, (ids, c) in enumerate(zip(seqs, cut)) if c + t < len(ids)}
        for i, row in zip(step, sess.decode(step)):
            outs[i].append(row[None])
    model = hf_model(d, torch.float32)
    worst = max(rel_err(torch.cat(out), hf_logits(model, ids)) for ids, out in zip(seqs, outs))
    return "ok" if worst < 1e-5 else f"FAILED: logits {worst:.2e} apart from transformers'"


def passes_bitwise(spec, rng: random.Random, seed: int, tp: int = 1) -> str:
    """The interpreter at the spec's own dtypes (bf16 / f16 / fp32, mixed storage): graphs with every pass against
    graphs without any, bit for bit, over a ragged prefill and decode steps (at TP tp where the spec allows it)."""
    import torch

    from beamc.checkpoint.init import init_weights
    from beamc.checkpoint.layout import check_tp
    from beamc.compiler import compile_graphs
    from beamc.passes.manager import select_passes
    from beamc.runtime.session import ReferenceSession

    try:
        check_tp(spec, tp)
    except Exception:  # noqa: BLE001 - this spec does not split tp ways
        tp = 1
    d = Path(tempfile.mkdtemp())
    init_weights(spec, d, seed=seed)
    n = min(spec.max_position_embeddings, 40)
    seqs = [[rng.randrange(spec.vocab_size) for _ in range(rng.randint(1, n - 2))] for _ in range(rng.randint(1, 3))]
    outs = []
    for names in ("none", "all"):
        graphs = compile_graphs(spec, tp=tp, dtype=None, passes=select_passes(names))
        sess = ReferenceSession.from_checkpoint(spec, d, tp=tp, dtype=None, max_len=n, max_chunk=n * 3,
                                                graphs=graphs)
        out = sess.prefill(list(enumerate(seqs)))
        for t in range(2):
            out.append(sess.decode({i: s[t % len(s)] for i, s in enumerate(seqs)}))
        outs.append(out)
    same = all(torch.equal(a, b) for a, b in zip(*outs))
    finite = all(bool(x.isfinite().all()) for x in outs[0])
    return (f"tp {tp}: " if tp > 1 else "") + ("ok" if same and finite else
                                               f"FAILED: bitwise {same}, finite {finite}")


def aot(spec, rng: random.Random, arch: int, seen: set) -> str:
    """Every kernel of one rank's package (a random TP the heads allow) compiled for sm_<arch>a."""
    from beamc.codegen.package import compile_package
    from beamc.passes.manager import select_passes
    from test_codegen import _aot

    tp = rng.choice([t for t in (1, 2, 4, 8) if spec.attention.num_heads % t == 0])
    try:
        pkg = compile_package(spec, target="sm100" if arch == 100 else "sm90", tp=tp, passes=select_passes("all"))
    except Exception as e:  # noqa: BLE001 - a valid spec the compiler cannot compile: reported with the spec
        return f"tp {tp}: FAILED to compile the package: {type(e).__name__}: {str(e)[:600]}"
    bad = []
    for name, k in pkg.kernels.items():
        src = k.source()
        if src in seen:
            continue
        seen.add(src)
        try:
            _aot((name, src, arch))
        except Exception as e:  # noqa: BLE001 - reported with the spec
            bad.append(f"{name}: {type(e).__name__}: {str(e)[-300:]}")
    return f"tp {tp}, {len(pkg.kernels)} kernels: " + ("ok" if not bad else "FAILED " + " | ".join(bad))


def runtime(spec, rng: random.Random, seed: int, tp: int = 1) -> str:
    """`beamc logits` with both backends on a random checkpoint, a ragged prefill and two decode steps; with tp > 1
    (where the heads and the NVFP4 groups allow it) the interpreter backend at TP tp (ranks simulated in one process:
    the IR's per-rank lowering) against itself at TP 1 instead."""
    import torch
    from safetensors.torch import load_file

    from conftest import rel_err

    from beamc.checkpoint.init import init_weights
    from beamc.spec.hf import spec_to_yaml

    d = Path(tempfile.mkdtemp())
    (d / "spec.yaml").write_text(spec_to_yaml(spec))
    init_weights(spec, d / "ckpt", seed=seed)
    seqs = [[rng.randrange(spec.vocab_size) for _ in range(rng.randint(1, 24))] for _ in range(rng.randint(1, 3))]
    (d / "b.json").write_text(json.dumps({"sequences": seqs, "decode_steps": 2}))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = {}
    m = spec.mlp.moe
    if spec.attention.num_heads % tp or (spec.dtypes.experts == "nvfp4" and (m.d_ff // tp) % 16) or m.d_ff % tp:
        tp = 1
    runs = [("interpreter", 1), ("compiled", 1)] if tp == 1 else [("interpreter", 1), ("interpreter", tp)]
    for backend, t in runs:
        p = subprocess.run([sys.executable, "-m", "beamc.cli", "logits", str(d / "spec.yaml"), "--checkpoint",
                            str(d / "ckpt"), "--input", str(d / "b.json"), "--passes", "all", "-o",
                            str(d / f"{backend}{t}.st"), "--backend", backend, "--tp", str(t)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if p.returncode:
            return f"FAILED ({backend}, tp {t}): {p.stderr[-1500:]}"
        out[(backend, t)] = load_file(d / f"{backend}{t}.st")
    worst, tokens = 0.0, True
    want_all, got_all = out[runs[0]], out[runs[1]]
    for k, want in want_all.items():
        got = got_all[k]
        if "tokens" in k:
            tokens &= bool(torch.equal(got, want))
        else:
            worst = max(worst, rel_err(got, want))
    return (f"tp {tp}: " if tp > 1 else "") + (
        "ok" if worst < 1e-5 and tokens else f"FAILED: logits {worst:.2e} apart, tokens equal: {tokens}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("aot", "runtime", "hf", "passes"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=10)
    ap.add_argument("--arch", type=int, choices=(90, 100), default=90, help="aot: the target")
    ap.add_argument("--odd", action="store_true", help="runtime: widths that are not powers of 2")
    ap.add_argument("--tp", type=int, default=1, help="runtime: the interpreter at this TP against TP 1 instead")
    ap.add_argument("--wide", action="store_true", help="the spec's other free fields too")
    ap.add_argument("--edge", action="store_true", help="wide() at the schema's small extremes")
    args = ap.parse_args(argv)
    from conftest import spec_variant

    from beamc.spec import load_spec

    base = load_spec(ROOT / "models" / ("beam.yaml" if args.mode == "aot" else "beam-tiny.yaml"))
    rng = random.Random(args.seed)
    seen: set = set()
    failed = 0
    for i in range(args.count):
        if args.edge:
            changes = edge(rng, args.mode == "hf")
        elif args.mode == "aot":
            changes = full_size_wide(rng) if args.wide else full_size(rng)
        elif args.wide or args.mode == "hf":
            changes = wide(rng, args.odd, args.mode == "hf") if args.wide else small(rng, args.odd)
        else:
            changes = small(rng, args.odd)
        if args.mode == "hf":
            changes = for_hf(changes)
        t0 = time.time()
        try:
            spec = spec_variant(base, changes)
        except Exception as e:  # noqa: BLE001 - a refused spec: its message is the check
            print(i, "refused:", str(e)[:200], flush=True)
            continue
        if args.mode == "aot":
            r = aot(spec, rng, args.arch, seen)
        elif args.mode == "hf":
            r = hf_parity(spec, rng, args.seed * 1000 + i)
        elif args.mode == "passes":
            r = passes_bitwise(spec, rng, args.seed * 1000 + i, args.tp)
        else:
            r = runtime(spec, rng, args.seed * 1000 + i, args.tp)
        failed += "FAILED" in r
        print(i, f"{time.time() - t0:.0f}s", r, json.dumps(changes) if "FAILED" in r else "", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
