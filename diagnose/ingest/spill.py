"""What the parent keeps on disk rather than in memory while it analyses a run.

Each rank's mini timeline (step/cover.py's Drawing: the longest intervals of each lane, every
step) is most of what a GPU rank brings back (96 of 113 KiB for a 26 MB ResNet-50 rank), yet the
report draws 16 ranks at most, after the checklist. So each arriving rank's drawing is written to
one anonymous temporary file (unlinked at once on POSIX, gone with the run) and read back only
for the ranks drawn (#20: the client's memory per rank). Where no temporary file can be made, it
stays in memory: the analysis never depends on the disk.

The file holds only what this process pickled itself, never input from a trace file as such.
"""
from __future__ import annotations

import pickle
import tempfile
from dataclasses import dataclass
from typing import IO, Any


class Spill:
    """One run's spilled objects, in one temporary file opened at the first put."""

    def __init__(self) -> None:
        self._file: IO[bytes] | None = None
        self._broken = False

    def put(self, obj: Any) -> Any:
        """A handle to read `obj` back (Spilled), or `obj` itself where the disk is not to be had."""
        if self._broken:
            return obj
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            if self._file is None:
                self._file = tempfile.TemporaryFile(prefix="diagnose-spill-")
            at = self._file.seek(0, 2)
            self._file.write(data)
        except OSError:
            self._broken = True
            return obj
        return Spilled(self, at, len(data))

    def read(self, at: int, size: int) -> bytes:
        assert self._file is not None
        self._file.flush()
        self._file.seek(at)
        return self._file.read(size)


@dataclass(frozen=True, slots=True)
class Spilled:
    """Where one object lies in its spill."""

    spill: Spill
    at: int
    size: int

    def load(self) -> Any:
        return pickle.loads(self.spill.read(self.at, self.size))


def unspilled(x: Any) -> Any:
    """x itself, or what it stands for when spilled."""
    return x.load() if isinstance(x, Spilled) else x
