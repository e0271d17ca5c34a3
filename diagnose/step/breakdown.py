"""Per-rank, per-step breakdown: where each step's time went.

Components are disjoint and sum to the step time (priority order, so overlapping
activity is counted once):
- GPU: compute > communication > DataLoader wait > other (GPU idle).
- CPU: DataLoader wait > compute > communication > other (host gaps, sleeps); Python's garbage
  collections the probes placed in the step (step/pauses.py) come out of the DataLoader wait where
  a pass began inside a fetch, else out of other and then compute (the process stood still), never
  out of communication: `gc`, the step graph's part of the same name, from the same intervals.
On GPU ranks `other` is split by the idle model's classes (why the device idled).
Communication not hidden under compute is split into the part spent waiting for the
single last-arriving rank of each collective, or for the ranks late together when the context
found some (`straggler_wait`: what fixing them would give back; collectives.wait_for_group),
and the rest (`exposed_comm`: transfers and general arrival skew).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import fields

import numpy as np
import pandas as pd

from diagnose.ingest.assemble import ReduceFailed, Run
from diagnose.model import StepBreakdown
from diagnose.step.appended import Appended
from diagnose.step.collectives import Matched, RowsByValue
from diagnose.step.cover import column
from diagnose.step.idle import CLASSES
from diagnose.step.intervals import Intervals, covered, intersect, subtract, union
from diagnose.step.pauses import Pauses


class Waits:
    """Each rank's waits for the last rank alone (or for the ranks late together), on its own
    clock, where its lanes live: `get(rank)` makes the rank's interval set from the matched rows
    sorted by rank once, when its reader asks (an interval set for every rank at once was held
    through the breakdown's build and the communication table, objects a rank, #20)."""

    def __init__(self, run: Run, matched: Matched) -> None:
        cols = ["rank", "tail_wait", "latest", "end"]
        pr = matched.frame(cols)
        if pr.empty:  # nothing matched: no columns to read
            pr = pd.DataFrame({c: np.zeros(0, dtype=np.int64 if c == "rank" else np.float64) for c in cols})
        mine = pr[pr["tail_wait"] > 0]
        self._rows = RowsByValue(mine["rank"].to_numpy())  # a rank's rows in table order
        self._end = np.minimum(mine["latest"], mine["end"]).to_numpy()
        self._tail = mine["tail_wait"].to_numpy()
        self._offsets = run.clock_offsets_us

    def get(self, r: int, default: Intervals | None = None) -> Intervals | None:
        rows = self._rows[r]
        if not rows.size:
            return default
        e = self._end[rows] - self._offsets.get(r, 0.0)
        return union(e - self._tail[rows], e)


def waits_by_rank(run: Run, matched: Matched) -> Waits:
    """Each rank's waits (Waits), found in one pass (a scan of every matched row per rank was
    1.5 of the client's 7.3 s at 1,024 ranks)."""
    return Waits(run, matched)


def exposed_comm(run: Run, rank: int, waits: Waits) -> Intervals:
    """The rank's communication that compute_breakdown books as exposed_comm: its exposed set
    (cover.exposed) outside its waits for the last rank alone (waits_by_rank's). For splitting
    that time further (step/bandwidth.py), on the rank's own clock."""
    exposed_set = run.timelines[rank].cover.exposed_comm()
    mine = waits.get(rank)
    return subtract(exposed_set, mine) if mine is not None and len(mine) else exposed_set


def compute_breakdown(run: Run, matched: Matched, pauses: dict[int, Pauses] | None = None) -> list[StepBreakdown]:
    """One StepBreakdown per (rank, step), rank after rank."""
    return list(breakdown_rows(breakdown_table(run, matched, pauses)))


FIELDS = tuple(f.name for f in fields(StepBreakdown))
MS_FIELDS = tuple(f for f in FIELDS if f.endswith("_ms") and f != "other_by_cause_ms")
"""The components in ms (step_ms ... other_ms): numpy floats, as the ranks' arrays give them."""
CAUSE_COLUMNS = tuple(f"other_by_cause_ms:{c}" for c in CLASSES)
"""breakdown_table's columns for StepBreakdown.other_by_cause_ms, one per idle class (NaN where the
rank has no split): a dict a row was ~0.4 KB a DLRM rank held through every check (#20)."""
HAS_CAUSES = "other_by_cause"
"""breakdown_table's column saying which rows have the split (GPU ranks with an idle model)."""
GC_IN_FETCH = "gc_in_fetch_ms"
"""breakdown_table's column of gc_ms taken out of the DataLoader wait: dataloader_ms plus it is
the wait the trace shows (what the DataLoader check cites, and takes its collections off)."""
TABLE_COLUMNS = tuple(f for f in FIELDS if f != "other_by_cause_ms") + CAUSE_COLUMNS + (HAS_CAUSES, GC_IN_FETCH)


def cause_column(cls: str) -> str:
    """breakdown_table's column of the idle class `cls` (step/idle.CLASSES)."""
    return CAUSE_COLUMNS[CLASSES.index(cls)]


def _collections(pz: Pauses, offset: float, lo: np.ndarray, hi: np.ndarray, exposed_set: Intervals,
                 dl: np.ndarray, other: np.ndarray, compute: np.ndarray) -> tuple[np.ndarray, ...]:
    """The placed collections' time in each step (us), and how much of it comes out of the
    DataLoader wait, other and compute: (gc, from dl, from other, from compute). Outside the
    exposed communication, as the step graph's lanes are outside their blocked stretches; a pass
    that began in a fetch out of the wait (capped by it), the rest out of other, then compute."""
    a, b = lo + offset, hi + offset  # the pauses are on the run's aligned clock
    shifted = Intervals(exposed_set.starts + offset, exposed_set.ends + offset) if len(exposed_set) else exposed_set
    every = subtract(pz.every, shifted) if len(shifted) else pz.every
    fetch = subtract(pz.in_fetch, shifted) if len(shifted) else pz.in_fetch
    in_fetch = np.minimum(covered(fetch, a, b), dl)
    rest = np.maximum(covered(every, a, b) - covered(fetch, a, b), 0.0)
    from_other = np.minimum(rest, other)
    from_compute = np.minimum(rest - from_other, compute)
    return in_fetch + from_other + from_compute, in_fetch, from_other, from_compute


def breakdown_table(run: Run, matched: Matched, pauses: dict[int, Pauses] | None = None) -> pd.DataFrame:
    """The breakdown as one frame, a row per (rank, step) and a column per StepBreakdown field, the
    split of other_ms by cause a column per class (TABLE_COLUMNS; empty, no columns, when no rank
    has a step): what the checks read (Context.table). Built a column at a time from each rank's
    arrays, not from a StepBreakdown per row: those were held beside the frame through every check
    for the report alone (0.8 MB at 1,024 replicated DLRM ranks; #20), and are made from it only at
    the end (breakdown_rows)."""
    out = {f: Appended() for f in TABLE_COLUMNS}
    all_waits = waits_by_rank(run, matched)
    for r in run.ranks:
        tl = run.timelines[r]
        lo = tl.steps.start
        hi = tl.steps.end
        step_us = hi - lo
        compute = column(tl, "compute")
        dl = column(tl, "dataloader_free")
        exposed_set = tl.cover.exposed_comm()
        exposed = covered(exposed_set, lo, hi)
        waits = all_waits.get(r, Intervals.empty())
        wait = covered(intersect(exposed_set, waits), lo, hi) if len(waits) else np.zeros(lo.size)
        wait = np.minimum(wait, exposed)
        exposed = exposed - wait
        other = np.maximum(step_us - compute - exposed - wait - dl, 0.0)
        gc = gc_dl = np.zeros(lo.size)
        if (pz := (pauses or {}).get(r)) is not None and lo.size:
            gc, gc_dl, gc_other, gc_compute = _collections(pz, run.clock_offsets_us.get(r, 0.0), lo, hi,
                                                           exposed_set, dl, other, compute)
            dl, other, compute = dl - gc_dl, other - gc_other, compute - gc_compute
        gaps = run.idle.get(r)
        split = gaps.outside_dataloader_us if gaps is not None and not isinstance(gaps, ReduceFailed) else None
        n = len(tl.steps.step)
        # the same values the dicts held: rounded from each float, not as an array (bit for bit)
        causes = np.array([[round(float(split[i, k]) / 1000, 6) for k in range(len(CLASSES))] for i in range(n)],
                          dtype=np.float64).reshape(n, len(CLASSES)) if split is not None \
            else np.full((n, len(CLASSES)), np.nan)
        for f, v in (("rank", np.full(n, r, dtype=np.int64)), ("step", np.asarray(tl.steps.step).astype(np.int64)),
                     ("start_us", np.asarray(lo, dtype=np.float64)), ("step_ms", step_us / 1000),
                     ("compute_ms", compute / 1000), ("exposed_comm_ms", exposed / 1000),
                     ("straggler_wait_ms", wait / 1000), ("dataloader_ms", dl / 1000), ("other_ms", other / 1000),
                     ("gc_ms", gc / 1000), *zip(CAUSE_COLUMNS, causes.T), (HAS_CAUSES, np.full(n, split is not None)),
                     (GC_IN_FETCH, gc_dl / 1000)):
            out[f].add(v)
    if not out["rank"].n:
        return pd.DataFrame()
    return pd.DataFrame({f: out.pop(f).array() for f in TABLE_COLUMNS})


def breakdown_rows(table: pd.DataFrame) -> Iterator[StepBreakdown]:
    """breakdown_table's rows as StepBreakdowns, each value of the type it had when it was
    computed (a rank and step as int, start_us as float, the ms as numpy floats)."""
    return iter(BreakdownRows(table))


class BreakdownRows(Sequence):
    """Diagnosis.breakdown: breakdown_table's rows held as its columns, each row a StepBreakdown
    made when it is read (breakdown_rows' values and types), equal to any sequence of the same
    rows. A StepBreakdown a rank and step, held from the end of the analysis until written, was
    the client's height at 1,024 ranks once the rest had gone to disk (#20)."""

    __slots__ = ("_cols", "_n")

    def __init__(self, table: pd.DataFrame) -> None:
        self._n = 0 if table.empty else len(table)
        self._cols = {f: table[f].to_numpy() for f in TABLE_COLUMNS} if self._n else {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self._row(j) for j in range(*i.indices(self._n)))
        j = i + self._n if i < 0 else i
        if not 0 <= j < self._n:
            raise IndexError(i)
        return self._row(j)

    def __iter__(self) -> Iterator[StepBreakdown]:
        return (self._row(i) for i in range(self._n))

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(other) == self._n and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # as a list's: rows compare by value

    def __repr__(self) -> str:
        return f"BreakdownRows({self._n} rows)"

    def _row(self, i: int) -> StepBreakdown:
        cols = self._cols
        causes = {c: float(cols[k][i]) for c, k in zip(CLASSES, CAUSE_COLUMNS)} if cols[HAS_CAUSES][i] else {}
        return StepBreakdown(rank=int(cols["rank"][i]), step=int(cols["step"][i]), start_us=float(cols["start_us"][i]),
                             **{f: cols[f][i] for f in MS_FIELDS}, other_by_cause_ms=causes)


def unnamed_wait(table: pd.DataFrame, flag_share: float) -> dict | None:
    """The rank that waited longest at collectives for late peers, where that is at least
    `flag_share` of its step (the straggler check's flag threshold): {rank, wait_ms, share}, said
    beside "no significant cause" (extras.unnamed_wait). A wait the straggler check could not
    attribute (too few collectives for its chance test) left "no significant cause found" alone
    over 155.7 ms of waiting a step, 63% of it."""
    if table.empty:
        return None
    per = table.groupby("rank")[["straggler_wait_ms", "step_ms"]].mean()
    per = per[per["step_ms"] > 0]
    share = per["straggler_wait_ms"] / per["step_ms"]
    share = share[share >= flag_share]
    if share.empty:
        return None
    r = int(per.loc[share.index, "straggler_wait_ms"].idxmax())
    return {"rank": r, "wait_ms": round(float(per.at[r, "straggler_wait_ms"]), 3), "share": round(float(share[r]), 4)}


def unnamed_wait_caution(w: dict) -> str:
    """The caution's text (terminal and report) for extras.unnamed_wait."""
    return (f"rank {w['rank']} waited {w['wait_ms']:.1f} ms per step ({w['share']:.0%}) at collectives for a late "
            "peer, and no check named a cause: the straggler check says why")
