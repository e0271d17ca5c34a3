"""Helpers shared by the analyzers: shares, severities, check construction."""
from __future__ import annotations

import numpy as np
import pandas as pd

from diagnose.ingest.load import KIND_ANNOTATION, KIND_CPU_OP
from diagnose.model import Check, Finding
from diagnose.probes.patches import EVAL_BATCH_NAMES
from diagnose.step.idle import IdleModel, completeness
from diagnose.step.timeline import CPU_COMM_ENQUEUE, CPU_COMM_TRANSFER, DATALOADER, RankTimeline, _names_matching, frames
from diagnose.thresholds import Thresholds
from diagnose.whatif import finding_saving


def confidence_for(ctx, base: str = "high") -> str:
    """Lower confidence for thin evidence: one profiled step, or a subset of the ranks."""
    levels = ["low", "medium", "high"]
    level = levels.index(base)
    n_steps = int(ctx.table.groupby("rank")["step"].nunique().min())
    if n_steps < 2:
        level -= 1
    run = ctx.run
    if run.world_size and len(run.ranks) < run.world_size and len(run.ranks) < 0.5 * run.world_size:
        level -= 1
    if any(getattr(run.traces[r], "salvaged", False) for r in run.ranks):
        level -= 1  # a trace cut short (a killed job): its last events are missing
    return levels[max(level, 0)]


def idle_completeness(ctx, th) -> list[str]:
    """Per-rank completeness notes of the idle model (diagnose/step/idle.py), "rank r: ..." (at most
    three): a check that reads idle classes lowers its confidence to low when any applies."""
    idle = ctx.run.idle  # each model read back from disk (ingest/assemble.Keep): one at a time
    notes = [f"rank {r}: {n}" for r in sorted(idle) if isinstance(m := idle[r], IdleModel)
             for n in completeness(m, th)]
    return notes[:3] + ([f"and {len(notes) - 3} more"] if len(notes) > 3 else [])


def passed(check_id: str, title: str, reason: str) -> Check:
    return Check(id=check_id, title=title, status="passed", reason=reason)


def not_measurable(check_id: str, title: str, reason: str) -> Check:
    return Check(id=check_id, title=title, status="not_measurable", reason=reason)


def below(th_share: float, ms: float, share: float) -> str:
    return f"{ms:.2f} ms per step ({share:.1%}), below the {th_share:.0%} threshold"


WAITS_FOR_PEERS = frozenset({"straggler", "load_imbalance"})
"""Checks whose own measure is time ranks wait at collectives for their peers."""


def paused_peers(ctx, wait_ms: float, replayed_ms: float | None = None) -> str | None:
    """A wait for peers (`wait_ms` a step, its check's own measure) that the step model's replay
    gives back less than half of (`replayed_ms`; None: every rank brought to the median, the
    waits' own edit), where the placed garbage collections (step/pauses.py) give back at least half
    of the difference: the clause saying the waits were for peers stopped in collections."""
    m = getattr(ctx, "model", None)
    if m is None or not m.trusted:
        return None
    if replayed_ms is None:
        replayed_ms = m.saving("load_imbalance")
    if replayed_ms is None or replayed_ms >= 0.5 * wait_ms:
        return None
    paused = m.saving("gc_pause")
    if paused is None or paused < 0.5 * (wait_ms - replayed_ms):
        return None
    return (f"the waits were for peers stopped in garbage collections, which the step model sets apart: "
            f"removing those gives back {paused:.1f} ms per profiled step, the gc_pause check's")


def flag_or_pass(finding: Finding, threshold: float, th: Thresholds, reason_flag: str, ctx=None) -> Check:
    """Flagged when the cause costs at least `threshold` of the step. With ctx, where the step
    model is faithful and can express the cause, what it costs is what the replay gives back with
    it removed (diagnose/whatif.py): a wait that only hides another is measured but not flagged.
    The finding keeps the check's own figure; the pipeline's replay then sets recoverable_ms."""
    ms, share = finding.recoverable_ms, finding.share_of_step
    replayed = None
    m = getattr(ctx, "model", None)
    if m is not None and m.trusted and finding.kind != "capacity":
        replayed = finding_saving(m, finding)
    if replayed is not None:
        ms, share = replayed, (replayed / ctx.mean_step_ms if ctx.mean_step_ms > 0 else 0.0)
    if share >= threshold and ms >= th.healthy_floor_ms:
        return Check(id=finding.id, title=finding.title, status="flagged", reason=reason_flag, finding=finding,
                     measured_ms=finding.recoverable_ms)
    why = below(threshold, ms, share)
    if replayed is not None:
        why = f"removing it gives back {why} (replayed; its own measure: {finding.recoverable_ms:.2f} ms"
        # a wait for peers whose process stood still in a garbage collection is that collection's
        paused = paused_peers(ctx, finding.recoverable_ms, replayed) if finding.id in WAITS_FOR_PEERS else None
        if paused is not None:
            why += f"; {paused})"
        else:
            why += "; other waits take its place)" if replayed < 0.5 * finding.recoverable_ms else ")"
    return Check(id=finding.id, title=finding.title, status="passed", reason=why, measured_ms=finding.recoverable_ms)


def host_self_times(ev: pd.DataFrame, tl: RankTimeline) -> pd.DataFrame:
    """The host ops of the training threads with their self times (`self_us`), without the step
    markers, DataLoader fetches and communication calls: those are other checks' time.

    Self times are taken before those are left out: a pipeline stage's "Backward 0" annotation
    holding an 88 ms blocking gloo:recv has that recv subtracted, so the wait is never counted as
    the annotation's own (per-op) time.

    An op that starts in a step ends, here, no later than that step: a step boundary taken inside an
    op (the probes step the profiler from an optimizer step post-hook, so `Optimizer.step` holds the
    next step's start, and on the last profiled step the trace export: 100 ms in one 25 ms step)
    would otherwise book time outside every step as that op's own."""
    host = ev["kind"].isin([KIND_CPU_OP, KIND_ANNOTATION]).to_numpy()
    # step markers, a closure's Optimizer.step, Lightning's profiler annotations: they hold waits, not work
    framing = pd.Series(frames(ev), index=ev.index)
    ops = ev[host & ~ev["tid"].astype(str).isin(tl.comm_threads).to_numpy()]
    ops = ops.assign(dur=_clipped_to_step(ops, tl))
    ops = ops.assign(tid=ops["tid"].astype(str)).sort_values(["tid", "ts", "dur"], ascending=[True, True, False])
    ops = ops.assign(self_us=self_times(ops))
    skip = (_names_matching(ops, DATALOADER)
            | _names_matching(ops, CPU_COMM_ENQUEUE) | _names_matching(ops, CPU_COMM_TRANSFER)
            | framing.loc[ops.index].to_numpy())
    return ops[~skip]


def _clipped_to_step(ops: pd.DataFrame, tl: RankTimeline) -> np.ndarray:
    """Each op's duration, cut at the end of the step it starts in (ops outside steps unchanged)."""
    ts, dur = ops["ts"].to_numpy(dtype=float), ops["dur"].to_numpy(dtype=float)
    lo, hi = tl.steps.start, tl.steps.end
    if not len(lo):
        return dur
    k = np.searchsorted(lo, ts, side="right") - 1
    end = hi[np.clip(k, 0, None)]
    inside = (k >= 0) & (ts < end)
    return np.where(inside, np.minimum(dur, end - ts), dur)


def self_times(df: pd.DataFrame) -> np.ndarray:
    """Self time of each op (duration minus its direct children), per thread.

    Rows must be sorted by (tid, ts, -dur). One stack walk: CPU-only traces hold
    tens of thousands of ops per step at most, so a Python loop is fast enough here.
    A child that outlives its parent (gloo's async `gloo:recv` starts inside `c10d::recv_` and
    ends 88 ms later) has the part beyond the parent's end taken from the ancestors it lies in.
    """
    ts = df["ts"].to_numpy()
    end = ts + df["dur"].to_numpy()
    tids = df["tid"].to_numpy()
    self_t = df["dur"].to_numpy().copy()
    stack: list[int] = []
    prev_tid = None
    for i in range(len(ts)):
        if tids[i] != prev_tid:
            stack.clear()
            prev_tid = tids[i]
        while stack and end[stack[-1]] <= ts[i]:
            stack.pop()
        start = ts[i]
        for j in reversed(stack):  # the parent first; what outlasts it, its ancestors
            hi = min(end[i], end[j])
            if hi > start:
                self_t[j] -= hi - start
                start = hi
            if start >= end[i]:
                break
        stack.append(i)
    return np.maximum(self_t, 0.0)


def evaluation_marks(ev: pd.DataFrame) -> pd.DataFrame:
    """The DataLoader fetches the probes marked as an evaluation's (probes/patches.EVAL_BATCH)."""
    return ev[ev["name"].isin(EVAL_BATCH_NAMES).to_numpy()]


def evaluation_spans(marks: pd.DataFrame, tl: RankTimeline) -> tuple[np.ndarray, np.ndarray]:
    """Per profiled step, (start, end) of its evaluation loop: from its first marked fetch
    (evaluation_marks) to the end of its last (the fetch that ends the loop is marked too); NaN in
    steps without one. File clock, us."""
    n = len(tl.steps.start)
    first, last = np.full(n, np.inf), np.full(n, -np.inf)
    if len(marks) and n:
        s0, s1 = np.asarray(tl.steps.start, dtype=float), np.asarray(tl.steps.end, dtype=float)
        start = marks["ts"].to_numpy(float)
        end = start + marks["dur"].to_numpy(float)
        k = np.searchsorted(s0, start, side="right") - 1
        inside = (k >= 0) & (end <= s1[np.maximum(k, 0)])
        np.minimum.at(first, k[inside], start[inside])
        np.maximum.at(last, k[inside], end[inside])
    found = np.isfinite(first)
    return np.where(found, first, np.nan), np.where(found, last, np.nan)
