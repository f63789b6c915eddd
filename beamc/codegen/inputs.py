"""Random, meaningful buffers for one IR node's launches: what kernel tests and benchmarks feed a generated kernel.

Values follow their role, not just their dtype: token ids inside the vocabulary, positions and slots that form
valid sequences (several slots, positions past a ring wrap), distinct expert ids per token, routing weights that sum
to one, norm weights around one, activations of unit scale. Outputs are poisoned (NaN, or 0x7F bytes) so that a
kernel that skips an element is caught.
"""
from __future__ import annotations

import math

import torch

from beamc.ir.dtypes import torch_dtype
from beamc.ir.graph import Node, Value


def bind(shape, sizes: dict[str, int]) -> list[int]:
    return [sizes[d] if isinstance(d, str) else d for d in shape]


def random_value(v: Value, sizes: dict[str, int], gen: torch.Generator, device, *, role: str = "") -> torch.Tensor:
    shape = bind(v.shape, sizes)
    dt = torch_dtype(v.dtype)
    name = v.producer.attrs.get("name", v.name) if v.producer is not None and v.producer.op in ("param", "input") else v.name
    if v.dtype in ("i64", "i32"):
        if name == "input_ids":
            return torch.randint(0, sizes["V"], shape, generator=gen, device=device).to(dt)
        if name == "block_table":  # each slot its own run of pages of the pool
            return torch.arange(shape[0] * shape[1], device=device).view(shape).to(dt)
        if name == "slots":
            return (torch.arange(shape[0]) % sizes["S"]).to(device, dt)
        if name == "positions":  # each slot's tokens consecutive, starting past a ring wrap
            slots = torch.arange(shape[0]) % sizes["S"]
            rank = torch.zeros_like(slots)
            for s in slots.unique():
                rank[slots == s] = torch.arange(int((slots == s).sum()))
            return (sizes.get("P0", 0) + rank).to(device, dt)
        if len(shape) == 2:  # top-k expert ids: distinct per token
            E = sizes["E"]
            keys = torch.rand(shape[0], E, generator=gen, device=device)  # a random permutation per token
            return keys.argsort(dim=1)[:, : shape[1]].to(dt).contiguous()
        return torch.randint(0, 4, shape, generator=gen, device=device).to(dt)
    if v.dtype in ("e2m1x2", "u8"):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8, device=device)
    x = torch.randn(shape, generator=gen, device=device)
    if role == "routing_weights":
        x = torch.softmax(x, dim=-1)
    elif "norm" in name or name.endswith("layernorm.weight"):
        x = 1.0 + 0.1 * x
    elif name.endswith("_scale") or v.dtype == "f8e4m3":
        x = x.abs() * 0.01 + 0.005
    elif v.producer is not None and v.producer.op == "param":
        x = x * (1.0 / math.sqrt(max(shape[-1], 1)))
    return x.to(device=device, dtype=dt)


def node_buffers(node: Node, sizes: dict[str, int], device, seed: int = 0) -> tuple[list, list]:
    """(inputs, poisoned outputs) for one node; state inputs (caches) are filled with garbage too."""
    gen = torch.Generator(device=device).manual_seed(seed)  # drawn where used: the full vocab table is 1.5 GB
    ins = []
    for i, v in enumerate(node.inputs):
        weights_at = 1 if node.op == "boundary" else len(node.inputs) - 1  # (moe_experts with combine: the last)
        role = "routing_weights" if node.op in ("boundary", "moe_experts") and node.attrs.get("combine") \
            and i == weights_at else ""
        ins.append(random_value(v, sizes, gen, device, role=role))
    outs = [poisoned(v, sizes, device) for v in node.outputs]
    return ins, outs


def poisoned(v: Value, sizes: dict[str, int], device) -> torch.Tensor:
    shape = bind(v.shape, sizes)
    t = torch.empty(shape, dtype=torch_dtype(v.dtype), device=device)
    if t.is_floating_point() and t.element_size() > 1:
        t.fill_(float("nan"))
    else:
        t.view(torch.uint8).fill_(0x7F) if t.element_size() == 1 else t.fill_(-1)
    return t
