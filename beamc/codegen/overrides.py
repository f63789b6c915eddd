"""Template overrides: `--set TEMPLATE.CONSTANT=VALUE`, a template constant pinned for every kernel of a package.

For kernel engineers: try a tile, a warp count or a render option of one template inside the whole model (the
decode step, the ablation) without editing an emitter. The value replaces what the emitter would have passed (or
the template's own default) in every kernel rendered from that template; the manifest records the overrides, and
the runtime rebuilds the package with them (a package on disk stays what beamc generates from its manifest).

Checked here, before any work: the template exists, and it reads the constant (jinja2's list of the variables a
template uses, its includes' too), so a misspelt name is an error, not a silent no-op. After lowering,
`compile_package` checks that some kernel of the package was rendered from each overridden template.
An override is not a proof: the package's kernels are checked by the same tests as any other render only where
those tests run it (`beamc compile ... --set ...` then the GPU tests or `bench/full_model.py --set`).
"""
from __future__ import annotations

import functools
from typing import Any

import jinja2.meta
import yaml

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
    """A YAML scalar: true / false, integers, floats, null; anything else stays a string."""
    try:
        v = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return v if isinstance(v, (bool, int, float, str)) or v is None else text


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


def check(template: str, const: str, where: str = "--set") -> None:
    if template not in templates():
        raise BeamcError(f"{where} {template}.{const}", f"no kernel template {template!r}",
                         "use one of " + ", ".join(templates()))
    if const not in constants_read(template):
        raise BeamcError(f"{where} {template}.{const}", f"template {template} reads no constant {const!r}",
                         "use one of " + ", ".join(sorted(constants_read(template))))


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
