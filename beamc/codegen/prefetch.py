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

from beamc.codegen.emitters import Launch, named_params
from beamc.codegen.kernel import KernelSpec
from beamc.codegen.overrides import pin
from beamc.ir.dtypes import nbytes
from beamc.ir.graph import Graph

HIDE_OPS = ("qk_attention", "attention", "attention_gate", "moe_experts")
MIN_BYTES = 1 << 20  # below this a prefetch is not worth its launch


def _weights_after(launches: list, i: int):
    """(IR value name, bytes) of the params the launches after launch i's op read, in launch order, up to the next
    latency-bound op."""
    hidden = launches[i][0]
    for node, ln in launches[i:]:
        if node is hidden:
            continue
        if node.op in HIDE_OPS:
            return
        for v in named_params(node, ln):
            yield v.name, int(math.prod(v.shape) * nbytes(v.dtype))


def plan(launches: list, g: Graph, budget_mb: int, pinned: dict | None = None, where: str = "--set") -> list:
    """The step's (node, launch) list with the prefetch launches inserted (see the module docstring); unchanged
    when budget_mb <= 0 or nothing qualifies. `pinned`: the l2_prefetch template's `--set` overrides (its render
    options: CHUNK, BULK, EVICT_LAST)."""
    if budget_mb <= 0:
        return launches
    inserts: dict[int, tuple[str, ...]] = {}
    for i, (node, _) in enumerate(launches):
        if node.op not in HIDE_OPS or (i > 0 and launches[i - 1][0] is node):
            continue  # (before the first launch of each latency-bound op)
        names: dict[str, int] = {}
        for name, n in _weights_after(launches, i):
            if name not in names:
                if sum(names.values()) + n > budget_mb << 20:
                    break  # whole weights in launch order, up to the first that does not fit
                names[name] = n
        if sum(names.values()) >= MIN_BYTES:
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
