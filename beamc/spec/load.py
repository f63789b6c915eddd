"""YAML -> ModelSpec with located errors: every problem is reported as `FILE:LINE: key.path: message`."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from beamc.errors import BeamcError
from beamc.spec.schema import ModelSpec, SpecError


def _compose_lines(text: str) -> dict[tuple, int]:
    """Map each key path (tuple of keys / list indices) to its 1-based line in the YAML text."""
    lines: dict[tuple, int] = {}

    def walk(node: Any, path: tuple) -> None:
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = k.value
                lines[path + (key,)] = k.start_mark.line + 1
                walk(v, path + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, path + (i,))

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, ())
    return lines


def _line_for(lines: dict[tuple, int], path: tuple) -> int | None:
    while path:
        if path in lines:
            return lines[path]
        path = path[:-1]
    return None


def _fmt_path(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "<top level>"


def _pydantic_messages(err: ValidationError) -> list[tuple[tuple, str]]:
    msgs = []
    for e in err.errors():
        loc = tuple(x for x in e["loc"])
        ctx_err = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_err, SpecError):
            path = tuple(int(p) if p.isdigit() else p for p in ctx_err.path.split("."))
            msgs.append((loc + path, ctx_err.message))
            continue
        kind = e["type"]
        if kind == "extra_forbidden":
            msg = "unknown key (remove it or check its spelling)"
        elif kind == "missing":
            msg = "required key is missing"
        elif kind == "literal_error":
            msg = f"got {e.get('input')!r}, {e['msg'][0].lower()}{e['msg'][1:]}"
        else:
            msg = f"{e['msg']} (got {e.get('input')!r})"
        msgs.append((loc, msg))
    return msgs


def parse_spec(data: Any, source: str = "<spec>", text: str | None = None) -> ModelSpec:
    """Validate already-parsed YAML data; raise one BeamcError listing every problem with its location."""
    lines = _compose_lines(text) if text else {}
    if not isinstance(data, dict):
        raise BeamcError(source, f"the spec must be a YAML mapping at the top level, got {type(data).__name__}")
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as err:
        parts = []
        for path, msg in _pydantic_messages(err):
            line = _line_for(lines, path)
            where = f"{source}:{line}" if line else source
            parts.append(f"{where}: {_fmt_path(path)}: {msg}")
        raise BeamcError("", "invalid spec:\n  " + "\n  ".join(parts)) from None
    except SpecError as err:  # raised outside pydantic's wrapping
        raise BeamcError(source, f"{err.path}: {err.message}") from None


def load_spec(path: str | Path) -> ModelSpec:
    """Read and validate a spec file (`models/beam.yaml`)."""
    p = Path(path)
    if not p.is_file():
        raise BeamcError(str(p), "spec file not found", "pass a path such as models/beam.yaml")
    text = p.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark else str(p)
        raise BeamcError(where, f"not valid YAML: {getattr(e, 'problem', e)}") from None
    return parse_spec(data, str(p), text)
