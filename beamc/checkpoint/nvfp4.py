"""NVFP4 weights in NVIDIA ModelOpt's checkpoint layout.

A weight W [N, K] is stored as
- `weight`         uint8 [N, K/2]: two 4-bit E2M1 codes per byte, the even column in the low nibble;
- `weight_scale`   float8_e4m3fn [N, K/16]: one scale per 16 consecutive values of a row;
- `weight_scale_2` float32 scalar: the global scale.
Value = E2M1[code] * weight_scale * weight_scale_2. `quantize` follows ModelOpt's `NVFP4QTensor` recipe so that
a checkpoint written here is what ModelOpt would have written for the same bf16 weights.
"""
from __future__ import annotations

import torch

GROUP = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0

# code -> value; bit 3 is the sign (code 8 is -0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TABLE = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)

# Midpoints between consecutive magnitudes. A value on a midpoint rounds to the even mantissa: down at the
# even-indexed midpoints (0.25 -> 0, 1.25 -> 1, 2.5 -> 2, 5 -> 4), up at the odd ones (0.75 -> 1, 1.75 -> 2, 3.5 -> 4).
_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] 4-bit codes (uint8) -> [..., K/2] bytes, column 2j in the low nibble, 2j+1 in the high one."""
    codes = codes.to(torch.uint8)
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] 4-bit codes (uint8)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even E2M1 codes of already scaled values (magnitudes beyond 6 saturate to 6)."""
    a = x.abs()
    bounds = _BOUNDS.to(a.device)
    mag = torch.searchsorted(bounds, a) + torch.isin(a, bounds[1::2])
    # signbit (not x < 0) so that -0.0 keeps code 8: quantize(dequantize(q)) then reproduces q exactly.
    return (mag.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)).to(torch.uint8)


def quantize(w: torch.Tensor, group_size: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [..., N, K] float -> (packed uint8 [..., N, K/2], scale float8_e4m3fn [..., N, K/g], scale_2 fp32 scalar)."""
    w = w.float()
    K = w.shape[-1]
    if K % group_size:
        raise ValueError(f"last dim {K} is not a multiple of the group size {group_size}")
    scale_2 = w.abs().amax() / (E2M1_MAX * E4M3_MAX)
    if scale_2 == 0:  # all-zero weight: any scale works, avoid 0/0
        scale_2 = torch.ones((), dtype=torch.float32)
    blocks = w.reshape(*w.shape[:-1], K // group_size, group_size)
    scale = blocks.abs().amax(-1) / (E2M1_MAX * scale_2)
    scale = torch.where(scale == 0, 1.0, scale)  # ModelOpt: all-zero blocks get scale 1
    scale = scale.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)  # clamp: e4m3fn has no inf, overflow would be NaN
    denom = scale.float() * scale_2
    # A scale that underflowed to 0 in e4m3: its block is negligible next to the global amax, store zeros.
    denom = torch.where(denom == 0, torch.inf, denom)
    codes = round_e2m1(blocks / denom.unsqueeze(-1)).reshape(w.shape)
    return pack_codes(codes), scale, scale_2.reshape(()).float()


def dequantize(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | float,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """table[code] * scale * scale_2 in fp32 (exact: a 2-bit by 4-bit mantissa product times one fp32), then cast.

    packed [..., N, K/2], scale [..., N, K/g]; scale_2 a scalar, or any shape broadcasting against [..., N, K]
    (e.g. [E, 1, 1] for a stack of E experts)."""
    codes = unpack_codes(packed)
    *lead, n, k = codes.shape
    groups = scale.shape[-1]
    vals = E2M1_TABLE.to(codes.device)[codes.int()].view(*lead, n, groups, k // groups)
    vals = (vals * scale.float().unsqueeze(-1)).view(*lead, n, k)
    return (vals * torch.as_tensor(scale_2, dtype=torch.float32, device=codes.device)).to(dtype)


def dequantize_stacked(weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """The fp32 values [E, N, K] of a stack of NVFP4 matrices as the graph holds them (`layout.expert_graph_params`).

    weight uint8 [E, N, K/2], scale e4m3 [E, N, K/g], scale_2 fp32 [E, parts]: the N rows are `parts` equal blocks
    (gate rows then up rows of gate_up: parts = 2; down: parts = 1), each with its own global scale, because each
    block is one quantised file tensor."""
    E, N = weight.shape[:2]
    parts = scale_2.shape[-1]
    if N % parts:
        raise ValueError(f"{N} rows do not split into {parts} equal blocks of one global scale each")
    rows_scale = scale_2.float().repeat_interleave(N // parts, dim=1)  # [E, N]: each row's global scale
    return dequantize(weight, scale, rows_scale[..., None])
