"""The errors rpb raises for problems with what it was given (not for bugs).

Every named error derives from ``RpbError``: bad data rows, a bad configuration, a prior that
belongs to another run, a model no adapter fits, a bad argument, and the like. Each one's
message names the file, line, field or argument at fault, so the command line prints it
alone and exits 2; any other exception is a bug, printed with its traceback (exit 1).
``RpbError`` is a ``ValueError``, so code that caught those before still does.
"""


class RpbError(ValueError):
    """A problem with rpb's input, explained by its message."""


class ArgumentError(RpbError):
    """An argument (command-line option or function parameter) that rpb cannot use."""


class ConfigError(RpbError):
    """Every problem with a configuration (``source``: the file or object), listed at once."""

    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        super().__init__(f"{source}: {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))
