"""Ablation (issue 11): decode and prefill time of one TP-8 rank's share of the full Beam as each pass is added.

    python bench/ablation.py [--out bench/results] [--context 102400] [--chunk 2048] [--steps 30] [--reps 3]
    TRITON_INTERPRET=1 python bench/ablation.py --dry [--rows 0,1,8]   # the same code path: tiny spec on a CPU

Rows: the unfused graph (`passes=[]`: every IR op its own generated kernel or named library call), then each pass
of `beamc.passes.manager.PASSES` added cumulatively in that (the seed's) order; the last row is every pass.
`--rows` picks rows by index (0 = unfused, 8 = all passes) or by the last pass's name ("none" / "all" too).

Each row reuses bench/full_model.py (imported, not copied): the same spec patch (fp8 KV, room for the context),
the same one-rank simulation (collectives as copies), the same timing helpers and the same decode roofline.
- compile: `compile_package(spec, tp=8, rank=0, passes=row)`, written to a temporary package;
- weights: ONE random dict for the whole run, drawn once from the unfused graphs (which read the unpacked
  Q/K/V/gate weights); rows whose `pack_qkv_gate` pass asks for a packed param get it from `Model.load`
  (`interpret.with_packed_weights` concatenates the same tensors at load; the other params are shared, not
  copied), so every row computes with the same values. A row needing a param the dict lacks stops the run;
- decode: batch 1 at `--context` (`Model.fill_context`), the captured CUDA graph replayed `--steps` times
  (median ms, CUDA events); kernels and library calls of one batch-1 decode step;
- prefill: `--batch` x `--chunk` tokens appended to `--context` each, the bucket's graph replayed `--reps` times;
- roofline: decode bytes (full_model.decode_bytes) over the read bandwidth measured once in this run.
  No prefill roofline yet (the issue asks for FLOPs over the measured bf16 GEMM rate: not implemented here);
- the model is freed (gc + torch.cuda.empty_cache) before the next row.
Budget: 9 rows must fit in ~8 minutes on an H200, so the defaults are 30 decode steps (the issue's minimum)
and 3 prefill replays, and no API-path timings (full_model.py has those for the fused package).
NOT implemented yet: the torch.compile + CUDA graph baseline row (plain PyTorch on the same weights) and the
per-layer-kind profiler breakdown; the JSON says so ("not_implemented"), nothing is faked.

Writes OUT/ablation-<date>[-dry].json, OUT/ablation-<date>[-dry].png (two panels: decode ms and prefill ms per row;
skipped with a note without matplotlib) and prints a Markdown table last.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import full_model as fm  # noqa: E402  bench/full_model.py
from beamc.codegen.package import compile_package  # noqa: E402
from beamc.passes.manager import PASSES  # noqa: E402

NOT_IMPLEMENTED = [
    "torch.compile + CUDA graph baseline row (plain PyTorch on the same weights): not implemented yet",
    "per-layer-kind profiler breakdown of the fused decode step: not implemented yet",
    "prefill roofline (FLOPs over the measured bf16 GEMM rate): not implemented yet",
]


def all_rows() -> list[tuple[str, list[str]]]:
    """(label, passes) of every row: unfused, then each pass added cumulatively."""
    names = list(PASSES)
    return [("none", [])] + [(f"+{n}", names[:i + 1]) for i, n in enumerate(names)]


def pick_rows(arg: str | None) -> list[int]:
    rows = all_rows()
    if not arg:
        return list(range(len(rows)))
    out = []
    for s in (x.strip() for x in arg.split(",") if x.strip()):
        if s.isdigit():
            i = int(s)
        elif s == "none":
            i = 0
        elif s == "all":
            i = len(rows) - 1
        elif s in PASSES:
            i = list(PASSES).index(s) + 1
        else:
            raise SystemExit(f"--rows: {s!r} is not a row index, 'none', 'all' or a pass name")
        if not 0 <= i < len(rows):
            raise SystemExit(f"--rows: {i} outside 0..{len(rows) - 1}")
        out.append(i)
    return sorted(set(out))


def free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_row(a, spec, passes: list[str], weights: dict, device, tmpdir: Path, tag: str, bw: float | None) -> dict:
    from beamc.runtime.model import Model

    row: dict = {"passes": passes}
    t = time.perf_counter()
    package = compile_package(spec, tp=a.tp, rank=0, passes=passes, dtype="f32" if a.dry else None)
    pkg = package.write(tmpdir / tag)
    row["compile_s"] = round(time.perf_counter() - t, 1)
    lib_static = sum(1 for _, ln in package.steps["decode"].launches if ln.kernel is None)
    packed = sorted(n for st in package.steps.values() for n, node in st.graph.leaves("param").items()
                    if "pack" in node.attrs)
    row["packed_params"] = len(packed)
    del package
    t = time.perf_counter()
    max_context = a.context + max(a.chunk, 4)
    model = Model.load(pkg, None, device=str(device), spec=spec, tp=a.tp, rank=0, kv_dtype="fp8", weights=weights,
                       max_batch=a.batch, max_context=max_context, max_prefill_tokens=a.batch * a.chunk)
    fm.sync(device)
    row["load_s"] = round(time.perf_counter() - t, 1)
    gen = torch.Generator().manual_seed(a.seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist()

    try:
        # ---- decode: batch 1 at `context`
        model.fill_context("d", a.context, seed=a.seed)
        for tok in tokens(2):  # warm up (the decode graphs were captured at load)
            model.decode(["d"], [tok])
        key = ("decode", 1, 1)
        dec = fm.timed(fm.replay(model, key, "decode", {"B": 1, "R": 1}), device, a.steps)
        launches = model.phases["decode"].launches
        lib = Counter(ln.library for _, ln in launches if ln.library and ln.runs_for(1))
        row["decode"] = {"ms": statistics.median(dec), "steps": a.steps, "runs_as": model.graphs.status.get(key, "?"),
                         "kernels": sum(1 for _, ln in launches if ln.kernel is not None and ln.runs_for(1)),
                         "library_calls": sum(lib.values()), "library": dict(lib),
                         "library_calls_compiled": lib_static}
        model.release("d")
        if bw is not None:
            nbytes = fm.decode_bytes(model, spec, a.context)
            roof_ms = nbytes["total"] / (bw * 1e12) * 1e3
            row["roofline"] = {"bytes": nbytes["total"], "ms": roof_ms, "fraction": roof_ms / row["decode"]["ms"]}
        # ---- prefill: batch x chunk tokens after `context` each
        seqs = [f"p{i}" for i in range(a.batch)]
        for i, s in enumerate(seqs):
            model.fill_context(s, a.context, seed=a.seed + 1 + i)
        chunks = [tokens(a.chunk) for _ in seqs]
        t = time.perf_counter()
        model.prefill(seqs, chunks, start_positions=[a.context] * a.batch)  # captures the bucket's graph
        fm.sync(device)
        first_s = time.perf_counter() - t
        pkey = next(k for k in model.graphs.status if k[0] == "prefill")
        pre = fm.timed(fm.replay(model, pkey, "prefill", {"T": pkey[1], "R": pkey[2]}), device, a.reps)
        row["prefill"] = {"ms": statistics.median(pre), "reps": a.reps, "tokens": a.batch * a.chunk,
                          "bucket": pkey[1], "first_call_s": round(first_s, 2),
                          "runs_as": model.graphs.status.get(pkey, "?")}
        if device.type == "cuda":
            row["max_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / fm.GB, 2)
    finally:
        del model
        free(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
    return row


def plot(facts: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG (pip install matplotlib)"
    rows = [r for r in facts["rows"] if "decode" in r]
    labels = [r["label"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in ((axes[0], "decode", f"decode, batch 1 @ {facts['context']} (ms/step)"),
                           (axes[1], "prefill", f"prefill {facts['batch']} x {facts['chunk']} @ {facts['context']} (ms)")):
        vals = [r[key]["ms"] for r in rows]
        ax.bar(range(len(vals)), vals, color="tab:blue")
        ax.plot(range(len(vals)), vals, color="tab:orange", marker="o")
        for i, v in enumerate(vals):
            ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(vals)))
        ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
        ax.set_title(title)
        ax.set_ylabel("ms")
    fig.suptitle(f"{facts['spec']}: TP-{facts['tp']} rank 0 on {facts['env']['device']}, passes added cumulatively")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def markdown(facts: dict) -> str:
    lines = ["| row | passes | decode ms | prefill ms | kernels/step | library calls/step | roofline |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in facts["rows"]:
        if "decode" not in r:
            lines.append(f"| {r['index']} | {r['label']} | failed: {r.get('error', '?')} | | | | |")
            continue
        d, p = r["decode"], r["prefill"]
        roof = f"{r['roofline']['fraction']:.1%}" if "roofline" in r else "-"
        lines.append(f"| {r['index']} | {r['label']} | {d['ms']:.3f} | {p['ms']:.2f} | {d['kernels']} | "
                     f"{d['library_calls']} | {roof} |")
    lines.append("| - | torch.compile + CUDA graph | not implemented yet | | | | |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    fm.add_common_args(ap, steps=30, reps=3)
    ap.add_argument("--rows", default=None, help="row indices / pass names, comma-separated (default: all 9)")
    a = ap.parse_args(argv)
    device = fm.device_for(a)
    import kernels as kb  # bench/kernels.py: read_bandwidth
    from beamc.runtime.random_weights import random_rank_weights, weights_nbytes

    fm.single_rank_collectives()
    t0 = time.perf_counter()
    rows = all_rows()
    chosen = pick_rows(a.rows)
    spec = fm.bench_spec(Path(a.spec), a.context, max(a.chunk, 4), a.experts)
    facts: dict = {"date": datetime.date.today().isoformat(), "dry": a.dry, "note": fm.SKIPPED, "tp": a.tp,
                   "rank": 0, "context": a.context, "chunk": a.chunk, "batch": a.batch, "kv_cache": "fp8",
                   "spec": spec.name, "experts": spec.dtypes.experts, "pass_order": list(PASSES),
                   "not_implemented": NOT_IMPLEMENTED,
                   "env": {"torch": torch.__version__,
                           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"}}
    # ---- one weights dict for every row: the unfused graphs' params (unpacked; Model.load packs per row)
    t = time.perf_counter()
    base = compile_package(spec, tp=a.tp, rank=0, passes=[], dtype="f32" if a.dry else None)
    weights = random_rank_weights(spec, [st.graph for st in base.steps.values()], tp=a.tp, rank=0, device=device,
                                  seed=a.seed)
    del base
    fm.sync(device)
    facts["weights_gb"] = round(weights_nbytes(weights) / fm.GB, 2)
    facts["weights_s"] = round(time.perf_counter() - t, 1)
    bw = kb.read_bandwidth()  # TB/s, once for every row
    facts["read_tb_s"] = round(bw, 3)
    facts["rows"] = []
    tmp = tempfile.TemporaryDirectory(prefix="beam-ablation-")
    for i in chosen:
        label, passes = rows[i]
        t = time.perf_counter()
        print(f"row {i} {label}: ...", flush=True)
        try:
            r = run_row(a, spec, passes, weights, device, Path(tmp.name), f"row{i}", bw)
        except Exception as e:  # one failing row must not lose the others' numbers
            free(device)
            r = {"passes": passes, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        r = {"index": i, "label": label, **r, "row_s": round(time.perf_counter() - t, 1)}
        facts["rows"].append(r)
        if "decode" in r:
            print(f"row {i} {label}: decode {r['decode']['ms']:.3f} ms, prefill {r['prefill']['ms']:.2f} ms, "
                  f"{r['decode']['kernels']} kernels + {r['decode']['library_calls']} library calls ({r['row_s']} s)",
                  flush=True)
        else:
            print(f"row {i} {label}: FAILED {r['error']}", flush=True)
    del weights
    free(device)
    facts["total_s"] = round(time.perf_counter() - t0, 1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"ablation-{facts['date']}{'-dry' if a.dry else ''}"
    path = out / f"{stem}.json"
    facts["png"] = plot(facts, out / f"{stem}.png")
    path.write_text(json.dumps(facts, indent=1) + "\n")
    print(f"{spec.name}: TP-{a.tp} rank 0 on one {facts['env']['device']}; {fm.SKIPPED}")
    print(f"weights {facts['weights_gb']} GB, read bandwidth {bw:.2f} TB/s; {facts['png']}")
    for n in NOT_IMPLEMENTED:
        print(f"note: {n}")
    print(f"wrote {path} ({facts['total_s']} s)")
    print(markdown(facts))
    return facts


if __name__ == "__main__":
    main()
