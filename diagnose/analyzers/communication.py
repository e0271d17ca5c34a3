"""2. Communication vs compute overlap.

Estimation: per rank, the mean per-step communication time not hidden under
compute, less the time spent waiting for the last-arriving rank. That waiting is never
booked here, whether the straggler check names a rank (its part) or finds arrival jitter
(no rank to fix; the straggler check reports its size): no bucket size or interconnect
change shortens a wait for a late peer. Job-level: the median rank, since a
collective ends at the same moment on every rank and the median is robust to one
rank's noise.
Also reports collectives per step, their sizes, and overlap.
"""
from __future__ import annotations

import numpy as np

from diagnose.analyzers.common import confidence_for, flag_or_pass, not_measurable, passed
from diagnose.context import Context
from diagnose.model import Check, Finding
from diagnose.step.bandwidth import SMALL_MESSAGE_BYTES
from diagnose.step.intervals import covered
from diagnose.thresholds import Thresholds

ID = "exposed_communication"
TITLE = "Exposed communication (collectives not overlapped with compute)"
FIX = ("Hide or shrink communication: let DDP overlap it (bucket_cap_mb=25..100, gradient_as_bucket_view=True, "
       "static_graph=True); accumulate gradients under model.no_sync() to all-reduce less often; "
       "compress gradients (bf16/fp16 comm hook); check the interconnect and NCCL topology (NCCL_DEBUG=INFO).")
FIX_TINY = ("Collectives are many and small: raise DDP bucket_cap_mb (default 25) so gradients travel "
            "in a few large buckets, and avoid per-parameter all-reduce calls.")
# Hundreds of collectives per step under 1 MiB each: latency-bound, i.e. no bucketing.
MANY_COLLECTIVES = 50
SMALL_BYTES = SMALL_MESSAGE_BYTES  # one definition of a small collective (step/bandwidth.py: why 1 MiB)


def analyze(ctx: Context, th: Thresholds) -> list[Check]:
    run = ctx.run
    has_comm = any(len(tl.comm) for tl in run.timelines.values())
    if not has_comm:
        if (run.world_size or 1) <= 1:
            return [passed(ID, TITLE, "single process (world size 1): no communication")]
        return [not_measurable(ID, TITLE, "no collective events in the trace (NCCL kernels or gloo ops); "
                               "the profiler may not have recorded communication")]
    exposed = ctx.per_rank_mean("exposed_comm_ms")
    wait = ctx.per_rank_mean("straggler_wait_ms")
    wait_ms = float(np.median(wait.to_numpy()))
    ms = float(np.median(exposed.to_numpy()))
    share = ms / ctx.mean_step_ms
    totals, counts, sizes = {}, [], []
    for r, tl in run.timelines.items():
        totals[r] = float(np.mean(covered(tl.comm, tl.steps["start"], tl.steps["end"]))) / 1000
        c = tl.collectives[tl.collectives["step"] >= 0]
        if len(c):
            counts.append(c.groupby("step").size().mean())
            sizes += list(c["bytes"].dropna())
    total_ms = float(np.median(list(totals.values())))
    hidden = max(total_ms - ms - wait_ms, 0.0)
    per_step = float(np.median(counts)) if counts else 0.0
    median_bytes = float(np.median(sizes)) if sizes else float("nan")
    tiny = per_step >= MANY_COLLECTIVES and (not sizes or median_bytes < SMALL_BYTES)
    metrics: dict[str, float | int | str] = {
        "exposed_comm_ms_per_step": round(ms, 3),
        "comm_ms_per_step": round(total_ms, 3),
        "overlapped_share": round(hidden / total_ms, 4) if total_ms else 0.0,
        "collectives_per_step": round(per_step, 1),
        "median_collective_bytes": round(median_bytes) if sizes else "not recorded",
        "share_of_step": round(share, 4),
    }
    if wait_ms > 0:
        metrics["peer_wait_ms_per_step_not_counted"] = round(wait_ms, 3)
    for r in exposed.index:
        metrics[f"rank{r}_exposed_comm_ms"] = round(float(exposed[r]), 3)
    if run.is_gpu:
        kernel_ms = {r: float(np.mean(covered(tl.compute, tl.steps["start"], tl.steps["end"]))) / 1000
                     for r, tl in run.timelines.items()}
        comm_share = [totals[r] / (totals[r] + kernel_ms[r]) for r in totals if totals[r] + kernel_ms[r] > 0]
        if comm_share:
            metrics["comm_share_of_device_time"] = f"{min(comm_share):.0%}-{max(comm_share):.0%}"
    # evidence: the longest collectives on the rank with the most exposed communication
    worst = int(exposed.idxmax())
    c = run.timelines[worst].collectives
    longest = c.assign(d=c["end"] - c["arrival"]).nlargest(5, "d")
    refs = tuple(ctx.event_ref(worst, int(row), "collective") for row in longest["row"])
    ranks = tuple(int(r) for r in exposed[exposed / ctx.per_rank_mean("step_ms") >= th.communication].index)
    f = Finding(
        id=ID, title=TITLE, severity=th.severity(share), recoverable_ms=round(ms, 3), share_of_step=round(share, 4),
        ranks=ranks or tuple(run.ranks), metrics=metrics, events=refs, fix=FIX_TINY if tiny else FIX,
        confidence=confidence_for(ctx, "high" if len(run.ranks) > 1 else "medium"),
        method="Median over ranks of per-step communication not hidden under compute, excluding time "
               "spent waiting for the last-arriving rank (a late peer: the straggler check's).")
    reason = (f"communication is exposed {ms:.1f} ms per step ({share:.0%}); "
              f"{metrics['overlapped_share']:.0%} of it overlaps compute")
    if tiny:
        reason += f"; {per_step:.0f} small collectives per step (no bucketing?)"
    return [flag_or_pass(f, th.communication, th, reason, ctx)]
