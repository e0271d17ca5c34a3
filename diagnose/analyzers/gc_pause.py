"""Python garbage collection pauses: the training process stopped while the collector runs.

A full pass (generation 2) walks every object Python tracks: with a large long-lived heap (a
dataset's per-sample records as dicts, caches) each one stops a rank for hundreds of ms, at the
steps that rank's own allocations decide, while the other ranks wait for it at the next
collective. A few such steps in a run are invisible in a profiled window of five steps, and
when one is caught it reads as a straggler or host gaps (measured: `examples/train_ddp.py
--gc-heap 1000000 --gc-churn 20000`, full passes of 330-420 ms at steps 11, 12 and 27 of 39, the
run's mean step 138 ms against a median 108: the tool said "no significant cause found").

Measured from the probes' every-step record (probes/patches._gc times every collection with
gc.callbacks), not from the profiled steps: like fail_slow and checkpoint_io, the pauses fall
where they fall. What the fix takes away is the full passes (gc.freeze() leaves the younger
generations' frequent short collections as they are: generation 1's are reported, not counted;
generation 0's are not timed, the probes' callback returning at once for them). Per step
the job waits for the rank whose full passes took longest (ranks pausing at the same step pause
together), so the cost is the mean over the recorded steps of that longest full-pass time; two
ranks pausing at the same wall time but in steps they number differently would be counted twice
(an upper bound). The record's own step times corroborate it (the run's mean step against its
median). On a device with queued work a host pause costs less than its length: there too the
figure is an upper bound, and confidence is medium.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from diagnose.analyzers.common import flag_or_pass, not_measurable
from diagnose.context import Context
from diagnose.model import Check, Finding
from diagnose.probedata import job_step_ms
from diagnose.thresholds import Thresholds
from diagnose.units import rank_ranges

ID = "gc_pause"
TITLE = "Python garbage collection pauses"
FIX = ("Keep the collector's full passes out of the steps: call gc.freeze() once the model, optimizer and "
       "dataset are built (what exists then is never walked again), and/or gc.disable() in the training loop "
       "with gc.collect() every N steps at the same step on every rank (torchtitan's gc_freq, Megatron-LM's "
       "--manual-gc), so the ranks pause together rather than one at a time while the others wait. Fewer "
       "Python objects (per-sample records in numpy arrays or Arrow tables, not dicts) make each pass shorter.")
MIN_STEPS = 10
"""Recorded steps, at the least: a pause every few dozen steps needs a run, not a window."""


def _collections(ctx: Context) -> pd.DataFrame | None:
    """One row per rank and recorded step (step, rank, gc_ms, gc_full, gc_full_ms, job_ms: the
    step as the job ran it) over the ranks whose probes timed collections; None where none did.
    Long, not a step x rank table: a 1,024-rank record of thousands of steps stays its own size."""
    timed = {r: p.steps for r, p in ctx.probes.items()
             if isinstance(p.meta.get("gc"), dict) and p.meta["gc"].get("timed") and not p.steps.empty}
    if not timed:
        return None
    frame = pd.concat([s[["step", "gc_ms", "gc_full", "gc_full_ms"]].assign(rank=r, job_ms=job_step_ms(s))
                       for r, s in timed.items()], ignore_index=True)
    return frame.drop_duplicates(["step", "rank"], keep="last").fillna({"gc_ms": 0.0, "gc_full": 0.0,
                                                                          "gc_full_ms": 0.0})


def analyze(ctx: Context, th: Thresholds) -> list[Check]:
    frame = _collections(ctx)
    if frame is None:
        return [not_measurable(ID, TITLE, "no probe timed Python's garbage collections (`diagnose run` or the probes' "
                                          "API time them on every step)")]
    n = int(frame["step"].nunique())
    if n < MIN_STEPS:
        return [not_measurable(ID, TITLE, f"{n} steps recorded: pauses that come every few dozen steps need "
                                          f"{MIN_STEPS} or more")]
    by_rank = frame.groupby("rank")
    # the job waits for the rank whose full passes took longest at each step
    per_step = float(frame.groupby("step")["gc_full_ms"].max().sum()) / n
    young = float((frame["gc_ms"] - frame["gc_full_ms"]).clip(lower=0).groupby(frame["rank"]).mean().max())
    step_ms = float(frame["job_ms"].mean())
    beyond = float((by_rank["job_ms"].mean() - by_rank["job_ms"].median()).median())
    share = per_step / step_ms if step_ms > 0 else 0.0
    passes = by_rank["gc_full"].sum()
    hits = frame[frame["gc_full"] > 0]
    with_full = int(hits["step"].nunique())
    multi = frame["rank"].nunique() > 1
    alone = int((hits.groupby("step").size() == 1).sum()) if multi else 0
    top = frame.loc[frame["gc_full_ms"].idxmax()]
    worst_rank, worst_step, longest = int(top["rank"]), int(top["step"]), float(top["gc_full_ms"])
    ranks = tuple(int(r) for r in passes.index[passes > 0]) or (worst_rank,)
    full_each = by_rank["gc_full_ms"].sum() / n
    metrics: dict[str, float | int | str] = {
        "full_pass_ms_per_step": round(per_step, 3),
        "share_of_step": round(share, 4),
        "young_gc_ms_per_step": round(young, 3),
        "every_step_steps": n,
        "every_step_step_ms": round(step_ms, 3),
        "mean_beyond_median_step_ms": round(beyond, 3),
        "full_passes": int(passes.sum()),
        "steps_with_a_full_pass": with_full,
        "steps_one_rank_alone": alone,
        "longest_pause_ms": round(longest, 3),
        "longest_pause_rank": worst_rank,
        "longest_pause_step": worst_step,
    }
    for r in passes.index:
        metrics[f"rank{int(r)}_full_pass_ms_per_step"] = round(float(full_each[r]), 3)
        metrics[f"rank{int(r)}_full_passes"] = int(passes[r])
    cfg = next((p.meta["gc"] for _, p in sorted(ctx.probes.items()) if isinstance(p.meta.get("gc"), dict)), {})
    fix = FIX
    together = multi and with_full > 0 and alone == 0
    if cfg:
        fix += (f" This run: thresholds {tuple(cfg.get('threshold', ()))}, {cfg.get('frozen', 0)} objects frozen"
                f"{', the collector disabled (collections by hand)' if cfg.get('enabled') is False else ''}"
                f"{'; its ranks already collect at the same steps: collect less often, or make fewer reference cycles' if together else ''}.")
    on_device = ctx.run.is_gpu
    f = Finding(
        id=ID, title=TITLE, severity=th.severity(share), recoverable_ms=round(per_step, 3),
        share_of_step=round(share, 4), ranks=ranks, metrics=metrics, events=(), fix=fix,
        confidence="medium" if on_device else "high", over="run",
        method="Mean over the probes' every-step record of the longest time any rank spent in Python's full "
               "garbage collections at that step (gc.callbacks)" + (": an upper bound where the device has work "
                                                                     "queued" if on_device else "."))
    if not with_full:
        return [flag_or_pass(f, th.gc_pause, th, "", ctx)]
    where = (f"at {alone} of the {with_full} steps with one, one rank collected alone while the others waited"
             if alone else f"every rank collected at the same {with_full} step(s)" if together
             else f"{with_full} step(s) with one")
    reason = (f"full garbage collections stop the training process {per_step:.1f} ms per step over the run's "
              f"{n} recorded steps ({share:.0%}): {int(passes.sum())} on rank(s) {rank_ranges(ranks)}, the "
              f"longest {longest:.0f} ms (rank {worst_rank}, step {worst_step}); {where}; the run's mean step is "
              f"{beyond:.1f} ms above its median (young collections, not counted: {young:.1f} ms per step)")
    return [flag_or_pass(f, th.gc_pause, th, reason, ctx)]
