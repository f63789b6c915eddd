"""Sequences in cache slots: which slot holds how many tokens, and whether a step fits, decided before it runs.

Shared by the reference session and the compiled runtime. Full-attention layers keep their K/V in pages of
`page_size` positions from one pool, found through a block table per sequence (serving stacks hand those in; this
table gives each slot its own `max_len / page_size` pages); sliding layers keep a ring of `window - 1 + max_chunk`
positions per slot (a chunk's first token still sees its whole window when the chunk's last token is written).
Every check happens before any cache is touched, so a refused step leaves every sequence's cache as it was.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from beamc.errors import BeamcError
from beamc.ir.dtypes import torch_dtype
from beamc.ir.graph import Graph
from beamc.spec.schema import ModelSpec


@dataclass
class SlotTable:
    spec: ModelSpec
    max_seqs: int
    max_len: int
    max_chunk: int
    page_size: int = 16
    lengths: list[int] = field(init=False)

    def __post_init__(self):
        for name in ("max_seqs", "max_len", "max_chunk", "page_size"):
            if getattr(self, name) < 1:
                raise BeamcError(name, f"must be >= 1, got {getattr(self, name)}")
        limit = self.spec.max_position_embeddings
        if self.max_len > limit:
            raise BeamcError("max_len", f"{self.max_len} exceeds the spec's max_position_embeddings ({limit})",
                             "ask for a shorter context or raise max_position_embeddings in the spec")
        self.lengths = [0] * self.max_seqs

    @property
    def ring(self) -> int:
        """Positions a sliding layer's ring keeps per slot."""
        w = self.spec.effective_window
        return min(self.max_len, w - 1 + self.max_chunk)

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_len // self.page_size)

    def sizes(self) -> dict[str, int]:
        """The symbolic cache dims of the graphs: S slots, Cs sliding ring, P pages in the pool, MP per sequence."""
        return {"S": self.max_seqs, "Cs": self.ring, "P": self.max_seqs * self.pages_per_seq, "MP": self.pages_per_seq}

    def block_table(self, device: Any = "cpu") -> torch.Tensor:
        """[S, MP] int32: slot s owns pages s * MP ... (s + 1) * MP - 1 of the pool."""
        mp = self.pages_per_seq
        return torch.arange(self.max_seqs * mp, dtype=torch.int32, device=device).view(self.max_seqs, mp)

    def plan(self, chunks: list[tuple[int, list[int] | torch.Tensor]]) -> dict[str, list[int] | torch.Tensor]:
        """input_ids, positions and slots of a step appending each chunk to its slot; raises before anything runs.

        A chunk is a list of ints or a 1-D int64 CPU tensor (a long prefill chunk, checked with tensor ops: the same
        checks and messages); with any tensor chunk the three outputs are int64 tensors, else int lists."""
        if not chunks:
            raise BeamcError("step", "no sequences given")
        if len({s for s, _ in chunks}) != len(chunks):
            raise BeamcError("step", "a slot appears twice in one step", "give each sequence's tokens once")
        ids, pos, slots = [], [], []
        as_tensors = any(isinstance(toks, torch.Tensor) for _, toks in chunks)
        for slot, toks in chunks:
            if not isinstance(slot, int) or not 0 <= slot < self.max_seqs:
                raise BeamcError("slot", f"{slot!r} is outside [0, {self.max_seqs})", "raise max_seqs")
            if not len(toks):
                raise BeamcError(f"slot {slot}", "empty token list")
            if len(toks) > self.max_chunk:
                raise BeamcError(f"slot {slot}", f"chunk of {len(toks)} tokens exceeds max_chunk={self.max_chunk}",
                                 "split the prefill into chunks or raise max_chunk")
            start = self.lengths[slot]
            end = start + len(toks)
            if end > self.spec.max_position_embeddings:
                raise BeamcError(f"slot {slot}", f"length {end} exceeds the spec's max_position_embeddings "
                                 f"({self.spec.max_position_embeddings})", "raise max_position_embeddings in the spec")
            if end > self.max_len:
                raise BeamcError(f"slot {slot}", f"length {end} exceeds max_len={self.max_len}", "raise max_len")
            if isinstance(toks, torch.Tensor):
                out = ((toks < 0) | (toks >= self.spec.vocab_size)).nonzero()
                bad = [int(toks[out[0, 0]])] if len(out) else []
            else:
                bad = [t for t in toks if isinstance(t, bool) or not isinstance(t, int)
                       or not 0 <= t < self.spec.vocab_size]
            if bad:
                raise BeamcError(f"slot {slot}", f"token id {bad[0]!r} outside the vocabulary [0, {self.spec.vocab_size})")
            if as_tensors:
                ids.append(toks if isinstance(toks, torch.Tensor) else torch.tensor(toks, dtype=torch.int64))
                pos.append(torch.arange(start, end, dtype=torch.int64))
                slots.append(torch.full((len(toks),), slot, dtype=torch.int64))
            else:
                ids += toks
                pos += range(start, end)
                slots += [slot] * len(toks)
        if as_tensors:
            return {"input_ids": torch.cat(ids), "positions": torch.cat(pos), "slots": torch.cat(slots)}
        return {"input_ids": ids, "positions": pos, "slots": slots}

    def commit(self, chunks: list[tuple[int, list[int]]]) -> None:
        for slot, toks in chunks:
            self.lengths[slot] += len(toks)

    def reset(self, slot: int) -> None:
        if not 0 <= slot < self.max_seqs:
            raise BeamcError("slot", f"{slot!r} is outside [0, {self.max_seqs})")
        self.lengths[slot] = 0


def alloc_states(g: Graph, sizes: dict[str, int], device: Any = "cpu") -> dict[str, torch.Tensor]:
    """Zeroed state tensors for a graph's `state` leaves, symbolic dims taken from `sizes` (S, Cs, P)."""
    out = {}
    for name, node in g.leaves("state").items():
        v = node.out
        shape = [sizes[d] if isinstance(d, str) else d for d in v.shape]
        out[name] = torch.zeros(shape, dtype=torch_dtype(v.dtype), device=device)
    return out
