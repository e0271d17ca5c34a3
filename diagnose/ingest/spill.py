"""What the parent keeps on disk rather than in memory while it analyses a run.

What a rank brings back that the analysis reads once, or for a few ranks only, is written to one
anonymous temporary file (unlinked at once on POSIX, gone with the run) as it arrives and read
back when needed (#20: the client's memory should not grow with the rank count):
- the mini timeline (step/cover.py's Drawing): most of a GPU rank's result (96 of 113 KiB for a
  26 MB ResNet-50 rank), drawn for 16 ranks at most, after the checklist; the step graph's lanes
  and the stretches of exposed communication (read once by the graph, the breakdown and the
  communication table);
- after the checks' per-rank reductions: their summaries (each read by its own check;
  SpilledMap), the idle model (read by the breakdown), the cited events (read for the events a
  finding cites) and the rank's collectives (read when the run is assembled);
- once gathered, the run's collective columns (Run.collectives, each column read back alone), and
  once built, the step model's graph (step/graph.GraphOnDisk: its node columns, read back by
  each edit, and by each replay a block of nodes at a time), each in a spill of its own.
With what else Keep (ingest/assemble.py) shares, a replicated DLRM rank in the parent went from
32.6 to 4.1 KB, mostly pandas' and Python's per-object cost, not data; held as a row of run-wide
columns (ingest/store.py), 2.4 KB with its collectives. What goes to disk arrives pickled where
it was made (Packed) and is written as it is.
Where no temporary file can be made, everything stays in memory: the analysis never depends on
the disk.

The file holds only what this process or its workers pickled (the results of this code), never
input from a trace file as such.
"""
from __future__ import annotations

import pickle
import tempfile
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

import numpy as np


PROTOCOL = 4
"""Not 5: a small numpy array unpickled from protocol 5 keeps a buffer object of its own beside it
(an idle model read back held 9.9 KB against 2.6 KB from protocol 4)."""


class Spill:
    """One run's spilled objects, in one temporary file opened at the first put."""

    def __init__(self) -> None:
        self._file: IO[bytes] | None = None
        self._broken = False
        self._end = 0  # the file's length: each put goes there
        self._at_end = True  # the file's position is its end (no read since the last put)
        self._keys: dict[tuple[str, ...], tuple[str, ...]] = {}  # one tuple for the ranks' equal keys

    def put(self, obj: Any) -> Any:
        """A handle to read `obj` back (Spilled), or `obj` itself where the disk is not to be had
        (a Packed one, unpacked)."""
        if self._broken:
            return unpacked(obj)
        data = obj.blob if isinstance(obj, Packed) else pickle.dumps(obj, protocol=PROTOCOL)
        at = self._append(data)
        return unpacked(obj) if at is None else Spilled(self, at, len(data))

    def put_array(self, a: np.ndarray) -> SpilledArray | np.ndarray:
        """A handle to read a 1-d array of plain numbers back whole or a stretch at a time
        (SpilledArray), or `a` itself where the disk is not to be had."""
        assert a.ndim == 1 and not a.dtype.hasobject, "raw bytes: numbers only"
        at = None if self._broken else self._append(np.ascontiguousarray(a).tobytes())
        return a if at is None else SpilledArray(self, at, a.dtype, a.size)

    def put_map(self, d: dict[str, Any]) -> Mapping[str, Any]:
        """A mapping that reads each value back when looked up (SpilledMap), or `d`'s values
        themselves (unpacked) where the disk is not to be had."""
        if self._broken or not d:
            return {k: unpacked(v) for k, v in d.items()}
        # each value written as it is pickled, one after the other: not every value's bytes and
        # then their join at once, three copies of a table at its writer's height (#20)
        ends = array("Q")
        at, n = None, 0
        for v in d.values():
            b = v.blob if isinstance(v, Packed) else pickle.dumps(v, protocol=PROTOCOL)
            where = self._append(b)
            if where is None or (at is not None and where != at + n):
                return {k: unpacked(v) for k, v in d.items()}
            at = where if at is None else at
            n += len(b)
            ends.append(n)
            del b
        keys = tuple(d)
        return SpilledMap(self, self._keys.setdefault(keys, keys), at, ends)

    def _append(self, data: bytes) -> int | None:
        try:
            if self._file is None:
                self._file = tempfile.TemporaryFile(prefix="diagnose-spill-")
            if not self._at_end:  # a seek flushes the writes buffered: only after a read
                self._file.seek(self._end)
                self._at_end = True
            at = self._end
            self._file.write(data)
        except OSError:
            self._broken = True
            return None
        self._end = at + len(data)
        return at

    def read(self, at: int, size: int) -> bytes:
        assert self._file is not None
        self._file.flush()
        self._file.seek(at)
        self._at_end = False
        return self._file.read(size)


@dataclass(frozen=True, slots=True)
class Packed:
    """An object pickled where it was made (a worker), for the parent to write to its spill as it
    is: what lies on disk is never built in the parent while the ranks arrive, its objects and
    the memory they leave behind once freed (#20: the client's resident memory grew ~2x what a
    rank keeps while results arrived), nor pickled there a second time."""

    blob: bytes

    def load(self) -> Any:
        return pickle.loads(self.blob)


def pack(obj: Any) -> Packed:
    return Packed(pickle.dumps(obj, protocol=PROTOCOL))


def unpacked(x: Any) -> Any:
    return x.load() if isinstance(x, Packed) else x


@dataclass(frozen=True, slots=True)
class Spilled:
    """Where one object lies in its spill."""

    spill: Spill
    at: int
    size: int

    def load(self) -> Any:
        return pickle.loads(self.spill.read(self.at, self.size))


@dataclass(frozen=True, slots=True)
class SpilledArray:
    """Where a 1-d array's raw bytes lie in its spill: unlike a pickle, a stretch of it can be read
    alone (a replay reads its graph's columns a block of nodes at a time: step/graph.replay)."""

    spill: Spill
    at: int
    dtype: np.dtype
    n: int

    def load(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Elements [lo, hi) (the whole array by default): a fresh, read-only copy."""
        hi = self.n if hi is None else min(hi, self.n)
        size = self.dtype.itemsize
        return np.frombuffer(self.spill.read(self.at + lo * size, max(hi - lo, 0) * size), dtype=self.dtype)


def array_stretch(x: SpilledArray | np.ndarray, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """Elements [lo, hi) of what Spill.put_array gave, read-only: read back from disk, or a view of
    the array itself where the disk was not to be had (its owner never writes it either)."""
    if isinstance(x, SpilledArray):
        return x.load(lo, hi)
    v = x[lo:hi]
    v.setflags(write=False)
    return v


class ArrayBlocks:
    """What Spill.put_array gave, read a block of `block` elements at a time as elements are asked
    for (`blocks[i]`, `blocks[array_of_i]`): for a reader that follows a few elements through a
    long array (the critical path: step/graph.critical_path, critical_segments). `keep`: the
    blocks held at most, the least recently read going first (None: every block read, each read
    once)."""

    __slots__ = ("_x", "_block", "_read", "_keep")

    def __init__(self, x: SpilledArray | np.ndarray, block: int = 4096, keep: int | None = None) -> None:
        self._x, self._block, self._read, self._keep = x, block, {}, keep

    def _of(self, b: int) -> np.ndarray:
        got = self._read.pop(b, None)
        if got is None:
            got = array_stretch(self._x, b * self._block, (b + 1) * self._block)
            if self._keep is not None and len(self._read) >= self._keep:
                del self._read[next(iter(self._read))]
        self._read[b] = got  # last in the order: the most recently read
        return got

    def __getitem__(self, i):
        if isinstance(i, (int, np.integer)):
            b = int(i) // self._block
            return self._of(b)[int(i) - b * self._block]
        i = np.asarray(i, dtype=np.int64)
        out = np.empty(i.shape, dtype=self._x.dtype)
        for b in np.unique(i // self._block).tolist():
            sel = i // self._block == b
            out[sel] = self._of(b)[i[sel] - b * self._block]
        return out


def unspilled(x: Any) -> Any:
    """x itself, or what it stands for when spilled."""
    return x.load() if isinstance(x, Spilled) else x


class SpilledMap(Mapping):
    """A dict whose values lie back to back in a spill: each lookup reads one value back, a fresh
    copy (what the parent reads of a rank is never written). Per object it holds a key shared by
    the ranks and 8 bytes: one Spilled per value was about 120 bytes, 1.8 KB a rank for 15 checks."""

    __slots__ = ("_spill", "_keys", "_at", "_ends")

    def __init__(self, spill: Spill, keys: tuple[str, ...], at: int, ends: array) -> None:
        self._spill, self._keys, self._at, self._ends = spill, keys, at, ends

    def where(self) -> tuple[Spill, tuple[str, ...], int, array]:
        """(spill, keys, offset of the first value, each value's end after it): how it is held."""
        return self._spill, self._keys, self._at, self._ends

    def __getitem__(self, key: str) -> Any:
        try:
            i = self._keys.index(key)
        except ValueError:
            raise KeyError(key) from None
        lo = self._ends[i - 1] if i else 0
        return pickle.loads(self._spill.read(self._at + lo, self._ends[i] - lo))

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class Unspilling(Mapping):
    """A dict whose values may be Spilled, read back on lookup (each rank's idle model in Run.idle
    where the ranks keep their objects: ingest/assemble._hold)."""

    __slots__ = ("_d",)

    def __init__(self, d: dict) -> None:
        self._d = d

    def __getitem__(self, key: Any) -> Any:
        return unspilled(self._d[key])

    def __iter__(self) -> Iterator:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)
