"""A reference serving session over the interpreter: ragged prefill, per-sequence decode, explicit KV caches.

It is how tests and `beamc logits` run the IR end to end: sequences live in cache slots; a prefill step appends a
chunk to any number of slots (each from its own current length), a decode step appends one token to each named
slot. Sliding layers keep a ring of `window - 1 + max_chunk` positions, full layers `max_len` positions in pages
(`runtime.kv_cache.SlotTable`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from beamc.errors import BeamcError
from beamc.ir.dtypes import ir_dtype, torch_dtype
from beamc.ir.graph import Graph
from beamc.runtime.interpret import Interpreter, with_packed_weights
from beamc.runtime.kv_cache import SlotTable, alloc_states
from beamc.spec.schema import ModelSpec


def page_size(g: Graph) -> int:
    """Positions per page of a graph's paged (full-layer) caches; 1 when it has none."""
    shapes = [n.out.shape for n in g.leaves("state").values() if n.out.shape[0] == "P"]
    return shapes[0][1] if shapes else 1


def check_dtype(spec: ModelSpec, dtype: str, where: str, fix: str | None = None) -> None:
    """A session's activation dtype is f32 (logic checks: every float in fp32) or the spec's own."""
    act = ir_dtype(spec.dtypes.activations)
    if ir_dtype(dtype) not in ("f32", act):
        raise BeamcError(where, f"{dtype}: this spec computes in {spec.dtypes.activations} (dtypes.activations)",
                         fix or f"use {where} {act}, or f32 for a logic check")


class ReferenceSession:
    def __init__(self, spec: ModelSpec, weights: list[dict[str, torch.Tensor]], *, tp: int = 1,
                 dtype: Literal["bf16", "f16", "f32"] | None = "f32", max_seqs: int = 4, max_len: int = 1024,
                 max_chunk: int = 256, device: str = "cpu", graphs: dict[str, list[Graph]] | None = None):
        from beamc.compiler import compile_graphs

        self.spec, self.tp, self.device = spec, tp, device
        self.graphs = graphs = graphs or compile_graphs(spec, tp=tp, dtype=dtype)
        self.slots = SlotTable(spec, max_seqs, max_len, max_chunk, page_size=page_size(graphs["prefill"][0]))
        # the load-time weight plan (packed params) is the same for both phases: build it once
        weights = [with_packed_weights(g, w) for g, w in zip(graphs["prefill"], weights)]
        self.interp = {k: Interpreter(gs, weights) for k, gs in graphs.items()}
        self.states = [alloc_states(g, self.slots.sizes(), device) for g in self.graphs["prefill"]]
        has_pages = "block_table" in self.graphs["prefill"][0].leaves("input")
        self.fixed_inputs = {"block_table": self.slots.block_table(device)} if has_pages else {}

    @property
    def lengths(self) -> list[int]:
        return self.slots.lengths

    @classmethod
    def from_checkpoint(cls, spec: ModelSpec, ckpt: str | Path, *, tp: int = 1,
                        dtype: Literal["bf16", "f16", "f32"] | None = "f32", device: str = "cpu",
                        **kw) -> "ReferenceSession":
        from beamc.checkpoint.loader import load_rank_weights

        if dtype is not None:
            check_dtype(spec, dtype, "dtype", "pass None (the spec's dtypes) or 'f32' (a logic check)")
        tdtype = torch_dtype(dtype or spec.dtypes.activations)
        weights = [load_rank_weights(spec, ckpt, tp=tp, rank=r, dtype=tdtype, device=device) for r in range(tp)]
        return cls(spec, weights, tp=tp, dtype=dtype, device=device, **kw)

    def reset(self, slot: int) -> None:
        self.slots.reset(slot)

    def _step(self, phase: str, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Logits [T, V] (fp32), rows in the order the tokens were given. Every check runs before the step."""
        plan = self.slots.plan(chunks)
        inputs = {k: torch.as_tensor(v, dtype=torch.int64, device=self.device) for k, v in plan.items()}
        inputs.update(self.fixed_inputs)
        out = self.interp[phase].run(inputs, self.states)[0]["logits"]
        self.slots.commit(chunks)
        return out

    def prefill(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Append each chunk to its slot; returns per-chunk logits [n_i, V]."""
        return list(self._step("prefill", chunks).split([len(t) for _, t in chunks]))

    def decode(self, tokens: dict[int, int]) -> torch.Tensor:
        """One token for each named slot; returns logits [B, V] in the dict's order."""
        return self._step("decode", [(s, [t]) for s, t in tokens.items()])
