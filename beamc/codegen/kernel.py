"""A generated kernel: a jinja2 template under `templates/`, rendered with the constants of one IR node into a
readable Triton module, and loaded back as a Python module.

The contract every template renders (see any `templates/*.py.j2`):
- a module docstring: what it computes, the IR op, the reference it equals (`beamc.ir.reference`);
- `@triton.jit def kernel(...)`: `*_ptr` arguments, `UPPER` constexprs, a mask on every load/store; float math in
  fp32 with the reference's rounding points (casts where the reference rounds, nothing fused across them);
- `def launch(...)`: the launcher. Its tensor arguments are the IR op's inputs in IR order, then its outputs
  (pre-allocated by the caller: a CUDA graph replays fixed buffers); it launches and returns nothing;
- `SIGNATURE` (argument name -> Triton type, e.g. "*bf16", "i32", "constexpr") and `CONSTEXPRS` (name -> value):
  what `triton.compile` needs to compile the kernel ahead of time for a target (sm_90a, sm_100a) with no GPU;
- `OPTIONS`: the compile options the launcher launches with (num_warps, enable_fp_fusion=False,
  enable_reflect_ftz=False, launch_pdl), which `aot_compile` uses too; a launcher that launches with other
  options as well (the router's one-warp selection) lists every set in `LAUNCH_OPTIONS` (`launch_options(mod)`);
  a set may pin constants (key `constexprs`: a binary of its own, e.g. one stage of a multi-stage kernel) and
  name a second kernel of the module (key `fn`; its signature in `SIGNATURES[fn]`, its constants all in the set);
- `GRID`: the launch grid rule in words (it goes into the manifest).
Kernels are compiled without FP contraction (`enable_fp_fusion=False`): an FMA would round differently from the
reference's separate multiply and add.
"""
from __future__ import annotations

import hashlib
import importlib.util
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import jinja2

TEMPLATES = Path(__file__).parent / "templates"
_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                          keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)

# IR dtype -> Triton's element type name (signatures) and tl dtype expression (templates)
TL_TYPE = {"bf16": "bf16", "f16": "fp16", "f32": "fp32", "f8e4m3": "fp8e4nv", "i64": "i64", "i32": "i32",
           "u8": "u8", "e2m1x2": "u8"}
TL_DTYPE = {"bf16": "tl.bfloat16", "f16": "tl.float16", "f32": "tl.float32", "f8e4m3": "tl.float8e4nv"}


def whole_row_chunks(k: int) -> tuple[int, int]:
    """(chunk, chunks) for a kernel that holds a whole row of k values as one register tile per chunk (rendered one
    named tile each: the one-pass GEMV, the one-launch router): the largest power of 2 in [64, 1024] dividing k, else
    min(1024, next_pow2(k)) with a masked tail."""
    c = next((c for c in (1024, 512, 256, 128, 64) if k % c == 0), min(1024, 1 << max(k - 1, 1).bit_length()))
    return c, -(-k // c)


_ENV.globals["whole_row_chunks"] = whole_row_chunks


@dataclass(frozen=True)
class KernelSpec:
    """One kernel of a package: which template, specialised with which constants, for which IR op."""

    template: str  # file stem under templates/
    op: str  # the IR op it implements
    constants: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """A stable file name: template + a hash of its constants (nodes with equal constants share a kernel)."""
        digest = hashlib.sha1(repr(sorted(self.constants.items())).encode()).hexdigest()[:8]
        return f"{self.template}_{digest}"

    def source(self) -> str:
        return render(self.template, **self.constants)


def render(template: str, **constants: Any) -> str:
    """The Triton source of `templates/<template>.py.j2` with these constants (a missing one is an error)."""
    return _ENV.get_template(f"{template}.py.j2").render(TL_DTYPE=TL_DTYPE, TL_TYPE=TL_TYPE, **constants)


def load_source(source: str, name: str, directory: str | Path | None = None) -> ModuleType:
    """Import generated source as a module. Triton needs a real file (it reads the kernel's source text)."""
    d = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="beamc_kernels_"))
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.py"
    if not path.exists() or path.read_text() != source:
        path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"beamc_generated.{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_kernel(k: KernelSpec, directory: str | Path | None = None) -> ModuleType:
    return load_source(k.source(), k.name, directory)


def launch_options(mod: ModuleType) -> list[dict]:
    """Every set of compile options the module's launcher launches with: `LAUNCH_OPTIONS`, else just `OPTIONS`."""
    return [dict(o) for o in getattr(mod, "LAUNCH_OPTIONS", (mod.OPTIONS,))]


def aot_compile(mod: ModuleType, arch: int, options: dict | None = None):
    """Compile a generated module's kernel ahead of time for sm_<arch> (90 -> sm_90a, 100 -> sm_100a), no GPU
    needed, with the launcher's `OPTIONS` (or `options`: one of `launch_options(mod)`). Returns Triton's compiled
    kernel (its .asm holds ptx and cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # the launcher's own options: same warps (same reduction order), no FMA, no FTZ; constants an option set pins
    options = dict(mod.OPTIONS if options is None else options)
    fn_name = options.pop("fn", "kernel")  # (a module's second kernel: its own SIGNATURES entry, constants all pinned)
    fn = getattr(mod, fn_name)
    signature = mod.SIGNATURE if fn_name == "kernel" else mod.SIGNATURES[fn_name]
    # pointers 16-byte aligned (torch's allocations are): what lets the compiler vectorise loads, as at run time
    aligned = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
    constexprs = dict(mod.CONSTEXPRS if fn_name == "kernel" else {}, **options.pop("constexprs", {}))
    if getattr(fn, "is_gluon", lambda: False)():  # a Gluon kernel (explicit layouts): its own front end
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
