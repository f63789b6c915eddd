"""Ablation (issue 11): decode and prefill time of one TP-8 rank's share of the full Beam as each pass is added.

    python bench/ablation.py [--out bench/results] [--context 102400] [--chunk 2048] [--steps 30] [--reps 3]
    TRITON_INTERPRET=1 python bench/ablation.py --dry [--rows 0,1,8]   # the same code path: tiny spec on a CPU

Rows: the unfused graph (`passes=[]`: every IR op its own generated kernel or named library call), then each pass
of `beamc.passes.manager.PASSES` added cumulatively in that (the seed's) order; the last row is every pass.
`--rows` picks rows by index (0 = unfused, the last = all passes) or by the last pass's name ("none" / "all" too).

Each row reuses bench/full_model.py (imported, not copied): the same spec patch (fp8 KV, room for the context),
the same one-rank simulation (collectives skipped, or copies where a row has no fused all-reduce), the same timing helpers and the same decode roofline.
- compile: `compile_package(spec, tp=8, rank=0, passes=row)`, written to a temporary package;
- weights: ONE random dict for the whole run, drawn once from the unfused graphs (which read the unpacked
  Q/K/V/gate weights); rows whose `pack_qkv_gate` pass asks for a packed param get it from `Model.load`
  (`interpret.with_packed_weights` concatenates the same tensors at load; the other params are shared, not
  copied), so every row computes with the same values. A row needing a param the dict lacks stops the run;
- decode: batch 1 at `--context` (`Model.fill_context`), the captured CUDA graph replayed `--steps` times
  (median ms, CUDA events); kernels and library calls of one batch-1 decode step;
- prefill: `--batch` x `--chunk` tokens appended to `--context` each, the bucket's graph replayed `--reps` times;
- roofline: decode bytes (full_model.decode_bytes) over the read bandwidth measured once in this run; prefill
  FLOPs (`prefill_flops`: GEMMs, the router, attention over the context and the causal chunk) over the bf16 GEMM
  rate measured once in this run (torch.mm 8192^3);
- the fully fused row (every pass) also profiles one decode step (bench/profile_step.py: eager launches under
  torch.profiler), printed as a table of device time by layer kind and op;
- `--baseline`: plain PyTorch with torch.compile + CUDA graph on the same weights (bench/torch_baseline.py);
- the model is freed (gc + torch.cuda.empty_cache) before the next row; the JSON is rewritten after every row.
Budget: the device allows 10 minutes a call, and a row takes ~1 minute (load, graph capture, a 100K context for
9 sequences), so the rows go in two calls (`--rows 0,1,2,3,4,5 --tag=-part1`, `--rows 6,7,8,9,10,11 --baseline
--tag=-part2`) merged with `--merge part1.json part2.json --out ablation-<date>.json`. Only the buckets timed are
captured (decode 1, prefill batch x chunk).
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
from profile_step import breakdown_table, profile_step  # noqa: E402  bench/profile_step.py
from beamc.codegen.package import compile_package  # noqa: E402
from beamc.passes.manager import PASSES  # noqa: E402

NOT_IMPLEMENTED: list[str] = []


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


def run_row(a, spec, passes: list[str], weights: dict, device, tmpdir: Path, tag: str, bw: float | None,
            gemm_tflops: float | None = None, profile: bool = False, copy_bw: float | None = None,
            overrides: dict | None = None, prefill: bool = True, options: dict | None = None,
            outputs: list | None = None, keep: list | None = None, decode_batch: int = 1) -> dict:
    """One package (these passes; `overrides`: template constants pinned, `beamc compile --set`; `options`: more
    `compile_package` keywords) on the shared weights: decode at the context (`decode_batch` sequences) and, with
    `prefill`, the batch x chunk prefill after it. `outputs`: a list that receives the logits of the two decode
    steps before the timed ones (graph replays, the same inputs for every package: compare them across packages).
    `keep` (decode only): a list that receives (model, a function replaying its timed decode step), the model kept
    loaded with its sequences, so that the caller can time it again beside other packages (bench/variants.py
    --rounds).
    `decode_batch`: the decode step's sequences (each at the context, its own fill seed; batch 1 by default), its
    bucket captured at load; the roofline is a batch-1 figure (left out at B > 1)."""
    assert keep is None or not prefill, "keep: decode only (the kept model holds its decode sequence)"
    from beamc.runtime.model import Model

    row: dict = {"passes": passes, **({"template_overrides": overrides} if overrides else {}),
                 **({"compile_options": options} if options else {})}
    t = time.perf_counter()
    package = compile_package(spec, tp=a.tp, rank=0, passes=passes, dtype="f32" if a.dry else None,
                              **{"nvfp4_relayout": a.nvfp4_relayout, **(options or {})}, template_overrides=overrides)
    pkg = package.write(tmpdir / tag)
    row["compile_s"] = round(time.perf_counter() - t, 1)
    lib_static = sum(1 for _, ln in package.steps["decode"].launches if ln.kernel is None)
    packed = sorted(n for st in package.steps.values() for n, node in st.graph.leaves("param").items()
                    if "pack" in node.attrs)
    row["packed_params"] = len(packed)
    del package
    t = time.perf_counter()
    max_context = a.context + max(a.chunk, 4)
    B = decode_batch
    model = Model.load(pkg, None, device=str(device), spec=spec, tp=a.tp, rank=0, kv_dtype="fp8", weights=weights,
                       max_batch=max(a.batch, B), max_context=max_context, max_prefill_tokens=a.batch * a.chunk,
                       decode_buckets=sorted({1, a.batch, B}), prefill_buckets=[a.batch * a.chunk])  # ~those timed
    fm.sync(device)
    row["load_s"] = round(time.perf_counter() - t, 1)
    gen = torch.Generator().manual_seed(a.seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist()

    try:
        # ---- decode: batch B (1 by default) at `context`
        seqs_d = [f"d{j}" for j in range(B)]
        for j, s in enumerate(seqs_d):
            model.fill_context(s, a.context, seed=a.seed + 100 * j)
        for _ in range(2):  # warm up (the decode graphs were captured at load)
            logits = model.decode(seqs_d, tokens(B))
            if outputs is not None:
                outputs.append(logits.detach().float().cpu())
        key, sizes = ("decode", B, B), {"B": B, "R": B}
        dec = fm.timed(fm.replay(model, key, "decode", sizes), device, a.steps)
        launches = model.phases["decode"].launches
        lib = Counter(ln.library for _, ln in launches if ln.library and ln.runs_for(B))
        row["decode"] = {"ms": statistics.median(dec), "steps": a.steps, "runs_as": model.graphs.status.get(key, "?"),
                         "batch": B,
                         "kernels": sum(1 for _, ln in launches if ln.kernel is not None and ln.runs_for(B)),
                         "library_calls": sum(lib.values()), "library": dict(lib),
                         "library_calls_compiled": lib_static}
        if profile:  # which kernel holds the time (the fully fused row)
            row["decode"]["profile"] = profile_step(model, "decode", sizes, reps=3)
        if keep is not None:
            keep.append((model, fm.replay(model, key, "decode", sizes)))
        else:
            for s in seqs_d:
                model.release(s)
        if bw is not None and B == 1:
            nbytes = fm.decode_bytes(model, spec, a.context)
            roof_ms = nbytes["total"] / (bw * 1e12) * 1e3
            row["roofline"] = {"bytes": nbytes["total"], "ms": roof_ms, "fraction": roof_ms / row["decode"]["ms"],
                               "read_tb_s": bw}
            if copy_bw:
                row["roofline"]["fraction_at_copy_rate"] = nbytes["total"] / (copy_bw * 1e12) * 1e3 / row["decode"]["ms"]
        if not prefill:
            return row
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
        if gemm_tflops:
            flops = prefill_flops(spec, a.tp, a.batch, a.chunk, a.context)
            roof_ms = flops / (gemm_tflops * 1e12) * 1e3
            row["prefill"]["roofline"] = {"flops": flops, "ms": roof_ms, "fraction": roof_ms / row["prefill"]["ms"]}
        if device.type == "cuda":
            row["max_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / fm.GB, 2)
    finally:
        del model
        free(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
    return row


def prefill_flops(spec, tp: int, batch: int, chunk: int, context: int) -> int:
    """FLOPs of one rank's prefill of `batch` sequences x `chunk` new tokens after `context` cached ones: every
    GEMM (2 x tokens x weights; experts: top_k of them; the router in fp32 counted alike), attention's QK^T and PV
    (4 x heads x head_dim per visible position: the context and the causal part of the chunk; the window on sliding
    layers), and the logits of the last token of each sequence."""
    from beamc.checkpoint.layout import rank_dims

    r, at, H = rank_dims(spec, tp), spec.attention, spec.hidden_size
    hd, T = at.head_dim, batch * chunk
    attn_w = H * hd * (2 * r.heads + 2 * r.kv_heads) + r.heads * hd * H  # q, gate, k, v, o
    total = 0
    for L in range(spec.num_layers):
        if spec.mlp_types[L] == "sparse":
            m = spec.mlp.moe
            mlp_w = H * m.num_experts + m.top_k * 3 * H * r.moe_ff
        else:
            mlp_w = 3 * H * r.dense_ff
        total += 2 * T * (attn_w + mlp_w)
        if spec.attention_types[L] == "sliding_attention":
            w = spec.effective_window
            visible = sum(min(w, context + j + 1) for j in range(chunk))
        else:
            visible = chunk * context + chunk * (chunk + 1) // 2
        total += 4 * r.heads * hd * batch * visible
    return total + 2 * batch * H * r.vocab


def bf16_gemm_tflops(device, n: int = 8192, reps: int = 10) -> float | None:
    """The bf16 GEMM rate of this GPU now (torch.mm n x n x n, median of reps): the prefill roofline's rate."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b)
    ms = statistics.median(fm.timed(lambda: torch.mm(a, b), device, reps))
    del a, b
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


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
        ticks = list(labels)
        b = facts.get("baseline") or {}
        if f"{key}_ms" in b:  # plain PyTorch (torch.compile + CUDA graph) on the same weights, beside the rows
            vals = vals + [b[f"{key}_ms"]]
            ax.bar([len(vals) - 1], [vals[-1]], color="tab:gray")
            ticks.append("torch.compile\nbaseline")
        for i, v in enumerate(vals):
            ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(vals)))
        ax.set_xticklabels(ticks, rotation=45, ha="right", fontsize=8)
        ax.set_title(title)
        ax.set_ylabel("ms")
    fig.suptitle(f"{facts['spec']}: TP-{facts['tp']} rank 0 on {facts['env']['device']}, passes added cumulatively")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def markdown(facts: dict) -> str:
    lines = ["| row | passes | decode ms | prefill ms | kernels/step | library calls/step | decode roofline | "
             "prefill roofline |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in facts["rows"]:
        if "decode" not in r:
            lines.append(f"| {r['index']} | {r['label']} | failed: {r.get('error', '?')} | | | | | |")
            continue
        d, p = r["decode"], r["prefill"]
        roof = f"{r['roofline']['fraction']:.1%}" if "roofline" in r else "-"
        proof = f"{p['roofline']['fraction']:.1%}" if "roofline" in p else "-"
        lines.append(f"| {r['index']} | {r['label']} | {d['ms']:.3f} | {p['ms']:.2f} | {d['kernels']} | "
                     f"{d['library_calls']} | {roof} | {proof} |")
    b = facts.get("baseline")
    if b is None:
        lines.append("| - | torch.compile + CUDA graph | not run (--baseline) | | | | | |")
    elif "error" in b:
        lines.append(f"| - | torch.compile + CUDA graph | failed: {b['error'][:120]} | | | | | |")
    else:
        lines.append(f"| - | torch.compile + CUDA graph ({b.get('mode', '?')}) | {b['decode_ms']:.3f} | "
                     f"{b['prefill_ms']:.2f} | | | | |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    fm.add_common_args(ap, steps=30, reps=3)
    ap.add_argument("--rows", default=None, help="row indices / pass names, comma-separated (default: all of them)")
    ap.add_argument("--baseline", action="store_true", help="also the torch.compile + CUDA graph baseline "
                    "(bench/torch_baseline.py) on the same weights")
    ap.add_argument("--tag", default="", help="appended to the output file names (e.g. -part1)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="merge these ablation JSONs into --out (a file "
                    "name) and print the table; nothing is measured")
    a = ap.parse_args(argv)
    if a.merge:
        return merge(a.merge, a.out)
    device = fm.device_for(a)
    import kernels as kb  # bench/kernels.py: read_bandwidth
    from beamc.runtime.random_weights import random_rank_weights, weights_nbytes

    fm.single_rank_collectives()
    t0 = time.perf_counter()
    rows = all_rows()
    chosen = pick_rows(a.rows)
    spec = fm.bench_spec(Path(a.spec), a.context, max(a.chunk, 4), a.experts)
    facts: dict = {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
                   "dry": a.dry, "note": fm.SKIPPED, "tp": a.tp,
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
    # the roofline names the copy rate; the read rate is the stricter ceiling for a step that reads its
    # bytes and writes almost nothing, so the table uses it and the JSON keeps both
    facts["copy_tb_s"] = round(kb.copy_bandwidth(), 3)
    gemm = bf16_gemm_tflops(device)
    facts["bf16_gemm_tflops"] = round(gemm, 1) if gemm else None
    facts["rows"] = []
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"ablation-{facts['date']}{'-dry' if a.dry else ''}{a.tag}"
    path = out / f"{stem}.json"
    tmp = tempfile.TemporaryDirectory(prefix="beam-ablation-")
    for i in chosen:
        label, passes = rows[i]
        t = time.perf_counter()
        print(f"row {i} {label}: ...", flush=True)
        try:
            r = run_row(a, spec, passes, weights, device, Path(tmp.name), f"row{i}", bw, gemm,
                        profile=i == len(rows) - 1, copy_bw=facts["copy_tb_s"])
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
        path.write_text(json.dumps(facts, indent=1) + "\n")  # after every row: a timeout keeps the rows done
    if a.baseline:
        from torch_baseline import run_baseline  # bench/torch_baseline.py

        t = time.perf_counter()
        print("baseline torch.compile: ...", flush=True)
        # the last user of the dict: it may drop each layer's NVFP4 experts once converted to fp8 (peak memory)
        facts["baseline"] = run_baseline(spec, weights, a.tp, device, a.context, a.chunk, a.batch, a.steps, a.reps,
                                         consume=True)
        facts["baseline"]["row_s"] = round(time.perf_counter() - t, 1)
        print(f"baseline: {facts['baseline']}", flush=True)
    del weights
    free(device)
    facts["total_s"] = round(time.perf_counter() - t0, 1)
    facts["png"] = plot(facts, out / f"{stem}.png")
    path.write_text(json.dumps(facts, indent=1) + "\n")
    print(f"{spec.name}: TP-{a.tp} rank 0 on one {facts['env']['device']}; {fm.SKIPPED}")
    print(f"weights {facts['weights_gb']} GB, read bandwidth {bw:.2f} TB/s; {facts['png']}")
    for n in NOT_IMPLEMENTED:
        print(f"note: {n}")
    print(f"wrote {path} ({facts['total_s']} s)")
    print(report(facts))
    return facts


def report(facts: dict) -> str:
    """The Markdown table, then the fused row's decode breakdown by layer kind when it was profiled."""
    text = markdown(facts)
    prof = next((r["decode"]["profile"] for r in facts["rows"] if "profile" in r.get("decode", {})), None)
    return text + ("\n\n" + breakdown_table(prof) if prof else "")


def merge(paths: list[str], out: str) -> dict:
    """One ablation JSON (table, PNG) from the rows of several runs of the same settings (a GPU call per part:
    the device allows 10 minutes a call): rows by index, the later file winning; the baseline from whichever has
    it."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    keys = ("spec", "tp", "context", "chunk", "batch", "kv_cache", "experts")
    for p, f in zip(paths[1:], parts[1:]):
        if any(f.get(k) != parts[0].get(k) for k in keys):
            raise SystemExit(f"--merge: {p} was measured with other settings than {paths[0]} ({keys})")
    facts = dict(parts[0])
    rows = {}
    for f in parts:
        rows.update({r["index"]: r for r in f["rows"]})
        if "baseline" in f:
            facts["baseline"] = f["baseline"]
    facts["rows"] = [rows[i] for i in sorted(rows)]
    facts["merged_from"] = [Path(p).name for p in paths]
    facts["read_tb_s_parts"] = [f.get("read_tb_s") for f in parts]
    facts["bf16_gemm_tflops_parts"] = [f.get("bf16_gemm_tflops") for f in parts]
    path = Path(out)
    facts["png"] = plot(facts, path.with_suffix(".png"))
    path.write_text(json.dumps(facts, indent=1) + "\n")
    print(f"wrote {path}; {facts['png']}")
    print(report(facts))
    return facts


if __name__ == "__main__":
    main()
