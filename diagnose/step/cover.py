"""What the parent reads of one rank's interval sets, measured next to its trace.

A rank's timeline holds interval sets with an interval per kernel, host op and idle gap: a rank's
result held 420 KB for a 26 MB trace of six ResNet-50 steps, about 1.6% of the JSON, so a thousand
ranks of 1 GB traces would have put some 16 GB on the client (#20: bounded client memory). The
analysis in the parent never needs the sets, only these, sized by steps, collectives and the
stretches of exposed communication:

- `per_step`: how much of each step each set covers (the breakdown, the communication and
  DataLoader checks, the compiled share);
- `exposed`: communication not hidden under compute (on CPU ranks nor under DataLoader waits):
  the breakdown splits it by the matched collectives' waits, the step graph's lanes are blocked
  on it. It is what still grows with the kernels: compute kernels running beside a collective
  cut its exposed time into stretches (311 of them for 21 collectives on
  hta_nccl_data_rank0of2_a100), and the step graph looks at each;
- the step graph's lane parts (DataLoader wait, each idle class, pageable input copies) as
  cumulative coverage at every point a lane can have there (step bounds, collective arrivals,
  ends of exposed stretches), so the graph gets each lane edge's composition by difference
  (`Lanes`: on disk in the parent until the graph reads it);
- `drawing`: the report's mini timeline of each step (the longest MAX_DRAWN intervals a lane).

Built once per rank (`rank_cover`) where the trace is read, before the sets are dropped from what
travels (`RankTimeline.for_parent`). Every figure read from it equals the sets' own (the diagnosis
JSON of every shared trace and recorded job was byte-identical before and after).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from diagnose.ingest.spill import Spilled, unspilled
from diagnose.step.idle import CLASSES, LATENCY, IdleModel
from diagnose.step.intervals import Intervals, clip, covered, member, merge, running, subtract, union

if TYPE_CHECKING:  # both import this module
    from diagnose.ingest.assemble import ReduceFailed
    from diagnose.step.timeline import RankTimeline

STEP_SETS = ("compute", "comm", "dataloader", "dataloader_free", "input_copy", "host_busy", "compiled")
"""per_step's columns. dataloader_free: DataLoader wait with neither compute nor communication on
the device alongside (GPU; on CPU ranks the DataLoader set itself)."""
LANE_SETS = ("dataloader",) + tuple(f"idle_{c}" for c in CLASSES) + ("input_copy",)
"""The step graph's lane parts measured from interval sets, in its PARTS order (graph.py)."""
DRAWN = ("host", "compute", "communication", "dataloader")
MAX_DRAWN = 400
"""Intervals kept a lane a step for the mini timeline: the longest (a browser draws thousands)."""
POINT_SLACK_US = 1e-6
"""How far below a lane point (float error of the clock shift) a query still finds it."""


@dataclass(frozen=True, slots=True)
class Drawing:
    """The mini timeline's lanes of every step, each lane's steps concatenated: rows of step i are
    offsets[i]:offsets[i+1]. File clock, clipped to the step, in time order."""

    starts: dict[str, np.ndarray]
    ends: dict[str, np.ndarray]
    offsets: dict[str, np.ndarray]
    idle_cls: np.ndarray
    """Class of each drawn idle gap (lane "idle"; GPU ranks with an idle model)."""

    def lane(self, name: str, i: int) -> tuple[np.ndarray, np.ndarray]:
        o = self.offsets.get(name)
        if o is None:
            return np.empty(0), np.empty(0)
        return self.starts[name][o[i]:o[i + 1]], self.ends[name][o[i]:o[i + 1]]

    def idle_classes(self, i: int) -> np.ndarray:
        o = self.offsets["idle"]
        return self.idle_cls[o[i]:o[i + 1]]


@dataclass(frozen=True, slots=True)
class Lanes:
    """The step graph's lane parts of one rank, measured at its lane points."""

    points: np.ndarray
    """Lane points (file clock, sorted): where `cum` is measured."""
    cols: np.ndarray
    """The LANE_SETS this rank has any time in (most ranks have a few idle classes): cum's columns."""
    cum: np.ndarray
    """(points, len(cols)): each such set's coverage up to each point (intervals.running, whose
    differences are covered() between points)."""
    inside: np.ndarray
    """(points, len(cols)): the set covers the moment just after the point (how a query a
    fraction of a microsecond past a point, a lane resuming at a collective's end, continues)."""

    def parts(self, a: np.ndarray, b: np.ndarray, offset: float) -> np.ndarray:
        """(len(a), len(LANE_SETS)): each lane set's time between a[i] and b[i] (aligned clock:
        `offset` added to this rank's times)."""
        a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
        out = np.zeros((a.size, len(LANE_SETS)))
        if self.cols.size:
            out[:, self.cols] = np.maximum(self._at(b - offset) - self._at(a - offset), 0.0)
        return out

    def _at(self, x: np.ndarray) -> np.ndarray:
        i = np.clip(np.searchsorted(self.points, x + POINT_SLACK_US, side="right") - 1, 0, None)
        dt = np.maximum(x - self.points[i], 0.0)
        return self.cum[i] + self.inside[i] * dt[:, None]


@dataclass(frozen=True, slots=True)
class RankCover:
    per_step: np.ndarray
    """(steps, len(STEP_SETS)): us of each set inside each step (the timeline's step rows)."""
    n_comm: int
    """Intervals in the communication set (is there any communication)."""
    n_dataloader: int
    """Intervals in the DataLoader set (is there any DataLoader span)."""
    exposed: Intervals | Spilled
    """In the parent, on disk until the breakdown, the communication table and the step graph read
    it, once each (ingest/spill.py; ~1 KB a DLRM rank held): use `exposed_comm()`."""
    lanes: Lanes | Spilled
    """In the parent, on disk until the step graph reads it, once (ingest/spill.py): use `lane_parts`."""
    drawing: Drawing | Spilled
    """In the parent, on disk until the report draws the rank (ingest/spill.py): use `drawn()`."""

    def exposed_comm(self) -> Intervals:
        return unspilled(self.exposed)

    def drawn(self) -> Drawing:
        return unspilled(self.drawing)

    def lane_parts(self, a: np.ndarray, b: np.ndarray, offset: float) -> np.ndarray:
        """Lanes.parts of this rank's lanes."""
        return unspilled(self.lanes).parts(a, b, offset)


def exposed_set(tl: RankTimeline) -> Intervals:
    """Communication not hidden under compute (on CPU ranks, nor under DataLoader waits, which come first)."""
    return subtract(tl.comm, tl.compute) if tl.is_gpu else subtract(subtract(tl.comm, tl.compute), tl.dataloader)


def idle_sets(m: IdleModel | ReduceFailed | None, lo: float, hi: float) -> list[Intervals]:
    """Per idle class, the rank's idle gaps of that class (open ends cut at [lo, hi])."""
    if not isinstance(m, IdleModel):
        return [Intervals.empty() for _ in CLASSES]
    a, b = np.maximum(m.start, lo), np.minimum(m.end, hi)
    return [union(a[m.cls == k], b[m.cls == k]) for k in range(len(CLASSES))]


def _drawing(tl: RankTimeline, m: IdleModel | ReduceFailed | None, lo: np.ndarray, hi: np.ndarray) -> Drawing:
    starts: dict[str, list] = {}
    ends: dict[str, list] = {}
    cls: list[np.ndarray] = []
    sets = dict(zip(DRAWN, (tl.host_busy, tl.compute, tl.comm, tl.dataloader)))
    for a, b in zip(lo, hi):
        a, b = float(a), float(b)
        for name, iv in sets.items():
            c = clip(iv, a, b)
            keep = np.sort(np.argsort(c.ends - c.starts)[::-1][:MAX_DRAWN])
            starts.setdefault(name, []).append(c.starts[keep])
            ends.setdefault(name, []).append(c.ends[keep])
        if isinstance(m, IdleModel):
            # each idle gap with its cause (scheduling latency left out: too small to see)
            s0, s1 = np.maximum(m.start, a), np.minimum(m.end, b)
            sel = np.flatnonzero((s1 > s0) & (m.cls != LATENCY))
            sel = np.sort(sel[np.argsort(s0[sel] - s1[sel], kind="stable")][:MAX_DRAWN])
            starts.setdefault("idle", []).append(s0[sel])
            ends.setdefault("idle", []).append(s1[sel])
            cls.append(m.cls[sel])
    offsets = {k: np.concatenate([[0], np.cumsum([len(x) for x in v])]).astype(np.int64) for k, v in starts.items()}
    cat = {k: np.concatenate(v) if v else np.empty(0) for k, v in starts.items()}
    return Drawing(starts=cat, ends={k: np.concatenate(v) if v else np.empty(0) for k, v in ends.items()},
                   offsets=offsets, idle_cls=np.concatenate(cls) if cls else np.empty(0, dtype=np.int64))


def rank_cover(tl: RankTimeline, m: IdleModel | ReduceFailed | None) -> RankCover:
    """tl: the rank's full RankTimeline; m: its idle model (None on CPU ranks, or why it failed)."""
    lo = tl.steps.start
    hi = tl.steps.end
    busy = merge(tl.compute, tl.comm)
    dl_free = subtract(tl.dataloader, busy) if tl.is_gpu else tl.dataloader
    per_step = np.stack([covered(s, lo, hi) for s in (tl.compute, tl.comm, tl.dataloader, dl_free,
                                                       tl.input_copies, tl.host_busy, tl.compiled)], axis=1) \
        if lo.size else np.zeros((0, len(STEP_SETS)))
    exposed = exposed_set(tl)
    if lo.size:
        # the lane parts as the step graph cuts them (graph.build_graph: lanes and their points)
        gaps = idle_sets(m, float(lo.min()), float(hi.max()))
        lane = [dl_free, *[subtract(s, dl_free) for s in gaps], tl.input_copies]
        c = tl.collectives
        arrivals = c["arrival"].to_numpy(dtype=float)[c["step"].to_numpy() >= 0]
        ends = np.minimum(exposed.ends, hi.max())
        points = np.unique(np.concatenate([lo, hi, arrivals, ends[ends > lo.min()]]))
        cols = np.array([k for k, s in enumerate(lane) if len(s)], dtype=np.int64)
        cum = np.stack([running(lane[k], points) for k in cols], axis=1) if cols.size else np.zeros((points.size, 0))
        inside = np.stack([member(points, lane[k]) for k in cols], axis=1) if cols.size \
            else np.zeros((points.size, 0), dtype=bool)
    else:
        points, cols, cum, inside = np.empty(0), np.empty(0, dtype=np.int64), np.zeros((0, 0)), np.zeros((0, 0), dtype=bool)
    return RankCover(per_step=per_step, n_comm=len(tl.comm), n_dataloader=len(tl.dataloader),
                     exposed=exposed, lanes=Lanes(points=points, cols=cols, cum=cum, inside=inside),
                     drawing=_drawing(tl, m, lo, hi))


def column(tl: RankTimeline, name: str) -> np.ndarray:
    """us of set `name` (STEP_SETS) inside each of the timeline's steps."""
    return tl.cover.per_step[:, STEP_SETS.index(name)]
