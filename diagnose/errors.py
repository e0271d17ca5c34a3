"""The one error type users see: a message naming the file and the problem."""
from __future__ import annotations

from pathlib import Path


class DiagnoseError(Exception):
    """Bad input a user can act on. The CLI prints it as one line and exits 2."""

    def __init__(self, problem: str, path: str | Path | None = None) -> None:
        self.path = str(path) if path is not None else None
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path else problem)
