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
    """Issue one step's launches eagerly (each inside `mark(i)` when given); the number issued."""
    from beamc.runtime import library

    v = model.buffers(phase, sizes)
    K = model.step_module.K
    T = sizes.get("T", sizes.get("B"))
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
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        n += 1
    return n


def profile_step(model, phase: str, sizes: dict, reps: int = 3) -> dict:
    """Device µs per step by launch (node, layer kind, op class), averaged over `reps` profiled eager steps."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = model.device.type == "cuda"
    issue(model, phase, sizes)  # warm: every kernel compiled / loaded before the trace
    if cuda:
        torch.cuda.synchronize(model.device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(reps):
            issue(model, phase, sizes, mark=lambda i: record_function(f"beamc#{i}"))
        if cuda:
            torch.cuda.synchronize(model.device)
    # Each range's kernels: those launched inside it (linked by the profiler's correlation ids), its own and its
    # child ops'. Not the range's device_time_total: the GPU-side copy of a user range spans from its first kernel
    # to its last, idle gaps of an eager launch-bound step included.
    def kernel_us(e) -> float:
        return sum(k.duration for k in getattr(e, "kernels", [])) + sum(kernel_us(c) for c in e.cpu_children)

    per_launch: dict[int, float] = defaultdict(float)
    kernels: dict[str, float] = defaultdict(float)
    for e in prof.events():
        on_device = str(getattr(e, "device_type", "")).endswith("CUDA")
        if e.name.startswith("beamc#") and not on_device:
            per_launch[int(e.name[6:])] += kernel_us(e) / reps
        elif on_device and not e.name.startswith("beamc#"):
            kernels[e.name] += (getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0) or 0.0) / reps
    launches = model.phases[phase].launches
    by_kind: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    by_kind_op: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for i, us in per_launch.items():
        node, ln = launches[i]
        k, o = _kind(model.spec, getattr(node, "layer", None)), _op_class(node, ln)
        by_kind[k] += us
        by_op[o] += us
        by_kind_op[k][o] += us
    layers = defaultdict(int)
    for L in range(model.spec.num_layers):
        layers[_kind(model.spec, L)] += 1
    total = sum(per_launch.values())
    top_kernels = sorted(kernels.items(), key=lambda x: -x[1])[:15]
    return {"phase": phase, "sizes": sizes, "reps": reps, "launches_profiled": len(per_launch),
            "device_us_total": total, "device_us_kernels": sum(kernels.values()),
            "by_layer_kind": {k: {"us": by_kind[k], "layers": layers.get(k, 1),
                                  "us_per_layer": by_kind[k] / layers.get(k, 1),
                                  "ops": dict(sorted(by_kind_op[k].items(), key=lambda x: -x[1]))}
                              for k in sorted(by_kind, key=lambda x: -by_kind[x])},
            "by_op": dict(sorted(by_op.items(), key=lambda x: -x[1])),
            "top_kernels": dict(top_kernels),
            "note": "eager launches under torch.profiler (no CUDA graph, no PDL overlap); device time per launch"}


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
    return "\n".join(lines)


def profile_replay(fn, device, reps: int = 3) -> dict:
    """Kernels per call and their summed device µs when `fn` (a CUDA-graph replay) runs `reps` times: against the
    replay's measured time this says how much of a step is kernels and how much is gaps between them."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return {"kernels": 0, "kernel_us": 0.0, "note": "no device"}
    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(device)
    ev = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    return {"kernels": len(ev) / reps, "kernel_us": sum(e.device_time for e in ev) / reps}
