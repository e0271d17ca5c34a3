"""Gradient accumulation without DDP's no_sync(): the gradients all-reduced after every micro-batch.

Accumulating k micro-batches per optimizer step needs one gradient reduction per step: DDP's
`no_sync()` context skips it for the first k-1 backward passes (the Hugging Face Trainer and
Lightning do this themselves). A hand-written loop that forgets it all-reduces every gradient
bucket k times per step, and k-1 of those reductions are thrown away by the next one.

Measured from the trace alone (CPU and GPU): per optimizer step (ProfilerStep window), the
micro-batches are the `DistributedDataParallel.forward` spans on the training thread; an
all-reduce of this rank that arrives before the last micro-batch's forward starts was issued
for an earlier micro-batch, which no_sync() would have skipped. What it costs: this rank's
communication in those early windows that nothing hides (exposed, including any wait for a late
peer at those collectives), per step; job-level the median rank. With no_sync() each of those
collectives is gone, so all of it is recoverable: a direct measurement, not a replay (the step
graph has no edit that removes collectives).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from diagnose.analyzers.common import confidence_for, evaluation_marks, evaluation_spans, flag_or_pass, passed
from diagnose.context import Context
from diagnose.ingest.load import KIND_ANNOTATION, KIND_CPU_OP, RankTrace
from diagnose.model import Check, Finding
from diagnose.step.bandwidth import collective_kind
from diagnose.step.intervals import covered, subtract
from diagnose.step.timeline import RankTimeline, _names_matching
from diagnose.thresholds import Thresholds

ID = "grad_sync"
TITLE = "Gradients all-reduced on every micro-batch (gradient accumulation without no_sync)"
FIX = ("Wrap every micro-batch but the last in `with model.no_sync():` (DDP), so gradients accumulate locally "
       "and are all-reduced once per optimizer step; FSDP2: model.set_requires_gradient_sync(False) on the same "
       "micro-batches. The Hugging Face Trainer, accelerate's `accumulate()` and Lightning's "
       "accumulate_grad_batches do this for you.")
DDP_FORWARD = re.compile(r"^DistributedDataParallel\.forward$")
TOP = 4  # evidence events per rank


@dataclass(frozen=True, slots=True)
class Accumulation:
    """One rank's micro-batches and gradient reductions per step (profiled steps)."""

    ddp: bool
    """The rank's training thread runs DistributedDataParallel.forward at all."""
    steps: int
    """Profiled steps with two or more DDP forwards (micro-batches)."""
    micro_batches: float
    """Median DDP forwards per such step."""
    syncing_steps: int
    """Those steps with an all-reduce before the last micro-batch's forward."""
    early_allreduces: float
    """Mean all-reduces per such step before the last micro-batch's forward."""
    allreduces: float
    """Mean all-reduces per such step in all."""
    early_exposed_ms: float
    """Mean per such step: exposed communication before the last micro-batch's forward."""
    rows: tuple[int, ...]
    """Evidence: the first early all-reduce of a few steps."""


NONE = dict(steps=0, micro_batches=1.0, syncing_steps=0, early_allreduces=0.0, allreduces=0.0, early_exposed_ms=0.0,
            rows=())


def reduce(trace: RankTrace, tl: RankTimeline) -> Accumulation:
    ev = trace.events
    host = ev["kind"].isin([KIND_CPU_OP, KIND_ANNOTATION]).to_numpy()
    fw = ev[host & _names_matching(ev, DDP_FORWARD)]
    fw = fw[~fw["tid"].astype(str).isin(tl.comm_threads)].sort_values("ts")
    if fw.empty or not len(tl.steps):
        return Accumulation(ddp=False, **NONE)
    c = tl.collectives
    coll = c[(c["step"] >= 0) & np.array([collective_kind(str(n)) == "all_reduce" for n in c["name"]], dtype=bool)]
    starts_all = fw["ts"].to_numpy()
    # an evaluation inside the step (its fetches marked by the probes) runs DDP forwards that are
    # no micro-batches: left out (a validation every N steps read as N-fold accumulation)
    e0, e1 = evaluation_spans(evaluation_marks(ev), tl)
    for a, b in zip(e0[~np.isnan(e0)], e1[~np.isnan(e1)]):
        starts_all = starts_all[(starts_all < a) | (starts_all > b)]
    exposed = subtract(tl.comm, tl.compute)
    n = syncing = 0
    micro, early_n, all_n, early_ms, rows = [], [], [], [], []
    for s in tl.steps.frame().itertuples():
        starts = starts_all[(starts_all >= s.start) & (starts_all < s.end)]
        if len(starts) < 2:
            continue
        n += 1
        last = float(starts[-1])
        mine = coll[coll["step"] == s.step]
        early = mine[mine["arrival"] < last]
        micro.append(len(starts))
        all_n.append(len(mine))
        early_n.append(len(early))
        early_ms.append(float(covered(exposed, [s.start], [last])[0]) / 1000)
        if len(early):
            syncing += 1
            if len(rows) < TOP:
                rows.append(int(early["row"].iloc[0]))
    if not n:
        return Accumulation(ddp=True, **NONE)
    return Accumulation(ddp=True, steps=n, micro_batches=float(np.median(micro)), syncing_steps=syncing,
                        early_allreduces=float(np.mean(early_n)), allreduces=float(np.mean(all_n)),
                        early_exposed_ms=float(np.mean(early_ms)), rows=tuple(rows))


def analyze(ctx: Context, th: Thresholds) -> list[Check]:
    run = ctx.run
    if (run.world_size or len(run.ranks)) <= 1:
        return [passed(ID, TITLE, "single process (world size 1): no gradient all-reduce")]
    facts = {r: f for r, f in ctx.facts(ID).items() if f.ddp}
    if not facts:
        return [passed(ID, TITLE, "no DistributedDataParallel.forward in the profiled steps: not a DDP job "
                       "(FSDP and other wrappers are not judged here)")]
    accum = {r: f for r, f in facts.items() if f.steps}
    if not accum:
        return [passed(ID, TITLE, "one forward per optimizer step: no gradient accumulation")]
    k = float(np.median([f.micro_batches for f in accum.values()]))
    syncing = {r: f for r, f in accum.items() if 2 * f.syncing_steps > f.steps}
    if not syncing:
        # several forwards per step are micro-batches, or several DDP-wrapped modules (DLRM wraps
        # two): either way nothing was reduced before the last one
        return [passed(ID, TITLE, f"{k:.0f} DDP forwards per step (gradient accumulation under no_sync(), or "
                       "several DDP modules) and no all-reduce before the last one: no gradient reduced twice")]
    ms = float(np.median([f.early_exposed_ms for f in accum.values()]))
    share = ms / ctx.mean_step_ms if ctx.mean_step_ms > 0 else 0.0
    early = float(np.median([f.early_allreduces for f in syncing.values()]))
    total = float(np.median([f.allreduces for f in syncing.values()]))
    metrics: dict[str, float | int | str] = {
        "micro_batches_per_step": round(k, 2),
        "allreduces_per_step": round(total, 2),
        "allreduces_before_last_micro_batch": round(early, 2),
        "exposed_ms_before_last_micro_batch": round(ms, 3),
        "share_of_step": round(share, 4),
        "steps_judged": int(max(f.steps for f in accum.values())),
    }
    refs = [ctx.event_ref(r, i, "an all-reduce before the step's last micro-batch: no_sync() would skip it")
            for r, f in sorted(syncing.items()) for i in f.rows]
    f = Finding(
        id=ID, title=TITLE, severity=th.severity(share), recoverable_ms=round(ms, 3), share_of_step=round(share, 4),
        ranks=tuple(sorted(syncing)), metrics=metrics, events=tuple(refs[:TOP]), fix=FIX,
        confidence=confidence_for(ctx, "high"),
        method="Per step with two or more DistributedDataParallel.forward spans: the rank's all-reduces that "
               "arrive before the last one starts, and its exposed communication until then (all of it goes "
               "with no_sync()); mean over those steps, median over ranks.")
    return [flag_or_pass(f, th.grad_sync, th,
                         f"{early:.0f} of {total:.0f} all-reduces per step come before the last of {k:.0f} "
                         f"micro-batches (no no_sync()): {ms:.1f} ms per step ({share:.0%}) of exposed "
                         f"communication that accumulating locally would remove", ctx)]
