"""Device waits with work already queued (work launched, idle anyway).

GPU traces. Estimation: the queued class of the idle model (diagnose/step/idle.py): per step,
device idle ended by work whose launch call returned before the idle began, or that was
launched before the profiler started. The host was not the bottleneck: the device had the
work and waited for something else, named by the sub-tag of each gap:
- other_stream: a cross-stream dependency (the device's last activity was on another
  stream, or the launch followed a cudaStreamWaitEvent);
- collective: a communication kernel queued but not started (other ranks, or its stream);
- graph: a CUDA graph waiting to start;
- same_stream: none of these; impossible in a complete trace, so events are missing.
Job-level: median rank. Guards: a trace without flow events or with few linked device
events, or whose queued idle is mostly same-stream, cannot attribute the time: the check
then says not_measurable with the bound it saw.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diagnose.analyzers.common import confidence_for, flag_or_pass, idle_completeness, not_measurable
from diagnose.context import Context
from diagnose.ingest.load import RankTrace
from diagnose.model import Check, Finding
from diagnose.step import idle
from diagnose.step.timeline import RankTimeline
from diagnose.thresholds import Thresholds

ID = "device_wait"
TITLE = "Device idles with work already queued (waiting on another stream, a collective or a graph)"
FIXES = {
    "other_stream": ("A cross-stream dependency holds the queued work: find the stream it waits for in the "
                     "evidence (the event before it on its stream, and the other stream's work at the gap start); "
                     "move that producer earlier, split it, or overlap it with independent work, and drop "
                     "unneeded stream.wait_stream / event waits."),
    "collective": ("A collective was launched but could not start: other ranks (see straggler / exposed "
                   "communication) or its own stream hold it; overlap it with compute (DDP bucket_cap_mb, "
                   "FSDP prefetch) and even out the ranks' work."),
    "graph": ("A CUDA graph replay waits to start: its inputs' copies or the previous replay on its stream "
              "hold it; stage inputs earlier (static buffers filled before the replay) and keep unrelated "
              "work off the graph's stream."),
    "same_stream": ("The queued work waits behind nothing the trace shows: events are missing (sampled or "
                    "filtered trace). Profile again with all CUDA activity recorded before acting on it."),
}


@dataclass(frozen=True, slots=True)
class RankWait:
    """One GPU rank's queued idle by sub-tag, and the gaps that show it."""

    ms: float
    by_sub_ms: tuple[tuple[str, float], ...]
    linked_share: float
    evidence: tuple[tuple[int, str], ...]

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(r for r, _ in self.evidence)


def reduce(trace: RankTrace, tl: RankTimeline, idle_gaps: idle.IdleModel | None = None) -> RankWait | None:
    if not tl.is_gpu:
        return None
    m = idle_gaps or idle.idle_model(trace, tl)
    by_sub = m.queued_by_sub_us.mean(axis=0) / 1000 if m.steps else np.zeros(len(idle.SUBTAGS))
    q = np.flatnonzero((m.cls == idle.QUEUED) & (m.end_row >= 0))
    evidence: list[tuple[int, str]] = []
    for i in q[np.argsort(-m.in_steps_us[q])[:2]]:
        tag = idle.SUBTAGS[m.sub[i]]
        waited = m.queued_us[i]
        when = (f"launched {waited / 1000:.2f} ms before it started" if np.isfinite(waited)
                else "launched before the profiler started")
        evidence.append((int(m.end_row[i]), f"ends a {(m.end[i] - m.start[i]) / 1000:.2f} ms device idle; {when} "
                         f"(queued, {tag.replace('_', ' ')})"))
        if m.launch_row[i] >= 0:
            evidence.append((int(m.launch_row[i]), "its launch call, returned before the device went idle"))
        if m.prev_row[i] >= 0:
            evidence.append((int(m.prev_row[i]), "the event before it on the same stream"))
    return RankWait(ms=m.class_ms("queued"),
                    by_sub_ms=tuple((t, float(v)) for t, v in zip(idle.SUBTAGS[1:], by_sub[1:])),
                    linked_share=m.linked / m.device_events if m.device_events else 0.0, evidence=tuple(evidence))


def analyze(ctx: Context, th: Thresholds) -> list[Check]:
    run = ctx.run
    if not run.is_gpu:
        return [not_measurable(ID, TITLE, "no GPU events: a device queue exists only on GPU traces")]
    facts = {r: f for r, f in ctx.facts(ID).items() if f is not None}
    ms = float(np.median([f.ms for f in facts.values()]))
    share = ms / ctx.mean_step_ms
    subs: dict[str, float] = {}
    for f in facts.values():
        for t, v in f.by_sub_ms:
            subs[t] = subs.get(t, 0.0) + v / len(facts)
    top = max(subs, key=subs.get) if subs and max(subs.values()) > 0 else "same_stream"
    metrics: dict[str, float | int | str] = {"queued_idle_ms_per_step": round(ms, 3), "share_of_step": round(share, 4)}
    metrics.update({f"{t}_ms_per_step": round(v, 3) for t, v in subs.items()})
    linked = float(np.median([f.linked_share for f in facts.values()]))
    metrics["device_events_linked_to_launch"] = round(linked, 3)
    same = subs.get("same_stream", 0.0) / ms if ms > 0 else 0.0
    no_flows = not any(run.traces[r].flows for r in run.ranks)
    if ms >= th.healthy_floor_ms and (linked < th.min_linked_share or (no_flows and same >= th.same_stream_suspect)):
        why = ("no flow events" if no_flows else "") + (" and " if no_flows and linked < th.min_linked_share else "")
        why += f"only {linked:.0%} of device events linked to a launch" if linked < th.min_linked_share else ""
        return [Check(id=ID, title=TITLE, status="not_measurable", measured_ms=None, reason=(
            f"the device idles {ms:.1f} ms per step ({share:.0%}) with its next work already launched, "
            f"{same:.0%} of it behind nothing on the same stream; the trace looks sampled ({why}): events are "
            "missing, so this is a bound, not a measurement, and its cause cannot be named"))]
    base = "high"
    if same >= th.same_stream_suspect:
        base = "low"
        metrics["note"] = (f"{same:.0%} of the queued idle is same-stream, which a complete trace cannot show: "
                           "events look missing")
    elif no_flows:
        base = "medium"
    gaps = idle_completeness(ctx, th)
    if gaps:
        base = "low"
        metrics["note"] = "; ".join(([metrics["note"]] if "note" in metrics else []) + gaps)
    refs = [ctx.event_ref(r, row, note) for r, f in facts.items() for row, note in f.evidence]
    ranks = tuple(r for r, f in facts.items() if f.ms / ctx.mean_step_ms >= th.device_wait) or tuple(run.ranks)
    f = Finding(
        id=ID, title=TITLE, severity=th.severity(share), recoverable_ms=round(ms, 3), share_of_step=round(share, 4),
        ranks=ranks, metrics=metrics, events=tuple(refs[:6]), fix=FIXES[top], confidence=confidence_for(ctx, base),
        method="Median over ranks of per-step device idle ended by work whose launch call returned before the "
               "idle began (linked by correlation id; diagnose/step/idle.py), by what the queued work waited for.")
    return [flag_or_pass(f, th.device_wait, th, f"the device idles {ms:.1f} ms per step ({share:.0%}) with its "
                         f"next work already launched; mostly {top.replace('_', ' ')}")]
