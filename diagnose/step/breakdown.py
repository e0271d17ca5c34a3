"""Per-rank, per-step breakdown: where each step's time went.

Components are disjoint and sum to the step time (priority order, so overlapping
activity is counted once):
- GPU: compute > communication > DataLoader wait > other (GPU idle).
- CPU: DataLoader wait > compute > communication > other (host gaps, sleeps).
On GPU ranks `other` is split by the idle model's classes (why the device idled).
Communication not hidden under compute is split into the part spent waiting for the
single last-arriving rank of each collective, or for the ranks late together when the context
found some (`straggler_wait`: what fixing them would give back; collectives.wait_for_group),
and the rest (`exposed_comm`: transfers and general arrival skew).
"""
from __future__ import annotations

import numpy as np

from diagnose.ingest.assemble import ReduceFailed, Run
from diagnose.model import StepBreakdown
from diagnose.step.collectives import Matched, rows_by_value
from diagnose.step.cover import column
from diagnose.step.idle import CLASSES
from diagnose.step.intervals import Intervals, covered, intersect, subtract, union


def waits_by_rank(run: Run, matched: Matched) -> dict[int, Intervals]:
    """Each rank's waits for the last rank alone (or for the ranks late together), on its own
    clock, where its lanes live; found in one pass (a scan of every matched row per rank was
    1.5 of the client's 7.3 s at 1,024 ranks)."""
    pr = matched.per_rank
    if pr.empty:
        return {}
    mine = pr[pr["tail_wait"] > 0]
    rank = mine["rank"].to_numpy()
    end, tail = np.minimum(mine["latest"], mine["end"]).to_numpy(), mine["tail_wait"].to_numpy()
    out = {}
    for r, rows in rows_by_value(rank, [int(x) for x in np.unique(rank)]).items():
        e = end[rows] - run.clock_offsets_us.get(r, 0.0)
        out[r] = union(e - tail[rows], e)
    return out


def exposed_comm(run: Run, rank: int, waits: dict[int, Intervals]) -> Intervals:
    """The rank's communication that compute_breakdown books as exposed_comm: its exposed set
    (cover.exposed) outside its waits for the last rank alone (waits_by_rank's). For splitting
    that time further (step/bandwidth.py), on the rank's own clock."""
    exposed_set = run.timelines[rank].cover.exposed_comm()
    mine = waits.get(rank)
    return subtract(exposed_set, mine) if mine is not None and len(mine) else exposed_set


def compute_breakdown(run: Run, matched: Matched) -> list[StepBreakdown]:
    rows: list[StepBreakdown] = []
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
        gaps = run.idle.get(r)
        split = gaps.outside_dataloader_us if gaps is not None and not isinstance(gaps, ReduceFailed) else None
        for i, step in enumerate(tl.steps.step):
            causes = {c: round(float(split[i, k]) / 1000, 6) for k, c in enumerate(CLASSES)} if split is not None else {}
            rows.append(StepBreakdown(
                rank=r, step=int(step), start_us=float(lo[i]), step_ms=step_us[i] / 1000,
                compute_ms=compute[i] / 1000, exposed_comm_ms=exposed[i] / 1000,
                straggler_wait_ms=wait[i] / 1000, dataloader_ms=dl[i] / 1000, other_ms=other[i] / 1000,
                other_by_cause_ms=causes))
    return rows
