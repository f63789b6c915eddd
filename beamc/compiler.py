"""The one pipeline driver: spec -> graphs per phase and TP rank -> verified -> fusion passes (each verified).

Every command and runtime goes through `compile_spec`: `beamc compile` (one rank, with reports and dumps), the
reference session (all ranks), `beamc logits`, and the code generator.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from beamc.checkpoint.layout import check_tp
from beamc.errors import ensure_dir
from beamc.ir.graph import Graph
from beamc.ir.lower import LowerOptions, lower
from beamc.ir.printer import to_dot, to_text
from beamc.ir.verify import verify
from beamc.passes.manager import PassReport, run_passes
from beamc.spec.schema import ModelSpec

PHASES = ("prefill", "decode")


@dataclass
class Compiled:
    graphs: dict[str, list[Graph]]  # phase -> one graph per lowered rank
    reports: dict[str, PassReport]  # phase -> what the passes matched (on the first lowered rank)


def compile_spec(spec: ModelSpec, *, tp: int = 1, ranks: list[int] | None = None, dtype: str | None = None,
                 passes: list[str] | tuple[str, ...] = (), phases: tuple[str, ...] = PHASES,
                 logits: str = "all", dump_dir: str | Path | None = None) -> Compiled:
    """Lower each phase for `ranks` (default: every rank of `tp`), verify, run the passes. `dump_dir`: the text and
    DOT of each phase's first rank graph before and after each pass."""
    check_tp(spec, tp)
    ranks = list(range(tp)) if ranks is None else ranks
    for r in ranks:
        check_tp(spec, tp, r)
    graphs, reports = {}, {}
    for phase in phases:
        gs = [lower(spec, LowerOptions(phase=phase, tp=tp, rank=r, dtype=dtype, logits=logits)) for r in ranks]
        for g in gs:
            verify(g)
        dump = ensure_dir(Path(dump_dir) / phase, "--dump-ir") if dump_dir else None
        if dump:
            (dump / "lowered.txt").write_text(to_text(gs[0]))
            (dump / "lowered.dot").write_text(to_dot(gs[0]))
        reports[phase] = run_passes(gs, list(passes), dump_dir=dump)
        graphs[phase] = gs
    return Compiled(graphs, reports)


def compile_graphs(spec: ModelSpec, **kw) -> dict[str, list[Graph]]:
    """phase -> rank graphs: what a session or backend executes."""
    return compile_spec(spec, **kw).graphs
