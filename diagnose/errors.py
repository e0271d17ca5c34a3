"""The one error type users see: a message naming the file and the problem."""
from __future__ import annotations

from pathlib import Path


def one_line(text: str) -> str:
    """Text fit for one terminal line: control characters (a newline in a file name, a
    lone surrogate from non-UTF-8 bytes) are shown escaped, never acted on."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class DiagnoseError(Exception):
    """Bad input a user can act on. The CLI prints it as one line and exits 2."""

    def __init__(self, problem: str, path: str | Path | None = None) -> None:
        self.path = one_line(str(path)) if path is not None else None
        self.problem = one_line(problem)
        super().__init__(f"{self.path}: {self.problem}" if self.path else self.problem)
