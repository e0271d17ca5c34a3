"""Assemble a Run: load every rank's trace, check they belong together, align clocks.

Policy for bad input (docs/bad-input.md): a file that cannot be used is skipped with
its reason when other ranks remain (degrade); when nothing usable remains, the first
file's problem is raised (error, exit 2). Files that cannot belong to one run (two
files for a rank, different world sizes, profiles that do not overlap in time) are
refused: which run the user meant is not ours to guess.

Each rank is parsed and reduced in one step (`load_one`), in worker processes when the
input is large: its timeline, then each check's per-rank summary (the `reduce` the
pipeline passes in), then its events table is cut down to the few events cited as
evidence. The parent holds timelines and summaries, never a rank's raw JSON, whole
event table or interval sets (an interval per kernel: their cover, step/cover.py, is what
it reads), so its memory grows with the steps and collectives, not the trace sizes, and
the checks' per-rank work runs in parallel. What it reads once, or for a few ranks, it keeps on
disk as each rank arrives (Keep, ingest/spill.py), the rest in run-wide columns
(ingest/store.py). With `--cluster` the same reduction runs on Dask workers next to the files
(ingest/cluster.py) and only its result travels.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import pandas as pd

from diagnose.errors import DiagnoseError, one_line
from diagnose.heap import give_back_freed, keep_large_blocks_mapped
from diagnose.ingest import discover_traces, load_trace
from diagnose.ingest.load import DEFAULT_MAX_BYTES, RankTrace, base_offset_us
from diagnose.ingest.spill import Spill, Spilled, SpilledMap, Unspilling, pack, unspilled
from diagnose.ingest.store import Arrivals, ByRank
from diagnose.step.cover import rank_cover
from diagnose.step.idle import IdleModel, idle_model
from diagnose.step.timeline import RankTimeline, build_timeline, gather_collectives
from diagnose.units import rank_ranges

# Below this much JSON in total, worker processes cost more to start than they save.
PARALLEL_MIN_BYTES = 32 * 1024**2
IN_FLIGHT = 4  # files queued a local worker: its next file is there when it finishes one
GZIP_RATIO = 8
INTERNAL_ERROR = "internal error"
# Profiles of one run overlap in time; across hosts, clocks may disagree by this much.
SAME_HOST_SLACK_US = 1e6
CROSS_HOST_SLACK_US = 600e6


@dataclass(frozen=True, slots=True)
class ReduceFailed:
    """A check's per-rank reduction raised on this rank: the check reports it, the others go on."""

    error: str


Reduce = Callable[[RankTrace, RankTimeline, "IdleModel | ReduceFailed | None"], "tuple[dict[str, object], set[int]]"]
"""(trace, timeline, idle model) -> (each check's per-rank summary by check name, event rows cited
as evidence). The idle model is None on CPU ranks, ReduceFailed where building it raised."""


@dataclass(slots=True)
class Run:
    traces: Mapping[int, RankTrace]
    """After a reduction, `events` holds only the rows cited as evidence (and collectives); held
    column-wise, a rank's trace built when looked up (ingest/store.py)."""
    timelines: Mapping[int, RankTimeline]
    """After a reduction, held column-wise too (ingest/store.py)."""
    world_size: int | None
    backend: str | None
    clock_offsets_us: dict[int, float]
    """Added to each rank's timestamps to put it on rank-reference time."""
    warnings: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    facts: Mapping[int, Mapping[str, object]] = field(default_factory=dict)
    """Per rank, each check's per-rank summary (or ReduceFailed), when loaded with a reduction;
    read from disk at each lookup (Keep)."""
    idle: Mapping[int, IdleModel | ReduceFailed] = field(default_factory=dict)
    """GPU ranks: the idle model (diagnose/step/idle.py), or why it could not be built; read from
    disk at each lookup (Keep)."""
    unnamed_groups: list[int] = field(default_factory=list)
    """gloo ranks whose collectives ran on several process groups the trace does not name
    (RankTimeline.unnamed_groups): matched as one group's, said in a warning."""
    collectives: Mapping[str, np.ndarray] | None = None
    """Every rank's collectives inside its steps as column arrays, read from the timelines once
    when the run is assembled (step/timeline.gather_collectives; None: read them when needed);
    on disk from then, each column read back alone by the tables built from them
    (`collective_columns`): held, they were 0.7 MB at 1,024 replicated DLRM ranks through the
    checks, extras and replays, most of which never read them; read back whole, every column for
    a table of three to eight (#20)."""

    @property
    def ranks(self) -> list[int]:
        return sorted(self.timelines)

    def collective_columns(self, names: tuple[str, ...] | None = None) -> dict[str, np.ndarray] | None:
        """The named columns of `collectives` (every one by default), each a fresh copy the caller
        owns (read back where it lies on disk, copied where it is held); {} when the run has none."""
        cols = self.collectives
        if cols is None or not len(cols):
            return None if cols is None else {}
        held = not isinstance(cols, SpilledMap)  # no disk to be had: the run's own arrays
        return {c: cols[c].copy() if held else cols[c] for c in (cols if names is None else names)}

    @property
    def missing_ranks(self) -> list[int]:
        if not self.world_size:
            return []
        return [r for r in range(self.world_size) if r not in self.timelines]

    @property
    def is_gpu(self) -> bool:
        return any(t.is_gpu for t in self.timelines.values())


class _Kept:
    """One of a Loaded's fields: built from the rank's row at each read once kept (Loaded.hold),
    and never written then; its own object before (the slot of the same name with a `_`)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name, self._slot = name, "_" + name

    def __get__(self, x: Loaded | None, owner: type | None = None) -> Any:
        if x is None:
            return self
        return getattr(x._rows, self._name)(x._at) if x._rows is not None else getattr(x, self._slot)

    def __set__(self, x: Loaded, v: Any) -> None:
        if x._rows is not None:
            raise AttributeError("a kept rank is read, never written (ingest/store.py)")
        setattr(x, self._slot, v)


class Loaded:
    """One file's outcome: its trace and timeline, or why it cannot be used; `facts`, each check's
    per-rank summary; `reduced`, the checks' per-rank reductions ran (the events table holds only
    the cited events). In the parent, once kept (Keep.take), a reduced rank lies in the run-wide
    columns of ingest/store.Arrivals and each read of `path`, `trace`, `timeline`, `facts` or
    `idle` builds the object anew from its row: read, never written."""

    __slots__ = ("_path", "_trace", "_timeline", "error", "_facts", "_idle", "reduced", "_rows", "_at")

    def __init__(self, path: Path, trace: RankTrace | None = None, timeline: RankTimeline | None = None,
                 error: str | None = None, facts: Mapping[str, object] | None = None,
                 idle: IdleModel | ReduceFailed | Spilled | None = None, reduced: bool = False) -> None:
        self._path, self._trace, self._timeline, self.error = path, trace, timeline, error
        self._facts: Mapping[str, object] = {} if facts is None else facts
        self._idle, self.reduced = idle, reduced
        self._rows: Arrivals | None = None
        self._at = -1

    def __getstate__(self) -> tuple:
        if self._rows is not None:
            raise TypeError("a kept rank stays in the process that keeps it (ingest/store.py)")
        return self._path, self._trace, self._timeline, self.error, self._facts, self._idle, self.reduced

    def __setstate__(self, state: tuple) -> None:
        self.__init__(*state)

    def hold(self, rows: Arrivals) -> None:
        """Into the run-wide columns, where this rank fits them (ingest/store.Arrivals.add)."""
        at = rows.add(self._trace, self._timeline, self._facts, self._idle) \
            if self.reduced and self._trace is not None and self._timeline is not None else None
        if at is not None:
            self._rows, self._at = rows, at
            self._path = self._trace = self._timeline = self._facts = self._idle = None

    @property
    def row(self) -> tuple[Arrivals, int] | None:
        """Where a kept rank lies (its columns and position), or None where it keeps its objects."""
        return (self._rows, self._at) if self._rows is not None else None

    def assume_rank(self, rank: int) -> None:
        """A file that names no rank, alone: rank `rank`. A kept rank gets it where the run is built
        (ingest/store.ByRank gives each trace the run's rank)."""
        if self._trace is not None:
            self._trace.rank = rank

    @property
    def ok(self) -> bool:
        return self._rows is not None or (self._trace is not None and self._timeline is not None)

    path: Path = _Kept()  # type: ignore[assignment]
    trace: RankTrace | None = _Kept()  # type: ignore[assignment]
    timeline: RankTimeline | None = _Kept()  # type: ignore[assignment]
    facts: Mapping[str, object] = _Kept()  # type: ignore[assignment]
    idle: IdleModel | ReduceFailed | Spilled | None = _Kept()  # type: ignore[assignment]


@runtime_checkable
class SharesText(Protocol):
    """A per-rank summary holding names that other ranks repeat (analyzers.why_late.RankOps)."""

    def shared(self, texts: dict[str, str]) -> SharesText: ...


@dataclass(slots=True)
class Keep:
    """How the parent keeps each rank's result as it arrives (#20: the client's peak should not
    grow with the rank count):
    - on disk (ingest/spill.py), what is read once or for a few ranks: the mini timeline (the
      report draws 16 ranks), the step graph's lanes (read once), the exposed communication (read
      by the breakdown, the communication table and the graph), and after a reduction the
      checks' per-rank summaries (each check reads its own), the idle model (the breakdown), the
      rank's collectives (the run's assembly gathers them: Run.collectives) and the cited events
      (the events findings cite);
    - what ranks repeat, once: each rank's file metadata is swapped for the first equal copy
      seen, value by value, its keys and those of a value that differs by rank too (every rank's
      result is unpickled into objects of its own; at 1,024 ranks identical device properties
      were much of the client's memory), and the short texts every rank has (step source, rank
      source);
    - the column labels of a table kept in memory, once: an Index of ~1.2 KB a rank;
    - the rest of a reduced rank (steps, cover rows, disk offsets, metadata references): a row of
      run-wide columns (`rows`, ingest/store.Arrivals), its objects built when read.
    Where the disk is not to be had, the summaries' op names and the tables' labels are shared
    across ranks instead."""

    texts: dict[str, str] = field(default_factory=dict)
    values: dict[str, object] = field(default_factory=dict)
    last_meta: dict | None = None
    """The last rank's metadata as kept (_meta)."""
    spill: Spill = field(default_factory=Spill)
    labels: dict[tuple, pd.Index] = field(default_factory=dict)
    rows: Arrivals = field(init=False)
    """Each reduced rank, once kept, a row of run-wide columns (ingest/store.py)."""

    def __post_init__(self) -> None:
        self.rows = Arrivals(self.spill)

    def _labels(self, df: pd.DataFrame) -> pd.DataFrame:
        key = (tuple(df.columns), str(df.columns.dtype))
        df.columns = self.labels.setdefault(key, df.columns)  # an Index is immutable: one serves all
        return df

    def _frame(self, df: pd.DataFrame, reduced: bool, names: bool = False) -> pd.DataFrame | Spilled:
        """On disk after a reduction; in memory otherwise (or without a disk), its labels shared
        and, for cited events (`names`), their names."""
        out = self.spill.put(df) if reduced else df
        if isinstance(out, Spilled):
            return out
        return self._labels(self._cited_names(out) if names else out)

    def take(self, x: Loaded) -> Loaded:
        """Without a reduction (every event kept, for tools that read them) only the cover's
        drawing, lanes and exposed communication go to disk."""
        if x.timeline is not None:
            cover = x.timeline.cover
            x.timeline = replace(x.timeline, collectives=self._frame(x.timeline.collectives, x.reduced),
                                 step_source=self._text(x.timeline.step_source),
                                 cover=replace(cover, exposed=self.spill.put(cover.exposed),
                                               lanes=self.spill.put(cover.lanes),
                                               drawing=self.spill.put(cover.drawing)) if cover else None)
        if x.trace is not None:
            x.trace.meta = self._meta(kept_meta(x.trace.meta) if x.reduced else x.trace.meta)
            x.trace.rank_source = self._text(x.trace.rank_source)
            x.trace.thread_names = self._value(x.trace.thread_names)  # {} after a reduction
            if x.reduced:
                x.trace.events = self._frame(x.trace.events, True, names=True)
        if x.idle is not None and x.reduced:
            x.idle = self.spill.put(x.idle)
        facts = self.spill.put_map(x.facts) if x.reduced else x.facts
        if not isinstance(facts, SpilledMap):
            facts = {k: (v.shared(self.texts) if isinstance(v, SharesText) else v) for k, v in facts.items()}
        x.facts = facts
        x.hold(self.rows)
        return x

    def _text(self, s: str) -> str:
        return self.texts.setdefault(s, s)

    def _meta(self, meta: dict) -> dict:
        """The file's metadata, each value the first equal copy seen; the previous rank's dict
        itself where every value is the same object (ranks arrive in order: a host's ranks share
        theirs), a dict of its own otherwise (a value that differs by rank, a time base)."""
        m = {self._text(k): self._value(v, nested=True) for k, v in meta.items()}
        last = self.last_meta
        if last is not None and last.keys() == m.keys() and all(last[k] is v for k, v in m.items()):
            return last
        self.last_meta = m
        return m

    def _value(self, v: object, nested: bool = False) -> object:
        """The first equal copy seen of a value read, never written, after loading (metadata, thread
        names); a number as it is and a text as _text keeps it (an entry here would cost more than
        the value). `nested`: a dict no rank had before (distributedInfo differs by the rank it
        holds where the metadata is kept whole) is one of its own, its keys and values shared the
        same way (~0.4 KB a rank of copies)."""
        if v is None or isinstance(v, (bool, int, float)):
            return v
        if isinstance(v, str):
            return self._text(v)
        key = json.dumps(v, sort_keys=True, default=str)
        if key not in self.values:
            if nested and isinstance(v, dict):
                v = {self._text(k) if isinstance(k, str) else k: self._value(x) for k, x in v.items()}
            self.values[key] = v
        return self.values[key]


    def _cited_names(self, ev: pd.DataFrame) -> pd.DataFrame:
        """The cited events' names, the same on every rank, shared (what stays in memory without a disk)."""
        if "name" in ev and ev["name"].dtype == object:
            names = [self.texts.setdefault(v, v) if isinstance(v, str) else v for v in ev["name"]]
            return cited_frame(ev.assign(name=pd.Series(names, index=ev.index, dtype=object)))
        return ev


META_READ = ("deviceProperties", "distributedInfo", "host_name", "baseTimeNanoseconds")
"""The file metadata's keys read once the checks' per-rank reductions have run: the devices'
names (the run's facts, launch overhead, host syncs), the run's world size, backend and process
groups, the host and time base (the clock alignment, one run's profiles overlapping). The rest
(the trace's own name, schema version, each tool's additions) is read by nothing after loading."""


def kept_meta(meta: dict) -> dict:
    """What a reduced rank keeps of its file's metadata (META_READ); distributedInfo without the
    rank, read at loading into the trace's own `rank` (load._rank): with it, and the trace's name,
    every rank's copy differed and each was held apart (#20: with the Paths held as names,
    store.Arrivals.path, what the client held after the checks at 1,024 replicated DLRM ranks
    went 4.01 -> 3.41 MB)."""
    out = {k: meta[k] for k in META_READ if k in meta}
    info = out.get("distributedInfo")
    if isinstance(info, dict) and "rank" in info:
        out["distributedInfo"] = {k: v for k, v in info.items() if k != "rank"}
    return out


def load_one(args: tuple[str, int, Reduce | None]) -> Loaded:
    """One file, parsed and reduced; never raises (what went wrong is the Loaded's error). Runs in
    this process, in a local worker process, or on a Dask worker next to the file (ingest/cluster.py)."""
    path, max_bytes, reduce = args
    try:
        trace = load_trace(path, max_bytes)
        # the rank is provisional until all files are seen; 0 is what a lone unranked file becomes
        timeline = build_timeline(trace, trace.rank if trace.rank is not None else 0)
        gaps = _idle(trace, timeline)
        timeline = replace(timeline, cover=rank_cover(timeline, gaps))
        facts: dict[str, object] = {}
        if reduce is not None:
            # a rank without a complete step is skipped later: nothing to summarise, nothing to keep
            facts, rows = reduce(trace, timeline, gaps) if len(timeline.steps) else ({}, set())
            _keep_only(trace, rows | set(timeline.collectives["row"].tolist()))
            timeline = timeline.for_parent()
            if isinstance(gaps, IdleModel):
                gaps = gaps.for_parent()
        return Loaded(Path(path), trace, timeline, facts=facts, idle=gaps, reduced=reduce is not None)
    except DiagnoseError as exc:
        return Loaded(Path(path), error=str(exc))
    except MemoryError:
        return Loaded(Path(path), error=one_line(f"{path}: out of memory while reading (raise the machine's "
                                                 "memory or pass fewer files)"))
    except Exception as exc:  # a reader bug must cost the user one file, never the whole analysis
        detail = " ".join(str(exc).split())[:200]
        return Loaded(Path(path), error=one_line(f"{path}: could not be read ({INTERNAL_ERROR}: "
                                                 f"{type(exc).__name__}: {detail}; please report it)"))


def packed(x: Loaded) -> Loaded:
    """x with what the parent writes to its spill as it arrives (Keep.take) pickled here, where it
    was made (spill.Packed): how a worker process or a Dask worker sends a rank back."""
    tl = x.timeline
    if tl is not None and tl.cover is not None:
        c = tl.cover
        x.timeline = replace(tl, collectives=pack(tl.collectives) if x.reduced else tl.collectives,
                             cover=replace(c, exposed=pack(c.exposed), lanes=pack(c.lanes), drawing=pack(c.drawing)))
    if x.reduced:
        if x.trace is not None:
            x.trace.events = pack(x.trace.events)
        if x.idle is not None:
            x.idle = pack(x.idle)
        x.facts = {k: pack(v) for k, v in x.facts.items()}
    return x


def load_packed(args: tuple[str, int, Reduce | None]) -> Loaded:
    """load_one, then `packed`: in a worker."""
    return packed(load_one(args))


def _idle(trace: RankTrace, tl: RankTimeline) -> IdleModel | ReduceFailed | None:
    """The GPU rank's idle model, built once next to its timeline: the breakdown and every check
    that talks about device idle time read this one model."""
    if not tl.is_gpu or not len(tl.steps):
        return None
    try:
        return idle_model(trace, tl)
    except Exception as exc:  # noqa: BLE001 - the checks that need it fail on this rank; the others go on
        return ReduceFailed(one_line(f"idle model: {type(exc).__name__}: {exc}")[:300])


CITED_COLUMNS = ("name", "ts", "dur")
"""What the parent reads of a cited event (Context.event_ref): after the reduction nothing else."""


def cited_frame(events: pd.DataFrame) -> pd.DataFrame:
    """A few dozen cited rows in as few blocks as pandas allows (names one object block, times one
    float block; labels kept: rows are cited by label). Each further column or block costs about 1
    KB a rank whatever its rows (#20: 8 columns were 14 KB of a DLRM rank's 71 KB in the client)."""
    cols = {c: events[c] for c in CITED_COLUMNS if c in events.columns}
    if "name" in cols:  # object, not pandas 3's inferred string dtype: one block, each name shareable
        cols["name"] = pd.Series(cols["name"].to_numpy(dtype=object), index=events.index, dtype=object)
    return pd.DataFrame(cols, index=events.index).copy()  # copy: consolidated into one block per type


def _keep_only(trace: RankTrace, rows: set[int]) -> None:
    """Cut the events table down to the rows cited as evidence, and to what the parent reads of them
    (the collectives' args and the thread names: nothing; the timeline holds the collectives'
    bytes and groups)."""
    keep = trace.events.index.intersection(sorted(rows))
    trace.events = cited_frame(trace.events.loc[keep])
    trace.comm_args = None
    trace.thread_names = {}


def _size(f: Path) -> int:
    """Bytes to parse, roughly: gzip'd traces expand about 8x."""
    try:
        size = f.stat().st_size
    except OSError:
        return 0
    return size * GZIP_RATIO if f.name.endswith(".gz") else size


Progress = Callable[[int, int, str], None]
"""(files done, files in all, the name of the one just done): for a progress line."""


def load_files(files: list[Path], max_bytes: int, jobs: int | None, reduce: Reduce | None = None,
               progress: Progress | None = None) -> list[Loaded]:
    keep = Keep()
    total = sum(_size(f) for f in files)
    work = [(str(f), max_bytes, reduce) for f in files]
    workers = min(jobs or os.cpu_count() or 1, len(files))
    tell = progress or (lambda done, n, name: None)
    if workers > 1 and total >= PARALLEL_MIN_BYTES:
        try:
            with ProcessPoolExecutor(max_workers=workers) as pool:
                out: list[Loaded | None] = [None] * len(work)
                # A few files in flight a worker, not one future a file: each future holds ~1 KB
                # (its lock and condition) until the pool closes, ~1 MB at 1,024 ranks.
                todo = iter(enumerate(work))
                pending = {pool.submit(load_packed, w): i for i, w in islice(todo, IN_FLIGHT * workers)}
                done = 0
                while pending:
                    finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in finished:
                        i = pending.pop(fut)
                        out[i] = keep.take(fut.result())
                        done += 1
                        tell(done, len(work), Path(work[i][0]).name)
                        for j, w in islice(todo, 1):
                            pending[pool.submit(load_packed, w)] = j
                return [x for x in out if x is not None]
        except (OSError, BrokenProcessPool):
            pass  # no processes to be had (sandbox, limits, a worker killed): read here instead
    out_serial = []
    for done, w in enumerate(work, 1):
        out_serial.append(keep.take(load_one(w)))
        tell(done, len(work), Path(w[0]).name)
    return out_serial


def _assign_ranks(ok: list[Loaded], warnings: list[str]) -> dict[int, Loaded]:
    """rank -> its file's outcome. Each trace is looked at once, one at a time (a kept rank's is
    built at each read: ingest/store.py)."""
    ranks = [x.trace.rank for x in ok]
    unknown = [x for x, r in zip(ok, ranks) if r is None]
    if unknown:
        if len(ok) == 1:
            ranks[0] = 0
            ok[0].assume_rank(0)
            warnings.append(f"{ok[0].path.name}: no rank in distributedInfo or file name; assumed rank 0")
        else:
            names = ", ".join(x.path.name for x in unknown)
            raise DiagnoseError(f"cannot tell the rank of {names} (no distributedInfo, no rankN/workerN "
                                "in the name); rename the files rankN.json or pass them one at a time",
                                unknown[0].path)
    by_rank: dict[int, Loaded] = {}
    for x, r in zip(ok, ranks):
        assert r is not None
        if r in by_rank:
            from diagnose.ingest.windows import two_of_a_rank  # the error's path only: reads two files' heads

            raise DiagnoseError(f"two traces for rank {r}: {by_rank[r].path.name} and {x.path.name} "
                                + two_of_a_rank(by_rank[r].path, x.path), x.path.parent)
        by_rank[r] = x
    return by_rank


class _Traces(Mapping):
    """rank -> trace of each rank's outcome, each built when read (not all held at once)."""

    def __init__(self, by_rank: Mapping[int, Loaded]) -> None:
        self._by_rank = by_rank

    def __getitem__(self, r: int) -> RankTrace:
        t = self._by_rank[r].trace
        assert t is not None
        return t

    def __iter__(self) -> Iterator[int]:
        return iter(self._by_rank)

    def __len__(self) -> int:
        return len(self._by_rank)


def _check_one_run(by_rank: Mapping[int, RankTrace]) -> int | None:
    sizes = {r: t.world_size for r, t in by_rank.items() if t.world_size}
    distinct = sorted(set(sizes.values()))
    if len(distinct) > 1:
        parts = "; ".join(f"world size {w}: " + ", ".join(by_rank[r].path.name for r in sizes if sizes[r] == w)
                          for w in distinct)
        raise DiagnoseError(f"files from different runs ({parts}); pass one run's files",
                            next(iter(by_rank.values())).path.parent)
    return distinct[0] if distinct else None


def _align_clocks(run_tl: Mapping[int, RankTimeline], traces: Mapping[int, RankTrace],
                  warnings: list[str]) -> dict[int, float]:
    """Offsets that put every rank on the reference rank's clock.

    Ranks on one host share a clock (offset 0). Across hosts, matched collectives
    end together (everyone leaves a collective when the last one arrives and the
    transfer completes), so the median end-time difference is the clock offset.
    """
    offsets = {r: 0.0 for r in run_tl}
    hosts = {r: traces[r].meta.get("host_name") for r in run_tl}
    known = {h for h in hosts.values() if isinstance(h, str)}
    if len(known) <= 1 and all(isinstance(h, str) for h in hosts.values()):
        return offsets
    ref = min(run_tl)
    ref_end = _ends_by_key(run_tl[ref].own_collectives())
    if not ref_end:
        if len(known) > 1:
            warnings.append("ranks on several hosts and no collectives to align their clocks on: "
                            "cross-host timings are unaligned")
        return offsets
    for r, tl in run_tl.items():
        if r == ref or (isinstance(hosts[r], str) and hosts[r] == hosts[ref]):
            continue
        mine = _ends_by_key(tl.own_collectives())
        diff = np.array([ref_end[k] - e for k, e in mine.items() if k in ref_end], dtype=np.float64)
        if len(diff) == 0:
            continue
        off = float(np.median(diff))
        spread = float(np.median(np.abs(diff - off)))
        # same-host clocks agree to microseconds; only correct a clear, consistent offset
        if abs(off) > max(50.0, 5 * spread):
            offsets[r] = off
            warnings.append(f"rank {r}: clock offset {off / 1000:.3f} ms vs rank {ref} "
                            f"(from {len(diff)} matched collectives) applied")
    return offsets


def _ends_by_key(c: pd.DataFrame) -> dict[tuple, float]:
    """A rank's collectives' end times by (step, pg, seq), the key that matches one collective
    across ranks (unique: seq counts within a step's group). A dict, not a pandas join: the join
    (set_index, concat) cost ~1.5 ms a rank, a third of the client's own work after the last file
    arrived at 1,024 ranks, which more workers do not shorten (#20)."""
    return dict(zip(zip(c["step"].tolist(), c["pg"].tolist(), c["seq"].tolist()), c["end"].tolist()))


def absolute_span_us(t: RankTrace) -> tuple[float, float] | None:
    """[first event start, last event end] on an absolute clock where the file says how."""
    if t.span_us is None:
        return None
    off = base_offset_us(t.meta)
    return t.span_us[0] + off, t.span_us[1] + off


def _check_overlap(by_rank: Mapping[int, RankTrace]) -> None:
    """Profiles of one run overlap in time: two that do not come from two runs."""
    spans = {r: s for r, t in by_rank.items() if (s := absolute_span_us(t)) is not None}
    if len(spans) < 2:
        return
    late = max(spans, key=lambda r: spans[r][0])
    early = min(spans, key=lambda r: spans[r][1])
    gap = spans[late][0] - spans[early][1]
    h1, h2 = by_rank[late].meta.get("host_name"), by_rank[early].meta.get("host_name")
    slack = SAME_HOST_SLACK_US if isinstance(h1, str) and h1 == h2 else CROSS_HOST_SLACK_US
    if gap > slack:
        a, b = by_rank[early].path.name, by_rank[late].path.name
        raise DiagnoseError(f"files from different runs: {b} starts {gap / 1e6:.1f} s after {a} ends "
                            "(the ranks of one run are profiled at the same time: two runs, or two windows of one "
                            "run); pass one window's files, one a rank",
                            by_rank[early].path.parent)


def _check_same_steps(kept: Mapping[int, Loaded]) -> None:
    """Ranks whose profiler steps have no number in common are two windows of one run (or two
    runs), however close in time: a window's ranks record the same steps, and collectives are
    matched across ranks by their step's number, so none would match. _check_overlap's slack let
    windows a second apart through (rank 0's window 1 with rank 1's window 2 read as one run,
    "exposed communication, high confidence", until 2026-12-07)."""
    ref: tuple[int, set, str | None, float, float] | None = None
    for r, x in sorted(kept.items()):
        t, tl = x.trace, x.timeline
        if tl.step_source != "ProfilerStep" or not len(tl.steps):
            continue
        host = t.meta.get("host_name")
        off = base_offset_us(t.meta)
        mine = (r, set(tl.steps.step.tolist()), host if isinstance(host, str) else None,
                float(tl.steps.start.min()) + off, float(tl.steps.end.max()) + off)
        if ref is None:
            ref = mine
            continue
        if ref[1] & mine[1]:
            continue

        def said(x: tuple[int, set, str | None, float, float]) -> str:
            return f"rank {x[0]} steps #{min(x[1])}-#{max(x[1])}"

        after = ref[2] is not None and ref[2] == mine[2] and (ref[4] < mine[3] or mine[4] < ref[3])
        how = f"one after the other on host {one_line(mine[2] or '')[:64]}" if after else "no step in common"
        raise DiagnoseError(f"{said(ref)} and {said(mine)}, {how}: two windows of one run, or two runs (the ranks "
                            "of one window record the same steps; collectives are matched by step); pass one "
                            "window's files, one a rank", t.path.parent)


class Reader(Protocol):
    """Loads files somewhere else (ingest/cluster.py's DaskReader): the paths are listed and read there."""

    windows: Any
    """After load: of one run's repeated profiler windows, the one read there (ingest/windows.Choice), or None."""

    def load(self, paths: list[str | Path], max_bytes: int, reduce: Reduce | None,
             progress: Progress | None = None, window: int | None = None) -> list[Loaded]: ...


def _hold(run: Run, kept: dict[int, Loaded]) -> None:
    """The run's ranks: rank-keyed views of their rows where every one lies in the same columns
    (ingest/store.py; a row's timeline already has the rank the run gives it: Arrivals.fits),
    else the objects themselves."""
    rows = {id(x.row[0]) if x.row else None for x in kept.values()}
    first = next(iter(kept.values())).row
    if len(rows) == 1 and first is not None:
        held = first[0]
        at = {r: x.row[1] for r, x in kept.items()}
        run.traces, run.timelines, run.facts = ByRank(held, "trace", at), ByRank(held, "timeline", at), \
            ByRank(held, "facts", at)
        run.idle = ByRank(held, "idle", {r: p for r, p in at.items() if held.idle(p) is not None})
        return
    run.traces = {r: x.trace for r, x in kept.items()}
    run.timelines = {r: x.timeline for r, x in kept.items()}
    run.facts = {r: x.facts for r, x in kept.items()}
    run.idle = Unspilling({r: i for r, x in kept.items() if (i := x.idle) is not None})


def load_run(paths: list[str | Path], *, max_bytes: int = DEFAULT_MAX_BYTES, jobs: int | None = None,
             reduce: Reduce | None = None, progress: Progress | None = None, reader: Reader | None = None,
             window: int | None = None) -> Run:
    """reduce: each check's per-rank phase (analyzers.reduce_rank); without it every event is kept.
    reader: where the files are listed and read (default: here); window: `--window K`, for the
    reader (here the caller narrows the paths: pipeline.last_windows)."""
    keep_large_blocks_mapped()  # for callers other than the CLI, which pins it at its start (heap.py)
    if reader is not None:
        loaded = reader.load(paths, max_bytes, reduce, progress, window)
    else:
        loaded = load_files(discover_traces(paths), max_bytes, jobs, reduce, progress)
    errors = [x.error for x in loaded if x.error]
    ok = [x for x in loaded if x.ok]
    if not ok:
        raise DiagnoseError(errors[0] if len(errors) == 1 else f"{errors[0]} (and {len(errors) - 1} more)")
    warnings: list[str] = [f"skipped {e}" for e in errors]
    skipped = list(errors)
    for x in ok:
        warnings += x.trace.warnings
    by_rank = _assign_ranks(ok, warnings)
    traces = _Traces(by_rank)
    world = _check_one_run(traces)
    _check_overlap(traces)
    kept: dict[int, Loaded] = {}
    for r, x in sorted(by_rank.items()):
        tl = x.timeline
        warnings += tl.warnings
        if len(tl.steps) == 0:
            t = x.trace
            reason = "no complete training step (no ProfilerStep#N or Optimizer.step markers)"
            if t.salvaged:
                reason += "; the file was cut before a step ended"
            skipped.append(f"{t.path}: {reason}")
            warnings.append(f"skipped {t.path}: {reason}")
            continue
        kept[r] = x
    _check_same_steps(kept)
    if not kept:
        first = traces[next(iter(by_rank))]
        cut = "; the file was cut (killed job?) before a step ended" if first.salvaged and len(by_rank) == 1 else ""
        raise DiagnoseError("no complete training step found (no ProfilerStep#N or Optimizer.step markers; "
                            f"an inference or non-training trace?){cut}",
                            first.path if len(by_rank) == 1 else first.path.parent)
    backends = {b for r in by_rank if (b := traces[r].backend)}
    run = Run(traces={}, timelines={}, world_size=world, backend=next(iter(backends)) if len(backends) == 1 else None,
              clock_offsets_us={}, warnings=warnings, skipped=skipped)
    _hold(run, kept)
    del loaded, ok, by_rank, traces, kept  # each rank lies in its row now, or in the run's dicts
    give_back_freed()
    run.clock_offsets_us = _align_clocks(run.timelines, run.traces, warnings)
    run.collectives = Spill().put_map(gather_collectives(run.timelines))
    if run.missing_ranks:
        found = len(run.ranks)
        miss = run.missing_ranks
        warnings.append(f"{found} of {world} ranks: missing rank(s) {rank_ranges(miss)}")
    run.unnamed_groups = [r for r in run.ranks if run.timelines[r].unnamed_groups]
    if run.unnamed_groups:
        warnings.append(f"rank(s) {rank_ranges(run.unnamed_groups)} ran collectives on several process groups, which "
                        "gloo traces do not name (only their threads tell them apart): each step's collectives "
                        "are matched across ranks by their order as if one group's, so a wait for a peer in "
                        "another group and each group's figures are approximate (NCCL traces name the group)")
    salvaged = [r for r in run.ranks if run.traces[r].salvaged]
    if salvaged:
        warnings.append(f"rank(s) {rank_ranges(salvaged)} salvaged from cut files: "
                        "findings that rely on them are less certain")
    return run
