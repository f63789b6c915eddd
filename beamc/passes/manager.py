"""The pass manager: an ordered list of passes chosen by flags (`--passes all|none|a,b,c`, `--disable x`), each run
over every rank graph, verified after it runs, counted per rule and layer kind, and optionally dumped."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from beamc.errors import BeamcError
from beamc.ir.graph import Graph
from beamc.ir.printer import to_dot, to_text
from beamc.ir.verify import verify
from beamc.passes import (allreduce_norm, attention_gate, combine_experts, dense_swiglu, fold_small, fp32_router,
                          kv_write, norm_residual_norm, pack_qkv_gate, qk_attention, qk_norm_pos)
from beamc.passes.base import Pass
from beamc.passes.rewrite import rewrite

# The seed's order: each later pass may build on an earlier one's ops (3 on 1, 6 on 2, 9 on 2's sigmoid_gate, 10 on
# 3's boundary, 11 on 6's qk_norm_pos_kv and 9's attention_gate).
PASSES: dict[str, Pass] = {p.name: p for p in (
    norm_residual_norm.PASS, qk_norm_pos.PASS, allreduce_norm.PASS, fp32_router.PASS, pack_qkv_gate.PASS,
    kv_write.PASS, dense_swiglu.PASS, fold_small.PASS, attention_gate.PASS, combine_experts.PASS, qk_attention.PASS,
)}


def select_passes(spec: str = "all", disable: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Resolve `--passes` and `--disable` into an ordered list of pass names (always in the canonical order)."""
    names = list(PASSES)
    if spec == "all":
        chosen = names
    elif spec in ("none", ""):
        chosen = []
    else:
        chosen = [s.strip() for s in spec.split(",") if s.strip()]
    for flag, given in (("--passes", chosen), ("--disable", list(disable))):
        unknown = [n for n in given if n not in PASSES]
        if unknown:
            raise BeamcError(flag, f"unknown pass {unknown[0]!r}", "known passes: " + ", ".join(names))
    return [n for n in names if n in chosen and n not in disable]


@dataclass
class PassReport:
    order: list[str]
    counts: dict[str, Counter] = field(default_factory=dict)  # pass -> (rule, layer kind) -> matches (rank 0)
    ops_after: dict[str, Counter] = field(default_factory=dict)  # "input" / pass -> layer kind -> compute ops

    def matches(self, pass_name: str, rule: str | None = None, kind: str | None = None) -> int:
        return sum(v for (r, k), v in self.counts.get(pass_name, Counter()).items()
                   if (rule is None or r == rule) and (kind is None or k == kind))


def ops_per_kind(g: Graph) -> Counter:
    """Compute ops in one layer of each kind."""
    return Counter({k: sum(c.values()) for k, c in g.ops_by_layer_kind().items()})


def run_passes(graphs: list[Graph], names: list[str], dump_dir: str | Path | None = None) -> PassReport:
    """Apply the named passes, in order, to every rank graph (in place)."""
    report = PassReport(list(names))
    report.ops_after["input"] = ops_per_kind(graphs[0])
    dump = Path(dump_dir) if dump_dir else None
    for i, name in enumerate(names):
        counts = Counter()
        for r, g in enumerate(graphs):
            if dump and r == 0:
                _dump(g, dump / f"{i:02d}-{name}.before")
            rewrite(g, PASSES[name].rules, counts if r == 0 else None)
            verify(g)
            if dump and r == 0:
                _dump(g, dump / f"{i:02d}-{name}.after")
        report.counts[name] = counts
        for g in graphs:  # which passes shaped this graph (a pass run again changes nothing, so adds nothing)
            g.meta["passes"] = list(dict.fromkeys(g.meta.get("passes", []) + [name]))
        report.ops_after[name] = ops_per_kind(graphs[0])
    return report


def _dump(g: Graph, stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_name(stem.name + ".txt").write_text(to_text(g))
    stem.with_name(stem.name + ".dot").write_text(to_dot(g))
