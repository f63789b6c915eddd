"""The central kernel check: for a node of a compiled graph, run its launches (generated kernels and library calls,
in order, on fresh random inputs with poisoned outputs) and compare every output with its op's reference on the
same inputs. Used by the CPU tests (fp32 instances under TRITON_INTERPRET=1) and the GPU tests (bf16, bitwise).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from beamc.codegen.emitters import Launch
from beamc.codegen.inputs import bind, node_buffers
from beamc.codegen.kernel import load_kernel
from beamc.ir.dtypes import torch_dtype
from beamc.ir.graph import Node
from beamc.ir.ops import OPS
from beamc.ir.reference import REFS


@dataclass
class Comparison:
    op: str
    kernel: str
    layer: int | None
    elements: int = 0
    mismatches: int = 0  # elements whose bits differ from the reference's
    max_ulp: int = 0  # largest distance in units of the output dtype's last place
    max_rel: float = 0.0  # max |out - ref| / max |ref|
    nan: int = 0  # outputs left NaN (poison not overwritten) or produced NaN where the reference has none
    int_mismatches: int = 0  # integer outputs (expert ids) that differ
    norm_rel: float = 0.0  # ||out - ref|| / ||ref|| over the float outputs (how GEMM-class kernels are judged)
    _sq: list = field(default_factory=lambda: [0.0, 0.0], repr=False)
    notes: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| counted in representable values of their (float) dtype: order-preserving integer views."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    ia, ib = a.contiguous().view(bits).long(), b.contiguous().view(bits).long()
    sign = 1 << (torch.iinfo(bits).bits - 1)
    ia = torch.where(ia < 0, -(ia + sign), ia)  # sign-magnitude -> two's complement order
    ib = torch.where(ib < 0, -(ib + sign), ib)
    return (ia - ib).abs()


def compare(out: torch.Tensor, ref: torch.Tensor, c: Comparison) -> None:
    c.elements += ref.numel()
    if not out.is_floating_point() or out.element_size() == 1:
        same = out.view(torch.uint8) == ref.view(torch.uint8) if out.element_size() == 1 else out == ref
        c.mismatches += int((~same).sum())
        if not out.is_floating_point() and out.element_size() > 1:
            c.int_mismatches += int((~same).sum())
        return
    nan_out, nan_ref = torch.isnan(out), torch.isnan(ref)
    c.nan += int((nan_out & ~nan_ref).sum())
    ok = ~(nan_out | nan_ref)
    diff = ulp_distance(out[ok], ref[ok]) if ok.any() else torch.zeros(1, dtype=torch.long)
    c.mismatches += int((diff != 0).sum()) + int((nan_out != nan_ref).sum())
    c.max_ulp = max(c.max_ulp, int(diff.max()) if diff.numel() else 0)
    scale = ref[ok].float().abs().max().clamp_min(1e-30) if ok.any() else torch.tensor(1.0)
    rel = ((out[ok].float() - ref[ok].float()).abs().max() / scale) if ok.any() else torch.tensor(0.0)
    c.max_rel = max(c.max_rel, float(rel))
    if ok.any():
        c._sq[0] += float((out[ok].double() - ref[ok].double()).pow(2).sum())
        c._sq[1] += float(ref[ok].double().pow(2).sum())
        c.norm_rel = (c._sq[0] / max(c._sq[1], 1e-300)) ** 0.5


def run_launches(node: Node, launches: list[Launch], ins: list[torch.Tensor], outs: list[torch.Tensor],
                 sizes: dict[str, int], kernel_dir: str | Path | None = None) -> None:
    """Issue a node's launches over its buffers (scratch buffers allocated here)."""
    from beamc.runtime import library

    buf = {v.name: t for v, t in zip(node.inputs, ins)}
    written = {o for _, o in OPS[node.op].state_io}
    for i, (v, t) in enumerate(zip(node.outputs, outs)):
        if i not in written:
            buf[v.name] = t
    T = sizes.get("T", sizes.get("B"))
    for ln in launches:
        if not ln.runs_for(T):  # a launch for other token counts (the gemv / cuBLAS choice)
            continue
        for name, shape, dt in ln.scratch:
            buf[name] = torch.empty(bind(shape, sizes), dtype=torch_dtype(dt), device=ins[0].device)
        args = [buf[a] for a in ln.args]
        if ln.kernel is not None:
            load_kernel(ln.kernel, kernel_dir).launch(*args)
        elif ln.library != "view":
            getattr(library, ln.library)(*args, **dict(ln.kwargs))


def check_node(node: Node, launches: list[Launch], sizes: dict[str, int], device: Any = "cpu", seed: int = 0,
               kernel_dir: str | Path | None = None) -> Comparison:
    """Kernels vs reference on identical random inputs; state inputs (caches) compared after both wrote them."""
    ins, outs = node_buffers(node, sizes, device, seed)
    ref_ins = [t.clone() for t in ins]  # the reference writes its own copy of the caches
    ref_outs = REFS[node.op](ref_ins, node.attrs)
    run_launches(node, launches, ins, outs, sizes, kernel_dir)
    T = sizes.get("T", sizes.get("B"))
    kname = ",".join(ln.kernel.name for ln in launches if ln.kernel is not None and ln.runs_for(T))
    c = Comparison(node.op, kname, node.layer)
    for i, (v, r) in enumerate(zip(node.outputs, ref_outs)):
        state_in = next((si for si, o in OPS[node.op].state_io if o == i), None)
        got = ins[state_in] if state_in is not None else outs[i]
        compare(got, r, c)
    return c
