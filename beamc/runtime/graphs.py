"""CUDA graphs of the compiled runtime: one graph per step bucket, replayed over the model's static buffers.

Decode is captured at load for every batch bucket (1, 2, 4, ..., max_batch); prefill per (token bucket, logit-row
bucket) the first time that bucket runs. A capture first runs the step twice eagerly (Triton compiles its kernels,
cuBLAS picks its algorithms) with every row a padding row, whose tokens live in the reserved padding slot and pages:
warm-up and capture never touch a real sequence's cache. All graphs share one memory pool (they replay one at a time
on one stream, so their temporaries may overlap).

A step can only be captured when none of its launches synchronises with the host. Some library calls of this stage
do (the reference attention and MoE loops read indices back to the host: `torch.unique(...).tolist()`); a bucket
whose step runs one (launches may be limited to a token range) runs eagerly, and `status` / `summary()` say why. A
capture error likewise turns its phase eager, with the error recorded. On a CPU nothing is captured.
"""
from __future__ import annotations

from typing import Any

import torch

# library calls (beamc.runtime.library) that read device values back to the host: a step holding one cannot be
# captured (they go away as issues 8 and 9 replace them with kernels)
_REF_ATTENTION = "the reference attention (torch.unique/.tolist per slot) until the attention kernels"
HOST_SYNC = {"attention": _REF_ATTENTION, "attention_gate": _REF_ATTENTION,
             "moe_experts_dense": "the reference MoE expert loop (torch.unique(idx).tolist()) until the MoE kernels",
             "moe_experts_nvfp4": "the reference MoE expert loop (torch.unique(idx).tolist()) until the MoE kernels",
             "all_gather": "all_gather allocates its parts per call through torch.distributed"}


class StepGraphs:
    def __init__(self, model, enabled: bool):
        self.model = model
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.status: dict[tuple, str] = {}  # bucket key (phase, tokens, logit rows) -> "graph" or why eager
        self.enabled = enabled
        self.pool = torch.cuda.graph_pool_handle() if enabled else None
        self.failed: dict[str, str] = {}  # phase -> the capture error that turned it eager

    def why_eager(self, key: tuple) -> str | None:
        """None when bucket `key` can be captured, else the reason it runs eagerly."""
        phase, T = key[0], key[1]
        if not self.enabled:
            return "eager=True" if self.model.device.type == "cuda" else "cpu"
        if phase in self.failed:
            return self.failed[phase]
        sync = sorted({ln.library for _, ln in self.model.phases[phase].launches
                       if ln.library in HOST_SYNC and (not hasattr(ln, "runs_for") or ln.runs_for(T))})
        if sync:
            return "library calls that sync with the host: " + "; ".join(f"{s} ({HOST_SYNC[s]})" for s in sync)
        return None

    def summary(self) -> dict[str, str]:
        """phase -> how its buckets run so far ("graphs", or "eager: <why>" per distinct reason)."""
        out: dict[str, set[str]] = {}
        for phase in self.model.phases:
            keys = [k for k in self.status if k[0] == phase] or [(phase, 1, 1)]
            for k in keys:
                why = self.status.get(k) or self.why_eager(k)
                out.setdefault(phase, set()).add("graphs" if why in (None, "graph") else f"eager ({why})")
        return {p: "; ".join(sorted(s)) for p, s in out.items()}

    def capture_decode(self) -> None:
        """Capture every decode batch bucket now (serving never pays for a capture in a decode step)."""
        for b in self.model.decode_buckets:
            key = ("decode", b, b)
            if self.why_eager(key) is None:
                self.prepare(key, self.model.buffers("decode", {"B": b, "R": b}))

    def prepare(self, key: tuple, v: dict[str, Any]) -> None:
        phase = key[0]
        if key in self.graphs:
            return
        why = self.why_eager(key)
        if why is not None:
            self.status[key] = why
            return
        self._pad_inputs(key)
        m = self.model
        try:
            stream = torch.cuda.Stream(device=m.device)
            stream.wait_stream(torch.cuda.current_stream(m.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    m.run_step(phase, v)
            torch.cuda.current_stream(m.device).wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                m.run_step(phase, v)
            torch.cuda.synchronize(m.device)
        except Exception as e:  # a launch the capture refuses: this phase runs eagerly from now on
            torch.cuda.synchronize(m.device)
            first = str(e).splitlines()[0] if str(e) else ""
            self.failed[phase] = self.status[key] = f"capture failed: {type(e).__name__}: {first}"
            return
        self.graphs[key] = g
        self.status[key] = "graph"

    def run(self, key: tuple, v: dict[str, Any]) -> None:
        g = self.graphs.get(key)
        if g is not None:
            g.replay()
        else:
            self.model.run_step(key[0], v)

    def _pad_inputs(self, key: tuple) -> None:
        """Every row of the bucket a padding row: token 0 in the padding slot."""
        m = self.model
        phase, size, rb = key
        ins = m.inputs[phase]
        ins["input_ids"][:size].zero_()
        ins["positions"][:size].copy_(torch.arange(size) % m._pad_mod)
        ins["slots"][:size].fill_(m.pad_slot)
        if "logit_rows" in ins:
            ins["logit_rows"][:rb].zero_()
