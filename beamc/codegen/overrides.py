"""Template overrides: `--set TEMPLATE.CONSTANT=VALUE`, a template constant pinned for every kernel of a package.

For kernel engineers: try a tile, a warp count or a render option of one template inside the whole model (the
decode step, the ablation) without editing an emitter. The value replaces what the emitter would have passed (or
the template's own default) in every kernel rendered from that template; the manifest records the overrides, and
the runtime rebuilds the package with them (a package on disk stays what beamc generates from its manifest).

Checked here, before any work: the template exists, and it reads the constant (jinja2's list of the variables a
template uses, its includes' too), so a misspelt name is an error, not a silent no-op; and the constant is not one
that says what the kernel computes or which arguments it takes (STRUCTURAL: dtypes, PDL, the fused forms). When a
kernel is rendered (`pin`): the constant is not one its emitter derived from the IR node (a shape, an attribute:
only a tile the emitter picks, TUNABLE_DERIVED, may be pinned), and the pinned source renders, imports and keeps the
launcher's arguments. After lowering, `compile_package` checks that some kernel of the package was rendered from
each overridden template.
An override is not a proof: the package's kernels are checked by the same tests as any other render only where
those tests run it (`beamc compile ... --set ...` then the GPU tests or `bench/full_model.py --set`).
"""
from __future__ import annotations

import functools
from typing import Any

import jinja2.meta

from beamc.codegen.kernel import _ENV, TEMPLATES
from beamc.errors import BeamcError

Overrides = dict[str, dict[str, Any]]  # template -> {constant: value}


def templates() -> list[str]:
    """The kernel templates (file stems under templates/, the step file's and the includes left out)."""
    return sorted(p.name[: -len(".py.j2")] for p in TEMPLATES.glob("*.py.j2") if p.name != "step.py.j2")


@functools.cache
def constants_read(template: str) -> frozenset[str]:
    """The variables a template (and every file it includes) reads: the constants it can be rendered with."""
    seen, todo, names = set(), [f"{template}.py.j2"], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        ast = _ENV.parse(_ENV.loader.get_source(_ENV, name)[0])
        names |= jinja2.meta.find_undeclared_variables(ast)
        todo += [n for n in jinja2.meta.find_referenced_templates(ast) if n]
    return frozenset(names - {"TL_DTYPE", "TL_TYPE", "whole_row_chunks"})


def parse_value(text: str) -> Any:
    """true / false, null / none (any case), an int, a float (1e-6 too), else the string itself."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_overrides(items: list[str] | tuple[str, ...] | None, where: str = "--set") -> Overrides:
    """`["attention_decode.KV_TILES=true", ...]` -> {"attention_decode": {"KV_TILES": True}}; one BeamcError
    naming the first bad item and the fix."""
    out: Overrides = {}
    for item in items or ():
        name, eq, value = item.partition("=")
        template, dot, const = name.strip().partition(".")
        if not eq or not dot or not template or not const or not value.strip():
            raise BeamcError(f"{where} {item!r}", "not of the form TEMPLATE.CONSTANT=VALUE",
                             "e.g. --set attention_decode.NUM_WARPS=8")
        check(template, const, where)
        out.setdefault(template, {})[const] = parse_value(value.strip())
    return out


# Constants a package's kernels must not have pinned: they say what a kernel computes or which arguments it takes
# (its dtype, PDL, the fused epilogues and prologues a pass chose). Constants the emitter derives from the IR node
# (shapes, attributes) are refused too, when a kernel is rendered (`pin`); a tile the emitter picks is allowed.
STRUCTURAL = frozenset({"DTYPE", "PDL", "COMBINE", "ROUTED_SCALE", "GATE", "QKN", "PAGED", "MIRROR", "MIRROR_PAGES",
                        "DEQUANT", "DEQUANT_DOWN", "NATIVE_FP4", "EPILOGUE", "PACKED", "PATH", "CACHE_DTYPE", "MODE",
                        "RELAYOUT_KSPLIT"})
TUNABLE_DERIVED = frozenset({"BLOCK_N", "F16_DOT", "NUM_WARPS", "EX2_FTZ", "Q16_OUT", "TOKENS", "BLOCK_M",
                             "MAXNREG"})  # chosen by an emitter (attention_decode_tiles, attention_dot,
# ATTENTION_SLIDING_PREFILL_TILES, QK_NORM_PREFILL_TILES, ROUTER_PREFILL_TILES, MOE_DECODE_MAXNREG), not derived
# from the IR


def check(template: str, const: str, where: str = "--set") -> None:
    if template not in templates():
        raise BeamcError(f"{where} {template}.{const}", f"no kernel template {template!r}",
                         "use one of " + ", ".join(templates()))
    if const not in constants_read(template):
        raise BeamcError(f"{where} {template}.{const}", f"template {template} reads no constant {const!r}",
                         "use one of " + ", ".join(sorted(constants_read(template) - STRUCTURAL)))
    if const in STRUCTURAL:
        raise BeamcError(f"{where} {template}.{const}", f"{const} says what the kernel computes or which arguments "
                         "it takes (the compiler sets it from the IR and the passes)",
                         "pin a tile or render constant (a warp count, a block size, a render option)")


def pin(template: str, emitted: dict[str, Any], pinned: dict[str, Any], where: str = "--set") -> dict[str, Any]:
    """An emitter's constants with the overrides of its template pinned over them; refuses a constant the emitter
    derived from the IR node (a shape, an attribute: pinning it would compute something else) and a value the
    template cannot be rendered and imported with, or one that changes the kernel's launch arguments."""
    if not pinned:
        return emitted
    derived = sorted(k for k in pinned if k in emitted and k not in TUNABLE_DERIVED)
    if derived:
        raise BeamcError(f"{where} " + ", ".join(f"{template}.{k}" for k in derived),
                         "set by the compiler from the op's shapes and attributes: pinned, the kernel would compute "
                         "another op", "pin a tile or render constant (a warp count, a block size, a render option)")
    out = {**emitted, **pinned}
    _check_renders(template, emitted, out, where, pinned)
    return out


_RENDERS_CHECKED: set[str] = set()  # pinned kernels already checked (every layer's node asks for the same kernel)


@functools.cache
def _check_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="beamc_override_check_")  # one directory for the process's checked renders


def _check_renders(template: str, before: dict, after: dict, where: str, pinned: dict) -> None:
    """Render and import both forms; their launchers must take the same arguments. Once per distinct kernel."""
    import inspect

    from beamc.codegen.kernel import KernelSpec, load_source

    got = KernelSpec(template, "check", after)
    if got.name in _RENDERS_CHECKED:
        return
    names = ", ".join(f"{template}.{k}={v!r}" for k, v in pinned.items())
    try:
        mod = load_source(got.source(), f"override_{got.name}", _check_dir())
    except Exception as e:  # noqa: BLE001 - any failure of the pinned render is the override's
        raise BeamcError(f"{where} {names}", f"the kernel does not render with it ({type(e).__name__}: {e})",
                         "give a value the template accepts (see its constants' comments)") from None
    ref = KernelSpec(template, "check", before)
    base = load_source(ref.source(), f"override_{ref.name}", _check_dir())
    def runtime_args(m) -> list[str]:  # (a render may add compile-time constants, e.g. a stage's own binary, and
        # tensor descriptors its launcher builds from the arguments it already takes: attention_decode.TMA_KV)
        return [k for k, v in m.SIGNATURE.items() if v != "constexpr" and not v.startswith("tensordesc")]

    if inspect.signature(mod.launch) != inspect.signature(base.launch) or runtime_args(mod) != runtime_args(base):
        raise BeamcError(f"{where} {names}", "it changes the kernel's arguments", "pin a tile or render constant")
    _RENDERS_CHECKED.add(got.name)


def validate(overrides: Overrides | None, where: str = "--set") -> Overrides:
    """Check an overrides dict (from a manifest or a caller) as parse_overrides checks its items; a copy."""
    out: Overrides = {}
    for template, consts in (overrides or {}).items():
        for const, value in consts.items():
            check(template, const, where)
            out.setdefault(template, {})[const] = value
    return out


def unused(overrides: Overrides, used_templates: set[str]) -> list[str]:
    """Overridden templates that no kernel of a package is rendered from."""
    return sorted(t for t in overrides if t not in used_templates)
