"""What every analyzer reads: the run, matched collectives, the step breakdown and the step model
(the dependency graph of the steps with its replay: what removing a cause gives back)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from diagnose.errors import one_line
from diagnose.ingest.assemble import ReduceFailed, Run, SharesText
from diagnose.ingest.spill import Spill, unspilled
from diagnose.heap import give_back_freed
from diagnose.model import EventRef
from diagnose.probedata import ProbeData
from diagnose.step.breakdown import breakdown_table
from diagnose.step.collectives import Matched, group_wait_ms, late_group, match_collectives, wait_for_group
from diagnose.step.graph import build_graph
from diagnose.step.pauses import Pauses, run_pauses
from diagnose.step.cover import column
from diagnose.thresholds import DEFAULT, Thresholds
from diagnose.whatif import StepModel, step_model


@dataclass(frozen=True, slots=True)
class Context:
    run: Run
    matched: Matched
    table: pd.DataFrame
    """The step breakdown (step/breakdown.py), one row per (rank, step) and a column per
    StepBreakdown field. The rows as StepBreakdowns (breakdown.breakdown_rows) are made only for
    the Diagnosis, once the analysis is done: held beside the table through every check, they
    were 0.8 MB at 1,024 replicated DLRM ranks (#20)."""
    probes: dict[int, ProbeData]
    """Every-step timings and metadata from the probes' sidecars, when the run had them."""
    model: StepModel | None = None
    """The dependency graph of every rank's steps (diagnose/step/graph.py) and its unedited replay
    (diagnose/whatif.py): each finding's recoverable ms comes from editing it; the graph lies on
    disk, read back by each replay (GraphOnDisk). None when it could not be built (model_error
    says why)."""
    model_error: str | None = None
    pauses: dict[int, Pauses] = field(default_factory=dict)
    """Each rank's garbage collections the probes placed in its profiled steps (step/pauses.py),
    where the step model carries them as their own part; empty where it has none."""
    late_groups: tuple[tuple[int, ...], ...] = ()
    """Ranks late at the collectives by a wide gap over the rest (fewer than half of them), whose
    being brought to the median rank the replay confirms is worth the straggler threshold, in the
    groups `late_peers` peeled them in (the latest first: a second slow host, less late, after
    the first)."""
    mean_step_ms: float = field(init=False)
    """The breakdown's mean step over every row, taken once: every check reads it, some once a rank
    (it was ~0.2 s of the checklist at 1,024 ranks taken at each read)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean_step_ms", float(self.table["step_ms"].mean()))

    @property
    def late_together(self) -> tuple[int, ...]:
        """Every rank of late_groups; with two or more, the breakdown books the others' wait for
        all of them as waiting for a late peer, not as exposed communication."""
        return tuple(r for g in self.late_groups for r in g)

    def facts(self, name: str) -> dict:
        """Each rank's per-rank summary from check `name`'s reduce phase, by rank.

        Raises when the run was loaded without the reduction, or the reduction failed on a rank
        (the pipeline then reports that check as failed and goes on with the others).
        Each summary is read back from disk (ingest/assemble.Keep), the names ranks repeat shared
        as they arrive: 1,024 ranks' op lists held 41 MB with a copy of each name per rank."""
        return dict(self.facts_each(name))

    def facts_each(self, name: str) -> Iterator[tuple[int, object]]:
        """(rank, summary) one rank at a time, as `facts` gives them: for a check that folds every
        rank's summary into one table, without holding them all at once."""
        texts: dict[str, str] = {}
        shares: dict[type, bool] = {}  # isinstance on a Protocol: ~20 us a call, 12,000 calls at 1,024 ranks
        for r in self.run.ranks:
            f = self.run.facts.get(r, {}).get(name)
            if f is None:
                raise RuntimeError(f"no per-rank summary '{name}' for rank {r} (load the run with "
                                   "reduce=analyzers.reduce_rank)")
            if isinstance(f, ReduceFailed):
                raise RuntimeError(f"rank {r}: {f.error}")
            kind = type(f)
            if kind not in shares:
                shares[kind] = isinstance(f, SharesText)
            yield r, (f.shared(texts) if shares[kind] else f)

    def compiled_share(self) -> float | None:
        """Median over ranks of the share of the host's busy time in the steps spent inside
        torch.compile'd code; None when no rank ran any."""
        shares = []
        for tl in self.run.timelines.values():
            busy = float(column(tl, "host_busy").sum())
            shares.append(float(column(tl, "compiled").sum()) / busy if busy > 0 else 0.0)
        return float(np.median(shares)) if any(shares) else None

    def per_rank_mean(self, column: str) -> pd.Series:
        return self.table.groupby("rank")[column].mean()

    def event_ref(self, rank: int, row: int, note: str = "") -> EventRef:
        """An evidence pointer to one event, in the file's own clock."""
        trace = self.run.traces[rank]
        ev = unspilled(trace.events)  # cell by cell: a whole row (.loc[row]) converts every column, 1 ms a call
        steps = self.run.timelines[rank].steps
        ts = float(ev.at[row, "ts"])
        hit = np.flatnonzero((steps.start <= ts) & (steps.end > ts))
        step = int(steps.step[hit[0]]) if len(hit) else None
        return EventRef(rank=rank, file=trace.path.name, ts_us=ts, dur_us=float(ev.at[row, "dur"]),
                        name=str(ev.at[row, "name"])[:300], step=step, note=note)


    def probe_meta(self, key: str) -> dict:
        """One metadata section from the lowest rank's sidecar that has it ({} if none)."""
        for r in sorted(self.probes):
            v = self.probes[r].meta.get(key)
            if isinstance(v, dict) and v:
                return v
        return {}


def prune_dead_views(run: Run) -> None:
    """Drop the dead view references each rank's tables collect. Under pandas' copy-on-write every
    filter or column taken from a frame leaves a weak reference in the frame's blocks, and pandas
    drops the dead ones only now and then (#20, the client's memory per rank; 512 replicated DLRM
    ranks, tracemalloc: the checklist retained 7.4 MB, ~4 MB of it such references, and the extras
    after it then set the client's peak). `has_reference()` prunes them as it counts (pandas 3.x
    internals: where they are missing, this does nothing). Run once, between the checklist and
    the extras: after each of the 15 checks it cost 1.5-3.6 s at 1,024 ranks (two runs)."""
    frames = [tl.collectives for tl in run.timelines.values()]
    frames += [f for t in run.traces.values() for f in (t.events, t.comm_args) if isinstance(f, pd.DataFrame)]
    for f in frames:
        for block in getattr(getattr(f, "_mgr", None), "blocks", ()):
            refs = getattr(block, "refs", None)
            if refs is not None and hasattr(refs, "has_reference"):
                refs.has_reference()


MAX_GROUPS = 4
"""Late groups peeled one after another at most (two slow hosts, each late by its own amount)."""


def late_peers(run: Run, matched: Matched, model: StepModel | None,
               th: Thresholds) -> tuple[tuple[int, ...], ...]:
    """The ranks late together (collectives.late_group: a gap of the straggler threshold's share of
    the step, above the healthy floor), kept when bringing them all to the median rank is worth
    that share too: by one replay where the step model is faithful, else by what the others wait
    for them inside the collectives. A gap of clock skew alone makes no one wait: neither figure
    moves. Then the next group among the rest, while it adds that share again and all of them stay
    fewer than half the ranks (a second slow host, less late: fixing the first alone leaves the
    others waiting for it)."""
    pr = matched.frame(["rank", "lateness"])
    if pr.empty:
        return ()
    spans = [tl.steps.end - tl.steps.start for tl in run.timelines.values()]
    step_ms = float(np.concatenate(spans).mean()) / 1000 if spans else 0.0
    floor = th.straggler_floor_ms(step_ms)
    lateness = pr.groupby("rank")["lateness"].mean() / 1000
    limit = (len(lateness) - 1) // 2
    named: tuple[int, ...] = ()
    groups: list[tuple[int, ...]] = []
    saved_before = 0.0
    for _ in range(MAX_GROUPS):
        rest = lateness.drop(index=list(named))
        group = tuple(late_group(rest, floor, limit - len(named)))
        if not group:
            break
        cand = named + group
        saved = ((model.saving("straggler", cand) or 0.0) if model is not None and model.trusted
                 else group_wait_ms(matched, cand))
        if saved - saved_before < floor:
            break
        named, saved_before = cand, saved
        groups.append(group)
    return tuple(groups)


def build_context(run: Run, probes: dict[int, ProbeData] | None = None, th: Thresholds = DEFAULT) -> Context:
    spill = Spill()
    # on disk from here, read a few columns at a time (Matched.on_disk: why), the graph's build and
    # the replays' too: held through them, it was part of the client's height at 1,024 ranks
    matched = match_collectives(run).on_disk(spill)
    give_back_freed()  # between phases: what each one built and dropped (heap.give_back_freed)
    model, error = None, None
    pauses = run_pauses(run, probes or {})
    try:
        # built into the spill (build_graph: why), the probes' garbage collections a part of its own
        model = step_model(build_graph(run, spill=spill, pauses=pauses), spill)
        give_back_freed()
    except Exception as exc:  # noqa: BLE001 - the checks' own estimates stand without the replay
        error = one_line(f"the step graph could not be built ({type(exc).__name__}: {exc})")[:300]
    groups = late_peers(run, matched, model, th)
    matched = wait_for_group(matched, tuple(r for g in groups for r in g))
    table = breakdown_table(run, matched, pauses if model is not None else None)
    matched = matched.on_disk(spill)  # wait_for_group's, where it made one
    return Context(run=run, matched=matched, table=table, probes=probes or {}, model=model,
                   model_error=error, pauses=pauses if model is not None else {}, late_groups=groups)
