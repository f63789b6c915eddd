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
