"""The loaded run's ranks held column-wise: one array per field for every rank, a rank's
RankTimeline, RankTrace, checks' summaries (SpilledMap) and idle model handle built when it is
looked up (Run.timelines, .traces, .facts, .idle).

Why (#20, the client's memory should not grow with the rank count): after the checks' per-rank
reductions a rank's timeline and trace are a few numbers, a few short arrays and handles to what
lies on disk, yet as objects of their own (a timeline, its steps' three arrays, its cover, seven
disk handles and their offsets, a trace, its path, the summaries' map and its offsets) they held
about 3 KB a replicated DLRM rank in the parent: Python's and numpy's cost per object, not data. Here a rank is a row of arrays that
every rank shares (its steps and cover rows a slice of one array each), and the objects a reader
gets are built for it and gone when it is done. The arrays are read-only: what a reader gets is a
view, and the parent never writes what a rank brought back.

Only what is held as the reductions leave it is stored so (no interval sets, events on disk): a
run loaded without them (tools that read every event) keeps its objects (`compact` gives them
back unchanged).
"""
from __future__ import annotations

import ctypes
from array import array
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from diagnose.ingest.load import RankTrace
from diagnose.ingest.spill import Spilled, SpilledMap, unspilled
from diagnose.step.cover import RankCover
from diagnose.step.timeline import RankTimeline, Steps


class _Handles:
    """One field's value for each rank where it may lie on disk: (at, size) arrays when every
    rank's is a Spilled in the same spill, else the objects themselves."""

    __slots__ = ("_spill", "_at", "_size", "_objs")

    def __init__(self, values: list[Any]) -> None:
        spills = {id(v.spill) for v in values if isinstance(v, Spilled)}
        if values and len(spills) == 1 and all(isinstance(v, Spilled) for v in values):
            self._spill = values[0].spill
            self._at = _frozen(np.array([v.at for v in values], dtype=np.int64))
            self._size = _frozen(np.array([v.size for v in values], dtype=np.int64))
            self._objs: list[Any] | None = None
        else:
            self._spill, self._at, self._size, self._objs = None, None, None, list(values)

    def __getitem__(self, i: int) -> Any:
        if self._objs is not None:
            return self._objs[i]
        return Spilled(self._spill, int(self._at[i]), int(self._size[i]))


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def _concat(parts: list[np.ndarray], dtype: Any, width: int | None = None) -> np.ndarray:
    if parts:
        return _frozen(np.concatenate(parts).astype(dtype, copy=False))
    return _frozen(np.empty((0,) if width is None else (0, width), dtype=dtype))


class _Ranks(Mapping):
    """Sorted rank ids and a rank's position among them."""

    __slots__ = ("_ranks",)

    def __init__(self, ranks: list[int]) -> None:
        self._ranks = _frozen(np.array(sorted(ranks), dtype=np.int64))

    def _pos(self, rank: Any) -> int:
        if isinstance(rank, (int, np.integer)) and not isinstance(rank, bool):
            i = int(np.searchsorted(self._ranks, rank))
            if i < self._ranks.size and self._ranks[i] == rank:
                return i
        raise KeyError(rank)

    def __iter__(self) -> Iterator[int]:
        return (int(r) for r in self._ranks)

    def __len__(self) -> int:
        return int(self._ranks.size)

    def __contains__(self, rank: object) -> bool:
        try:
            self._pos(rank)
        except KeyError:
            return False
        return True

    def __getitem__(self, rank: Any) -> Any:
        i = self._pos(rank)
        return self._build(int(self._ranks[i]), i)

    def _build(self, rank: int, i: int) -> Any:
        raise NotImplementedError


class TimelineStore(_Ranks):
    """rank -> RankTimeline as the parent keeps it (`RankTimeline.for_parent`, cover set)."""

    __slots__ = ("_file", "_is_gpu", "_source", "_warnings", "_device_timed", "_off", "_step", "_start",
                 "_end", "_per_step", "_n_comm", "_n_dl", "_coll", "_exposed", "_lanes", "_drawing")

    def __init__(self, timelines: Mapping[int, RankTimeline]) -> None:
        super().__init__(list(timelines))
        tls = [timelines[int(r)] for r in self._ranks]
        self._file = [t.file for t in tls]
        self._source = [t.step_source for t in tls]
        self._warnings = [t.warnings for t in tls]
        self._is_gpu = _frozen(np.array([t.is_gpu for t in tls], dtype=bool))
        self._device_timed = _frozen(np.array([t.device_timed for t in tls], dtype=bool))
        self._off = _frozen(np.concatenate([[0], np.cumsum([len(t.steps) for t in tls])]).astype(np.int64))
        self._step = _concat([t.steps.step for t in tls], np.int64)
        self._start = _concat([t.steps.start for t in tls], np.float64)
        self._end = _concat([t.steps.end for t in tls], np.float64)
        covers = [t.cover for t in tls]
        assert all(c is not None for c in covers)
        width = covers[0].per_step.shape[1] if covers else 0
        self._per_step = _concat([c.per_step for c in covers], np.float64, width)
        self._n_comm = _frozen(np.array([c.n_comm for c in covers], dtype=np.int64))
        self._n_dl = _frozen(np.array([c.n_dataloader for c in covers], dtype=np.int64))
        self._coll = _Handles([t.collectives for t in tls])
        self._exposed = _Handles([c.exposed for c in covers])
        self._lanes = _Handles([c.lanes for c in covers])
        self._drawing = _Handles([c.drawing for c in covers])

    @staticmethod
    def fits(tl: RankTimeline) -> bool:
        """Held as the reductions leave it: no interval sets, a cover whose rows are the steps'."""
        return (tl.cover is not None and tl.compute is None and tl.comm is None and tl.dataloader is None
                and tl.host_busy is None and tl.compiled is None and tl.input_copies is None
                and tl.comm_threads is None and tl.cover.per_step.shape[0] == len(tl.steps)
                and tl.steps.step.dtype == np.int64 and tl.steps.start.dtype == np.float64
                and tl.steps.end.dtype == np.float64 and tl.cover.per_step.dtype == np.float64)

    def _build(self, rank: int, i: int) -> RankTimeline:
        a, b = int(self._off[i]), int(self._off[i + 1])
        cover = RankCover(per_step=self._per_step[a:b], n_comm=int(self._n_comm[i]), n_dataloader=int(self._n_dl[i]),
                          exposed=self._exposed[i], lanes=self._lanes[i], drawing=self._drawing[i])
        return RankTimeline(rank=rank, file=self._file[i], is_gpu=bool(self._is_gpu[i]), step_source=self._source[i],
                            steps=Steps(step=self._step[a:b], start=self._start[a:b], end=self._end[a:b]),
                            compute=None, comm=None, dataloader=None, host_busy=None, collectives=self._coll[i],
                            comm_threads=None, compiled=None, warnings=self._warnings[i], input_copies=None,
                            device_timed=bool(self._device_timed[i]), cover=cover)


class TraceStore(_Ranks):
    """rank -> RankTrace as the parent keeps it after the reductions (cited events on disk, no
    args, no thread names). A trace looked up is a fresh object: the parent reads it, never writes."""

    __slots__ = ("_path", "_source", "_meta", "_events", "_names", "_warnings", "_ints", "_flags", "_span")

    def __init__(self, traces: Mapping[int, RankTrace]) -> None:
        super().__init__(list(traces))
        ts = [traces[int(r)] for r in self._ranks]
        self._path = [str(t.path) for t in ts]
        self._source = [t.rank_source for t in ts]
        self._meta = [t.meta for t in ts]
        self._names = [t.thread_names for t in ts]
        self._warnings = [t.warnings or None for t in ts]  # an empty list is 56 bytes of its own
        self._events = _Handles([t.events for t in ts])
        self._ints = _frozen(np.array([(t.flows, t.dropped, t.bytes_read) for t in ts], dtype=np.int64).reshape(-1, 3))
        self._flags = _frozen(np.array([(t.salvaged, t.hip, t.span_us is not None) for t in ts], dtype=bool).reshape(-1, 3))
        self._span = _frozen(np.array([t.span_us or (0.0, 0.0) for t in ts], dtype=np.float64).reshape(-1, 2))

    @staticmethod
    def fits(t: RankTrace) -> bool:
        return (isinstance(t.events, Spilled) and t.comm_args is None and not t.thread_names
                and t.rank is not None and isinstance(t.path, Path)
                and all(type(x) is int for x in (t.flows, t.dropped, t.bytes_read))
                and (t.span_us is None or all(type(x) is float for x in t.span_us)))

    def _build(self, rank: int, i: int) -> RankTrace:
        flows, dropped, bytes_read = (int(x) for x in self._ints[i])
        salvaged, hip, has_span = (bool(x) for x in self._flags[i])
        w = self._warnings[i]
        return RankTrace(path=Path(self._path[i]), rank=rank, rank_source=self._source[i], meta=self._meta[i],
                         events=self._events[i], comm_args=None, thread_names=self._names[i], flows=flows,
                         dropped=dropped, warnings=w if w is not None else [], salvaged=salvaged,
                         bytes_read=bytes_read, span_us=(float(self._span[i, 0]), float(self._span[i, 1])) if has_span else None,
                         hip=hip)


class SpilledByRank(_Ranks):
    """rank -> an object read back from disk at each lookup (a GPU rank's idle model)."""

    __slots__ = ("_handles",)

    def __init__(self, values: Mapping[int, Any]) -> None:
        super().__init__(list(values))
        self._handles = _Handles([values[int(r)] for r in self._ranks])

    def _build(self, rank: int, i: int) -> Any:
        return unspilled(self._handles[i])


class FactsStore(_Ranks):
    """rank -> each check's per-rank summary (a SpilledMap) where every rank's lies in one spill
    under the same checks: one offset and one row of ends a rank."""

    __slots__ = ("_spill", "_keys", "_at", "_ends")

    def __init__(self, facts: Mapping[int, SpilledMap]) -> None:
        super().__init__(list(facts))
        parts = [facts[int(r)].where() for r in self._ranks]
        self._spill, self._keys = parts[0][0], parts[0][1]
        self._at = _frozen(np.array([p[2] for p in parts], dtype=np.int64))
        self._ends = _frozen(np.array([p[3] for p in parts], dtype=np.uint64).reshape(len(parts), len(self._keys)))

    @staticmethod
    def fits(facts: Mapping[int, Mapping[str, Any]]) -> bool:
        maps = list(facts.values())
        if not maps or not all(isinstance(m, SpilledMap) for m in maps):
            return False
        spill, keys = maps[0].where()[:2]
        return all(m.where()[0] is spill and m.where()[1] == keys for m in maps)

    def _build(self, rank: int, i: int) -> SpilledMap:
        return SpilledMap(self._spill, self._keys, int(self._at[i]), array("Q", self._ends[i].tolist()))


def compact(traces: dict[int, RankTrace], timelines: dict[int, RankTimeline], facts: dict[int, Mapping[str, Any]],
            idle: dict[int, Any]) -> tuple[Mapping[int, RankTrace], Mapping[int, RankTimeline],
                                           Mapping[int, Mapping[str, Any]], Mapping[int, Any]]:
    """The run's traces, timelines, checks' summaries and idle models column-wise where every rank
    is held as the reductions leave it; each unchanged otherwise (idle models read back at each
    lookup either way)."""
    t = TraceStore(traces) if traces and all(TraceStore.fits(x) and x.rank == r for r, x in traces.items()) else traces
    tl = TimelineStore(timelines) if timelines and all(TimelineStore.fits(x) and x.rank == r
                                                       for r, x in timelines.items()) else timelines
    f = FactsStore(facts) if FactsStore.fits(facts) else facts
    return t, tl, f, SpilledByRank(idle)


def _trim() -> Callable[[], object] | None:
    try:
        f = ctypes.CDLL(None).malloc_trim
        f.argtypes, f.restype = [ctypes.c_size_t], ctypes.c_int
        return f
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to call, nothing lost
        return None


_MALLOC_TRIM = _trim()


def give_back_freed() -> None:
    """Return the heap's free pages to the system between the analysis's phases (glibc's
    malloc_trim; elsewhere nothing). Each phase's short-lived arrays and tables are freed, but the
    C heap keeps their pages while a long-lived object sits above them, so the client's resident
    memory only grew, phase after phase, about twice what Python held (#20; measured at 1,024
    DLRM ranks: a peak 2.5 MB lower with it). Dask trims its workers the same way."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
