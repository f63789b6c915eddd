"""The compiled runtime: a generated package (`beamc compile -o DIR`) and a checkpoint turned into a running model.

    model = Model.load("pkg/", "ckpt/", device="cuda", max_batch=8, max_context=4096)
    logits = model.prefill([7, 9], [[1, 2, 3], [4, 5]])        # [2, V] fp32: the last token of each sequence
    logits = model.decode([7, 9], [11, 12])                    # [2, V]: one token per sequence
    model.release(7)

What `load` does, once: imports the package's `step.py` (by path), checks its manifest against what is asked (spec
hash, target, tp/rank, activation and KV dtypes), loads this rank's weights (`checkpoint.loader`) with the graph's
load-time transforms (QKV+gate packing; on sm90, unless compiled with `--no-nvfp4-relayout`, the NVFP4 experts re-laid out for the MoE
kernels, the manifest's `load_transforms`), and allocates every buffer a step touches: the KV caches (pages for full layers, rings for
sliding ones: `kv_cache.SlotTable`), the step inputs, and every IR value and `scratch:` buffer of each step at its
largest bucket. Buckets: decode runs at batch 1, 2, 4, ..., max_batch, prefill at token counts 16,
32, ..., max_prefill_tokens (a step is padded to the next bucket). Smaller buckets are views of the same storage and
values whose lifetimes do not overlap share storage, so each bucket's buffers are fixed addresses: a step can be
captured in a CUDA graph (`runtime.graphs`; `eager=True` runs without).

Padding: padded rows belong to a reserved slot (index max_batch) whose ring rows and pages (the last MP pages of
the pool) no sequence ever uses, so they never write or read a real sequence's cache.

Every check of a step (unknown sequence, too many sequences, token ids, context overrun, block tables: pages
outside the pool, too few pages) runs before anything is launched: a refused step leaves every cache as it was.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Hashable, Sequence, get_args

import numpy as np
import torch

from beamc.errors import BeamcError
from beamc.ir.dtypes import ir_dtype, torch_dtype
from beamc.ir.graph import Graph
from beamc.ir.ops import OPS
from beamc.runtime import library
from beamc.runtime.kv_cache import SlotTable, alloc_states
from beamc.spec.schema import DtypeSpec

ALIGN = 256  # bytes: every buffer starts on this boundary of the arena
SMALL_CHECK_TOKENS = 512  # steps of at most this many tokens check their cache writes on int lists (cheaper than torch)
STAGED_INPUTS = ("input_ids", "positions", "slots", "logit_rows")  # the int64 inputs a step writes from the host
ONE_COPY_BYTES = 64 << 10  # a phase whose staged inputs take at most this crosses in one copy a step (decode)
LONG_CHUNK = 256  # a prefill chunk of more tokens is checked and planned as an int64 tensor (cheaper than int lists)


def buckets(limit: int, first: int = 1) -> list[int]:
    """first, 2 * first, ... below `limit`, then `limit`: the padded sizes a step runs at."""
    out, b = [], first
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


def bucket_for(n: int, sizes: list[int]) -> int:
    return next(b for b in sizes if b >= n)


# ---------------------------------------------------------------- the package on disk
def read_manifest(package_dir: str | Path) -> dict[str, Any]:
    d = Path(package_dir)
    for name in ("manifest.json", "step.py", "__init__.py"):
        if not (d / name).is_file():
            raise BeamcError(str(d), f"not a beamc package: {name} is missing",
                             "write one with `beamc compile SPEC -o DIR`")
    try:
        return json.loads((d / "manifest.json").read_text())
    except ValueError as e:
        raise BeamcError(str(d / "manifest.json"), f"not valid JSON: {e}") from None


def package_dtype(manifest: dict[str, Any]) -> str:
    """The activation dtype the package's kernels were generated for (f32 for CPU logic checks, else bf16)."""
    found = {k["constants"]["DTYPE"] for k in manifest.get("kernels", {}).values() if "DTYPE" in k.get("constants", {})}
    if len(found) > 1:
        raise BeamcError("manifest.json", f"kernels of several activation dtypes {sorted(found)}")
    return found.pop() if found else ir_dtype(manifest["dtypes"]["activations"])


def spec_sha256(spec) -> str:
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()


def resolve_spec(manifest: dict[str, Any], package_dir: Path, checkpoint, spec=None):
    """The package's spec: the one given (a ModelSpec or a YAML path), else the package's spec.json, else the
    checkpoint's config.json under the manifest's name; its hash must equal the manifest's."""
    from beamc.spec import load_spec

    want = manifest["spec"]["sha256"]
    if spec is not None:
        spec = spec if not isinstance(spec, (str, Path)) else load_spec(spec)
        got = spec_sha256(spec)
        if got != want:
            raise BeamcError("spec", f"{spec.name!r} (sha256 {got[:12]}) is not the spec the package was compiled "
                             f"from ({manifest['spec']['name']!r}, sha256 {want[:12]})",
                             "compile the package from this spec, or load it with the spec it was compiled from")
        return spec
    candidates = []
    if (package_dir / "spec.json").is_file():
        from beamc.spec.schema import ModelSpec

        candidates.append(ModelSpec.model_validate_json((package_dir / "spec.json").read_text()))
    if checkpoint is not None and (Path(checkpoint) / "config.json").is_file():
        from beamc.spec.hf import hf_config_to_spec

        try:
            cfg = json.loads((Path(checkpoint) / "config.json").read_text())
            candidates.append(hf_config_to_spec(cfg, manifest["spec"]["name"]))
        except (ValueError, BeamcError):
            pass
    for c in candidates:
        if spec_sha256(c) == want:
            return c
    raise BeamcError(str(package_dir), f"cannot tell which spec the package {manifest['spec']['name']!r} was "
                     "compiled from (no spec.json in it, and the checkpoint's config.json gives another spec)",
                     "pass spec= (a ModelSpec or the YAML path) to Model.load")


def import_step(package_dir: Path) -> ModuleType:
    """The package's step.py, imported as `<unique name>.step` so that it finds its kernels/ beside it."""
    d = package_dir.resolve()
    name = "beamc_pkg_" + hashlib.sha1(str(d).encode()).hexdigest()[:12]
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]  # a package rewritten in place: import it afresh
    spec = importlib.util.spec_from_file_location(name, d / "__init__.py", submodule_search_locations=[str(d)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return importlib.import_module(f"{name}.step")


# ---------------------------------------------------------------- buffers
@dataclass
class _Buf:
    """One root buffer of a step (an IR value or a scratch buffer): its symbolic shape and where it lives."""
    shape: tuple
    dtype: str
    block: int = -1


def _bind(shape, sizes: dict[str, int]) -> list[int]:
    return [sizes[d] if isinstance(d, str) else d for d in shape]


def _nbytes(shape, dtype: str, sizes: dict[str, int]) -> int:
    n = 1
    for d in _bind(shape, sizes):
        n *= d
    return n * torch.empty((), dtype=torch_dtype(dtype)).element_size()


class StepBuffers:
    """The buffers of one phase's step: which name is a leaf (input, param, state), a view of another buffer, or a
    root buffer of its own, and the lifetime of each root buffer in launch order (for storage sharing)."""

    def __init__(self, g: Graph, launches: list):
        self.graph = g
        self.leaf: dict[str, tuple[str, str]] = {}  # value name -> (leaf op, leaf name)
        self.alias: dict[str, tuple[str, tuple]] = {}  # value name -> (base value name, its shape)
        self.roots: dict[str, _Buf] = {}
        for n in g.nodes:
            if OPS[n.op].leaf:
                self.leaf[n.out.name] = (n.op, n.attrs["name"])
                continue
            if OPS[n.op].is_view:
                self.alias[n.out.name] = (n.inputs[0].name, n.out.shape)
                continue
            state_out = {o: i for i, o in OPS[n.op].state_io}
            for j, v in enumerate(n.outputs):
                if j in state_out:
                    self.alias[v.name] = (n.inputs[state_out[j]].name, None)  # written in place
                else:
                    self.roots[v.name] = _Buf(v.shape, v.dtype)
        for _, ln in launches:
            for name, shape, dtype in ln.scratch:
                b = self.roots.setdefault(name, _Buf(tuple(shape), dtype))
                if (b.shape, b.dtype) != (tuple(shape), dtype):  # one buffer per role: one shape per role
                    raise BeamcError(g.name, f"{name} is declared as {b.shape} {b.dtype} and as {tuple(shape)} "
                                     f"{dtype}", "give scratch buffers of different shapes different names "
                                     "(beamc/codegen/emitters.py)")
        self.used = [a for _, ln in launches for a in ln.args]
        missing = sorted({a for a in self.used if a not in self.roots and a not in self.alias and a not in self.leaf})
        if missing:
            raise BeamcError(g.name, f"launches name buffers the graph does not declare: {missing[:5]}")
        # lifetimes: first and last launch that names a root buffer (directly or through a view)
        self.first: dict[str, int] = {}
        self.last: dict[str, int] = {}
        for i, (_, ln) in enumerate(launches):
            for a in ln.args:
                r = self.root(a)
                if r in self.roots:
                    self.first.setdefault(r, i)
                    self.last[r] = i
        for v in g.outputs.values():  # read after the step
            r = self.root(v.name)
            if r in self.roots:
                self.first.setdefault(r, len(launches))
                self.last[r] = len(launches)
        self.n_launches = len(launches)

    def root(self, name: str) -> str:
        while name in self.alias:
            name = self.alias[name][0]
        return name

    def plan(self, sizes: dict[str, int], share: bool) -> list[int]:
        """Assign each root buffer to a storage block (sized at `sizes`, the largest bucket); returns block sizes.
        With `share`, a buffer takes a block freed by a buffer whose last use came before its first."""
        blocks: list[int] = []
        free: list[int] = []
        starts: dict[int, list[str]] = {}
        ends: dict[int, list[str]] = {}
        for r in self.first:
            starts.setdefault(self.first[r], []).append(r)
            ends.setdefault(self.last[r], []).append(r)
        for r in self.roots:  # declared but never named by a launch (none today): a block of its own
            if r not in self.first:
                self.roots[r].block = len(blocks)
                blocks.append(_aligned(_nbytes(self.roots[r].shape, self.roots[r].dtype, sizes)))
        for i in range(self.n_launches + 1):
            for r in starts.get(i, []):
                need = _aligned(_nbytes(self.roots[r].shape, self.roots[r].dtype, sizes))
                fit = [b for b in free if blocks[b] >= need]
                if share and fit:
                    b = min(fit, key=lambda b: blocks[b])
                elif share and free:
                    b = max(free, key=lambda b: blocks[b])
                    blocks[b] = need
                else:
                    b = len(blocks)
                    blocks.append(need)
                if b in free:
                    free.remove(b)
                self.roots[r].block = b
            for r in ends.get(i, []):
                free.append(self.roots[r].block)
        return blocks


def _aligned(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


# ---------------------------------------------------------------- the model
@dataclass
class _Seq:
    slot: int
    block_table: torch.Tensor | None = None  # caller-supplied pages (int32), None: the slot's own


@dataclass
class _Staging:
    """A phase's host-side copy of its int64 step inputs (input_ids, positions, slots, logit_rows): pinned on a GPU,
    so that a step's inputs cross in asynchronous copies with no stream synchronisation; `done` is recorded after
    those copies, and the host waits for it before it writes the buffers again (a caller may run steps ahead)."""
    flat: torch.Tensor  # the host buffer (int64; pinned on a GPU), laid out as device_flat
    device_flat: torch.Tensor  # the device buffer whose views are the phase's staged inputs
    device_views: dict[str, torch.Tensor]  # input name -> its view of `device_flat` (the step's input buffer)
    tensors: dict[str, torch.Tensor]  # input name -> its view of `flat`
    arrays: dict[str, np.ndarray]  # numpy views of the same memory (a slice assignment from a list runs in C)
    done: torch.cuda.Event | None


SKIP_COLLECTIVES_ENV = "BEAMC_SKIP_COLLECTIVES"  # benchmarks of one rank's share on one GPU (bench/full_model.py)


def _prefill_gate(manifest: dict[str, Any]) -> bool:
    """The package's prefill_attention_gate: {"fused": bool, ...} since 2026-12-01's twelfth session; a package from
    before it (no key) fused the gate in prefill too."""
    rec = manifest.get("prefill_attention_gate", {"fused": True})
    if not (isinstance(rec, dict) and isinstance(rec.get("fused"), bool)):
        raise BeamcError("manifest.json: prefill_attention_gate", f"{rec!r} is not a record with a boolean 'fused'",
                         "recompile the package")
    return rec["fused"]


def _prefetch_budget(manifest: dict[str, Any]) -> int:
    """The package's l2_prefetch_mb (an int >= 0; a package from before the thirteenth session has none: 0, off)."""
    mb = manifest.get("l2_prefetch_mb", 0)
    if not (isinstance(mb, int) and not isinstance(mb, bool) and mb >= 0):
        raise BeamcError("manifest.json: l2_prefetch_mb", f"{mb!r} is not a budget in MB (an int >= 0)",
                         "recompile the package")
    return mb


NATIVE_FP4_MIN_TRITON = (3, 8)  # tl.dot_scaled on NVFP4 weights for sm_100a: Triton 3.6's matmul lowering fails on
# it (TritonGPUAccelerateMatmul, checked on the CPU with 3.6.0: every moe_nvfp4_prefill NATIVE_FP4 render, the full
# spec's included), 3.8.0 compiles it


def triton_refusal(kernels: dict, version: str) -> tuple[str, str, str] | None:
    """(kernel, message, fix) when a package's kernels need a newer Triton than `version`, else None: the sm100
    NVFP4 prefill MoE (NATIVE_FP4) from NATIVE_FP4_MIN_TRITON on."""
    try:
        have = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        return None  # (a development build: let it try)
    native = sorted(n for n, k in kernels.items() if k.constants.get("NATIVE_FP4"))
    if native and have < NATIVE_FP4_MIN_TRITON:
        want = ".".join(map(str, NATIVE_FP4_MIN_TRITON))
        return (native[0], f"the sm100 NVFP4 prefill MoE (tl.dot_scaled on the packed weights) does not compile with "
                f"Triton {version}: its matmul lowering fails before {want}", f"install triton>={want}")
    return None


def collectives_skipped() -> bool:
    import os

    return os.environ.get(SKIP_COLLECTIVES_ENV, "") == "1"


def check_process_group(tp: int, rank: int, allow_single: bool = False) -> None:
    """tp > 1: the step's all-reduces and all-gathers go through torch.distributed, one process per rank, so the
    process group must exist and say the same world size and rank (without it an all-reduce would copy its input:
    silently wrong logits). `allow_single`: a benchmark of one rank's share that says it skips the collectives."""
    if tp == 1 or allow_single:
        return
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise BeamcError("Model.load", f"tp = {tp} needs torch.distributed: one process per rank, the group "
                         "initialised before loading", "launch with `torchrun --nproc-per-node N` and call "
                         "torch.distributed.init_process_group() (nccl on GPUs, gloo on CPU) first")
    if dist.get_world_size() != tp or dist.get_rank() != rank:
        raise BeamcError("Model.load", f"the package is rank {rank} of {tp}, this process is rank "
                         f"{dist.get_rank()} of {dist.get_world_size()}", "load the package compiled for this "
                         "process's rank (`beamc compile SPEC --tp N --rank R -o DIR`)")

class Model:
    """A loaded package: `prefill`, `decode`, `release` (see the module docstring)."""

    def __init__(self):
        raise TypeError("use Model.load(package_dir, checkpoint, ...)")

    # ------------------------------------------------------------ loading
    @classmethod
    def load(cls, package_dir: str | Path, checkpoint: str | Path | None = None, *, device: str = "cuda",
             dtype: str | None = None, kv_dtype: str | None = None, target: str | None = None, tp: int = 1,
             rank: int = 0, max_batch: int = 8, max_context: int = 4096, max_prefill_tokens: int = 512,
             max_logit_rows: int | None = None, num_pages: int | None = None, eager: bool = False,
             decode_buckets: Sequence[int] | None = None, prefill_buckets: Sequence[int] | None = None,
             spec=None, weights: dict[str, torch.Tensor] | None = None, take_weights: bool = False,
             share_buffers: bool = True) -> "Model":
        """Load `package_dir` (a `beamc compile -o` directory) with this rank's weights from `checkpoint` (or the
        graph-param dict `weights`, e.g. random weights made on the GPU).

        dtype / kv_dtype / target / tp / rank: what the caller expects; a package that disagrees is refused.
        max_batch: sequences held at once (and the largest decode batch); max_context: positions per sequence;
        max_prefill_tokens: tokens of one prefill step; max_logit_rows: rows of `all_logits=True` (default
        max(max_batch, min(max_prefill_tokens, 512))); decode_buckets / prefill_buckets: the padded sizes steps
        run at (default 1, 2, 4, ..., max_batch and 16, 32, ..., max_prefill_tokens; each one a CUDA graph).
        num_pages: given, the full layers' page pool is the caller's (a serving stack's paging): every sequence
        needs a block table into pages [0, num_pages); not given, the pool has max_batch * pages-per-sequence pages
        and a sequence without a table uses its slot's own (a table passed anyway must not name pages another live
        sequence holds). eager: never capture CUDA graphs. spec: the package's ModelSpec (or YAML path) when
        neither the package's spec.json nor the checkpoint's config.json gives it. take_weights: the caller hands
        `weights` over: each tensor a load-time transform replaces (the NVFP4 relayout) is dropped from the dict as
        the load goes, so that it is freed unless the caller holds it elsewhere (peak memory: one MoE layer's
        experts more, not a second copy of them); otherwise the dict is left as given. share_buffers: let step
        buffers with disjoint lifetimes share storage."""
        self = object.__new__(cls)
        self._load(Path(package_dir), checkpoint, device=device, dtype=dtype, kv_dtype=kv_dtype, target=target,
                   tp=tp, rank=rank, max_batch=max_batch, max_context=max_context,
                   max_prefill_tokens=max_prefill_tokens, max_logit_rows=max_logit_rows, num_pages=num_pages,
                   eager=eager, spec=spec, weights=weights, take_weights=take_weights, share=share_buffers,
                   decode_buckets=decode_buckets, prefill_buckets=prefill_buckets)
        return self

    def _load(self, pkg: Path, checkpoint, *, device, dtype, kv_dtype, target, tp, rank, max_batch, max_context,
              max_prefill_tokens, max_logit_rows, num_pages, eager, spec, weights, take_weights, share,
              decode_buckets, prefill_buckets) -> None:
        from beamc.codegen.package import compile_package, render_steps

        _check_load_args(device=device, dtype=dtype, kv_dtype=kv_dtype, tp=tp, rank=rank, max_batch=max_batch,
                         max_context=max_context, max_prefill_tokens=max_prefill_tokens,
                         max_logit_rows=max_logit_rows, num_pages=num_pages, decode_buckets=decode_buckets,
                         prefill_buckets=prefill_buckets)
        m = self.manifest = read_manifest(pkg)
        self.device = torch.device(device)
        # ---- the package must be the one asked for
        pdt = package_dtype(m)
        asked = {"tp": (tp, m["tp"]), "rank": (rank, m["rank"])}
        if target is not None:
            asked["target"] = (target, m["target"])
        if dtype is not None:
            asked["dtype (activations)"] = (ir_dtype(dtype), pdt)
        if kv_dtype is not None:
            asked["kv_dtype"] = (ir_dtype(kv_dtype), ir_dtype(m["dtypes"]["kv_cache"]))
        bad = [f"{k}: asked {a!r}, the package has {p!r}" for k, (a, p) in asked.items() if a != p]
        if bad:
            raise BeamcError(str(pkg), "the package is not the one asked for: " + "; ".join(bad),
                             "compile a package with these settings (`beamc compile SPEC -o DIR --tp N --rank R "
                             "--target T`)")
        check_process_group(tp, rank, allow_single=collectives_skipped())
        self.spec = resolve_spec(m, pkg, checkpoint, spec)
        self.tp, self.rank, self.dtype = tp, rank, pdt
        # ---- the package's graphs, rebuilt from the spec: the buffers every launch names, and a check that the
        # package on disk is what this beamc generates from that spec (a stale package is refused)
        self.package = compile_package(self.spec, target=m["target"], tp=tp, rank=rank, passes=m["passes"],
                                       dtype="f32" if pdt == "f32" else None,
                                       nvfp4_relayout=bool(m.get("nvfp4_relayout", False)),
                                       moe_dequant=bool(m.get("moe_dequant", False)),
                                       moe_wgmma=bool(m.get("moe_wgmma", False)),
                                       attention_mirror_pages=int(m.get("attention_mirror_pages", 0)),
                                       moe_combine_max_tokens=m.get("moe_combine_max_tokens"),
                                       moe_frag_max_tokens=int(m.get("moe_frag_max_tokens", 0)),
                                       prefill_attention_gate=_prefill_gate(m),
                                       template_overrides=m.get("template_overrides") or {},
                                       l2_prefetch_mb=_prefetch_budget(m),
                                       overrides_from=f"{pkg / 'manifest.json'}: template_overrides")
        if render_steps(self.package) != (pkg / "step.py").read_text():
            raise BeamcError(str(pkg / "step.py"), "differs from what this beamc generates for the package's spec "
                             "and passes (a stale or edited package)", "recompile the package")
        if json.loads(json.dumps(self.package.load_transforms())) != m.get("load_transforms", {}):
            raise BeamcError(str(pkg / "manifest.json"), "its load_transforms differ from the weight transforms this "
                             "beamc applies at load time (a package from an older beamc: its kernels may not read "
                             "the weights as they are prepared)", "recompile the package")
        missing = [n for n in self.package.kernels if not (pkg / "kernels" / f"{n}.py").is_file()]
        if missing:
            raise BeamcError(str(pkg / "kernels"), f"kernels {missing[:3]} of step.py are missing",
                             "recompile the package")
        if self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1" and self.package.kernels:
            raise BeamcError("device", "cpu: the generated Triton kernels run on a CPU only under Triton's "
                             "interpreter", "set TRITON_INTERPRET=1 in the environment before Python starts "
                             "(before any kernel is imported), or use device='cuda'")
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise BeamcError("device", f"{device} requested but CUDA is not available", "use device='cpu'")
            cap = torch.cuda.get_device_capability(self.device)
            if f"sm_{cap[0]}{cap[1]}a" != m["arch"]:
                raise BeamcError(str(pkg), f"compiled for {m['arch']}, but {self.device} is sm_{cap[0]}{cap[1]}a",
                                 "compile the package with the --target of this GPU")
            import triton

            refused = triton_refusal(self.package.kernels, triton.__version__)
            if refused is not None:
                raise BeamcError(str(pkg / "kernels" / f"{refused[0]}.py"), refused[1], refused[2])
        self.step_module = import_step(pkg)
        self.phases = {p: self.package.steps[p] for p in ("decode", "prefill") if p in self.package.steps}
        graphs = {p: st.graph for p, st in self.phases.items()}
        g0 = next(iter(graphs.values()))
        # ---- sizes: slots (max_batch + the padding slot), rings, pages
        from beamc.runtime.session import page_size as _page_size

        if max_batch < 1 or max_prefill_tokens < 1:
            raise BeamcError("max_batch" if max_batch < 1 else "max_prefill_tokens", "must be >= 1")
        self.max_batch, self.max_context, self.max_prefill_tokens = max_batch, max_context, max_prefill_tokens
        self.max_logit_rows = max_logit_rows or max(max_batch, min(max_prefill_tokens, 512))
        if self.max_logit_rows < min(max_batch, max_prefill_tokens):
            raise BeamcError("max_logit_rows", f"{self.max_logit_rows} is fewer than one row per sequence of a step "
                             f"(max_batch={max_batch})", "raise max_logit_rows")
        self.slots = SlotTable(self.spec, max_batch + 1, max_context, max_prefill_tokens, page_size=_page_size(g0))
        self.pad_slot = max_batch
        self.page_size = self.slots.page_size
        self.pages_per_seq = mp = self.slots.pages_per_seq
        self.paged = "block_table" in g0.leaves("input")
        self.caller_pages = num_pages is not None  # a pool the caller manages: no sequence has default pages
        self.num_pages = num_pages if num_pages is not None else max_batch * mp
        if self.num_pages < 1:
            raise BeamcError("num_pages", f"must be >= 1, got {self.num_pages}")
        self.sizes = {**self.slots.sizes(), "P": self.num_pages + mp}  # + the padding slot's pages
        self.pad_pages = list(range(self.num_pages, self.num_pages + mp))
        sliding = "sliding_attention" in self.spec.attention_types
        self._pad_mod = min(self.slots.ring, max_context) if sliding else max_context
        # ---- weights
        self.weights = self._load_weights(checkpoint, weights, graphs, take_weights)
        # ---- caches, inputs, step buffers
        self.states = alloc_states(g0, self.sizes, self.device)
        self.block_table_cpu = torch.empty(max_batch + 1, mp, dtype=torch.int32)
        for s in range(max_batch + 1):
            self.block_table_cpu[s] = torch.tensor(self._default_pages(s), dtype=torch.int32)
        self.block_table = self.block_table_cpu.to(self.device)
        self._dirty: set[int] = set()  # block-table rows changed on the host since the last step
        # pool page -> the slot whose sequence holds it (-1: free); pad pages are never anyone's
        self.page_owner = torch.full((self.num_pages,), -1, dtype=torch.int64)
        self._cache_checks = self._cache_check_plan(g0)
        self.decode_buckets = _bucket_list(decode_buckets, max_batch, "decode_buckets", "max_batch") \
            or buckets(max_batch)
        self.prefill_buckets = _bucket_list(prefill_buckets, max_prefill_tokens, "prefill_buckets",
                                            "max_prefill_tokens") or buckets(max_prefill_tokens,
                                                                             first=min(16, max_prefill_tokens))
        self.max_sizes = {"decode": {**self.sizes, "B": max_batch, "R": max_batch},
                          "prefill": {**self.sizes, "T": max_prefill_tokens,
                                      "R": min(self.max_logit_rows, max_prefill_tokens)}}
        self.bufs = {p: StepBuffers(graphs[p], st.launches) for p, st in self.phases.items()}
        plans = {p: b.plan(self.max_sizes[p], share) for p, b in self.bufs.items()}
        nblocks = max(len(pl) for pl in plans.values())
        block_sizes = [max((pl[i] if i < len(pl) else 0) for pl in plans.values()) for i in range(nblocks)]
        self.block_offsets, off = [], 0
        for s in block_sizes:  # decode and prefill never run at once: block i serves both
            self.block_offsets.append(off)
            off += s
        self.arena = torch.empty(off, dtype=torch.uint8, device=self.device)
        self.arena_bytes = off
        self.inputs, self._staging = {}, {}
        for p, g in graphs.items():
            # the int64 inputs a step writes from the host: views of one buffer, as their host staging is
            leaves = {n: node for n, node in g.leaves("input").items() if n != "block_table"}
            staged = [n for n in STAGED_INPUTS if n in leaves]
            assert all(leaves[n].out.dtype == "i64" for n in staged), "the IR's token inputs are int64"
            shapes = {n: _bind(node.out.shape, self.max_sizes[p]) for n, node in leaves.items()}
            self._staging[p] = st = self._new_staging({n: shapes[n] for n in staged})
            self.inputs[p] = {n: st.device_views[n] if n in staged else
                              torch.zeros(shapes[n], dtype=torch_dtype(node.out.dtype), device=self.device)
                              for n, node in leaves.items()}
        self._views: dict[tuple, dict[str, torch.Tensor]] = {}
        self._pad_positions = np.arange(max(max_batch, max_prefill_tokens), dtype=np.int64) % self._pad_mod
        self.seqs: dict[Hashable, _Seq] = {}
        # ---- CUDA graphs
        from beamc.runtime.graphs import StepGraphs

        self.graphs = StepGraphs(self, enabled=not eager and self.device.type == "cuda")
        self.graphs.capture_decode()

    def _load_weights(self, checkpoint, weights, graphs: dict[str, Graph],
                      take: bool = False) -> dict[str, torch.Tensor]:
        """The model's own dict of every param its steps read, on the device, checked against the graphs' types,
        with the load-time transforms: packing (`with_packed_weights`; a packed weight's rows get storage up to a
        multiple of 8 behind them, `library.with_row_room`, for the prefill GEMM's aligned route) and the NVFP4
        experts' relayout (`_relayout_experts`). A caller's `weights` dict is changed only when `take` (Model.load's
        take_weights): then the relaid-out tensors are dropped from it; the model's dict shares its other tensors."""
        from beamc.runtime.interpret import _bind as bind_check, with_packed_weights

        wdtype = torch.float32 if self.dtype == "f32" else torch_dtype(self.spec.dtypes.activations)
        owned = []  # dicts whose tensors may be released as they are transformed: loaded here, or handed over
        if weights is not None and take:
            owned.append(weights)
        if weights is None:
            if checkpoint is None:
                raise BeamcError("checkpoint", "give a checkpoint directory or a weights dict")
            from beamc.checkpoint.loader import load_rank_weights

            weights = load_rank_weights(self.spec, checkpoint, tp=self.tp, rank=self.rank, dtype=wdtype,
                                        device=self.device)
            owned.append(weights)
        g0 = next(iter(graphs.values()))
        weights = with_packed_weights(g0, weights)  # (a new dict when it packs anything)
        if owned and weights is not owned[0]:
            owned.append(weights)
        out = {}
        for g in graphs.values():
            for name, node in g.leaves("param").items():
                if name in out:
                    continue
                if name not in weights:
                    raise BeamcError("weights", f"missing param {name}")
                t = weights[name].to(self.device)
                bind_check(node.out, t, {}, f"param {name}")
                out[name] = t.contiguous()
                if node.attrs.get("pack") and node.attrs.get("dim") == 0 and t.dim() == 2:
                    out[name] = library.with_row_room(out[name])
        self._relayout_experts(out, owned)
        self._check_f16_dot(out)
        return out  # the unpacked parts of packed params are dropped: no step reads them

    def _check_f16_dot(self, out: dict[str, torch.Tensor]) -> None:
        """The attention kernels over an fp8 cache multiply in fp16 (F16_DOT, `emitters.attention_dot`): q's bf16
        values must stay inside fp16's range. After the per-head RMS norm |q| <= sqrt(head_dim) * max |w + offset|
        (times the SSMax scale on full layers): checked here once, against the loaded q norms, so that an outlying
        checkpoint gets an error naming the fix instead of inf scores."""
        mods = getattr(self.step_module, "K", {})
        if not any(getattr(m, "F16_DOT", False) for m in mods.values()):
            return
        a = self.spec.attention
        mul = 1.0
        if a.full.q_scale is not None:
            qs = a.full.q_scale
            ends = [(1 + (p + qs.offset) / qs.length) for p in (0, self.spec.max_position_embeddings - 1)]
            mul = max([1.0] + [e ** qs.exponent for e in ends if e > 0])
        for name, w in out.items():
            if not name.endswith("q_norm.weight"):
                continue
            bound = float((w.float() + a.qk_norm.offset).abs().max()) * a.head_dim ** 0.5 * mul
            if not bound < 65504.0:
                raise BeamcError(f"param {name}",
                                 f"max |w| lets q reach {bound:.4g}, beyond fp16's 65504: the fp8-cache attention "
                                 "kernels multiply q in fp16 (F16_DOT)",
                                 "compile the package with --set attention_decode.F16_DOT=false --set "
                                 "attention_prefill.F16_DOT=false (bf16 operands)")

    def _relayout_experts(self, out: dict[str, torch.Tensor], owned: list[dict[str, torch.Tensor]]) -> None:
        """The manifest's load_transforms: each MoE layer's six NVFP4 expert params in `out` replaced by their
        re-laid-out form (`relayout` of the package's moe_nvfp4_decode kernel module: the layout both MoE kernels
        read on sm90; `Package.nvfp4_relayouts` says which layers), one layer at a time; the ModelOpt tensors are
        dropped from `out` and from the dicts in `owned` (the one loaded here, or the caller's with take_weights),
        so that they are freed as it goes (peak: one layer's experts more) unless someone else holds them."""
        for entry in self.package.nvfp4_relayouts():
            names = entry["params"]
            relayout = self.step_module.K[entry["kernel"]].relayout
            new = relayout([out[n] for n in names])
            for n, t in zip(names, new):
                if t is out[n]:  # (the global scales: unchanged, kept where they are)
                    continue
                out[n] = t.contiguous()
                for d in owned:
                    d.pop(n, None)
            del new

    def _default_pages(self, slot: int) -> list[int]:
        mp = self.pages_per_seq
        if slot == self.pad_slot:
            return self.pad_pages
        if not self.caller_pages:
            return list(range(slot * mp, (slot + 1) * mp))
        return self.pad_pages  # a caller-managed pool: a slot has pages only through a supplied block table

    # ------------------------------------------------------------ buffers of one bucket
    def buffers(self, phase: str, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        """name -> tensor for every buffer the phase's step names, at these bucket sizes (cached: fixed addresses)."""
        key = (phase, tuple(sorted(sizes.items())))
        if key in self._views:
            return self._views[key]
        b = self.bufs[phase]
        sz = {**self.sizes, **sizes}
        v: dict[str, torch.Tensor] = {}

        def get(name: str) -> torch.Tensor:
            if name in v:
                return v[name]
            if name in b.leaf:
                op, leaf = b.leaf[name]
                if op == "param":
                    t = self.weights[leaf]
                elif op == "state":
                    t = self.states[leaf]
                elif leaf == "block_table":
                    t = self.block_table
                else:
                    n = _bind(b.graph.leaves("input")[leaf].out.shape, sz)[0]
                    t = self.inputs[phase][leaf][:n]
            elif name in b.alias:
                base, shape = b.alias[name]
                t = get(base)
                if shape is not None:
                    t = t.view(_bind(shape, sz))
            else:
                r = b.roots[name]
                nbytes = _nbytes(r.shape, r.dtype, sz)
                off = self.block_offsets[r.block]
                t = self.arena[off:off + nbytes].view(torch_dtype(r.dtype)).view(_bind(r.shape, sz))
            v[name] = t
            return t

        for name in b.used:
            get(name)
        for name in b.graph.outputs.values():
            get(name.name)
        self._views[key] = v
        return v

    # ------------------------------------------------------------ the API
    @property
    def lengths(self) -> dict[Hashable, int]:
        """seq id -> tokens in its cache."""
        return {sid: self.slots.lengths[s.slot] for sid, s in self.seqs.items()}

    def prefill(self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]],
                start_positions: Sequence[int] | None = None, positions: Sequence[Sequence[int]] | None = None,
                block_tables: Sequence[Sequence[int] | None] | None = None,
                all_logits: bool = False) -> torch.Tensor | list[torch.Tensor]:
        """Append `token_ids[i]` to sequence `seq_ids[i]` (a new id starts a sequence) in one ragged step.

        start_positions[i] (or positions[i], consecutive): where the chunk starts; default the sequence's length.
        A start before the length rewinds the sequence (the sliding rings must still hold the window before it).
        block_tables[i]: the pages of the sequence's full-layer cache (a serving stack's own paging); None keeps
        the last one given, or the slot's own pages. Returns fp32 soft-capped logits: [n_seqs, V] of each chunk's
        last token, or with all_logits a list of [len(chunk), V]."""
        chunks = [_token_chunk(t, f"token_ids[{i}]") for i, t in enumerate(_as_list(token_ids, "token_ids"))]
        seq_ids = _as_list(seq_ids, "seq_ids")
        if len(seq_ids) != len(chunks):
            raise BeamcError("prefill", f"{len(seq_ids)} seq_ids but {len(chunks)} token lists")
        if positions is not None:
            if start_positions is not None:
                raise BeamcError("prefill", "give start_positions or positions, not both")
            positions = _as_list(positions, "positions")
            if len(positions) != len(chunks):
                raise BeamcError("positions", f"{len(positions)} lists for {len(chunks)} sequences")
            start_positions = []
            for i, (p, c) in enumerate(zip(positions, chunks)):
                p = _token_list(p, f"positions[{i}]")
                if len(p) != len(c) or p != list(range(p[0], p[0] + len(p))):
                    raise BeamcError(f"positions[{i}]", "must be consecutive, one per token",
                                     "a chunk's tokens follow each other")
                start_positions.append(p[0])
        n_tok = sum(len(c) for c in chunks)
        if n_tok > self.max_prefill_tokens:
            raise BeamcError("prefill", f"{n_tok} tokens in one step exceed max_prefill_tokens="
                             f"{self.max_prefill_tokens}", "split the prefill into chunks or raise max_prefill_tokens")
        if all_logits and n_tok > self.max_logit_rows:
            raise BeamcError("prefill", f"all_logits for {n_tok} tokens exceeds max_logit_rows={self.max_logit_rows}",
                             "split the prefill or raise max_logit_rows")
        out = self._step("prefill", seq_ids, chunks, start_positions, block_tables, all_logits)
        if all_logits:
            return list(out.split([len(c) for c in chunks]))
        return out

    def decode(self, seq_ids: Sequence[Hashable], tokens: Sequence[int],
               block_tables: Sequence[Sequence[int] | None] | None = None) -> torch.Tensor:
        """One token for each (already prefilled) sequence; returns fp32 soft-capped logits [n_seqs, V]."""
        seq_ids = _as_list(seq_ids, "seq_ids")
        tokens = _token_list(tokens, "tokens")
        if len(seq_ids) != len(tokens):
            raise BeamcError("decode", f"{len(seq_ids)} seq_ids but {len(tokens)} tokens")
        for sid in seq_ids:
            if _hashable(sid) and sid not in self.seqs:
                raise BeamcError(f"seq {sid!r}", "unknown sequence (never prefilled, or released)",
                                 "prefill it first")
        return self._step("decode", seq_ids, [[t] for t in tokens], None, block_tables, False)

    def release(self, seq_id: Hashable) -> None:
        """Forget a sequence: its slot (and, without caller-supplied tables, its pages) serve the next one."""
        if not _hashable(seq_id) or seq_id not in self.seqs:
            raise BeamcError(f"seq {seq_id!r}", "unknown sequence", "release only live sequences")
        s = self.seqs.pop(seq_id)
        self.slots.reset(s.slot)
        self.block_table_cpu[s.slot] = torch.tensor(self._default_pages(s.slot), dtype=torch.int32)
        self.page_owner[self.page_owner == s.slot] = -1
        self._dirty.add(s.slot)

    def fill_context(self, seq_id: Hashable, length: int, seed: int = 0, block_table=None) -> None:
        """Benchmarks only: start a new sequence as if `length` tokens had been prefilled, without computing them:
        it takes a free slot (and its pages, or the pages of `block_table`, checked like a step's), its length
        becomes `length`, and its cache rows (every page covering [0, length), its whole ring) are filled with
        random N(0, 1) values in the cache dtype. The next decode or prefill continues at position `length`."""
        if not _hashable(seq_id) or seq_id in self.seqs:
            raise BeamcError(f"seq {seq_id!r}", "fill_context starts a new sequence: this one is live (or not "
                             "hashable)", "release it first")
        if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length < self.max_context:
            raise BeamcError(f"seq {seq_id!r}", f"fill_context length {length!r} outside [1, max_context="
                             f"{self.max_context})", "leave room for the tokens to come")
        used = {s.slot for s in self.seqs.values()}
        free = [s for s in range(self.max_batch) if s not in used]
        if not free:
            raise BeamcError(f"seq {seq_id!r}", f"all max_batch={self.max_batch} slots are held",
                             "release a sequence or raise max_batch")
        slot = free[0]
        pages = None
        if self.paged:
            if block_table is not None:
                pages = self._check_table(seq_id, block_table)
                self._check_owners({seq_id: pages}, {seq_id: slot})
            elif self.caller_pages:
                raise BeamcError(f"seq {seq_id!r}", f"no block table: the pool of num_pages={self.num_pages} is "
                                 "managed by the caller", "pass block_table")
            else:
                own = torch.tensor(self._default_pages(slot))
                if bool((self.page_owner[own] >= 0).any()):
                    raise BeamcError(f"seq {seq_id!r}", "its slot's pages are held by another sequence's block "
                                     "table", "pass block_table")
            have = (len(pages) if pages is not None else self.pages_per_seq) * self.page_size
            if length > have:
                raise BeamcError(f"seq {seq_id!r}", f"{length} positions do not fit its {have // self.page_size} "
                                 "pages", "give the sequence more pages")
        # ---- commit (as a step would), then fill the rows
        self.seqs[seq_id] = _Seq(slot, block_table=pages)
        if self.paged:
            row = self._row(pages) if pages is not None else torch.tensor(self._default_pages(slot), dtype=torch.int32)
            self.page_owner[(pages if pages is not None else row).long()] = slot
            self.block_table_cpu[slot] = row
            self.block_table[slot].copy_(row)
        self.slots.lengths[slot] = length
        gen = torch.Generator(device=self.device).manual_seed(seed)
        g = self.bufs["decode" if "decode" in self.bufs else "prefill"].graph
        used_pages = self.block_table_cpu[slot][: -(-length // self.page_size)].long().to(self.device)
        for name, node in g.leaves("state").items():
            t = self.states[name]
            if node.out.shape[0] == "P":  # pages of the pool: those covering [0, length), a chunk of them at a time
                per = max(1, (1 << 24) // max(1, t[0].numel()))
                for a in range(0, len(used_pages), per):
                    idx = used_pages[a:a + per]
                    vals = torch.randn((len(idx), *t.shape[1:]), generator=gen, device=self.device,
                                       dtype=torch.float32).to(t.dtype)
                    if t.dtype.itemsize == 1:  # index_copy_ of fp8: as bytes
                        t.view(torch.uint8).index_copy_(0, idx, vals.view(torch.uint8))
                    else:
                        t.index_copy_(0, idx, vals)
            else:  # a ring per slot: the whole ring of this slot
                t[slot].copy_(torch.randn(t.shape[1:], generator=gen, device=self.device, dtype=torch.float32))

    # ------------------------------------------------------------ one step
    def _step(self, phase: str, seq_ids: list, chunks: list[list[int]], starts, block_tables, all_logits: bool):
        n = len(seq_ids)
        if n == 0:
            raise BeamcError(phase, "no sequences given")
        if n > self.max_batch:
            raise BeamcError(phase, f"{n} sequences in one step exceed max_batch={self.max_batch}",
                             "split the batch or raise max_batch")
        if not all(_hashable(s) for s in seq_ids) or len(set(seq_ids)) != n:
            raise BeamcError(phase, "a sequence appears twice in one step (or an id is not hashable)",
                             "give each sequence's tokens once")
        # ---- slots: live sequences keep theirs, new ones take free slots (committed only if the step runs)
        used = {s.slot for s in self.seqs.values()}
        free = [s for s in range(self.max_batch) if s not in used]
        new = [sid for sid in seq_ids if sid not in self.seqs]
        if len(new) > len(free):
            raise BeamcError(phase, f"{len(new)} new sequences, but only {len(free)} of max_batch={self.max_batch} "
                             "slots are free", "release finished sequences or raise max_batch")
        slot_of = {sid: self.seqs[sid].slot for sid in seq_ids if sid in self.seqs}
        slot_of.update(zip(new, free))
        seq_of_slot = {s: sid for sid, s in slot_of.items()}
        lengths = list(self.slots.lengths)
        for sid in new:
            lengths[slot_of[sid]] = 0
        if starts is not None:
            starts = _token_list(starts, "start_positions")
            if len(starts) != n:
                raise BeamcError("start_positions", f"{len(starts)} for {n} sequences")
            for sid, st in zip(seq_ids, starts):
                self._check_start(sid, st, lengths[slot_of[sid]])
                lengths[slot_of[sid]] = st
        # ---- tokens, lengths: the SlotTable's checks, on the step's lengths
        saved = self.slots.lengths
        self.slots.lengths = lengths
        try:
            plan = self.slots.plan([(slot_of[sid], c) for sid, c in zip(seq_ids, chunks)])
        except BeamcError as e:
            raise _renamed(e, seq_of_slot) from None
        finally:
            self.slots.lengths = saved
        # ---- block tables: validated on the host before anything is written
        updates: dict[Hashable, torch.Tensor] = {}  # seq -> its new pages (a table that differs from the last)
        if block_tables is not None:
            block_tables = _as_list(block_tables, "block_tables")
            if len(block_tables) != n:
                raise BeamcError("block_tables", f"{len(block_tables)} for {n} sequences")
            for sid, bt in zip(seq_ids, block_tables):
                if bt is None:
                    continue
                pages = self._check_table(sid, bt)
                old = self.seqs[sid].block_table if sid in self.seqs else None
                if old is None or not torch.equal(old, pages):
                    updates[sid] = pages
        table = self.block_table_cpu
        if self.paged:
            if updates:
                self._check_owners(updates, slot_of)
                table = table.clone()
                for sid, pages in updates.items():
                    table[slot_of[sid]] = self._row(pages)
            for sid, c in zip(seq_ids, chunks):
                end = lengths[slot_of[sid]] + len(c)
                pages = updates.get(sid, self.seqs[sid].block_table if sid in self.seqs else None)
                if pages is None and self.caller_pages:
                    raise BeamcError(f"seq {sid!r}", f"no block table: the pool of num_pages={self.num_pages} is "
                                     "managed by the caller", "pass block_tables")
                if pages is None and sid in new:  # its slot's own pages: none may be held by another table
                    held = self.page_owner[torch.tensor(self._default_pages(slot_of[sid]))]
                    if bool((held >= 0).any()):
                        other = {s.slot: i for i, s in self.seqs.items()}.get(int(held[held >= 0][0]))
                        raise BeamcError(f"seq {sid!r}", f"its slot's pages are held by the block table of seq "
                                         f"{other!r}", "pass block_tables for every sequence, or for none")
                have = (len(pages) if pages is not None else self.pages_per_seq) * self.page_size
                if end > have:
                    raise BeamcError(f"seq {sid!r}", f"its block table has {len(pages)} pages "
                                     f"({have} positions), too few for {end} positions",
                                     "give the sequence more pages")
        ids, pos, slots = plan["input_ids"], plan["positions"], plan["slots"]  # int lists
        self._check_caches(plan["slots"], plan["positions"], table)
        # ---- commit: slots, tables, lengths; then the launch
        for sid in new:
            self.seqs[sid] = _Seq(slot_of[sid])
            if self.paged and not self.caller_pages and sid not in updates:
                self.page_owner[torch.tensor(self._default_pages(slot_of[sid]))] = slot_of[sid]
        for sid, pages in updates.items():
            s = slot_of[sid]
            self.seqs[sid].block_table = pages
            self.page_owner[self.page_owner == s] = -1
            self.page_owner[pages.long()] = s
            self._dirty.add(s)
        for sid in seq_ids:
            self.slots.lengths[slot_of[sid]] = lengths[slot_of[sid]]
        self.block_table_cpu = table
        if self.paged and self._dirty:
            for s in sorted(self._dirty):  # only the rows that changed cross to the device
                self.block_table[s].copy_(table[s])
            self._dirty.clear()
        rows = list(range(len(ids))) if all_logits or phase == "decode" else _last_rows([len(c) for c in chunks])
        out = self._launch(phase, ids, pos, slots, rows)
        self.slots.commit([(slot_of[sid], c) for sid, c in zip(seq_ids, chunks)])
        return out

    def _check_start(self, sid, start: int, length: int) -> None:
        if start < 0 or start > length:
            raise BeamcError(f"seq {sid!r}", f"start position {start} outside [0, {length}] (its length)",
                             "continue a sequence at its length, or rewind it to an earlier position")
        if start < length and "sliding_attention" in self.spec.attention_types:
            first = max(start - self.spec.effective_window + 1, 0)
            if first < length - self.slots.ring:
                raise BeamcError(f"seq {sid!r}", f"cannot rewind from {length} to {start}: its sliding-window ring "
                                 f"no longer holds position {first}", "re-prefill the sequence from the start")

    def _check_table(self, sid, bt) -> torch.Tensor:
        """A sequence's pages as an int32 tensor: at most pages-per-sequence of them, each in the pool, distinct."""
        if isinstance(bt, torch.Tensor):
            if bt.dim() != 1 or not _integer_dtype(bt):
                raise BeamcError(f"seq {sid!r}", f"block table must be a 1-D integer tensor, got {tuple(bt.shape)} "
                                 f"{bt.dtype}")
            pages = bt.to("cpu", torch.int32)
        else:
            pages = torch.tensor(_token_list(bt, f"block table of seq {sid!r}"), dtype=torch.int64)
            if len(pages) and (int(pages.min()) < -2 ** 31 or int(pages.max()) >= 2 ** 31):
                raise BeamcError(f"seq {sid!r}", "block table names a page outside the pool", "fix the block table")
            pages = pages.to(torch.int32)
        if len(pages) > self.pages_per_seq:
            raise BeamcError(f"seq {sid!r}", f"block table of {len(pages)} pages, more than the "
                             f"{self.pages_per_seq} of max_context={self.max_context}", "give at most that many")
        out = ((pages < 0) | (pages >= self.num_pages)).nonzero()
        if len(out):
            raise BeamcError(f"seq {sid!r}", f"block table names page {int(pages[out[0, 0]])}, outside the pool of "
                             f"num_pages={self.num_pages}", "fix the block table")
        if torch.unique(pages).numel() != pages.numel():
            raise BeamcError(f"seq {sid!r}", "block table names a page twice", "give each position its own page")
        return pages

    def _row(self, pages: torch.Tensor) -> torch.Tensor:
        """A block-table row: the pages, then the padding pages (never read for a real position)."""
        return torch.cat([pages, torch.tensor(self.pad_pages[: self.pages_per_seq - len(pages)], dtype=torch.int32)])

    def _check_owners(self, updates: dict, slot_of: dict) -> None:
        """No page of a new table may be held by another live sequence, or named by two tables of this step: each
        sequence writes every one of its positions, so a shared page would be overwritten."""
        seq_of_slot = {s.slot: sid for sid, s in self.seqs.items()}
        claimed: dict[int, Hashable] = {}
        for sid, pages in updates.items():
            s = slot_of[sid]
            owners = self.page_owner[pages.long()]
            for p, o in zip(pages.tolist(), owners.tolist()):
                other = claimed.get(p)
                if other is None and o not in (-1, s) and seq_of_slot.get(o) not in updates:
                    other = seq_of_slot.get(o)
                if other is not None and other != sid:
                    raise BeamcError(f"seq {sid!r}", f"block table names page {p}, which seq {other!r} holds",
                                     "give each live sequence its own pages")
                claimed[p] = sid

    def _cache_check_plan(self, g: Graph) -> list[tuple]:
        """The distinct cache checks of a step: one per kind of KV cache (ring capacity and window, or page size and
        pool), not one per layer."""
        from beamc.ir.reference import KV_WRITERS

        plan = set()
        for n in g.nodes:
            if n.op in KV_WRITERS:
                c = KV_WRITERS[n.op][0]
                shape = tuple(self.states[n.inputs[c].producer.attrs["name"]].shape)
                plan.add((shape[1], n.attrs.get("window"), bool(n.attrs.get("paged")), shape[0]))
        return sorted(plan, key=repr)

    def _check_caches(self, slots: list[int], pos: list[int], table) -> None:
        """The reference's cache checks (ring spans, pages within the table and the pool, distinct rows) on the
        step's real tokens, before any launch: on int lists for small steps (a decode batch: torch's per-op cost
        would be most of the step's host time), as tensors for long prefill steps."""
        from beamc.ir.reference import check_kv_capacity, check_kv_capacity_lists

        small = len(pos) <= SMALL_CHECK_TOKENS
        if small and isinstance(pos, torch.Tensor):
            slots, pos = slots.tolist(), pos.tolist()
        elif not small:
            slots, pos = torch.as_tensor(slots, dtype=torch.int64), torch.as_tensor(pos, dtype=torch.int64)
        for cap, window, paged, pool in self._cache_checks:
            (check_kv_capacity_lists if small else check_kv_capacity)(slots, pos, cap, window,
                                                                      table if paged else None, pool)

    def _launch(self, phase: str, ids, pos, slots, rows: list[int]) -> torch.Tensor:
        """Run one step: ids / pos / slots are int lists or int64 CPU tensors (a long prefill's plan)."""
        n, r = len(ids), len(rows)
        if phase == "decode":
            size = bucket_for(n, self.decode_buckets)
            sizes, rb = {"B": size, "R": size}, size
        else:
            size = bucket_for(n, self.prefill_buckets)
            rb = min(bucket_for(r, buckets(self.max_sizes["prefill"]["R"])), size)
            sizes = {"T": size, "R": rb}
        v = self.buffers(phase, sizes)
        key = (phase, size, rb)
        self.graphs.prepare(key, v)  # captures a graph for this bucket (on padding inputs) the first time
        self._write_inputs(phase, ids, pos, slots, rows, size, rb)
        self.graphs.run(key, v)
        out = v[self.bufs[phase].graph.outputs["logits"].name]
        return out[:r].float().clone()

    def _write_inputs(self, phase: str, ids, pos, slots, rows: list[int], size: int, rb: int) -> None:
        """The step's inputs, padded to the bucket (`size` tokens, `rb` logit rows), into the phase's input buffers."""
        n = len(ids)
        st = self._staging[phase]
        if st.done is not None:
            st.done.synchronize()  # the last step's copies out of these buffers have run (at once, unless run ahead)
        # padding tokens: id 0, distinct positions, the padding slot
        a = st.arrays
        _put(a["input_ids"], ids, size, 0)
        _put(a["positions"], pos, size, self._pad_positions[:size - n])
        _put(a["slots"], slots, size, self.pad_slot)
        if "logit_rows" in a:
            _put(a["logit_rows"], rows, rb, 0)
        # Asynchronous copies from pinned memory (no synchronisation with the host): the whole buffer in one where it
        # is small, else each input's rows. These copies (stream operations, not PDL kernels) also order the step
        # after the previous one's kernels: the decode attention reads the cache rows of earlier steps before its PDL
        # wait (attention_decode EARLY_KV), which is safe only because a step starts behind such an operation.
        if st.flat.numel() * 8 <= ONE_COPY_BYTES:  # (a decode step's few tokens: every input in one copy)
            st.device_flat.copy_(st.flat, non_blocking=True)
        else:
            ins = self.inputs[phase]
            for name, m in (("input_ids", size), ("positions", size), ("slots", size), ("logit_rows", rb)):
                if name in a:
                    ins[name][:m].copy_(st.tensors[name][:m], non_blocking=True)
        if st.done is not None:
            st.done.record()

    def _new_staging(self, shapes: dict[str, list[int]]) -> _Staging:
        """One int64 device buffer whose views are the staged inputs (`shapes`, in order), and its host twin (pinned
        on a GPU) with the same layout."""
        cuda = self.device.type == "cuda"
        sizes = {k: math.prod(v) for k, v in shapes.items()}
        device_flat = torch.zeros(sum(sizes.values()), dtype=torch.int64, device=self.device)
        flat = torch.zeros(device_flat.numel(), dtype=torch.int64, pin_memory=cuda)
        device_views, tensors, off = {}, {}, 0
        for k, n in sizes.items():
            device_views[k] = device_flat[off:off + n].view(shapes[k])
            tensors[k] = flat[off:off + n]
            off += n
        return _Staging(flat, device_flat, device_views, tensors, {k: t.numpy() for k, t in tensors.items()},
                        torch.cuda.Event() if cuda else None)

    def run_step(self, phase: str, v: dict[str, torch.Tensor]) -> None:
        """The generated step function over buffers `v` (what eager mode runs and a CUDA graph captures)."""
        getattr(self.step_module, phase)(v)


def _bucket_list(given, limit: int, what: str, limit_name: str) -> list[int] | None:
    """A caller's bucket sizes: ascending, positive, the last one the limit (None: the default doubling)."""
    if given is None:
        return None
    b = sorted(set(_token_list(given, what)))
    if not b or b[0] < 1 or b[-1] != limit:
        raise BeamcError(what, f"{list(given)}: sizes >= 1 whose largest is {limit_name}={limit}")
    return b


def _last_rows(lengths: list[int]) -> list[int]:
    """The index of each chunk's last token in the step."""
    out, total = [], 0
    for n in lengths:
        total += n
        out.append(total - 1)
    return out


def _check_load_args(*, device, dtype, kv_dtype, decode_buckets, prefill_buckets, **sizes) -> None:
    """Model.load's own arguments, before any file is read: sizes are integers (None where optional), the device
    one torch can name on a CPU or a CUDA GPU, the dtypes ones a package can have. One BeamcError naming the
    argument, never a TypeError from deep in the load."""
    for name, v in sizes.items():
        if v is None and name in ("max_logit_rows", "num_pages"):
            continue
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise BeamcError(name, f"must be an integer, got {v!r}")
    for name, b in (("decode_buckets", decode_buckets), ("prefill_buckets", prefill_buckets)):
        if b is not None:
            _token_list(b, name)  # a list of integers (the sizes themselves are checked against the maxima later)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise BeamcError("device", f"{device!r} is not a device", "use 'cuda', 'cuda:N' or 'cpu'") from None
    if dev.type not in ("cuda", "cpu"):
        raise BeamcError("device", f"{device!r}: beamc runs on a CUDA GPU (or a CPU under Triton's interpreter)",
                         "use 'cuda', 'cuda:N' or 'cpu'")
    # what a spec may say (the schema's own choices): a package has no other dtypes
    for name, v, field, fix in (("dtype", dtype, "activations", "'bf16', 'f16' or 'f32'"),
                                ("kv_dtype", kv_dtype, "kv_cache", "'bf16' or 'fp8'")):
        choices = get_args(DtypeSpec.model_fields[field].annotation)
        if v is None:
            continue
        try:
            ok = isinstance(v, str) and ir_dtype(v) in {ir_dtype(c) for c in choices}
        except BeamcError:
            ok = False
        if not ok:
            raise BeamcError(name, f"{v!r} is not a{' KV cache' if name == 'kv_dtype' else 'n activation'} dtype "
                             "of a beamc package", f"use {fix}")


def _hashable(x) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _as_list(x, what: str) -> list:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, (str, bytes)) or not hasattr(x, "__len__"):
        raise BeamcError(what, f"expected a list, got {type(x).__name__}")
    return list(x)


def _integer_dtype(x: torch.Tensor | np.ndarray) -> bool:
    """An integer tensor or array (signed or unsigned); bool, float and complex ones are not."""
    if isinstance(x, np.ndarray):
        return x.dtype.kind in "iu"
    return not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)


def _token_list(x, what: str) -> list[int]:
    """A list of Python ints (token ids, positions, pages) from a list (of Python or NumPy integers), a 1-D integer
    tensor or a 1-D integer NumPy array; a bool, float or complex one is refused (True is not token 1)."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        if x.ndim != 1 or not _integer_dtype(x):
            raise BeamcError(what, f"expected a 1-D integer {'array' if isinstance(x, np.ndarray) else 'tensor'}, "
                             f"got {tuple(x.shape)} {x.dtype}")
        return x.tolist()
    x = [int(t) if isinstance(t, np.integer) else t for t in _as_list(x, what)]
    bad = [t for t in x if isinstance(t, bool) or not isinstance(t, int)]
    if bad:
        raise BeamcError(what, f"{bad[0]!r} is not an integer")
    return x


def _token_chunk(x, what: str) -> list[int] | torch.Tensor:
    """A prefill chunk's token ids: as `_token_list`, but a chunk of more than LONG_CHUNK integers stays (or becomes)
    an int64 CPU tensor, so that the step's plan and checks run as tensor ops. Anything else takes the list path,
    which names the bad value (the same errors either way)."""
    if isinstance(x, np.ndarray) and x.ndim == 1 and x.size > LONG_CHUNK and (
            x.dtype.kind == "i" or (x.dtype.kind == "u" and x.dtype.itemsize < 8)):
        return torch.from_numpy(x.astype(np.int64))  # (uint64 takes the list path: no silent wrap past int64)
    if isinstance(x, torch.Tensor):
        if x.dim() == 1 and x.numel() > LONG_CHUNK and _integer_dtype(x):
            return x.to("cpu", torch.int64)
        return _token_list(x, what)
    if hasattr(x, "__len__") and not isinstance(x, (str, bytes, np.ndarray)) and len(x) > LONG_CHUNK:
        x = list(x)
        if set(map(type, x)) <= {int}:  # exact ints (a bool is not one): C-speed checks from here on
            try:
                return torch.from_numpy(np.array(x, dtype=np.int64))
            except OverflowError:
                pass  # an id beyond int64: the list path's vocabulary check names it
    return _token_list(x, what)


def _put(dst: np.ndarray, values, n: int, pad) -> None:
    """dst[:len(values)] = values (an int list or an int64 tensor), dst[len(values):n] = pad."""
    k = len(values)
    dst[:k] = values.numpy() if isinstance(values, torch.Tensor) else values
    dst[k:n] = pad


def _renamed(e: BeamcError, seq_of_slot: dict[int, Hashable]) -> BeamcError:
    """A SlotTable error about `slot N`, told about the caller's sequence id."""
    where = e.where
    if where.startswith("slot ") and where[5:].isdigit() and int(where[5:]) in seq_of_slot:
        where = f"seq {seq_of_slot[int(where[5:])]!r}"
    words = {"max_len": "max_context", "max_chunk": "max_prefill_tokens"}  # the SlotTable's names -> this API's
    msg, fix = e.message, e.fix
    for a, b in words.items():
        msg = msg.replace(a, b)
        fix = fix.replace(a, b) if fix else fix
    return BeamcError(where, msg, fix)
