"""Read one tensor-parallel rank's weights from a HF checkpoint, keyed by graph param name.

Everything is checked before a tensor is read: config.json against the spec (every key import-hf reads), and
every tensor header against `layout.file_tensors(spec)`, so a wrong checkpoint fails with one message listing
everything at fault. Tensors are read with `safe_open(...).get_slice` (mmap): a rank reads only its own slice, and
each slice is checked for NaN/Inf as it is read. Experts are stacked as the graph names them
(`layout.expert_graph_params`): unquantized as transformers holds them, NVFP4 still packed, with their scales.
"""
from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from beamc.checkpoint.layout import (RankSlice, TensorInfo, check_tp, expert_graph_params, file_tensors, graph_params,
                                     kept_as_stored, kv_scale_file_names, kv_scale_params, layer_prefix, rank_shape,
                                     shard_range)
from beamc.errors import BeamcError, read_error
from beamc.ir.dtypes import FLOAT_STORAGE, from_safetensors
from beamc.spec.hf import config_mismatches
from beamc.spec.load import load_spec
from beamc.spec.schema import ModelSpec

INDEX_NAME = "model.safetensors.index.json"
# safetensors header dtype -> torch dtype name (as layout.TensorInfo.dtype spells it)
_MAX_LISTED = 10


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
            open(f, "rb").close()  # safe_open reports every open failure as "No such file or directory"
        except OSError as e:
            raise read_error(f, e, "checkpoint") from None
        try:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    sl = h.get_slice(name)
                    out[name] = (f, tuple(sl.get_shape()), from_safetensors(sl.get_dtype()))
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise BeamcError(str(f), f"cannot read the safetensors header: {e}") from None
    return out


def check_config(spec: ModelSpec, ckpt_dir: str | Path) -> None:
    """Raise when the checkpoint's config.json disagrees with the spec (`spec.hf.config_mismatches`: every key
    import-hf reads, all disagreements in one error), or when import-hf would reject it (its error).

    A missing config.json is not an error: the tensor check still guards every shape and dtype."""
    d = Path(ckpt_dir)
    path = d / "config.json"
    if not path.is_file():
        return
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:
        raise BeamcError(str(path), f"not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise BeamcError(str(path), f"expected a JSON object at the top level, got {type(cfg).__name__}")
    bad = config_mismatches(spec, cfg, str(path))
    if bad:
        raise BeamcError(str(path), f"disagrees with the spec {spec.name!r}:\n"
                         + "\n".join(_listing("keys that differ", bad)), _fix_config(d))


def _listing(title: str, items: list[str]) -> list[str]:
    if not items:
        return []
    more = [f"    ... and {len(items) - _MAX_LISTED} more"] if len(items) > _MAX_LISTED else []
    return [f"  {title} ({len(items)}):"] + [f"    {x}" for x in items[:_MAX_LISTED]] + more


def _kv_scale_names(spec: ModelSpec) -> set[str]:
    """The file names a KV scale may have, any layer: optional in a checkpoint, whatever the KV cache dtype."""
    return {f for L in range(spec.num_layers) for names in kv_scale_file_names(L).values() for f in names}


def check_checkpoint(spec: ModelSpec, ckpt_dir: str | Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """Check config.json and every tensor header against the spec; return describe_checkpoint(ckpt_dir)."""
    check_config(spec, ckpt_dir)
    found = describe_checkpoint(ckpt_dir)
    expected = {t.name: t for t in file_tensors(spec)}
    optional = _kv_scale_names(spec)
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected and n not in optional]
    shapes = [f"{n}: expected {list(t.shape)}, found {list(found[n][1])}"
              for n, t in expected.items() if n in found and tuple(found[n][1]) != t.shape]
    dtypes = [f"{n}: expected {t.dtype}, found {found[n][2]}"
              for n, t in expected.items() if n in found and found[n][2] != t.dtype]
    if spec.dtypes.kv_cache == "fp8":  # a bf16 cache ignores the KV scales, whatever they hold
        kv = sorted(n for n in optional if n in found)
        shapes += [f"{n}: expected a scalar ([] or [1]), found {list(found[n][1])}"
                   for n in kv if tuple(found[n][1]) not in ((), (1,))]
        dtypes += [f"{n}: expected a float dtype, found {found[n][2]}" for n in kv if found[n][2] not in FLOAT_STORAGE]
    lines = (_listing("missing tensors", missing) + _listing("unexpected tensors", unexpected)
             + _listing("wrong shape", shapes) + _listing("wrong dtype", dtypes))
    if lines:
        raise BeamcError(str(ckpt_dir), f"checkpoint does not match the spec {spec.name!r} "
                         f"(experts: {spec.dtypes.experts}):\n" + "\n".join(lines), _fix_config(Path(ckpt_dir)))
    return found


def take_rank_slice(src: Any, sl: RankSlice) -> torch.Tensor:
    """A rank's slice (`layout.shard_range`) of `src`, a safetensors slice (only those bytes are read) or a tensor:
    its pieces concatenated, then the zero padding."""
    lead = (slice(None),) * sl.dim
    parts = [src[lead + (slice(a, b),)] for a, b in sl.pieces]
    if sl.pad:
        shape = list(parts[0].shape)
        shape[sl.dim] = sl.pad
        parts.append(torch.zeros(shape, dtype=parts[0].dtype, device=parts[0].device))
    return parts[0] if len(parts) == 1 else torch.cat(parts, sl.dim)


def _nonfinite(t: torch.Tensor) -> torch.Tensor:
    """Mask of the NaN/Inf entries of a float tensor, computed in its own dtype."""
    if t.dtype == torch.float8_e4m3fn:  # torch has no isfinite for it; e4m3fn has no Inf and NaN is S.1111.111
        return (t.view(torch.uint8) & 0x7F) == 0x7F
    if t.dtype.itemsize == 1:  # other fp8 formats (not in Beam checkpoints): widen
        t = t.float()
    return ~torch.isfinite(t)


def _screen(t: torch.Tensor) -> torch.Tensor:
    """A 0-d flag, True when `t` may hold a NaN/Inf: its sum in its own dtype, which is NaN/Inf whenever an element
    is, at a fraction of the cost of isfinite on CPU. A sum that overflows is a false alarm, cleared by the exact
    `_nonfinite` check run on flagged tensors only."""
    if t.dtype.itemsize == 1:  # fp8 scales have no sum kernel; they are small
        return _nonfinite(t).any()
    return ~torch.isfinite(t.sum())


def _file_index(idx: list[int], sl: RankSlice | None) -> list[int]:
    """An index into a rank's slice -> the same element's index in the file tensor."""
    if sl is None:
        return idx
    i = idx[sl.dim]
    for a, b in sl.pieces:
        if i < b - a:
            return idx[:sl.dim] + [a + i] + idx[sl.dim + 1:]
        i -= b - a
    raise AssertionError("a non-finite value in the zero padding")


class _RankReader:
    """Reads this rank's slices of file tensors, as stored, onto `device`, and checks each for NaN/Inf: a flag per
    tensor (`_screen`) on the device, all read together at the end (one sync, not one per tensor)."""

    def __init__(self, spec: ModelSpec, found: dict, tp: int, rank: int, device, stack: ExitStack):
        self.spec, self.found, self.tp, self.rank, self.device, self.stack = spec, found, tp, rank, device, stack
        self.progress: _Progress | None = None  # set by load_rank_weights
        self.infos = {t.name: t for t in file_tensors(spec)}
        self.handles: dict[Path, Any] = {}
        self.checked: list[tuple[str, TensorInfo]] = []
        self.flags: list[torch.Tensor] = []

    def _slice(self, name: str, info: TensorInfo) -> torch.Tensor:
        f = self.found[name][0]
        if f not in self.handles:
            self.handles[f] = self.stack.enter_context(safe_open(str(f), framework="pt"))
        sl = shard_range(self.spec, info, self.tp, self.rank)
        t = self.handles[f].get_tensor(name) if sl is None else take_rank_slice(self.handles[f].get_slice(name), sl)
        return t.to(self.device)

    def read(self, name: str, info: TensorInfo | None = None) -> torch.Tensor:
        """This rank's slice of file tensor `name` (shard rule: `info`, default the layout's)."""
        info = info or self.infos[name]
        t = self._slice(name, info)
        if self.progress is not None:
            self.progress.advance(t.numel() * t.element_size())
        if t.is_floating_point():
            self.checked.append((name, info))
            self.flags.append(_screen(t))
        return t

    def nonfinite(self) -> list[str]:
        """`name[i, j] is nan (file)` for each tensor read that holds a NaN/Inf, at its first one (in file
        coordinates); the slice is read again to find it, only on failure."""
        flagged = torch.stack(self.flags).tolist() if self.flags else []
        out = []
        for (name, info), flag in zip(self.checked, flagged):
            if not flag:
                continue
            t = self._slice(name, info)
            mask = _nonfinite(t)
            if not mask.any():  # the sum overflowed: a false alarm
                continue
            idx = mask.nonzero()[0].tolist()
            v = t[tuple(idx)].float().item()
            idx = _file_index(idx, shard_range(self.spec, info, self.tp, self.rank))
            at = f"[{', '.join(map(str, idx))}]" if idx else ""
            what = "nan" if v != v else ("inf" if v > 0 else "-inf")
            out.append(f"{name}{at} is {what} ({self.found[name][0].name})")
        return out


def _target_dtype(spec: ModelSpec, info: TensorInfo, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype a graph param is loaded in (None: as stored). `dtype` converts the float weights; what
    `layout.kept_as_stored` names stays as stored."""
    return None if kept_as_stored(spec, info) else dtype


def load_rank_weights(spec: ModelSpec | str | Path, ckpt_dir: str | Path, tp: int = 1, rank: int = 0,
                      dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                      progress: bool | None = None) -> dict[str, torch.Tensor]:
    """Graph param name (`layout.graph_params`) -> this rank's tensor (shape `layout.rank_shape`), as stored, or
    converted to `dtype` (bf16, fp16 or fp32) where `_target_dtype` says so.

    progress: a `rich` progress bar of the rank's bytes read (on stderr); None: when stderr is a terminal.

    Raises one BeamcError for a checkpoint that does not fit the spec, and one listing every tensor holding a NaN
    or Inf (with its first bad element) and every KV scale <= 0."""
    spec = spec if isinstance(spec, ModelSpec) else load_spec(spec)
    if dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
        raise BeamcError("dtype", f"must be None, torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    check_tp(spec, tp, rank)
    found = check_checkpoint(spec, ckpt_dir)
    out: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        reader = _RankReader(spec, found, tp, rank, device, stack)
        reader.progress = stack.enter_context(_Progress(spec, tp, rank, progress))
        for t in file_tensors(spec, experts=False):
            out[t.name] = _convert(reader.read(t.name), _target_dtype(spec, t, dtype))
        for L, mlp in enumerate(spec.mlp_types):
            if mlp == "sparse":
                out.update(_stacked_experts(spec, L, reader, dtype))
            out.update(_kv_scales(spec, L, reader))
        bad = reader.nonfinite()
    bad += [f"{t.name} is {out[t.name].item()!r}; a KV cache scale must be > 0"
            for L in range(spec.num_layers) for t in kv_scale_params(spec, L) if out[t.name].item() <= 0]
    if bad:
        raise BeamcError(str(ckpt_dir), "the checkpoint holds values that cannot be right:\n"
                         + "\n".join(_listing("bad values", bad)),
                         "a NaN or Inf weight poisons every logit: repair or re-export the checkpoint")
    for t in graph_params(spec):  # the loader and the layout's shard rules (what lowering declares) agree
        assert tuple(out[t.name].shape) == rank_shape(spec, t, tp, rank), (t.name, tuple(out[t.name].shape))
    return out


class _Progress:
    """A `rich` bar of the bytes of this rank's share read so far (the total from the layout's rank shapes)."""

    def __init__(self, spec: ModelSpec, tp: int, rank: int, show: bool | None):
        import sys

        self.show = sys.stderr.isatty() if show is None else show
        self.total = sum(math.prod(rank_shape(spec, t, tp, rank)) * torch.empty(0, dtype=getattr(torch, t.dtype))
                         .element_size() for t in graph_params(spec)) if self.show else 0
        self.bar = None

    def __enter__(self) -> "_Progress":
        if self.show:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("loading weights"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                                console=Console(stderr=True), transient=True)
            self.bar.__enter__()
            self.task = self.bar.add_task("load", total=self.total)
        return self

    def advance(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=nbytes)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def _convert(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None else t.to(dtype)


def _stacked_experts(spec: ModelSpec, L: int, reader: _RankReader,
                     dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The expert params of MoE layer L (`expert_graph_params`), stacked from this rank's slices of the per-expert
    file tensors. Each file tensor is sliced by its own rule (gate/up rows, down columns), which is what makes a
    rank's gate_up its gate rows then its up rows ("split_halves")."""
    base = f"{layer_prefix(L)}.mlp.experts"
    E = spec.mlp.moe.num_experts

    def stack(proj: str, part: str) -> torch.Tensor:
        return torch.stack([reader.read(f"{base}.{e}.{proj}.{part}") for e in range(E)])

    def gate_up(part: str) -> torch.Tensor:
        return torch.cat([stack("gate_proj", part), stack("up_proj", part)], dim=1)

    if spec.dtypes.experts == "nvfp4":
        values = [gate_up("weight"), gate_up("weight_scale"),
                  torch.stack([stack("gate_proj", "weight_scale_2"), stack("up_proj", "weight_scale_2")], dim=1),
                  stack("down_proj", "weight"), stack("down_proj", "weight_scale"),
                  stack("down_proj", "weight_scale_2")[:, None]]
    else:
        values = [gate_up("weight"), stack("down_proj", "weight")]
    infos = expert_graph_params(spec, L)
    return {t.name: _convert(v, _target_dtype(spec, t, dtype)) for t, v in zip(infos, values, strict=True)}


def _kv_scales(spec: ModelSpec, L: int, reader: _RankReader) -> dict[str, torch.Tensor]:
    """The fp8 KV cache's k_scale / v_scale of layer L as fp32 scalars: the checkpoint's, under either of its
    names, else 1.0. Nothing for a bf16 cache."""
    out = {}
    names = kv_scale_file_names(L)
    for t in kv_scale_params(spec, L):
        name = next((n for n in names[t.name] if n in reader.found), None)
        out[t.name] = (reader.read(name, t).reshape(()).float() if name is not None
                       else torch.ones((), dtype=torch.float32, device=reader.device))
    return out
