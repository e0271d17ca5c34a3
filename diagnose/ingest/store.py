"""The loaded run's ranks held column-wise, from the moment each arrives: one array per field for
every rank, a rank's RankTrace, RankTimeline, checks' summaries (SpilledMap) and idle model handle
built when it is looked up (Loaded's properties while the run is assembled; then Run.traces,
.timelines, .facts, .idle, rank-keyed views of the same rows).

Why (#20, the client's memory should not grow with the rank count): after the checks' per-rank
reductions a rank's result is a few numbers, a few short arrays and handles to what lies on disk,
yet as objects of their own (a timeline, its steps' three arrays, its cover, seven disk handles
and their offsets, a trace, its path, the summaries' map and its offsets) it held about 4 KB a
replicated DLRM rank in the parent while the files arrived: Python's and numpy's cost per object,
not data, and the memory they left behind once freed stayed the process's. Here a rank is a row
appended to arrays every rank shares, and the objects a reader gets are built for it and gone when
it is done. Once read, the arrays are read-only: a reader gets views, and the parent never writes
what a rank brought back.

Only a rank held as the reductions leave it (no interval sets, everything read once on disk in
one spill) is stored so; any other (a run loaded without the reductions, no disk to be had) keeps
its objects (`Arrivals.add` says no).
"""
from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from diagnose.ingest.load import RankTrace
from diagnose.ingest.spill import Spill, Spilled, SpilledMap, unspilled
from diagnose.step.cover import STEP_SETS, RankCover
from diagnose.step.timeline import RankTimeline, Steps

_HANDLES = ("events", "collectives", "exposed", "lanes", "drawing", "idle")
"""What lies on disk for each rank (idle: GPU ranks only): (offset, size) columns."""
_NUMBERS = {"parent": "q", "rank": "q", "flows": "q", "dropped": "q", "bytes_read": "q", "span0": "d",
            "span1": "d", "n_comm": "q", "n_dl": "q", "facts_at": "q"}
_FLAGS = ("has_rank", "salvaged", "hip", "has_span", "is_gpu", "device_timed", "has_facts", "unnamed_groups")
_REFS = ("name", "rank_source", "meta", "thread_names", "trace_warnings", "file", "step_source",
         "warnings", "facts_keys")
"""Per rank, a reference to an object most ranks share (metadata, texts) or its own short text
(its file's name: `Arrivals.path`); None for an empty list of the trace's warnings (56 bytes of
its own) and for the timeline's file name where it is the trace's."""


class Arrivals:
    """Each rank's reduced result as a row of run-wide columns, appended as it arrives (`add`),
    read back by its position (`trace`, `timeline`, `facts`, `idle`)."""

    def __init__(self, spill: Spill) -> None:
        self._spill = spill
        self._n = 0
        self._refs: dict[str, list[Any]] = {k: [] for k in _REFS}
        self._dirs: list[Path] = []  # each file's directory, once: `parent` is its position
        self._dir_at: dict[Path, int] = {}
        self._cols: dict[str, Any] = {k: array(c) for k, c in _NUMBERS.items()}
        self._cols.update({k: array("b") for k in _FLAGS})
        for h in _HANDLES:
            self._cols[h + "_at"], self._cols[h + "_size"] = array("q"), array("q")
        self._cols.update(step=array("q"), start=array("d"), end=array("d"), steps_upto=array("q"),
                          per_step=array("d"), facts_ends=array("Q"), facts_upto=array("q"))
        self._frozen = False

    def __len__(self) -> int:
        return self._n

    def _on_disk(self, v: Any) -> bool:
        return isinstance(v, Spilled) and v.spill is self._spill

    def fits(self, trace: RankTrace, tl: RankTimeline, facts: Mapping, idle: Any) -> bool:
        c = tl.cover
        return (not self._frozen and c is not None and tl.compute is None and tl.comm is None
                and tl.dataloader is None and tl.host_busy is None and tl.compiled is None
                and tl.input_copies is None and tl.comm_threads is None
                and c.per_step.shape == (len(tl.steps), len(STEP_SETS)) and c.per_step.dtype == np.float64
                and tl.steps.step.dtype == np.int64 and tl.steps.start.dtype == np.float64
                and tl.steps.end.dtype == np.float64 and tl.rank == (trace.rank if trace.rank is not None else 0)
                and all(self._on_disk(v) for v in (trace.events, tl.collectives, c.exposed, c.lanes, c.drawing))
                and (idle is None or self._on_disk(idle)) and trace.comm_args is None and not trace.thread_names
                and isinstance(trace.path, Path) and all(type(x) is int for x in (trace.flows, trace.dropped,
                                                                                   trace.bytes_read))
                and (trace.span_us is None or all(type(x) is float for x in trace.span_us))
                and ((isinstance(facts, SpilledMap) and facts.where()[0] is self._spill) or facts == {}))

    def add(self, trace: RankTrace, tl: RankTimeline, facts: Mapping, idle: Any) -> int | None:
        """The rank's position, or None where it is not held as the reductions leave it (`fits`)."""
        if not self.fits(trace, tl, facts, idle):
            return None
        c, cols, refs = tl.cover, self._cols, self._refs
        assert c is not None
        path = trace.path
        for k, v in (("name", path.name), ("rank_source", trace.rank_source), ("meta", trace.meta),
                     ("thread_names", trace.thread_names), ("trace_warnings", trace.warnings or None),
                     ("file", None if tl.file == path.name else tl.file), ("step_source", tl.step_source),
                     ("warnings", tl.warnings)):
            refs[k].append(v)
        parent = self._dir_at.setdefault(path.parent, len(self._dirs))
        if parent == len(self._dirs):
            self._dirs.append(path.parent)
        span = trace.span_us or (0.0, 0.0)
        for k, v in (("parent", parent), ("rank", trace.rank if trace.rank is not None else -1),
                     ("flows", trace.flows), ("dropped", trace.dropped), ("bytes_read", trace.bytes_read),
                     ("span0", span[0]), ("span1", span[1]), ("n_comm", c.n_comm), ("n_dl", c.n_dataloader)):
            cols[k].append(v)
        for k, v in (("has_rank", trace.rank is not None), ("salvaged", trace.salvaged), ("hip", trace.hip),
                     ("has_span", trace.span_us is not None), ("is_gpu", tl.is_gpu),
                     ("device_timed", tl.device_timed), ("has_facts", bool(facts)),
                     ("unnamed_groups", tl.unnamed_groups)):
            cols[k].append(bool(v))
        for h, v in zip(_HANDLES, (trace.events, tl.collectives, c.exposed, c.lanes, c.drawing, idle)):
            cols[h + "_at"].append(v.at if v is not None else -1)
            cols[h + "_size"].append(v.size if v is not None else 0)
        for k in ("step", "start", "end"):
            cols[k].frombytes(np.ascontiguousarray(getattr(tl.steps, k)).tobytes())
        cols["steps_upto"].append(len(cols["step"]))
        cols["per_step"].frombytes(np.ascontiguousarray(c.per_step).tobytes())
        if facts:
            _, keys, at, ends = facts.where()
            refs["facts_keys"].append(keys)
            cols["facts_at"].append(at)
            cols["facts_ends"].extend(ends)
        else:
            refs["facts_keys"].append(None)
            cols["facts_at"].append(-1)
        cols["facts_upto"].append(len(cols["facts_ends"]))
        self._n += 1
        return self._n - 1

    def _freeze(self) -> None:
        """At the first read: every column as a read-only numpy array (nothing is added after)."""
        if self._frozen:
            return
        out = {}
        for k, a in self._cols.items():
            v = np.array(a, dtype=bool if k in _FLAGS else np.dtype(a.typecode))
            v.setflags(write=False)
            out[k] = v
        out["per_step"] = out["per_step"].reshape(-1, len(STEP_SETS))
        self._cols, self._frozen = out, True

    def _span(self, name: str, i: int) -> tuple[int, int]:
        upto = self._cols[name + "_upto"]
        return (int(upto[i - 1]) if i else 0), int(upto[i])

    def _handle(self, h: str, i: int) -> Spilled | None:
        at = int(self._cols[h + "_at"][i])
        return Spilled(self._spill, at, int(self._cols[h + "_size"][i])) if at >= 0 else None

    def path(self, i: int) -> Path:
        """Its file's directory (one Path for all the files in it) joined to its name, the name
        the arriving Path gave: held whole, a rank's Path was ~0.2 KB of objects (its parts' list,
        its text; #20). The name is held, not the path's text: pathlib (to Python 3.11) interns a
        path's parts, and a name parsed from text at each lookup was interned anew each time; the
        1,024 ranks' names made and dropped at each of the checks' lookups used up the
        interpreter's table of interned strings, which then grew to twice its size (+1.9 MB of
        resident memory in the check where it happened)."""
        return self._dirs[int(self._cols["parent"][i])] / self._refs["name"][i]

    def trace(self, i: int, rank: int | None = None) -> RankTrace:
        """Rank i's trace (`rank`: the one the run assigned it, where it differs from the file's)."""
        self._freeze()
        c, refs = self._cols, self._refs
        w = refs["trace_warnings"][i]
        if rank is None and c["has_rank"][i]:
            rank = int(c["rank"][i])
        return RankTrace(path=self.path(i), rank=rank, rank_source=refs["rank_source"][i], meta=refs["meta"][i],
                         events=self._handle("events", i), comm_args=None, thread_names=refs["thread_names"][i],
                         flows=int(c["flows"][i]), dropped=int(c["dropped"][i]), warnings=w if w is not None else [],
                         salvaged=bool(c["salvaged"][i]), bytes_read=int(c["bytes_read"][i]),
                         span_us=(float(c["span0"][i]), float(c["span1"][i])) if c["has_span"][i] else None,
                         hip=bool(c["hip"][i]))

    def timeline(self, i: int) -> RankTimeline:
        self._freeze()
        c, refs = self._cols, self._refs
        a, b = self._span("steps", i)
        cover = RankCover(per_step=c["per_step"][a:b], n_comm=int(c["n_comm"][i]), n_dataloader=int(c["n_dl"][i]),
                          exposed=self._handle("exposed", i), lanes=self._handle("lanes", i),
                          drawing=self._handle("drawing", i))
        file = refs["file"][i]
        return RankTimeline(rank=int(c["rank"][i]) if c["has_rank"][i] else 0,
                            file=file if file is not None else refs["name"][i],
                            is_gpu=bool(c["is_gpu"][i]), step_source=refs["step_source"][i],
                            steps=Steps(step=c["step"][a:b], start=c["start"][a:b], end=c["end"][a:b]),
                            compute=None, comm=None, dataloader=None, host_busy=None,
                            collectives=self._handle("collectives", i), comm_threads=None, compiled=None,
                            warnings=refs["warnings"][i], input_copies=None,
                            device_timed=bool(c["device_timed"][i]), cover=cover,
                            unnamed_groups=bool(c["unnamed_groups"][i]))

    def facts(self, i: int) -> Mapping[str, Any]:
        self._freeze()
        if not self._cols["has_facts"][i]:
            return {}
        a, b = self._span("facts", i)
        return SpilledMap(self._spill, self._refs["facts_keys"][i], int(self._cols["facts_at"][i]),
                          array("Q", self._cols["facts_ends"][a:b].tolist()))

    def idle(self, i: int) -> Spilled | None:
        self._freeze()
        return self._handle("idle", i)


class ByRank(Mapping):
    """rank -> one kind of a rank's result (`trace`, `timeline`, `facts`, or its idle model read
    back), for the ranks of a run, from their rows in the Arrivals."""

    __slots__ = ("_rows", "_kind", "_ranks", "_pos", "_first", "_dense")

    def __init__(self, rows: Arrivals, kind: str, positions: Mapping[int, int]) -> None:
        self._rows, self._kind = rows, kind
        self._ranks = np.array(sorted(positions), dtype=np.int64)
        self._pos = np.array([positions[int(r)] for r in self._ranks], dtype=np.int64)
        self._ranks.setflags(write=False)
        # ranks first..first+n-1 with none missing (the usual run): a rank's place is arithmetic, not
        # a search (every check looks up every rank: ~45,000 lookups at 1,024 ranks)
        self._first = int(self._ranks[0]) if self._ranks.size else 0
        self._dense = bool(self._ranks.size) and int(self._ranks[-1]) - self._first + 1 == self._ranks.size

    def _at(self, rank: Any) -> int:
        if type(rank) is int and self._dense:
            i = rank - self._first
            if 0 <= i < self._ranks.size:
                return i
            raise KeyError(rank)
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
            self._at(rank)
        except KeyError:
            return False
        return True

    def __getitem__(self, rank: Any) -> Any:
        i = self._at(rank)
        p = int(self._pos[i])
        if self._kind == "trace":
            return self._rows.trace(p, int(self._ranks[i]))  # the rank the run assigned it
        if self._kind == "idle":
            return unspilled(self._rows.idle(p))
        return getattr(self._rows, self._kind)(p)
