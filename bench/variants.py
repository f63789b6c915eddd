"""Template variants in the whole step: batch-1 decode (and optionally the prefill) of one TP-8 rank's share of Beam,
every pass on, for packages that differ only in template constants (`beamc compile --set TEMPLATE.CONSTANT=VALUE`)
or compile options (`compile.NAME=VALUE`: COMPILE_OPTIONS, `compile_package`'s keywords), or leave a fusion pass out
(`pass.NAME=false`: the package without that pass, e.g. `--variant unfused=pass.qk_attention=false`), or change a
form the emitter picks by itself (`form.NAME.KEY=VALUE`: a key of `emitters.MOE_WGMMA_FORMS[NAME]`, constants the
compiler sets and `--set` may not pin, e.g. `--variant load4=form.bm256.WG_LOAD_WARPS=4,form.bm256.WG_LOAD_REGS=96`).

    python bench/variants.py --out $OUT --variant kv_tiles=attention_decode.KV_TILES=true \\
        --variant w8=attention_decode.NUM_WARPS=8,attention_decode.BLOCK_N=128 \\
        --variant ungated=compile.prefill_attention_gate=false --prefill [--once]
    TRITON_INTERPRET=1 python bench/variants.py --dry --variant w2=attention_decode.NUM_WARPS=2

Why: a kernel's isolated graph does not rank renders the way the step does (the eleventh session's QKN renders:
faster alone, slower in the step), so a render is judged in the step. One weights dict for every variant
(bench/ablation.py's `run_row`, which compiles, loads, fills the context, captures and times); the default package
runs first and again last, so the drift of the shared GPU over the run shows beside the differences. Each package's
logits of the two decode steps before the timed ones (the same inputs for all: one context fill, one token seed) are
compared with the first default run's: bitwise equal, or the largest difference (a render option that only moves
work, e.g. where a kernel lets the next launch start, must give the same bits; the second default run checks that the
comparison itself holds). Writes OUT/variants-<date>[-dry][tag].json and prints a table last (ms per decode step,
each variant against the mean of the two default runs, and its logits against the default's).

--decode-batch B: the decode step of B sequences (each at --context) instead of one, for render options that only
act at T > 1 (the MoE decode kernel's pairs per pass, its COMBINE rows per warp).

--rounds R (decode only): the default package stays loaded, and each variant, right after its own pass, is timed
R times more alternately with it (round r: the default first when r is even, the variant first when odd; `--steps`
replays each), then unloaded; a variant's "paired" figure is the median over the rounds of its ms / the default's ms
in the same round, with the rounds' range, so that the GPU's drift cancels. (Two packages at a time: each loaded
package holds its own re-laid-out NVFP4 experts, ~33 GB at TP 8, so the s18run2 run that kept all six ran out of
the H200's memory at the third.)
Why: the s17run4 variants held a null variant (TARGET_PROGRAMS 396: at one token the same kernels as the default,
both capped at 256 splits) that measured -1.4% against the two default runs; a single pass per package cannot
resolve the 1-2% a launch's placement or a pipeline depth moves. The second default run is the calibration: its
paired range is the noise left.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import ablation  # noqa: E402  bench/ablation.py
import full_model as fm  # noqa: E402  bench/full_model.py
from beamc.codegen.overrides import parse_overrides, parse_value  # noqa: E402
from beamc.codegen.package import compile_package  # noqa: E402
from beamc.errors import BeamcError  # noqa: E402
from beamc.passes.manager import PASSES  # noqa: E402


# `compile.NAME=VALUE` items: compile_package options a variant may set besides template constants
COMPILE_OPTIONS = {"prefill_attention_gate": bool, "moe_combine_max_tokens": int, "moe_dequant": bool, "moe_wgmma": bool,
                   "attention_mirror_pages": int, "nvfp4_relayout": bool, "l2_prefetch_mb": int,
                   "moe_frag_max_tokens": int}


def parse_variant(text: str) -> tuple[str, dict, dict]:
    """'LABEL=T.K=V[,T.K=V...]' -> (label, template overrides, compile options): items `compile.NAME=VALUE` set a
    `compile_package` option (COMPILE_OPTIONS), the others pin template constants; one line naming the bad variant
    otherwise."""
    label, eq, rest = text.partition("=")
    if not eq or not label or "." in label or not rest:
        raise SystemExit(f"--variant {text!r}: give LABEL=TEMPLATE.CONSTANT=VALUE[,...] (or compile.OPTION=VALUE)")
    items = rest.split(",")
    options = {}
    for item in (i for i in items if i.startswith("pass.")):  # a fusion pass left out: `pass.NAME=false`
        name, _, value = item[len("pass."):].partition("=")
        if name not in PASSES or value.lower() != "false":
            raise SystemExit(f"--variant {label}: {item!r}: give pass.NAME=false, NAME one of " + ", ".join(PASSES))
        options.setdefault("disable", []).append(name)
    items = [i for i in items if not i.startswith("pass.")]
    for item in (i for i in items if i.startswith("form.")):  # a key of one of the emitter's MoE WGMMA forms
        from beamc.codegen.emitters import MOE_WGMMA_FORMS
        name, _, kv = item[len("form."):].partition(".")
        key, _, value = kv.partition("=")
        if name not in MOE_WGMMA_FORMS or not key.isupper() or not value:
            raise SystemExit(f"--variant {label}: {item!r}: give form.NAME.KEY=VALUE, NAME one of "
                             + ", ".join(MOE_WGMMA_FORMS) + " (emitters.MOE_WGMMA_FORMS), KEY a template constant")
        options.setdefault("forms", {}).setdefault(name, {})[key] = parse_value(value)
    items = [i for i in items if not i.startswith("form.")]
    for item in (i for i in items if i.startswith("compile.")):
        name, _, value = item[len("compile."):].partition("=")
        if name not in COMPILE_OPTIONS or not value:
            raise SystemExit(f"--variant {label}: {item!r}: give compile.NAME=VALUE, NAME one of "
                             + ", ".join(COMPILE_OPTIONS))
        v = parse_value(value)
        kind = COMPILE_OPTIONS[name]
        if type(v) is not kind:  # (bool is not an int here: True would read as 1 token)
            raise SystemExit(f"--variant {label}: {item!r}: {name} takes {'true or false' if kind is bool else 'an integer'}")
        options[name] = v
    try:
        over = parse_overrides([i for i in items if not i.startswith("compile.")], where=f"--variant {label}")
    except BeamcError as e:
        raise SystemExit(f"variants.py: {e}") from None
    return label, over, options


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    fm.add_common_args(ap, steps=40, reps=3)
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=T.K=V[,T.K=V]",
                    help="a package with these template constants pinned (repeatable)")
    ap.add_argument("--prefill", action="store_true", help="also time the batch x chunk prefill of each variant")
    ap.add_argument("--tag", default="", help="appended to the output file name")
    ap.add_argument("--once", action="store_true", help="the default package once (not again at the end)")
    ap.add_argument("--decode-batch", type=int, default=1, metavar="B",
                    help="the decode step's sequences (each at --context; default 1): render options for T > 1")
    ap.add_argument("--rounds", type=int, default=0, metavar="R",
                    help="decode only: keep every package loaded and time them all R more times in turn (paired "
                         "with the default in each round; see the module docstring)")
    a = ap.parse_args(argv)
    if a.rounds and a.prefill:
        raise SystemExit("--rounds times decode steps only: leave out --prefill")
    variants = [("default", {}, {})] + [parse_variant(v) for v in a.variant] + (
        [] if a.once else [("default (again)", {}, {})])
    device = fm.device_for(a)
    import kernels as kb  # bench/kernels.py: read_bandwidth
    from beamc.runtime.random_weights import random_rank_weights

    fm.single_rank_collectives()
    t0 = time.perf_counter()
    spec = fm.bench_spec(Path(a.spec), a.context, max(a.chunk, a.steps + 4), a.experts)
    facts: dict = {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
                   "dry": a.dry, "note": fm.SKIPPED, "tp": a.tp, "rank": 0, "context": a.context, "chunk": a.chunk,
                   "batch": a.batch, "decode_batch": a.decode_batch, "kv_cache": "fp8", "spec": spec.name,
                   "passes": list(PASSES),
                   "env": {"device": fm.torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"}}
    base = compile_package(spec, tp=a.tp, rank=0, passes=[], dtype="f32" if a.dry else None)
    weights = random_rank_weights(spec, [st.graph for st in base.steps.values()], tp=a.tp, rank=0, device=device,
                                  seed=a.seed)
    del base
    bw = kb.read_bandwidth()
    facts["read_tb_s"] = round(bw, 3)
    facts["rows"] = []
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"variants-{facts['date']}{'-dry' if a.dry else ''}{a.tag}.json"
    tmp = tempfile.TemporaryDirectory(prefix="beam-variants-")
    reference = None  # the first default run's decode logits
    default_kept = None  # (--rounds) the default package: (model, its decode replay)
    for i, (label, over, options) in enumerate(variants):
        t = time.perf_counter()
        print(f"variant {label}: ...", flush=True)
        outs: list = []
        keep: list | None = [] if a.rounds else None
        try:
            passes = [p for p in PASSES if p not in options.get("disable", [])]
            compile_opts = {k: v for k, v in options.items() if k not in ("disable", "forms")}
            with emitter_forms(options.get("forms", {})):
                r = ablation.run_row(a, spec, passes, weights, device, Path(tmp.name), f"v{i}", bw,
                                     overrides=over, prefill=a.prefill, options=compile_opts, outputs=outs, keep=keep,
                                     decode_batch=a.decode_batch)
            reference = outs if reference is None else reference
            r["decode"]["logits"] = compare_logits(outs, reference)
        except Exception as e:  # one failing variant must not lose the others' numbers
            ablation.free(device)
            r = {"error": f"{type(e).__name__}: {e}"[:2000]}
        if keep and i == 0:
            default_kept = keep[0]
        elif keep and default_kept is not None:  # --rounds: this variant against the default, then unloaded
            print(f"  {a.rounds} rounds of {a.steps} steps, alternating with the default ...", flush=True)
            base_ms, var_ms = alternated(default_kept, keep[0], device, a.steps, a.rounds)
            r["decode"].update(rounds_ms=var_ms, rounds_base_ms=base_ms)
        del keep
        ablation.free(device)
        r.update(label=label, overrides=over, options=options, s=round(time.perf_counter() - t, 1))
        facts["rows"].append(r)
        paired([r])
        path.write_text(json.dumps(facts, indent=1, default=str) + "\n")
    del default_kept
    ablation.free(device)
    facts["total_s"] = round(time.perf_counter() - t0, 1)
    path.write_text(json.dumps(facts, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    print(table(facts))
    return facts


@contextlib.contextmanager
def emitter_forms(changes: dict):
    """emitters.MOE_WGMMA_FORMS with `changes` ({form: {key: value}}) while the variant's package compiles, then as
    it was (the next variant compiles with the emitter's own forms)."""
    from beamc.codegen import emitters
    saved = {name: dict(form) for name, form in emitters.MOE_WGMMA_FORMS.items()}
    for name, kv in changes.items():
        emitters.MOE_WGMMA_FORMS[name].update(kv)
    try:
        yield
    finally:
        emitters.MOE_WGMMA_FORMS.clear()
        emitters.MOE_WGMMA_FORMS.update(saved)


def alternated(base, variant, device, steps: int, rounds: int) -> tuple[list, list]:
    """ms per decode step (the median of `steps` replays) of two kept packages ((model, decode replay) each),
    `rounds` times in turn: round r times the base first when r is even, the variant first when odd, so that neither
    always follows the other. Returns (base's ms per round, variant's ms per round)."""
    out: tuple[list, list] = ([], [])
    for r in range(rounds):
        for k in ((0, 1) if r % 2 == 0 else (1, 0)):
            out[k].append(statistics.median(fm.timed((base, variant)[k][1], device, steps)))
    return out


def paired(rows: list[dict]) -> None:
    """Each row with `rounds_ms` (and the default's `rounds_base_ms` of the same rounds) gets `paired`: its ms / the
    default's ms round by round, as the median and the range over the rounds."""
    for r in rows:
        d = r.get("decode", {})
        if d.get("rounds_ms") and d.get("rounds_base_ms"):
            q = [x / b for x, b in zip(d["rounds_ms"], d["rounds_base_ms"])]
            d["paired"] = {"median": statistics.median(q), "min": min(q), "max": max(q)}


def compare_logits(outs: list, reference: list) -> dict:
    """A package's decode logits against the reference package's (lists of fp32 tensors, step by step)."""
    import torch

    if len(outs) != len(reference) or any(o.shape != r.shape for o, r in zip(outs, reference)):
        return {"bitwise_equal": False, "max_abs_diff": None, "finite": None}
    diff = max(((o - r).abs().max().item() for o, r in zip(outs, reference)), default=0.0)
    return {"bitwise_equal": all(torch.equal(o, r) for o, r in zip(outs, reference)), "max_abs_diff": diff,
            "finite": all(bool(torch.isfinite(o).all()) for o in outs)}


def _logits_cell(r: dict) -> str:
    c = r["decode"].get("logits")
    if c is None:
        return "-"
    if c["bitwise_equal"]:
        return "bitwise"
    if c["max_abs_diff"] is None:
        return "other shape"
    return f"max diff {c['max_abs_diff']:.2g}" + ("" if c["finite"] else ", not finite")


def table(facts: dict) -> str:
    ok = [r for r in facts["rows"] if "decode" in r]
    ref = [r["decode"]["ms"] for r in ok if r["label"].startswith("default")]
    mid = statistics.mean(ref) if ref else None
    rounds = any("paired" in r.get("decode", {}) for r in facts["rows"])
    lines = ["| variant | overrides | decode ms | vs default | prefill ms | logits vs default |"
             + (" paired vs default: median [range] |" if rounds else ""),
             "|---|---|---:|---:|---:|---|" + ("---:|" if rounds else "")]
    for r in facts["rows"]:
        over = "; ".join([f"{t}.{k}={v}" for t, kv in r["overrides"].items() for k, v in kv.items()]
                         + [f"compile.{k}={v}" for k, v in r.get("options", {}).items() if k != "disable"]
                         + [f"pass.{p}=false" for p in r.get("options", {}).get("disable", [])]) or "-"
        if "decode" not in r:
            lines.append(f"| {r['label']} | {over} | failed: {r.get('error', '?')[:160]} | | | |")
            continue
        ms = r["decode"]["ms"]
        rel = f"{ms / mid - 1:+.1%}" if mid else "-"
        pre = f"{r['prefill']['ms']:.2f}" if "prefill" in r else "-"
        cell = ""
        if rounds:
            q = r["decode"].get("paired")
            cell = (f" {q['median'] - 1:+.2%} [{q['min'] - 1:+.2%}, {q['max'] - 1:+.2%}] |" if q else " - |")
        lines.append(f"| {r['label']} | {over} | {ms:.3f} | {rel} | {pre} | {_logits_cell(r)} |{cell}")
    if len(ref) == 2:
        lines.append(f"(the two default runs: {ref[0]:.3f} and {ref[1]:.3f} ms: the drift over the run"
                     + ("; paired: each round's ms over the default's in the same round, the second default run's "
                        "range is the noise left)" if rounds else ")"))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
