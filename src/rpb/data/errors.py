"""Errors that name the file, line and field of every bad row, all at once."""

from __future__ import annotations

from dataclasses import dataclass

from rpb.errors import RpbError


@dataclass(frozen=True)
class RowError:
    """One problem with one row. ``line`` is 1-based, as editors show it."""

    line: int
    kind: str  # short machine-readable name, e.g. "blank", "malformed-json", "empty-q-span"
    message: str
    field: str | None = None

    def format(self, path: str) -> str:
        where = f"{path}:{self.line}"
        field = f" [{self.field}]" if self.field else ""
        return f"{where}: {self.kind}{field}: {self.message}"


class RowProblem(Exception):
    """Raised while handling a single row; turned into a RowError by the caller."""

    def __init__(self, kind: str, message: str, field: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.field = field

    def at(self, line: int) -> RowError:
        return RowError(line=line, kind=self.kind, message=self.message, field=self.field)


class DataError(RpbError):
    """Every bad row of a data file, reported together."""

    def __init__(self, path: str, errors: list[RowError]):
        self.path = str(path)
        self.errors = list(errors)
        lines = [e.format(self.path) for e in self.errors]
        head = f"{len(self.errors)} bad row(s) in {self.path}; nothing was computed or written:"
        super().__init__("\n".join([head, *("  " + line for line in lines)]))

    @property
    def kinds(self) -> list[str]:
        return [e.kind for e in self.errors]
