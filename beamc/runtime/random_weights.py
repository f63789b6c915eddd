"""Random weights for one tensor-parallel rank, made directly on the device: full-size benchmarks without the
250 GB of checkpoint files.

    w = random_rank_weights(spec, graphs, tp=8, rank=0, device="cuda", seed=0)
    model = Model.load(pkg, None, spec=spec, tp=8, rank=0, weights=w, ...)

The dict holds exactly the params the rank's graphs read (`Graph.leaves("param")`), at their shapes and dtypes:
what `checkpoint.loader.load_rank_weights` + `interpret.with_packed_weights` give for a real checkpoint, except that
a packed param (`pack` attribute, e.g. the QKV+gate GEMM's weight) is drawn as one tensor instead of being
concatenated from its parts (its parts are not in the dict: no step reads them, and the concatenation would
double the attention weights' peak memory). Values:
- bf16 (or the package's fp32) matrices ~ N(0, 1/fan_in), fan_in the full (unsharded) input width; embeddings
  ~ N(0, 1); norm weights 1 + N(0, 0.05^2); the per-head output-gate bias 0.5 N(0, 1); the fp32 router
  ~ N(0, 1/H) and its correction bias 0.01 N(0, 1); the rows of the padded vocab-parallel lm_head past the
  vocabulary are zeros, as the loader pads them;
- NVFP4 experts: uniformly random E2M1 codes (random bytes), e4m3 block scales uniform in [112, 448] (ModelOpt's
  block scales sit near the top of e4m3's range), and fp32 global scales chosen so that the dequantised weights
  have standard deviation ~ 1/sqrt(fan_in);
- the fp8 KV cache's k_scale / v_scale: 1.0 (what the loader gives a checkpoint without them).
Every tensor is generated in place in its final dtype (chunks of at most `CHUNK` elements where a wider
temporary is needed), so the peak is the final size plus one chunk, and the work is a few torch ops per tensor.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from beamc.checkpoint.layout import TensorInfo, graph_params, shard_range
from beamc.errors import BeamcError
from beamc.ir.dtypes import torch_dtype
from beamc.ir.graph import Graph

CHUNK = 1 << 26  # elements of one temporary (fp32: 256 MiB)
E2M1_RMS = math.sqrt(sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)  # of a uniform random code
SCALE_LO, SCALE_HI = 112.0, 448.0  # e4m3 block scales: uniform in this range
SCALE_RMS = math.sqrt((SCALE_HI ** 3 - SCALE_LO ** 3) / (3 * (SCALE_HI - SCALE_LO)))


def rank_params(graphs: Iterable[Graph]) -> dict[str, object]:
    """Param name -> its `param` node, over the rank's graphs (decode and prefill name the same params)."""
    out: dict[str, object] = {}
    for g in graphs:
        for name, node in g.leaves("param").items():
            out.setdefault(name, node)
    return out


def random_rank_weights(spec, graphs, *, tp: int = 1, rank: int = 0, device: str | torch.device = "cpu",
                        seed: int = 0) -> dict[str, torch.Tensor]:
    """Graph param name -> a random tensor on `device` for TP rank `rank` of `tp` (see the module docstring).

    graphs: the rank's step graphs (`package.steps[p].graph`, or a dict / list of graphs)."""
    graphs = list(graphs.values()) if isinstance(graphs, dict) else list(graphs)
    graphs = [getattr(g, "graph", g) for g in graphs]  # codegen Steps too
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    infos = {t.name: t for t in graph_params(spec)}
    out: dict[str, torch.Tensor] = {}
    for name, node in rank_params(graphs).items():
        shape = tuple(node.out.shape)
        if not all(isinstance(d, int) for d in shape):
            raise BeamcError(f"param {name}", f"symbolic shape {shape}: a param's shape must be fixed")
        dtype = torch_dtype(node.out.dtype)
        if "pack" in node.attrs:
            parts = [infos.get(p) for p in node.attrs["pack"]]
            if any(p is None for p in parts):
                raise BeamcError(f"param {name}", f"packs params the layout does not know: {node.attrs['pack']}")
            fan_ins = {p.shape[-1] if node.attrs["dim"] == 0 else None for p in parts}
            if len(fan_ins) != 1 or None in fan_ins:  # today: QKV+gate rows, all of input width H
                raise BeamcError(f"param {name}", "a pack along another dim than the rows is not supported here")
            t = _normal(shape, dtype, device, gen, 1 / math.sqrt(fan_ins.pop()))
        elif name in infos:
            t = _draw(spec, infos[name], shape, dtype, device, gen, tp, rank)
        else:
            raise BeamcError(f"param {name}", "not a param of the checkpoint layout (`layout.graph_params`): no "
                             "rule to draw it", "teach beamc/runtime/random_weights.py about it")
        out[name] = t
    _nvfp4_global_scales(spec, out, device, gen)
    return out


def _normal(shape, dtype, device, gen, std: float, mean: float = 0.0) -> torch.Tensor:
    """N(mean, std^2) drawn in place in `dtype` (bf16 / fp32: no temporary)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.normal_(mean, std, generator=gen)
    return t


def _chunked(t: torch.Tensor, fill) -> torch.Tensor:
    """Fill `t` (contiguous) by chunks of its flat view: fill(n) returns n values of t's dtype (or castable)."""
    flat = t.view(-1)
    for a in range(0, flat.numel(), CHUNK):
        b = min(a + CHUNK, flat.numel())
        flat[a:b].copy_(fill(b - a))
    return t


def _draw(spec, info: TensorInfo, shape, dtype, device, gen, tp: int, rank: int) -> torch.Tensor:
    last = info.name.rsplit(".", 1)[-1]
    if dtype == torch.uint8:  # NVFP4 codes: two random E2M1 codes a byte
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)
    if dtype == torch.float8_e4m3fn:  # NVFP4 block scales
        t = torch.empty(shape, dtype=dtype, device=device)
        return _chunked(t, lambda n: torch.empty(n, dtype=torch.float32, device=device)
                        .uniform_(SCALE_LO, SCALE_HI, generator=gen))
    if info.group == "kv_scales":
        return torch.ones(shape, dtype=dtype, device=device)
    if last == "weight_scale_2":  # set by _nvfp4_global_scales, once the fan-in is known
        return torch.ones(shape, dtype=dtype, device=device)
    if info.group == "norms":
        return _normal(shape, dtype, device, gen, 0.05, 1.0)
    if last == "gate_bias":
        return _normal(shape, dtype, device, gen, 0.5)
    if last == "e_score_correction_bias":
        return _normal(shape, dtype, device, gen, 0.01)
    if info.group == "embeddings":
        return _normal(shape, dtype, device, gen, 1.0)
    fan_in = info.shape[-1]  # the full input width (a rank holding columns reads a share of it)
    t = _normal(shape, dtype, device, gen, 1 / math.sqrt(fan_in))
    sl = shard_range(spec, info, tp, rank)
    if sl is not None and sl.pad:  # the padded lm_head rows past the vocabulary: zeros, as the loader gives
        t.narrow(sl.dim, t.shape[sl.dim] - sl.pad, sl.pad).zero_()
    return t


def _nvfp4_global_scales(spec, out: dict[str, torch.Tensor], device, gen) -> None:
    """weight_scale_2 of each NVFP4 matrix: std(code) * rms(block scale) * scale_2 = 1 / sqrt(fan_in), with a
    +-10% spread per expert and part (each is one quantised file tensor)."""
    if spec.dtypes.experts != "nvfp4":
        return
    H, I = spec.hidden_size, spec.mlp.moe.d_ff
    for name, t in out.items():
        if not name.endswith(".weight_scale_2"):
            continue
        fan_in = H if ".gate_up_proj." in name else I
        base = 1 / (math.sqrt(fan_in) * E2M1_RMS * SCALE_RMS)
        t.uniform_(0.9 * base, 1.1 * base, generator=gen)


def weights_nbytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())
