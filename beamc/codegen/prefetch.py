"""The decode step's L2 prefetch plan: weights brought into L2 beside the latency-bound kernels that precede their use.

At batch 1 a decode step alternates GEMVs, which stream their weights at the DRAM's rate, with kernels bound by their
own latency chains while the DRAM idles: the attention (a few hundred KB of cache) and the MoE experts (which
expert's bytes to read is known only from the router). Before each such op (HIDE_OPS) the plan inserts one launch of
the `l2_prefetch` kernel naming the weights that the launches after it read, in launch order, up to the next such
op and within `budget_mb` of weights (whole tensors; the H200's L2 holds 50 MB, and the hidden op's own traffic
passes through it too); a launch with less than MIN_BYTES to prefetch is left out. The prefetch runs on a side
stream after the launch before the op, so it overlaps the op, and the step's last launch joins that stream.
Schedule only: no value changes (a prefetch writes nothing), so nothing for the interpreter to prove; fp32 packages
(the CPU interpreter) get no plan.
Measured on the H200 (2026-12-01, docs/perf-log.md): correct (graph-captured as a branch, bitwise the same outputs)
but no faster: the TP-8 decode step 2.821 ms with 24 MB against 2.811 / 2.804 without, no op's span moved; alone, a
GEMV after a prefetch ran 7.7 us against 9.4 from DRAM and 5.4 after a GEMV had read the same weights. Off by default
(`package.L2_PREFETCH_MB`); kept for other budgets, targets and GPUs (`--l2-prefetch-mb`, `bench/variants.py`).
"""
from __future__ import annotations

import math

from beamc.codegen.emitters import Launch
from beamc.codegen.kernel import KernelSpec
from beamc.codegen.overrides import pin
from beamc.ir.graph import Graph

HIDE_OPS = ("qk_attention", "attention", "attention_gate", "moe_experts")
MIN_BYTES = 1 << 20  # below this a prefetch is not worth its launch
ELEMENT_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f8e4m3": 1, "i64": 8, "i32": 4, "u8": 1, "e2m1x2": 1}



def _weights(node, ln: Launch) -> list[tuple[str, int]]:
    """(IR value name, bytes) of the params this launch names."""
    out = []
    for v in node.inputs:
        p = v.producer
        if p is not None and p.op == "param" and v.name in ln.args:
            out.append((v.name, math.prod(v.shape) * ELEMENT_BYTES[v.dtype]))
    return out


def plan(launches: list, g: Graph, budget_mb: int, pinned: dict | None = None, where: str = "--set") -> list:
    """The step's (node, launch) list with the prefetch launches inserted (see the module docstring); unchanged
    when budget_mb <= 0 or nothing qualifies. `pinned`: the l2_prefetch template's `--set` overrides (its render
    options: CHUNK, BULK, EVICT_LAST)."""
    if budget_mb <= 0:
        return launches
    budget = budget_mb << 20
    firsts = [i for i, (node, _) in enumerate(launches)
              if node.op in HIDE_OPS and (i == 0 or launches[i - 1][0] is not node)]
    inserts: dict[int, tuple[str, ...]] = {}
    for i in firsts:
        hidden = launches[i][0]
        names, total = [], 0
        for node, ln in launches[i:]:
            if node is hidden:
                continue
            if node.op in HIDE_OPS:
                break
            fits = True
            for name, n in _weights(node, ln):
                if name in names:
                    continue
                if total + n > budget:
                    fits = False
                    break
                names.append(name)
                total += n
            if not fits:
                break
        if total >= MIN_BYTES:
            inserts[i] = tuple(names)
    if not inserts:
        return launches
    spec = KernelSpec("l2_prefetch", "l2_prefetch", pin("l2_prefetch", {}, pinned or {}, where))
    out = []
    for i, item in enumerate(launches):
        if i in inserts:
            out.append((item[0], Launch(inserts[i], kernel=spec)))
        out.append(item)
    out.append((launches[-1][0], Launch((), kernel=spec)))  # the join: the side stream rejoins the step's stream
    return out
