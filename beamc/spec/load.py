"""YAML -> ModelSpec with located errors.

Every malformed spec gives one `BeamcError`, never a traceback or a pydantic dump; each problem is one line
`FILE:LINE: key.path: message` that says what was expected. Lines come from composing the YAML text a second time,
which keeps the node marks that `yaml.safe_load` throws away.
"""
from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from beamc.errors import BeamcError, read_error
from beamc.spec.schema import ModelSpec, SpecError, missing_dimensions

MAX_SPEC_BYTES = 1 << 20  # a spec is a few KB; a larger file is the wrong path
KeyPath = tuple  # a key path: keys (str) and list indices (int), e.g. ("layers", "attention", 3)


def _compose_lines(text: str) -> tuple[dict[KeyPath, int], list[tuple[KeyPath, str]]]:
    """Map each key path to its 1-based line; also return duplicate keys, which safe_load would silently merge."""
    lines: dict[KeyPath, int] = {}
    dups: list[tuple[KeyPath, str]] = []

    def walk(node: Any, path: KeyPath) -> None:
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for k, v in node.value:
                key, line = k.value, k.start_mark.line + 1
                if key in seen:
                    dups.append((path + (key,), f"duplicate key (first given at line {seen[key]}); keep one"))
                seen.setdefault(key, line)
                lines[path + (key,)] = line
                walk(v, path + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, path + (i,))

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines, dups
    if root is not None:
        walk(root, ())
    return lines, dups


def _line_for(lines: dict[KeyPath, int], path: KeyPath) -> int | None:
    """The line of the key, or of its nearest written parent (a default that fails a check is not in the file)."""
    while path:
        if path in lines:
            return lines[path]
        path = path[:-1]
    return None


def fmt_path(path: KeyPath) -> str:
    """("layers", "attention", 3) -> "layers.attention[3]"."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "<top level>"


def _model_at(path: KeyPath) -> type[BaseModel] | None:
    """The pydantic model class that holds the mapping at `path` (to list the keys it allows)."""
    model: Any = ModelSpec
    for key in path:
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            return None
        ann = field.annotation
        if typing.get_origin(ann) in (typing.Union, types.UnionType):  # `QScaleSpec | None`
            ann = next((a for a in typing.get_args(ann) if a is not type(None)), ann)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _unknown_key_message(path: KeyPath) -> str:
    model = _model_at(path[:-1])
    allowed = list(model.model_fields) if model else []
    msg = "unknown key"
    close = difflib.get_close_matches(str(path[-1]), allowed, n=1)
    if close:
        msg += f"; did you mean '{close[0]}'?"
    if allowed:
        msg += f" (allowed here: {', '.join(allowed)})"
    return msg


_EXPECTED = {  # pydantic error type -> what the key should hold
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer (no fraction)",
    "float_type": "a number", "float_parsing": "a number", "bool_type": "true or false",
    "bool_parsing": "true or false", "string_type": "a string", "list_type": "a list",
    "model_type": "a mapping (key: value entries)", "model_attributes_type": "a mapping (key: value entries)",
    "dict_type": "a mapping (key: value entries)",
}
_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="), "less_than": ("lt", "<"),
           "less_than_equal": ("le", "<=")}


def _yaml_repr(v: Any) -> str:
    """A value as the user wrote it in YAML (null, true, 'text'), short enough for one line."""
    if v is None or isinstance(v, bool):
        return {None: "null", True: "true", False: "false"}[v]
    if isinstance(v, (dict, list)):
        return "a mapping" if isinstance(v, dict) else "a list"
    return repr(v)


def validation_problems(err: ValidationError) -> list[tuple[KeyPath, str]]:
    """Each pydantic error as (key path, message saying what was expected). Also used by `beamc.spec.hf`."""
    out = []
    for e in err.errors():
        loc, kind, ctx = tuple(e["loc"]), e["type"], e.get("ctx") or {}
        got = _yaml_repr(e.get("input"))
        if isinstance(ctx.get("error"), SpecError):  # a cross-field check: its path is relative to the model
            se = ctx["error"]
            out.append((loc + tuple(int(p) if p.isdigit() else p for p in se.path.split(".")), se.message))
        elif kind == "extra_forbidden":
            out.append((loc, _unknown_key_message(loc)))
        elif kind == "missing":
            out.append((loc, f"required key is missing; add `{loc[-1]}: ...`"))
        elif kind == "literal_error":
            out.append((loc, f"expected one of {ctx['expected'].replace(' or ', ', ')}; got {got}"))
        elif kind in _EXPECTED:
            out.append((loc, f"expected {_EXPECTED[kind]}, got {got}"))
        elif kind in _BOUNDS:
            key, op = _BOUNDS[kind]
            out.append((loc, f"must be {op} {ctx[key]:g}, got {got}"))
        elif kind == "value_error":  # our field validators, whose text already says what was wrong
            out.append((loc, e["msg"].removeprefix("Value error, ")))
        else:  # anything rarer: pydantic's own text
            out.append((loc, f"{e['msg']} (got {got})"))
    return out


def raise_problems(source: str, problems: list[tuple[int | None, str]], what: str = "spec") -> typing.NoReturn:
    """One error for all problems: a single one is one line, several are listed one per line under a header."""
    # in file order (located-nowhere ones, such as missing keys, first), each once
    problems = sorted(dict.fromkeys(problems), key=lambda p: p[0] or 0)
    lines = [f"{source}:{line}: {msg}" if line else f"{source}: {msg}" for line, msg in problems]
    if len(lines) == 1:
        raise BeamcError("", lines[0])
    raise BeamcError(source, f"{len(lines)} problems in the {what}:\n  " + "\n  ".join(lines))


def parse_spec(data: Any, source: str = "<spec>", text: str | None = None) -> ModelSpec:
    """Validate already-parsed YAML data; raise one BeamcError listing every problem with its location."""
    lines, dups = _compose_lines(text) if text else ({}, [])
    if data is None:
        raise_problems(source, [(None, "the spec is empty; expected a YAML mapping with at least `name:` "
                               "(see models/beam.yaml)")])
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"the scalar {_yaml_repr(data)}"
        raise_problems(source, [(lines.get(()), f"expected a YAML mapping (key: value lines) at the top level, "
                                                f"got {kind}")])
    problems = [(_line_for(lines, p), f"{fmt_path(p)}: {m}") for p, m in dups]
    try:
        spec = ModelSpec.model_validate(data)
    except ValidationError as err:
        problems += [(_line_for(lines, p), f"{fmt_path(p)}: {m}") for p, m in validation_problems(err)]
    except SpecError as err:  # raised outside pydantic's wrapping
        problems.append((None, f"{err.path}: {err.message}"))
    if problems:
        raise_problems(source, problems)
    missing = missing_dimensions(data, spec)  # only once the rest is valid: the layer kinds decide what is needed
    if missing:
        raise_problems(source, [(_line_for(lines, p[:-1]) if len(p) > 1 else None,
                                 f"{fmt_path(p)}: a model dimension, required (no default is implied); "
                                 f"add `{p[-1]}: ...`") for p in missing])
    return spec


def load_spec(path: str | Path) -> ModelSpec:
    """Read and validate a spec file (`models/beam.yaml`)."""
    p = Path(path)
    if not p.exists():
        raise BeamcError(str(p), "spec file not found", "pass a path such as models/beam.yaml")
    if p.is_dir():
        raise BeamcError(str(p), "is a directory, expected a spec YAML file", "pass a path such as models/beam.yaml")
    if not p.is_file():  # /dev/zero, a FIFO: reading would never end or never return
        raise BeamcError(str(p), "not a regular file, expected a spec YAML file",
                         "pass a path such as models/beam.yaml")
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)  # bounded even where st_size lies (/proc files report 0)
    except OSError as e:
        raise read_error(p, e, "spec") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise BeamcError(str(p), f"larger than {MAX_SPEC_BYTES >> 20} MiB; a spec YAML file is a few KB",
                         "pass a path such as models/beam.yaml")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BeamcError(str(p), "not a UTF-8 text file; expected a spec YAML file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark else str(p)
        problem = getattr(e, "problem", None) or str(e)
        col = f" (column {mark.column + 1})" if mark else ""
        raise BeamcError(where, f"not valid YAML: {problem}{col}") from None
    return parse_spec(data, str(p), text)
