"""Sampling helpers over the runtime's fp32 logits [B, V]: greedy, temperature, top-p (nucleus), seeded.

    gen = generator(seed=0, device=logits.device)
    tok = sample(logits, temperature=0.8, top_p=0.95, generator=gen)   # [B] int64
    tok = greedy(logits)                                               # temperature 0 is greedy too
"""
from __future__ import annotations

import math

import torch

from beamc.errors import BeamcError


def check_params(temperature: float, top_p: float, names: tuple[str, str] = ("temperature", "top_p")) -> None:
    """One error for a temperature that is not a finite number >= 0 (nan and inf included) or a top_p outside
    (0, 1]; `names`: how the caller spells them (the CLI's --temperature / --top-p)."""
    t, p = _number(temperature), _number(top_p)
    if t is None or not math.isfinite(t) or t < 0:
        raise BeamcError(names[0], f"must be a finite number >= 0, got {temperature!r}", "0 for greedy decoding")
    if p is None or not 0.0 < p <= 1.0:
        raise BeamcError(names[1], f"must be in (0, 1], got {top_p!r}")


def _number(v) -> float | None:
    try:
        return None if isinstance(v, (bool, str)) else float(v)
    except (TypeError, ValueError, RuntimeError):  # (a tensor of several values: RuntimeError)
        return None


def generator(seed: int = 0, device: str | torch.device = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The highest-scoring token of each row (the first one on ties)."""
    return logits.argmax(dim=-1)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits with every token outside the smallest set whose probability reaches `top_p` set to -inf (the most
    likely token always stays)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each one
    drop = before >= top_p
    drop[..., 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `logits` [B, V] (or [V]): greedy at temperature 0, else softmax(logits / temperature)
    restricted to the top-p nucleus, drawn with `generator` (seeded: the same seed gives the same tokens)."""
    check_params(temperature, top_p)
    squeeze = logits.dim() == 1
    x = logits.float()[None] if squeeze else logits.float()
    if temperature == 0:
        out = greedy(x)
    else:
        # the row's maximum subtracted first (softmax's own shift): a tiny temperature then sends the other logits
        # toward -inf instead of overflowing the best ones to inf (inf - inf: a NaN probability)
        x = top_p_filter((x - x.amax(dim=-1, keepdim=True)) / temperature, top_p)
        out = torch.multinomial(x.softmax(dim=-1), 1, generator=generator).squeeze(-1)
    return out[0] if squeeze else out
