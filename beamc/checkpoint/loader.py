"""Read one tensor-parallel rank's weights from a HF checkpoint, keyed by graph param name.

The whole checkpoint is checked against `layout.file_tensors(spec)` from the safetensors headers before any
tensor is read, so a wrong checkpoint fails with one message listing everything at fault. Tensors are read with
`safe_open(...).get_slice` (mmap): a rank reads only its own slice. Experts are stacked as the graph (and
transformers) holds them; NVFP4 experts are sliced while packed, then dequantised.
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from beamc.checkpoint import nvfp4
from beamc.checkpoint.layout import TensorInfo, check_tp, expert_graph_params, file_tensors, shard_range
from beamc.errors import BeamcError
from beamc.spec.hf import spec_to_hf_config
from beamc.spec.load import load_spec
from beamc.spec.schema import ModelSpec

INDEX_NAME = "model.safetensors.index.json"
# config.json keys that define the architecture (tensor shapes, layer kinds); the rest may legitimately differ.
ARCH_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts", "tie_word_embeddings",
             "layer_types", "mlp_layer_types")
# safetensors header dtype -> torch dtype name (as layout.TensorInfo.dtype spells it)
_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "U8": "uint8",
              "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_MAX_LISTED = 10
_DEQUANT_VALUES = 1 << 26  # values dequantised per call: few calls for small models, bounded memory for Beam


def _fix_config(d: Path) -> str:
    return f"write a spec for this checkpoint with `beamc import-hf {d / 'config.json'}`"


def checkpoint_files(ckpt_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: those of the index, else model.safetensors, else all *.safetensors."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        raise BeamcError(str(d), "checkpoint directory not found",
                         "pass a directory written by `beamc init-weights` or a HF checkpoint")
    index = d / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise BeamcError(str(index), f"not a safetensors index (needs a 'weight_map'): {e}") from None
        files = [d / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise BeamcError(str(index), f"points at missing file(s): {', '.join(missing)}",
                             "copy the missing shards or rewrite the checkpoint")
        return files
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise BeamcError(str(d), "no safetensors files (model.safetensors or model.safetensors.index.json)")
    return files


def describe_checkpoint(ckpt_dir: str | Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """name -> (file, shape, dtype name) for every tensor of the checkpoint, from the headers only."""
    out: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for f in checkpoint_files(ckpt_dir):
        try:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    sl = h.get_slice(name)
                    out[name] = (f, tuple(sl.get_shape()), _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype()))
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise BeamcError(str(f), f"cannot read the safetensors header: {e}") from None
    return out


def check_config(spec: ModelSpec, ckpt_dir: str | Path) -> None:
    """Raise when the checkpoint's config.json disagrees with the spec on an architectural key.

    A missing config.json, or a missing key in it, is not an error: the tensor check still guards every shape."""
    d = Path(ckpt_dir)
    path = d / "config.json"
    if not path.is_file():
        return
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:
        raise BeamcError(str(path), f"not valid JSON: {e}") from None
    want = spec_to_hf_config(spec)
    bad = [f"{k}: spec has {want[k]!r}, config.json has {cfg[k]!r}"
           for k in ARCH_KEYS if k in cfg and cfg[k] != want[k]]
    # No quantization_config means bf16 experts, as transformers reads it.
    algo = (cfg.get("quantization_config") or {}).get("quant_algo")
    if (algo == "NVFP4") != (spec.dtypes.experts == "nvfp4"):
        bad.append(f"experts: spec has dtypes.experts = {spec.dtypes.experts}, config.json has "
                   f"quantization_config.quant_algo = {algo!r}")
    if bad:
        raise BeamcError(str(path), f"disagrees with the spec {spec.name!r}:\n  " + "\n  ".join(bad),
                         _fix_config(d))


def _listing(title: str, items: list[str]) -> list[str]:
    if not items:
        return []
    more = [f"    ... and {len(items) - _MAX_LISTED} more"] if len(items) > _MAX_LISTED else []
    return [f"  {title} ({len(items)}):"] + [f"    {x}" for x in items[:_MAX_LISTED]] + more


def check_checkpoint(spec: ModelSpec, ckpt_dir: str | Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """Check config.json and every tensor header against the spec; return describe_checkpoint(ckpt_dir)."""
    check_config(spec, ckpt_dir)
    found = describe_checkpoint(ckpt_dir)
    expected = {t.name: t for t in file_tensors(spec)}
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected]
    shapes = [f"{n}: expected {list(t.shape)}, found {list(found[n][1])}"
              for n, t in expected.items() if n in found and tuple(found[n][1]) != t.shape]
    dtypes = [f"{n}: expected {t.dtype}, found {found[n][2]}"
              for n, t in expected.items() if n in found and found[n][2] != t.dtype]
    lines = (_listing("missing tensors", missing) + _listing("unexpected tensors", unexpected)
             + _listing("wrong shape", shapes) + _listing("wrong dtype", dtypes))
    if lines:
        raise BeamcError(str(ckpt_dir), f"checkpoint does not match the spec {spec.name!r} "
                         f"(experts: {spec.dtypes.experts}):\n" + "\n".join(lines), _fix_config(Path(ckpt_dir)))
    return found


def _target_dtype(info: TensorInfo, dtype: torch.dtype | None) -> torch.dtype | None:
    """None keeps the file dtype; fp32 everywhere; or bf16 except the router, which Beam always runs in fp32."""
    if dtype is None or dtype == torch.float32:
        return dtype
    return torch.float32 if info.group == "router" else dtype


def load_rank_weights(spec: ModelSpec | str | Path, ckpt_dir: str | Path, tp: int = 1, rank: int = 0,
                      dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Graph param name -> this rank's tensor. NVFP4 experts come dequantised (to fp32 when dtype is None)."""
    spec = spec if isinstance(spec, ModelSpec) else load_spec(spec)
    if dtype not in (None, torch.float32, torch.bfloat16):
        raise BeamcError("dtype", f"must be None, torch.float32 or torch.bfloat16, got {dtype}")
    check_tp(spec, tp, rank)
    found = check_checkpoint(spec, ckpt_dir)
    infos = {t.name: t for t in file_tensors(spec)}
    out: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def read(name: str) -> torch.Tensor:
            """This rank's slice of a file tensor, as stored."""
            f = found[name][0]
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(str(f), framework="pt"))
            r = shard_range(spec, infos[name], tp, rank)
            if r is None:
                return handles[f].get_tensor(name)
            dim, start, stop = r
            return handles[f].get_slice(name)[(slice(None),) * dim + (slice(start, stop),)]

        for t in infos.values():
            if t.group != "experts":
                target = _target_dtype(t, dtype)
                out[t.name] = read(t.name).to(device=device, dtype=target)
        for L, mlp in enumerate(spec.mlp_types):
            if mlp == "sparse":
                out.update(_stacked_experts(spec, L, read, dtype, device))
    return out


def _stacked_experts(spec: ModelSpec, L: int, read, dtype: torch.dtype | None,
                     device: str | torch.device) -> dict[str, torch.Tensor]:
    """gate_up [E, 2*I/tp, H] (this rank's gate rows, then its up rows) and down [E, H, I/tp] of one MoE layer."""
    nvfp4_experts = spec.dtypes.experts == "nvfp4"
    target = dtype or (torch.float32 if nvfp4_experts else torch.bfloat16)

    E = spec.mlp.moe.num_experts

    def proj(name: str) -> torch.Tensor:
        """[E, rows, cols] of one projection; NVFP4 dequantised in one call for all experts (fewer small ops)."""
        base = [f"model.layers.{L}.mlp.experts.{e}.{name}" for e in range(E)]
        weight = torch.stack([read(f"{b}.weight") for b in base]).to(device)
        if not nvfp4_experts:
            return weight.to(target)
        scale = torch.stack([read(f"{b}.weight_scale") for b in base]).to(device)
        scale_2 = torch.stack([read(f"{b}.weight_scale_2") for b in base]).to(device)[:, None, None]
        step = max(1, _DEQUANT_VALUES // (weight.shape[1] * weight.shape[2] * 2))  # bounds fp32 temporaries
        return torch.cat([nvfp4.dequantize(weight[i:i + step], scale[i:i + step], scale_2[i:i + step], target)
                          for i in range(0, E, step)])

    gate_up = torch.cat([proj("gate_proj"), proj("up_proj")], dim=1)
    down = proj("down_proj")
    gu_info, down_info = expert_graph_params(spec, L)
    return {gu_info.name: gate_up, down_info.name: down}
