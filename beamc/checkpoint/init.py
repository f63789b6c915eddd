"""`beamc init-weights`: a random checkpoint of a spec in HF layout.

The output is what `transformers.BeamForCausalLM.save_pretrained` (bf16 experts) or ModelOpt's export (NVFP4
experts) writes: config.json, safetensors with the names of `layout.file_tensors`, sharded with
`model.safetensors.index.json` when large, and hf_quant_config.json for NVFP4 or an FP8 KV cache (whose per-layer
k_scale / v_scale it writes too). Values are random but never trivial (norm weights are not all ones, biases are not
zero) so that tests comparing implementations exercise every tensor.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from beamc.checkpoint import nvfp4
from beamc.checkpoint.layout import TensorInfo, file_tensors, kv_scale_params
from beamc.errors import BeamcError, check_output_dir, ensure_dir
from beamc.spec.hf import spec_to_hf_config
from beamc.spec.load import load_spec, parse_spec
from beamc.spec.schema import ModelSpec

GiB = 1024**3
MAX_BYTES = 64 * GiB
INDEX_NAME = "model.safetensors.index.json"
_EXPERTS = {None: None, "nvfp4": "nvfp4", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
            "float16": "float16", "fp32": "float32", "float32": "float32"}


def written_tensors(spec: ModelSpec) -> list[TensorInfo]:
    """What init-weights writes: `file_tensors`, then the KV scales of an fp8 KV cache (optional in checkpoints)."""
    return file_tensors(spec) + [t for L in range(spec.num_layers) for t in kv_scale_params(spec, L)]


def checkpoint_bytes(spec: ModelSpec) -> int:
    """Size of the tensors of a checkpoint, from shapes alone (nothing is allocated)."""
    return sum(_nbytes(t) for t in written_tensors(spec))


def _nbytes(t: TensorInfo) -> int:
    return math.prod(t.shape) * getattr(torch, t.dtype).itemsize


def with_experts(spec: ModelSpec, experts: str | None) -> ModelSpec:
    """The spec with dtypes.experts overridden ('nvfp4' | 'bf16' | 'fp16' | 'fp32'), re-validated (NVFP4 needs
    d_ff % 16 == 0)."""
    if experts not in _EXPERTS:
        raise BeamcError("--experts", f"must be nvfp4, bf16, fp16 or fp32, got {experts!r}")
    if _EXPERTS[experts] is None or _EXPERTS[experts] == spec.dtypes.experts:
        return spec
    data = spec.model_dump()
    data["dtypes"]["experts"] = _EXPERTS[experts]
    return parse_spec(data, f"{spec.name} with --experts {experts}")


def _random_tensors(spec: ModelSpec, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, value) in written_tensors order, drawn from one generator: the values depend on the seed only, not on
    how the files are sharded."""
    g = torch.Generator().manual_seed(seed)
    std = spec.initializer_range
    pending: dict[str, torch.Tensor] = {}  # the rest of an NVFP4 quartet, produced with its weight

    def normal(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float32)

    for t in written_tensors(spec):
        if t.name in pending:
            yield t.name, pending.pop(t.name)
            continue
        if t.dtype == "uint8":  # NVFP4 expert weight: quantise a bf16 draw like ModelOpt would
            base = t.name[: -len(".weight")]
            w = (normal((t.shape[0], t.shape[1] * 2)) * std).to(torch.bfloat16)
            packed, scale, scale_2 = nvfp4.quantize(w, spec.nvfp4.group_size)
            # input_scale = calibrated activation amax / (6 * 448); amax of a few units is typical
            amax = 2.0 + 6.0 * torch.rand((), generator=g)
            pending[f"{base}.weight_scale"] = scale
            pending[f"{base}.weight_scale_2"] = scale_2
            pending[f"{base}.input_scale"] = (amax / (nvfp4.E2M1_MAX * nvfp4.E4M3_MAX)).float()
            yield t.name, packed
            continue
        dtype = getattr(torch, t.dtype)
        last = t.name.rsplit(".", 1)[-1]
        if last == "gate_bias":
            v = 0.5 * normal(t.shape)  # per-head output gate bias: visible effect on sigmoid(gate)
        elif last == "e_score_correction_bias":
            v = 0.01 * normal(t.shape)  # routing-choice bias, small next to sigmoid scores but changes ties
        elif t.group == "norms":
            v = 1.0 + 0.1 * normal(t.shape)  # RMSNorm weights around one, not exactly one
        elif t.group == "kv_scales":  # ModelOpt's calibrated amax / 448 (e4m3 max), amax of 2..20
            v = (2.0 + 18.0 * torch.rand(t.shape, generator=g)) / nvfp4.E4M3_MAX
        else:
            v = normal(t.shape) * std  # like transformers' _init_weights for Linear / Embedding / experts
        yield t.name, v.to(dtype)


def _plan_shards(spec: ModelSpec, shard_bytes: int) -> list[list[str]]:
    """Names per file, in order, starting a new file when the next tensor would push one past shard_bytes."""
    shards: list[list[str]] = [[]]
    size = 0
    for t in written_tensors(spec):
        n = _nbytes(t)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t.name)
        size += n
    return shards


def init_weights(spec_path_or_spec: str | Path | ModelSpec, out_dir: str | Path, seed: int = 0,
                 experts: str | None = None, force: bool = False, shard_bytes: int = 4 * GiB,
                 overwrite: bool = False) -> Path:
    """Write a random checkpoint of the spec to out_dir; return out_dir. A non-empty out_dir is refused unless
    `overwrite` (then the files of an earlier checkpoint there are replaced)."""
    spec = spec_path_or_spec if isinstance(spec_path_or_spec, ModelSpec) else load_spec(spec_path_or_spec)
    spec = with_experts(spec, experts)
    total = checkpoint_bytes(spec)
    if total > MAX_BYTES and not force:
        raise BeamcError("init-weights", f"the {spec.name} checkpoint would be {total / GiB:.1f} GiB, more than the "
                         f"{MAX_BYTES // GiB} GiB limit", "pass --force to write it anyway")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise BeamcError(str(out), "exists and is not a directory", "choose another -o")
    if out.is_dir() and not overwrite:
        try:
            used = any(out.iterdir())
        except OSError as e:
            raise BeamcError("-o", f"cannot list {out}: {e.strerror or e}", "choose another -o") from None
        if used:
            raise BeamcError("-o", f"{out} is not empty", "pass --overwrite to replace the checkpoint in it, or "
                             "choose another -o")
    check_output_dir(out, "-o")  # a read-only directory or file system fails here, before any tensor is drawn
    ensure_dir(out, "-o")
    # Files of an earlier checkpoint here (another shard count) would be read alongside the new ones.
    for old in [*out.glob("model*.safetensors"), out / INDEX_NAME, out / "hf_quant_config.json"]:
        old.unlink(missing_ok=True)

    cfg = spec_to_hf_config(spec)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    q = cfg.get("quantization_config")
    if q:  # NVFP4 experts and/or an FP8 KV cache
        hf_quant = {"producer": {"name": "modelopt"},
                    "quantization": {k: v for k, v in q.items() if k != "quant_method"}}
        (out / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2) + "\n")

    shards = _plan_shards(spec, shard_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    values = _random_tensors(spec, seed)
    weight_map: dict[str, str] = {}
    for fname, shard in zip(names, shards):
        tensors = {}
        for expected in shard:  # one file in memory at a time
            name, v = next(values)
            assert name == expected, (name, expected)
            tensors[name] = v.contiguous()
            weight_map[name] = fname
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return out
