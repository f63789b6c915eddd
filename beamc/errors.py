"""User-facing errors: one clear message naming the place at fault and the fix. The CLI prints these without a
traceback; everything else is a bug and keeps its traceback."""


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
    from pathlib import Path

    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BeamcError(where, f"cannot create directory {p}: {e.strerror}", "choose another path") from None
    return p
