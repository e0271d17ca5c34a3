"""7. Checkpoint I/O that blocks the training loop.

torch.save and torch.distributed.checkpoint are not profiler ops: the probes time them
(probes.checkpoint_hook: `meta["checkpoints"]` in each rank's sidecar, and a
`diagnose::checkpoint <api>` range in the trace when a save falls in a profiled window).

Estimation: per rank, the blocking time of the saves made inside training steps, summed
and spread over the probed steps (every step, not only the profiled ones): the time the
loop loses per step, on average. Job-level: the rank that spends most (while it writes,
the others wait for it at the next collective). Saves after the last step (a final save)
are reported but not charged to the loop. recoverable_ms is that whole blocking time: an
asynchronous save keeps only a copy of the state to host memory on the critical path, so
this is an upper bound. Without probes, the same from the trace's checkpoint ranges over
the profiled steps.

Risk flags (reported whatever the time): writes straight to the final file name (not a
temporary name renamed into place), one rank writing everything, synchronous writes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np

from diagnose.analyzers.common import confidence_for, flag_or_pass, not_measurable, passed
from diagnose.units import human
from diagnose.context import Context
from diagnose.ingest.load import KIND_ANNOTATION, KIND_CPU_OP, RankTrace
from diagnose.step.intervals import covered, union
from diagnose.model import Check, Finding
from diagnose.thresholds import Thresholds
from diagnose.step.timeline import RankTimeline, _names_matching
from diagnose.units import rank_ranges

ID = "checkpoint_io"
TITLE = "Checkpoint writes block the training loop"
TRACE_MARK = re.compile(r"^diagnose::checkpoint ")
SYNC_APIS = ("torch.save", "dcp.save")


def _records(ctx: Context) -> dict[int, list[dict]]:
    """Each rank's recorded saves (sidecar meta), malformed entries left out."""
    return {r: [c for c in p.meta.get("checkpoints") or [] if isinstance(c, dict)
                and isinstance(c.get("ms"), (int, float)) and isinstance(c.get("step"), int)]
            for r, p in sorted(ctx.probes.items())}


@dataclass(frozen=True, slots=True)
class TraceMarks:
    """One rank's checkpoint ranges in the trace (written by the probes when a save falls in a
    profiled window)."""

    count: int
    ms_per_step: float
    """Mean per-step time inside checkpoint ranges."""
    first_rows: tuple[int, ...]

    @property
    def rows(self) -> tuple[int, ...]:
        return self.first_rows


def reduce(trace: RankTrace, tl: RankTimeline) -> TraceMarks:
    ev = trace.events
    hit = ev[ev["kind"].isin([KIND_ANNOTATION, KIND_CPU_OP]).to_numpy() & _names_matching(ev, TRACE_MARK)]
    if hit.empty:
        return TraceMarks(count=0, ms_per_step=0.0, first_rows=())
    ms = float(np.mean(covered(union(hit["ts"], hit["ts"] + hit["dur"]), tl.steps.start, tl.steps.end))) / 1000
    return TraceMarks(count=len(hit), ms_per_step=ms, first_rows=tuple(int(i) for i in hit.index[:3]))


def _trace_marks(ctx: Context) -> dict[int, TraceMarks]:
    """Ranks whose trace holds checkpoint ranges."""
    return {r: m for r, m in ctx.facts("checkpoint_io").items() if m.count}


def _from_trace(ctx: Context, th: Thresholds, marks: dict[int, TraceMarks]) -> Check:
    per_rank = {r: m.ms_per_step for r, m in marks.items()}
    refs = [ctx.event_ref(r, i, "checkpoint write (blocking)") for r, m in marks.items() for i in m.first_rows]
    worst = max(per_rank, key=per_rank.get)
    ms = per_rank[worst]
    share = ms / ctx.mean_step_ms
    metrics: dict[str, float | int | str] = {"checkpoint_ms_per_step": round(ms, 3), "share_of_step": round(share, 4),
                                             "source": "trace (profiled steps only)"}
    f = Finding(id=ID, title=TITLE, severity=th.severity(share), recoverable_ms=round(ms, 3),
                share_of_step=round(share, 4), ranks=(worst,), metrics=metrics, events=tuple(refs[:6]), fix=_fix({}),
                confidence=confidence_for(ctx, "medium"),
                method="Checkpoint ranges in the profiled steps, per step, on the rank that spends most; only the "
                       "profiled window is seen.")
    check = flag_or_pass(f, th.checkpoint, th, f"checkpoint writes block rank {worst} {ms:.1f} ms per profiled step")
    return check if check.status == "flagged" else replace(check, finding=f)


def _fix(m: dict) -> str:
    parts = ["Take the write off the critical path: torch.distributed.checkpoint.async_save (or copy the state to "
             "host memory and write it from a background thread)"]
    if m.get("single_writer") is not None:
        parts.append(f"shard the write: with torch.distributed.checkpoint every rank writes its own part, instead "
                     f"of rank {m['single_writer']} writing {human(m.get('bytes_per_checkpoint'))} alone while the "
                     "others wait at the next collective")
    if m.get("direct_writes"):
        parts.append("write atomically: save to a temporary name in the same directory and os.replace() it onto "
                     "the final name, so a job killed mid-write never leaves a truncated checkpoint")
    if m.get("every_n_steps"):
        parts.append(f"or checkpoint less often: every {m['every_n_steps']} steps costs {m['share']:.1%} of wall "
                     f"time, every {2 * m['every_n_steps']} would cost about half")
    return "; ".join(parts) + "."


def analyze(ctx: Context, th: Thresholds) -> list[Check]:
    recs = _records(ctx)
    marks = _trace_marks(ctx)
    if not any(recs.values()):
        if marks:
            return [_from_trace(ctx, th, marks)]
        if ctx.probes:
            n = max((len(p.steps) for p in ctx.probes.values()), default=0)
            return [passed(ID, TITLE, f"no checkpoint written during the {n} probed steps (torch.save, "
                           "torch.distributed.checkpoint)")]
        return [not_measurable(ID, TITLE, "checkpoint writes are not profiler ops: run under `diagnose run`, whose "
                               "probes time torch.save and torch.distributed.checkpoint on every rank")]
    per_rank: dict[int, float] = {}
    detail: dict[int, dict] = {}
    for r, rs in recs.items():
        steps = ctx.probes[r].steps
        n = len(steps)
        last = int(steps["step"].max()) if n else -1
        inside = [c for c in rs if 1 <= c["step"] <= last]
        wall = float(steps["dur_ms"].sum()) if n else 0.0
        total = float(sum(c["ms"] for c in inside))
        per_rank[r] = total / n if n else 0.0
        detail[r] = {"inside": inside, "outside": [c for c in rs if c not in inside], "wall": wall, "total": total,
                     "n": n}
    writers = [r for r, rs in recs.items() if rs]
    worst = max(per_rank, key=per_rank.get)
    d = detail[worst]
    saves = d["inside"] or recs[worst]
    ms = per_rank[worst]
    mean_step = float(np.mean([detail[r]["wall"] / detail[r]["n"] for r in detail if detail[r]["n"]] or [0.0]))
    mean_step = mean_step or ctx.mean_step_ms
    share = ms / mean_step if mean_step else 0.0
    steps_at = sorted({c["step"] for c in saves})
    every = int(np.median(np.diff(steps_at))) if len(steps_at) >= 2 else None
    per_save = [c["ms"] for c in saves]
    sizes = [c["bytes"] for c in saves if isinstance(c.get("bytes"), (int, float)) and c["bytes"] > 0]
    all_recs = [c for rs in recs.values() for c in rs]
    direct = [c for c in all_recs if c.get("direct") is True]
    sync = [c for c in all_recs if c.get("api") in SYNC_APIS]
    world = ctx.run.world_size or len(ctx.probes)
    single = writers[0] if len(writers) == 1 and world > 1 and len(ctx.probes) >= 2 else None
    metrics: dict[str, float | int | str] = {
        "checkpoint_ms_per_step": round(ms, 3),
        "share_of_wall_time": round(share, 4),
        "share_of_step": round(share, 4),
        "checkpoints": len(saves),
        "ms_per_checkpoint": round(float(np.median(per_save)), 3),
        "max_ms_per_checkpoint": round(float(max(per_save)), 3),
        "every_n_steps": every if every is not None else "once",
        "probed_steps": d["n"],
        "apis": ", ".join(sorted({str(c.get("api")) for c in all_recs})),
        "writing_ranks": rank_ranges(writers),
        "risk_direct_writes": f"{len(direct)} of {len(all_recs)} saves wrote straight to the final file name"
                              if direct else "none",
        "risk_single_writer": f"rank {single} writes every checkpoint alone" if single is not None else "no",
        "risk_synchronous": f"{len(sync)} of {len(all_recs)} saves block the loop (torch.save / dcp.save)"
                            if sync else "none (async_save)",
    }
    if sizes:
        metrics["bytes_per_checkpoint"] = int(np.median(sizes))
        if np.median(per_save) > 0:
            metrics["write_mb_per_s"] = round(float(np.median(sizes)) / 1e6 / (float(np.median(per_save)) / 1000), 1)
    outside = [c for r in detail for c in detail[r]["outside"]]
    if outside:
        metrics["saves_outside_steps"] = len(outside)
        metrics["ms_outside_steps"] = round(float(sum(c["ms"] for c in outside)), 3)
    for r in sorted(per_rank):
        metrics[f"rank{r}_checkpoint_ms"] = round(per_rank[r], 3)
    refs = []
    for r, m in marks.items():
        refs += [ctx.event_ref(r, i, "checkpoint write (blocking)") for i in m.first_rows]
    fix = _fix({"single_writer": single, "bytes_per_checkpoint": metrics.get("bytes_per_checkpoint"),
                "direct_writes": bool(direct), "every_n_steps": every, "share": share})
    f = Finding(
        id=ID, title=TITLE, severity=th.severity(share), recoverable_ms=round(ms, 3), share_of_step=round(share, 4),
        ranks=(worst,), metrics=metrics, events=tuple(refs[:6]), fix=fix, over="run",
        confidence=confidence_for(ctx, "high" if d["n"] >= 10 else "medium"),
        method="Blocking time of the saves inside training steps (probes: every step), spread over the probed "
               "steps, on the rank that spends most; an asynchronous save would keep only the copy to host memory.")
    risks = [x for x in (f"{len(direct)} direct write(s) to the final name" if direct else "",
                         f"rank {single} writes alone" if single is not None else "",
                         "synchronous" if sync else "") if x]
    size = f" of {human(metrics['bytes_per_checkpoint'])}" if "bytes_per_checkpoint" in metrics else ""
    what = (f"{len(saves)} checkpoint(s){size}"
            f"{f' every {every} steps' if every else ''}, {metrics['ms_per_checkpoint']:.0f} ms each")
    reason = f"{what}: {ms:.1f} ms per step ({share:.1%} of wall time) on rank {worst}"
    if risks:
        reason += "; risks: " + ", ".join(risks)
    check = flag_or_pass(f, th.checkpoint, th, reason)
    if check.status != "flagged":
        check = replace(check, reason=f"{check.reason}; {what}" + (f"; risks: {', '.join(risks)}" if risks else ""),
                        finding=f)
    return [check]
