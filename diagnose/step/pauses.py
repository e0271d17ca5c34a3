"""Python's garbage collections placed on each rank's steps: time the process stood still.

A full collection walks every tracked object and stops the training process for tens to hundreds
of ms, at steps each rank's own allocations decide. The trace does not show it: the time reads as
whatever the process was doing when the pass began (a DataLoader fetch, host time between ops),
and its peers, reaching the next collective first, wait for it. Unplaced, one pass inside the
profiled steps made the window's figures name the wrong cause ("uneven work across ranks",
tests/fixtures/cpu_gc_in_window_2rank). The probes record where each long pass ran
(`StepRecord.gc_passes`: its offset in its step, on the host's wall clock like the step's start);
here they are put on the trace's clock, so the step graph carries them as a lane part of their own
(graph.py PARTS "gc"): not the DataLoader's wait, not work to bring to the median rank.

CPU ranks only. On a GPU rank the lane is the device's: a host pause costs what the device idles
once its queue drains, which this record cannot tell from the idle model's other host-side gaps
without the gaps' intervals (measured where the trace is read); there the passes stay inside those
classes, and the window's caution says so (step/window.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diagnose.ingest.assemble import Run
from diagnose.ingest.load import base_offset_us
from diagnose.probedata import ProbeData
from diagnose.step.intervals import Intervals, union


@dataclass(frozen=True, slots=True)
class Pauses:
    """One rank's placed collections that overlap its profiled steps (aligned clock, us)."""

    every: Intervals
    in_fetch: Intervals
    """Those the probes saw begin inside a DataLoader fetch: the trace shows them as the wait."""
    ms: float
    """Their time inside the profiled steps, summed."""
    in_fetch_ms: float
    """Of it, inside DataLoader fetches."""
    steps: int
    """The rank's profiled steps."""

    @property
    def ms_per_step(self) -> float:
        return self.ms / self.steps

    @property
    def in_fetch_ms_per_step(self) -> float:
        return self.in_fetch_ms / self.steps


def placed(p: ProbeData | None) -> bool:
    """The rank's probes record where each long collection ran (older probes sum them only)."""
    gc = p.meta.get("gc") if p is not None else None
    return isinstance(gc, dict) and gc.get("placed") is True


def rank_pauses(run: Run, r: int, p: ProbeData) -> Pauses | None:
    """Rank r's placed collections inside its profiled steps; None where they cannot be placed
    (a GPU rank, no absolute clock in the trace, probes that do not place them, none inside)."""
    tl, trace = run.timelines.get(r), run.traces.get(r)
    if tl is None or trace is None or tl.is_gpu or not placed(p) or p.gc_passes.empty:
        return None
    base = base_offset_us(trace.meta)
    if not base or not tl.steps.start.size:
        return None
    g = p.gc_passes
    # the probes' wall clock (time.time at each step's start) to the trace's file clock, then the
    # run's alignment of this rank
    off = run.clock_offsets_us.get(r, 0.0)
    a = g["start"].to_numpy(dtype=float) * 1e6 + off - base
    b = a + g["dur_ms"].to_numpy(dtype=float) * 1e3
    lo, hi = float(tl.steps.start.min()) + off, float(tl.steps.end.max()) + off
    a, b = np.maximum(a, lo), np.minimum(b, hi)
    inside = b > a
    if not inside.any():
        return None
    fetch = g["in_fetch"].to_numpy(dtype=bool) & inside
    every, in_fetch = union(a[inside], b[inside]), union(a[fetch], b[fetch])
    return Pauses(every=every, in_fetch=in_fetch, ms=float((every.ends - every.starts).sum()) / 1000,
                  in_fetch_ms=float((in_fetch.ends - in_fetch.starts).sum()) / 1000, steps=int(tl.steps.start.size))


def run_pauses(run: Run, probes: dict[int, ProbeData]) -> dict[int, Pauses]:
    """rank_pauses of every rank that has some."""
    out = {}
    for r, p in probes.items():
        got = rank_pauses(run, r, p)
        if got is not None:
            out[r] = got
    return out
