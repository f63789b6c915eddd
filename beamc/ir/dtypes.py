"""The one table of dtype names. The IR says `bf16`, the spec and the checkpoint layout say `bfloat16` (torch's
name), safetensors headers say `BF16`, the command line accepts either spelling (and `fp32`). Everything converts
through this table; nothing else keeps its own map. No torch import: planning (`beamc compile`) runs without it.

`e2m1x2` is NVFP4's packed storage: two E2M1 codes per byte (torch holds it as uint8), the even element in the low
nibble; kernels and references read it together with its e4m3 block scales and fp32 global scale.
"""
from __future__ import annotations

from dataclasses import dataclass

from beamc.errors import BeamcError


@dataclass(frozen=True)
class DType:
    ir: str  # the IR's name
    storage: str  # torch's / the spec's name
    safetensors: str | None  # the safetensors header name
    bits: int
    is_float: bool
    rank: int = 3  # floats: promotion order (torch's result dtype when two float types meet)


TABLE = (
    DType("f8e4m3", "float8_e4m3fn", "F8_E4M3", 8, True, 0),
    DType("bf16", "bfloat16", "BF16", 16, True, 1),
    DType("f16", "float16", "F16", 16, True, 1),
    DType("f32", "float32", "F32", 32, True, 2),
    DType("f64", "float64", "F64", 64, True, 3),
    DType("e2m1x2", "uint8", None, 8, False),  # packed NVFP4 codes: stored as uint8 bytes
    DType("u8", "uint8", "U8", 8, False),
    DType("i8", "int8", "I8", 8, False),
    DType("i16", "int16", "I16", 16, False),
    DType("i32", "int32", "I32", 32, False),
    DType("i64", "int64", "I64", 64, False),
    DType("bool", "bool", "BOOL", 8, False),
    DType("f8e5m2", "float8_e5m2", "F8_E5M2", 8, True, 0),
)
BY_IR = {d.ir: d for d in TABLE}
BY_STORAGE = {d.storage: d for d in TABLE if d.ir != "e2m1x2"}  # uint8 -> u8 (plain bytes); lowering picks e2m1x2
BY_SAFETENSORS = {d.safetensors: d for d in TABLE if d.safetensors}
FLOAT_STORAGE = ("bfloat16", "float16", "float32")  # the float dtypes a weight may be stored in
ALIASES = {"fp32": "f32", "fp16": "f16", "fp8": "f8e4m3", "half": "f16", "float": "f32"}


def ir_dtype(name: str) -> str:
    """Any spelling (IR, torch/spec, safetensors, CLI alias) -> the IR name."""
    if name in BY_IR:
        return name
    if name in ALIASES:
        return ALIASES[name]
    d = BY_STORAGE.get(name) or BY_SAFETENSORS.get(name)
    if d is None:
        raise BeamcError("dtype", f"unknown dtype {name!r}", "use one of " + ", ".join(BY_IR))
    return d.ir


def storage_name(ir: str) -> str:
    """The IR name -> torch's name (`bf16` -> `bfloat16`)."""
    return BY_IR[ir].storage


def from_safetensors(header_dtype: str) -> str:
    """A safetensors header dtype -> torch's name (unknown names are kept, so the mismatch message shows them)."""
    d = BY_SAFETENSORS.get(header_dtype)
    return d.storage if d else header_dtype


def torch_dtype(name: str):
    """Any spelling -> the torch dtype (imports torch: runtimes only)."""
    import torch

    return getattr(torch, storage_name(ir_dtype(name)))


def promote(a: str, b: str) -> str:
    """torch's result dtype for two float IR dtypes (the wider wins; equal rank keeps the first)."""
    return a if BY_IR[a].rank >= BY_IR[b].rank else b


def nbytes(ir: str) -> float:
    return BY_IR[ir].bits / 8
