"""Which kernel holds a step's time: one step's launches issued one by one under `torch.profiler`, each inside a
`record_function` range, so every kernel's device time is attributed to its IR node, its layer and its layer kind.

    from profile_step import profile_step, breakdown_table
    prof = profile_step(model, "decode", {"B": 1, "R": 1}, reps=3)
    print(breakdown_table(prof))

The launches run eagerly, as `step.py` would issue them outside a CUDA graph (the same kernels, arguments and
buffers; `beamc.codegen.check.run_launches` issues them the same way), so the per-kernel device times are those of
the graph replay minus what PDL overlaps; the replay's own time is measured beside it by the caller. On a CPU
(dry runs) the profiler sees no device kernels: the table says so and the launch order is still exercised.
"""
from __future__ import annotations

from collections import defaultdict

import torch


def _kind(spec, layer) -> str:
    """'sliding+moe', 'full+dense', ... for a layer index; 'head' for the embedding and the logits."""
    if layer is None or layer < 0:
        return "head"
    att = "sliding" if spec.attention_types[layer] == "sliding_attention" else "full"
    return f"{att}+{'moe' if spec.mlp_types[layer] == 'sparse' else 'dense'}"


def _op_class(node, ln) -> str:
    """A short label for what a launch does: the generated kernel's template or the library call, and the op."""
    what = ln.kernel.template if ln.kernel is not None else f"lib:{ln.library}"
    return f"{node.op}/{what}"


def issue(model, phase: str, sizes: dict, mark=None) -> int:
    """Issue one step's launches eagerly; with `mark`, each inside `mark(i)` and synchronised before the range
    ends (so that every kernel runs inside its launch's range); the number issued."""
    from beamc.runtime import library

    v = model.buffers(phase, sizes)
    K = model.step_module.K
    T = sizes.get("T", sizes.get("B"))
    cuda = model.device.type == "cuda"
    n = 0
    for i, (node, ln) in enumerate(model.phases[phase].launches):
        if not ln.runs_for(T) or (ln.kernel is None and ln.library == "view"):
            continue
        args = [v[a] for a in ln.args]
        ctx = mark(i) if mark is not None else None
        if ctx is not None:
            ctx.__enter__()
        try:
            if ln.kernel is not None:
                K[ln.kernel.name].launch(*args)
            else:
                getattr(library, ln.library)(*args, **dict(ln.kwargs))
            if ctx is not None and cuda:
                torch.cuda.synchronize(model.device)
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        n += 1
    return n


def interval_union(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: time some kernel of a launch ran, overlaps counted once."""
    union, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        union += max(0.0, b - max(a, end))
        end = max(end, b)
    return union


def profile_step(model, phase: str, sizes: dict, reps: int = 3) -> dict:
    """Device µs per step by launch (node, layer kind, op class), averaged over `reps` profiled eager steps."""
    import bisect

    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = model.device.type == "cuda"
    issue(model, phase, sizes)  # warm: every kernel compiled / loaded before the trace
    if cuda:
        torch.cuda.synchronize(model.device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(reps):
            issue(model, phase, sizes, mark=lambda i: record_function(f"beamc#{i}"))
    # Each GPU kernel belongs to the launch whose host range contains its start: the launches are synchronised
    # inside their ranges, so a range encloses its kernels' execution. (The profiler links kernels to ranges only
    # through torch ops, which Triton's launcher is not; a range's device_time_total would miss those kernels, and
    # its GPU-side span counts idle gaps.)
    ranges, kernels = [], []
    for e in prof.events():
        on_device = str(getattr(e, "device_type", "")).endswith("CUDA")
        if e.name.startswith("beamc#") and not on_device:
            ranges.append((e.time_range.start, e.time_range.end, int(e.name[6:])))
        elif on_device and not e.name.startswith("beamc#"):
            kernels.append((e.time_range.start, e.time_range.end - e.time_range.start, e.name))
    ranges.sort()
    starts = [r[0] for r in ranges]
    per_launch: dict[int, float] = defaultdict(float)
    parts: dict[int, list[float]] = defaultdict(list)  # each launch's kernel durations, in order, rep after rep
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)  # (start, end) of each range's kernels
    by_name: dict[str, float] = defaultdict(float)
    unattributed = 0.0
    for t0, dur, name in sorted(kernels):
        j = bisect.bisect_right(starts, t0) - 1
        if j >= 0 and t0 <= ranges[j][1]:
            spans[j].append((t0, t0 + dur))
            parts[ranges[j][2]].append(dur)
        else:
            unattributed += dur / reps
        by_name[name] += dur / reps
    # A launch's time is the union of its kernels' intervals, not their sum: a PDL kernel starts early and waits
    # (griddepcontrol.wait) while the one before it runs, so its duration holds that wait (summed, the s8run6
    # prefill profile counted 526 ms for a 474 ms step).
    overlap = 0.0
    for j, iv in spans.items():
        union = interval_union(iv)
        per_launch[ranges[j][2]] += union / reps
        overlap += (sum(b - a for a, b in iv) - union) / reps
    kernels_total = sum(by_name.values())
    launches = model.phases[phase].launches
    by_kind: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    by_kind_op: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    by_op_launches: dict[str, list[int]] = defaultdict(list)
    for i, us in per_launch.items():
        node, ln = launches[i]
        k, o = _kind(model.spec, getattr(node, "layer", None)), _op_class(node, ln)
        by_kind[k] += us
        by_op[o] += us
        by_kind_op[k][o] += us
        by_op_launches[f"{k}: {o}"].append(i)
    # the three costliest (layer kind, op) pairs in detail: each launch's us (in step order) and, where a launch runs
    # several kernels (attention's plan, copy and passes), the mean us of each of its kernels (k-th of n per rep)
    detail = {}
    for o in sorted(by_op_launches, key=lambda x: -sum(per_launch[i] for i in by_op_launches[x]))[:3]:
        ids = sorted(by_op_launches[o])
        n = min(len(parts[i]) for i in ids) // max(reps, 1)
        kern = [sum(sum(parts[i][r * n + k] for r in range(reps)) / reps for i in ids) / len(ids) for k in range(n)]
        detail[o] = {"launch_us": [round(per_launch[i], 1) for i in ids], "kernel_us_mean": [round(x, 1) for x in kern]}
    # the first step's launches in issue order, each with its kernel count: what maps a CUDA-graph replay's kernels
    # back to launches (`profile_replay`)
    first = len(ranges) // max(reps, 1)
    launch_kernels = []
    for j in range(first):
        node, ln = launches[ranges[j][2]]
        label = f"{_kind(model.spec, getattr(node, 'layer', None))}: {_op_class(node, ln)}"
        side = ln.kernel is not None and ln.kernel.template == "l2_prefetch"  # (a replay runs it beside the chain)
        launch_kernels.append((label, 0 if side else len(spans[j])))
    layers = defaultdict(int)
    for L in range(model.spec.num_layers):
        layers[_kind(model.spec, L)] += 1
    total = sum(per_launch.values())
    top_kernels = sorted(by_name.items(), key=lambda x: -x[1])[:15]
    return {"phase": phase, "sizes": sizes, "reps": reps, "launches_profiled": len(ranges) // max(reps, 1),
            "device_us_total": total, "device_us_kernels": kernels_total, "device_us_unattributed": unattributed,
            "device_us_pdl_overlap": overlap,
            "by_layer_kind": {k: {"us": by_kind[k], "layers": layers.get(k, 1),
                                  "us_per_layer": by_kind[k] / layers.get(k, 1),
                                  "ops": dict(sorted(by_kind_op[k].items(), key=lambda x: -x[1]))}
                              for k in sorted(by_kind, key=lambda x: -by_kind[x])},
            "by_op": dict(sorted(by_op.items(), key=lambda x: -x[1])),
            "top_kernels": dict(top_kernels),
            "top_ops_detail": detail,
            "launch_kernels": launch_kernels,
            "note": "eager launches under torch.profiler, each synchronised (no CUDA graph, no PDL overlap between "
                    "launches); a launch's device time is the union of its kernels' intervals (its PDL kernels "
                    "overlap each other; device_us_pdl_overlap: what summing them would add)"}


def breakdown_table(p: dict, top: int = 4) -> str:
    """Markdown: each layer kind's device time per step and per layer, and its largest ops."""
    if not p["device_us_total"]:
        return f"(profile of {p['phase']}: no device kernels seen ({p['launches_profiled']} launches issued; " \
               "a CPU run has none))"
    lines = [f"{p['phase']} step, device time by layer kind (eager profile, {p['device_us_total'] / 1e3:.3f} ms "
             "of kernels per step):", "",
             "| layer kind | layers | ms/step | share | us/layer | largest ops (us/step) |", "|---|---:|---:|---:|---:|---|"]
    for k, d in p["by_layer_kind"].items():
        ops = ", ".join(f"{o} {us:.0f}" for o, us in list(d["ops"].items())[:top])
        lines.append(f"| {k} | {d['layers']} | {d['us'] / 1e3:.3f} | {d['us'] / p['device_us_total']:.0%} | "
                     f"{d['us_per_layer']:.1f} | {ops} |")
    lines += ["", "largest ops over the step (us/step): " + ", ".join(
        f"{o} {us:.0f}" for o, us in list(p["by_op"].items())[:8])]
    if p.get("device_us_unattributed"):
        lines.append(f"(kernels outside any launch's range: {p['device_us_unattributed']:.0f} us/step)")
    return "\n".join(lines)


def device_kernels(fn, device, reps: int = 3) -> list:
    """The GPU kernels of `reps` calls of `fn` (after one warm-up call) under the profiler, in start order: torch
    profiler events (`.name`, `.time_range`)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(device)
    ev = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    return sorted(ev, key=lambda e: e.time_range.start)


# the names of generated kernels (a module's other kernels: moe_nvfp4_prefill's WGMMA render's `wg_kernel`, its
# COMBINE render's `combine_kernel`)
GENERATED = ("kernel", "wg_kernel", "wg_attention", "combine_kernel")  # (the Triton kernels, the Gluon MoE stages
# and attention pass, the MoE prefill's combine stage)


def launch_medians(fn, device, n: int, reps: int = 3, names: tuple[str, ...] = GENERATED) -> list[float]:
    """Median device us of each of the `n` launches (kernels named one of `names`, in launch order) that one call of
    `fn` makes, over `reps` calls (torch.profiler; a multi-stage generated kernel's stages)."""
    ev = [e for e in device_kernels(fn, device, reps) if e.name in names]
    assert len(ev) == n * reps, (len(ev), n * reps)
    return [sorted(ev[r * n + s].time_range.elapsed_us() for r in range(reps))[reps // 2] for s in range(n)]


SIDE_KERNEL = "l2_prefetch"  # the codegen's prefetch plan's kernel (templates/l2_prefetch.py.j2)


def _kernel_kind(name: str) -> str:
    """A coarse label for a kernel in a replay's timeline (generated kernels are named `kernel`, or GENERATED's others)."""
    low = name.lower()
    if name in GENERATED:
        return "triton"
    if "memcpy" in low or "memset" in low or "copy" in low:
        return "copy"
    if "nvjet" in low or "gemm" in low or "cublas" in low or "cutlass" in low:
        return "cublas"
    return "torch"


def split_by_launch(call: list[tuple[float, float]], launch_kernels: list) -> list[tuple[str, float]]:
    """A replay's kernels (start, end), in order, split by launch (label, kernel count): each launch's time runs from
    its first kernel's start, or its predecessor's end if later, to its last kernel's end (0 if inside the
    predecessor's). The times add up to the span minus the idle gaps between launches."""
    out, i, prev_end = [], 0, call[0][0] if call else 0.0
    for label, c in launch_kernels:
        if c:
            mine = call[i:i + c]
            last = max(b for _, b in mine)
            out.append((label, max(0.0, last - max(prev_end, min(a for a, _ in mine)))))
            prev_end, i = max(prev_end, last), i + c
    return out


def profile_replay(fn, device, reps: int = 3, launch_kernels: list | None = None) -> dict:
    """One call of `fn` (a CUDA-graph replay) under the profiler, as a timeline: kernels per call, the span from the
    first kernel's start to the last one's end, the time some kernel ran (the union of their intervals: a PDL kernel
    starts before its predecessor ends and waits inside, so durations overlap) and the idle rest, summed by the kinds
    of kernel on either side of each gap (triton / cublas / copy / torch). With `launch_kernels` (profile_step's:
    each launch's label and kernel count, in issue order) and as many kernels as they add up to, the span is also
    split by launch: each launch from its first kernel's start, or its predecessor's end if later (a PDL kernel's
    early start is its predecessor's time), to its last kernel's end, summed by label (`graph_us_by_op`)."""
    if device.type != "cuda":
        return {"kernels": 0, "note": "no device"}
    ev = device_kernels(fn, device, reps)
    side = [e for e in ev if e.name == SIDE_KERNEL]  # L2 prefetches on a side stream: not in the chain
    ev = [e for e in ev if e.name != SIDE_KERNEL]
    n = len(ev) // reps
    spans, busy, gaps, by_op = [], [], defaultdict(float), defaultdict(float)
    mapped = launch_kernels is not None and sum(c for _, c in launch_kernels) == n
    for r in range(reps):
        call = [(e.time_range.start, e.time_range.end, _kernel_kind(e.name)) for e in ev[r * n:(r + 1) * n]]
        spans.append(max(b for _, b, _ in call) - call[0][0])
        busy.append(interval_union([(a, b) for a, b, _ in call]))
        end, before = call[0][1], call[0][2]
        for a, b, kind in call[1:]:
            if a > end:
                gaps[f"{before}->{kind}"] += (a - end) / reps
            if b >= end:
                end, before = b, kind
        if mapped:
            for label, us in split_by_launch([(a, b) for a, b, _ in call], launch_kernels):
                by_op[label] += us / reps
    span, run = sum(spans) / reps, sum(busy) / reps
    out = {"kernels": n, "span_us": span, "busy_us": run, "idle_us": span - run,
           "idle_us_by_neighbours": dict(sorted(gaps.items(), key=lambda x: -x[1])),
           "note": "kernels of one replay; busy: the union of their intervals; idle: the span's rest"}
    if side:
        out["side_kernels"] = len(side) // reps
        out["side_us"] = sum(e.time_range.elapsed_us() for e in side) / reps
        out["note"] += f"; the {SIDE_KERNEL} kernels (side stream, beside the chain) counted apart (side_us)"
    if launch_kernels is not None:
        out["graph_us_by_op"] = dict(sorted(by_op.items(), key=lambda x: -x[1])) if mapped else \
            f"not mapped: the replay ran {n} kernels, the eager launches {sum(c for _, c in launch_kernels)}"
    return out
