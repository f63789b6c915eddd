"""User-facing errors: one clear message naming the place at fault and the fix. The CLI prints these without a
traceback; everything else is a bug and keeps its traceback."""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path


class BeamcError(Exception):
    """An error caused by the user's input (spec, checkpoint, command line, runtime call)."""

    def __init__(self, where: str, message: str, fix: str | None = None):
        self.where, self.message, self.fix = where, message, fix
        text = f"{where}: {message}" if where else message
        if fix:
            text += f" ({fix})"
        super().__init__(text)


def ensure_dir(path, where: str):
    """Create an output directory, or raise one BeamcError saying why it can't be (a file is there, no permission)."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BeamcError(where, f"cannot create directory {p}: {e.strerror}", "choose another path") from None
    return p


_READ_FIXES = {errno.EACCES: "check the file's permissions", errno.EPERM: "check the file's permissions",
               errno.EISDIR: "pass a file, not a directory"}


def read_error(path, e: OSError, where: str) -> BeamcError:
    """The BeamcError for a file that is there but cannot be read: `cannot read FILE: Permission denied`."""
    return BeamcError(where, f"cannot read {path}: {e.strerror or e}", _READ_FIXES.get(e.errno))


def check_readable(path, where: str) -> Path:
    """Raise one BeamcError unless `path` is a regular file this process can open for reading."""
    p = Path(path)
    if p.is_dir():
        raise BeamcError(where, f"cannot read {p}: Is a directory", "pass a file, not a directory")
    if p.exists() and not p.is_file():  # a FIFO or device: opening it could block or never end
        raise BeamcError(where, f"cannot read {p}: not a regular file", "pass a regular file")
    try:
        with open(p, "rb"):
            pass
    except OSError as e:
        raise read_error(p, e, where) from None
    return p


def _check_creatable(d: Path, where: str) -> None:
    """A directory that does not exist yet can be made: its nearest existing ancestor is a writable directory."""
    anc = d
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise BeamcError(where, f"cannot create directory {d}: {anc} is not a directory", "choose another path")
    try:  # a probe directory, removed at once: permissions, read-only and pseudo file systems (/proc) all answer
        os.rmdir(tempfile.mkdtemp(dir=anc))
    except OSError as e:
        raise BeamcError(where, f"cannot create directory {d}: {e.strerror or e}", "choose another path") from None


def check_output_dir(path, where: str) -> Path:
    """Check, before any work, that files can be written in the directory `path` (made later if missing)."""
    p = Path(path)
    if not p.exists():
        _check_creatable(p, where)
        return p
    if not p.is_dir():
        raise BeamcError(where, f"{p} exists and is not a directory", "choose another path")
    try:  # a read-only directory or file system fails here; nothing is left behind
        tempfile.TemporaryFile(dir=p).close()
    except OSError as e:
        raise BeamcError(where, f"cannot write in {p}: {e.strerror or e}", "choose another path") from None
    return p


def check_output_file(path, where: str) -> Path:
    """Check, before any work, that a file can be written at `path`: it is not a directory, its parent exists (or
    can be created) and is writable. Nothing is left behind: a probe file created here is removed again."""
    p = Path(path)
    fix = "choose another path"
    if p.is_dir():
        raise BeamcError(where, f"{p} is a directory, expected a file path", "give a file name inside it")
    if p.exists() and not p.is_file():
        raise BeamcError(where, f"{p} is not a regular file", fix)
    parent = p.parent
    if not parent.exists():
        _check_creatable(parent, where)
        return p
    if not parent.is_dir():
        raise BeamcError(where, f"cannot write {p}: {parent} is not a directory", fix)
    existed = p.exists()
    try:
        with open(p, "ab"):
            pass
    except OSError as e:
        raise BeamcError(where, f"cannot write {p}: {e.strerror or e}", fix) from None
    if not existed:
        p.unlink(missing_ok=True)
    return p
