"""The checklist: analyzers in the field's order.

Each module has one pure entry point, `analyze(ctx, thresholds) -> list[Check]`, and, when
it reads events beyond the timeline, a per-rank phase `reduce(trace, timeline) -> facts`
that runs where the rank is loaded (a worker process) and returns a small summary whose
`rows` are the events it cites as evidence; `analyze` then reads only the summaries
(`ctx.facts(name)`). Adding a check means adding it here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from diagnose.analyzers import (checkpoint, communication, cpu_contention, dataloader, device_wait, fail_slow,
                                gc_pause, grad_sync, host_sync, launch, memory, pipeline_bubbles, reduce_dtype,
                                straggler)
from diagnose.context import Context
from diagnose.errors import one_line
from diagnose.ingest.assemble import ReduceFailed
from diagnose.ingest.load import RankTrace
from diagnose.model import Check
from diagnose.step.idle import IdleModel
from diagnose.step.timeline import RankTimeline
from diagnose.thresholds import Thresholds

Analyzer = Callable[[Context, Thresholds], list[Check]]
Reducer = Callable[..., object]
"""reduce(trace, timeline) -> summary; with uses_idle, also idle_gaps=IdleModel (GPU ranks)."""


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    analyze: Analyzer
    reduce: Reducer | None = None
    uses_idle: bool = False
    """The per-rank phase reads the rank's idle model (diagnose/step/idle.py), built once per rank."""


CHECKLIST: tuple[Entry, ...] = (
    Entry("dataloader", dataloader.analyze, dataloader.reduce),
    Entry("communication", communication.analyze, communication.reduce),
    # and after it load_imbalance (imbalance.py: uneven work whose slowest rank changes), which
    # reads whom the straggler check flagged, so the straggler's entry returns both checks
    Entry("straggler", straggler.analyze, straggler.reduce),
    Entry("launch_overhead", launch.analyze, launch.reduce, uses_idle=True),
    # the queued idle launch_overhead leaves out: work launched, device waiting on something else
    Entry("device_wait", device_wait.analyze, device_wait.reduce, uses_idle=True),
    # after the four classic checks: capacity, schedule, I/O, synchronisation
    Entry("device_memory", memory.analyze),
    Entry("pipeline_bubble", pipeline_bubbles.analyze, pipeline_bubbles.reduce),
    Entry("checkpoint_io", checkpoint.analyze, checkpoint.reduce),
    Entry("host_sync", host_sync.analyze, host_sync.reduce, uses_idle=True),
    # the host stopped by Python itself: the probes' every-step record, no trace needed
    Entry("gc_pause", gc_pause.analyze),
    # the host's cores taken by other work (its DataLoader's workers among it): the probes' samples
    Entry("cpu_contention", cpu_contention.analyze),
    # configuration mistakes behind the causes above: gradients reduced on every micro-batch, and
    # in fp32 under bf16 compute
    Entry("grad_sync", grad_sync.analyze, grad_sync.reduce),
    Entry("reduce_dtype", reduce_dtype.analyze, reduce_dtype.reduce),
    # over the whole run (the probes' every-step record, no trace needed): when the job got slow
    Entry("fail_slow", fail_slow.analyze),
)


def reduce_rank(trace: RankTrace, tl: RankTimeline, gaps: IdleModel | ReduceFailed | None = None
                ) -> tuple[dict[str, object], set[int]]:
    """Every check's per-rank phase on one rank: (summaries by check name, evidence rows).

    gaps: the rank's idle model, built once where the rank is loaded (None on CPU ranks)."""
    facts: dict[str, object] = {}
    rows: set[int] = set()
    for e in CHECKLIST:
        if e.reduce is None:
            continue
        try:
            if e.uses_idle and isinstance(gaps, ReduceFailed):
                raise RuntimeError(gaps.error)
            f = e.reduce(trace, tl, idle_gaps=gaps) if e.uses_idle else e.reduce(trace, tl)
        except Exception as exc:  # one check's bug must not cost the user the file or the other checks
            facts[e.name] = ReduceFailed(one_line(f"{type(exc).__name__}: {exc}")[:300])
            continue
        facts[e.name] = f
        rows.update(int(r) for r in getattr(f, "rows", ()))
    return facts, rows
