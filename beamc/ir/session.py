"""A reference serving session over the interpreter: ragged prefill, per-sequence decode, explicit KV caches.

It is how tests and `beamc logits` run the IR end to end: sequences live in cache slots; a prefill step appends a
chunk to any number of slots (each from its own current length), a decode step appends one token to each named
slot. Sliding layers keep a ring of `window - 1 + max_chunk` positions, full layers `max_len` positions.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from beamc.errors import BeamcError
from beamc.ir.graph import Graph
from beamc.ir.interpret import Interpreter, alloc_states, with_packed_weights
from beamc.ir.verify import verify
from beamc.passes.manager import compiled_graphs
from beamc.spec.schema import ModelSpec


class ReferenceSession:
    def __init__(self, spec: ModelSpec, weights: list[dict[str, torch.Tensor]], *, tp: int = 1,
                 dtype: Literal["bf16", "f32"] | None = "f32", max_seqs: int = 4, max_len: int = 1024,
                 max_chunk: int = 256, device: str = "cpu", graphs: dict[str, list[Graph]] | None = None):
        self.spec, self.tp, self.device = spec, tp, device
        self.max_seqs, self.max_len, self.max_chunk = max_seqs, max_len, max_chunk
        self.graphs = graphs = graphs or compiled_graphs(spec, tp=tp, dtype=dtype)
        for gs in graphs.values():
            for g in gs:
                verify(g)
        # the load-time weight plan (packed params) is the same for both phases: build it once
        weights = [with_packed_weights(g, w) for g, w in zip(graphs["prefill"], weights)]
        self.interp = {k: Interpreter(gs, weights) for k, gs in graphs.items()}
        cs = min(max_len, spec.attention.sliding.window - 1 + max_chunk)
        sizes = {"S": max_seqs, "Cs": cs, "Cf": max_len}
        self.states = [alloc_states(g, sizes, device) for g in self.graphs["prefill"]]
        self.lengths = [0] * max_seqs

    @classmethod
    def from_checkpoint(cls, spec: ModelSpec, ckpt: str | Path, *, tp: int = 1,
                        dtype: Literal["bf16", "f32"] | None = "f32", device: str = "cpu", **kw) -> "ReferenceSession":
        from beamc.checkpoint.loader import load_rank_weights

        tdtype = torch.float32 if dtype == "f32" else torch.bfloat16
        weights = [load_rank_weights(spec, ckpt, tp=tp, rank=r, dtype=tdtype, device=device) for r in range(tp)]
        return cls(spec, weights, tp=tp, dtype=dtype, device=device, **kw)

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0

    def _step(self, phase: str, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Logits [T, V] (fp32), rows in the order the tokens were given."""
        ids, pos, slots = [], [], []
        for slot, toks in chunks:
            if not 0 <= slot < self.max_seqs:
                raise BeamcError("slot", f"{slot} is outside [0, {self.max_seqs})", "raise max_seqs")
            if not toks:
                raise BeamcError(f"slot {slot}", "empty token list")
            if len(toks) > self.max_chunk:
                raise BeamcError(f"slot {slot}", f"chunk of {len(toks)} tokens exceeds max_chunk={self.max_chunk}",
                                 "split the prefill into chunks or raise max_chunk")
            start = self.lengths[slot]
            if start + len(toks) > self.max_len:
                raise BeamcError(f"slot {slot}", f"length {start + len(toks)} exceeds max_len={self.max_len}")
            bad = [t for t in toks if not 0 <= t < self.spec.vocab_size]
            if bad:
                raise BeamcError(f"slot {slot}", f"token id {bad[0]} outside the vocabulary [0, {self.spec.vocab_size})")
            ids += toks
            pos += range(start, start + len(toks))
            slots += [slot] * len(toks)
        if len(set(s for s, _ in chunks)) != len(chunks):
            raise BeamcError("step", "a slot appears twice in one step")
        dev = self.device
        inputs = {"input_ids": torch.tensor(ids, device=dev), "positions": torch.tensor(pos, device=dev),
                  "slots": torch.tensor(slots, device=dev)}
        out = self.interp[phase].run(inputs, self.states)[0]["logits"]
        for slot, toks in chunks:
            self.lengths[slot] += len(toks)
        return out

    def prefill(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Append each chunk to its slot; returns per-chunk logits [n_i, V]."""
        return list(self._step("prefill", chunks).split([len(t) for _, t in chunks]))

    def decode(self, tokens: dict[int, int]) -> torch.Tensor:
        """One token for each named slot; returns logits [B, V] in the dict's order."""
        return self._step("decode", [(s, [t]) for s, t in tokens.items()])
