"""Copy the GEMM-class figures of a `bench/kernels.py` run into the compiler's choice table.

    python bench/update_choices.py bench/results/kernels-<date>.json [--target sm90]

Writes `beamc/codegen/measured/<target>.json`: per GEMM shape (op, K, N), the generated kernel's and the library's
us at each measured token count, and the run they came from. `beamc/codegen/choices.py` reads it: the compiler
takes the generated kernel where it measured at least as fast as cuBLAS.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPS = {"qkvg": "linear_packed", "o_proj": "linear", "gate_up": "gate_up_swiglu", "down": "linear",
       "lm_head": "linear_softcap"}


def table(run: dict, source: str) -> dict:
    shapes: dict[str, list] = {}
    for r in run["records"]:
        if not r["kernel"].startswith("gemv ") or r.get("baseline_us") is None:
            continue
        name = r["kernel"].split()[1]
        K, N = r["shape"]
        if name == "gate_up":
            N //= 2  # the op's N is F; the weights hold gate and up rows
        shapes.setdefault(f"{OPS[name]} K{K} N{N}", []).append(
            {"tokens": r["tokens"], "kernel_us": round(r["us"], 2), "library_us": round(r["baseline_us"], 2)})
    facts = run.get("facts", {})
    return {"source": f"{source} ({facts.get('device', '?')}, {facts.get('date', '?')}: {facts.get('command', '')}; "
                      f"library = {_library_label(run)} in the same run)", "shapes": shapes}


def _library_label(run: dict) -> str:
    """What the run's baseline_us timed: the step's library route (since the twelfth session, 2026-12-01) or, in older
    runs, the bare GEMM."""
    routes = {r["baseline"] for r in run["records"] if r["kernel"].startswith("gemv ") and r.get("baseline")}
    if routes and all(b.startswith("the step's library route") for b in routes):
        return "the step's library route (cuBLAS calls + the generated epilogue kernel, as the step runs them)"
    return "cuBLAS torch.mm of the bare GEMM"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--target", default="sm90")
    a = ap.parse_args()
    src = Path(a.run)
    out = ROOT / "beamc/codegen/measured" / f"{a.target}.json"
    t = table(json.loads(src.read_text()), str(src.resolve().relative_to(ROOT)) if src.resolve().is_relative_to(ROOT) else src.name)
    out.write_text(json.dumps(t, indent=1) + "\n")
    print(f"wrote {out}: {len(t['shapes'])} shapes")


if __name__ == "__main__":
    main()
