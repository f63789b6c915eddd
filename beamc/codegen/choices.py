"""Which kernel computes a GEMM-class op, decided from measurements: the generated small-M kernel (`gemv`,
`moe_nvfp4_decode`) or a library call (cuBLAS through torch).

`bench/kernels.py` times each generated kernel beside the library route a step runs without it (`bench/gemm.py`: the
cuBLAS calls of `beamc.runtime.library` and the generated epilogue kernel after them, e.g. the dense gate_up's two
GEMMs then the SwiGLU kernel; until 2026-12-01's twelfth session one bare GEMM, which credited cuBLAS with a free
epilogue and a single launch) at one TP-8 rank's shapes and M = 1 .. 64 in the same run; `measured/<target>.json`
keeps, per shape, those figures (copied from `bench/results/` by `bench/update_choices.py`, with the run they came
from). For a shape it has measured, the compiler takes the generated kernel for every token count up to the largest
measured M at which the kernel was at least as fast as the library route (and at every smaller measured M). A shape nobody has
measured (another spec, another target) takes the generated kernel at M = 1 only: the rule every measured shape
has followed so far on the H200, said as such in the manifest. The choice is made per step at run time from the
step's token count (fixed per CUDA-graph bucket), so `step.py` holds both launches, each under its condition.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

MEASURED_DIR = Path(__file__).parent / "measured"
DEFAULT_MAX_TOKENS = 1


@dataclass(frozen=True)
class Choice:
    max_tokens: int  # the generated kernel runs for T <= max_tokens, the library call above (0: never the kernel)
    basis: str  # "measured" or "rule"
    figures: tuple[tuple[int, float, float], ...] = ()  # (M, kernel us, library us) behind a measured choice
    source: str = ""

    def record(self) -> dict[str, Any]:
        return {"kernel_for_tokens_up_to": self.max_tokens, "basis": self.basis,
                "figures": [{"tokens": m, "kernel_us": k, "library_us": b} for m, k, b in self.figures],
                "source": self.source}


@lru_cache(maxsize=None)
def _table(target: str) -> dict[str, Any]:
    path = MEASURED_DIR / f"{target}.json"
    return json.loads(path.read_text()) if path.exists() else {"shapes": {}, "source": ""}


def shape_key(op: str, K: int, N: int) -> str:
    return f"{op} K{K} N{N}"


def choose(target: str, op: str, K: int, N: int, max_kernel_tokens: int = 64) -> Choice:
    """The token range of the generated kernel for one GEMM shape on `target`."""
    t = _table(target)
    rows = t["shapes"].get(shape_key(op, K, N))
    if not rows:
        return Choice(min(DEFAULT_MAX_TOKENS, max_kernel_tokens), "rule",
                      source="no measurement of this shape on this target: the generated kernel at M = 1")
    figs = tuple(sorted((int(r["tokens"]), float(r["kernel_us"]), float(r["library_us"])) for r in rows))
    best = 0
    for m, k, b in figs:  # the kernel up to the first measured M where the library is faster
        if k > b:
            break
        best = m
    return Choice(min(best, max_kernel_tokens), "measured", figs, t.get("source", ""))
