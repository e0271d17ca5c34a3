"""What-ifs by replaying the step graph (diagnose/step/graph.py) with one cause removed.

This is where a finding's milliseconds come from. Each check measures its cause and decides
whether to flag it; the replay then says what removing the cause would give back, with every
other wait kept: a freed wait that exposes another saves nothing, a cause hidden under a longer
one costs nothing, and removing two causes together is not the sum of removing each.
- `recoverable_ms` becomes the unedited replay's mean step minus the edited one's, where the
  graph can express the cause on this run and the unedited replay reproduces the measured steps
  within FIDELITY_OK; the check's own estimate stays as the metric `own_estimate_ms`, and
  `method` says which figure is given. Elsewhere `recoverable_ms` stays the check's own estimate
  (`replay_recoverable_ms` still shows the replay where there is one).
- `critical_path_ms`: the time the cause's part spends on the critical path per step.
The edits, one per cause:
- dataloader_starvation: DataLoader waits removed;
- straggler: the named ranks' work between anchors brought to the median rank's (with no rank
  named, every rank's: the cost of waiting for whichever rank is slowest);
- load_imbalance: every rank's work between anchors brought to the median rank's (the same edit,
  every rank listed: uneven work spread evenly);
- exposed_communication: each collective's transfer hidden (it completes the moment its last rank
  arrives; waiting for a late peer stays), and the lane's waits on a transfer in flight
  (`comm_wait`) removed: what overlapping or shrinking it can give back at most.
  Also given, as `replay_at_best_transfer_ms`: each transfer at its best over the profiled steps
  (MIN_STEPS_FOR_BEST steps or more): what steadier communication alone would give. That one is
  not the finding's figure: a job whose every all-reduce is equally slow would get nothing from
  it, and `diagnose scale` would book its communication as compute inflation;
- host_sync: sync drains removed; launch_overhead: host-launch gaps halved;
- reduce_dtype: each bandwidth-bound fp32 gradient reduction's transfer halved (half the bytes in
  bf16); given only where the check flags it (on an fp32 model it is no cause);
- gc_pause: the garbage collections the probes placed in the profiled steps removed (step/pauses.py;
  CPU ranks). Its finding is sized over the run (`Finding.over`): the replay's figure for the
  profiled steps is a metric beside it. The straggler's median edit leaves that part where it is:
  a collection is no work to share out;
- input_stall: blocking input copies removed: the idle model's input class and the device's time on
  pageable input copies alone (an upper bound: pinned, a copy still takes its bytes over the
  link's pinned rate; recorded on an H200, 64 MiB took 9.1 ms pageable and 1.2 ms pinned, and the
  step went 27.6 -> 19.1 ms against 18.5 predicted).
An edit that changes no weight on this run (CPU traces have no device idle classes, so the
GPU-only edits change nothing there) is not modelled: the check's own figure stands.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from diagnose.ingest.spill import Spill
from diagnose.model import Finding
from diagnose.step import graph as sg
from diagnose.thresholds import Thresholds

Edit = Callable[[sg.StepGraph, np.ndarray, np.ndarray | None, tuple[int, ...]], tuple[np.ndarray, np.ndarray | None]]

FIDELITY_OK = 0.05
"""The unedited replay must reproduce every measured step within this share for its what-ifs to
replace the checks' own estimates (the issue's 5% bar; shared GPU sets replay exactly, CPU gloo
jobs within 4%)."""
MIN_STEPS_FOR_BEST = 3


def _parts(fracs: dict[str, float]) -> Edit:
    def edit(g, w, tr, ranks):
        return sg.without_parts(g, fracs, w), tr
    return edit


def _straggler(g, w, tr, ranks):
    return sg.rank_at_median(g, set(ranks) or set(g.ranks), w), tr


def _every_rank(g, w, tr, ranks):
    return _straggler(g, w, tr, ())  # whichever ranks the finding lists: uneven work is every rank's


def _comm_hidden(g, w, tr, ranks):
    return sg.without_parts(g, {"comm_wait": 1.0}, w), np.zeros(g.n_nodes)


def _comm_best(g, w, tr, ranks):
    return w, np.minimum(tr, sg.best_transfers(g))


def _reduce_bf16(g, w, tr, ranks):
    return w, sg.halved_fp32_reductions(g, tr)


EDITS: dict[str, Edit] = {
    "dataloader_starvation": _parts({"dataloader": 1.0}),
    "input_stall": _parts({"idle_input": 1.0, "input_copy": 1.0}),
    "exposed_communication": _comm_hidden,
    "straggler": _straggler,
    "load_imbalance": _every_rank,
    "launch_overhead": _parts({"idle_launch": 0.5}),
    "host_sync": _parts({"idle_sync": 1.0}),
    "reduce_dtype": _reduce_bf16,
    # composed last in StepModel.without: the median edit reads the part it removes
    "gc_pause": _parts({"gc": 1.0}),
}
READS_TRANSFERS = frozenset({"reduce_dtype", "best_transfer"})
"""Edits that start from the transfers (they shrink them); the others pass them through as given
(None too) or set their own (hiding them: zero), so the model reads the graph's for these alone."""
# causes whose edit applies only where their check finds them: no cost of their own otherwise
# (load_imbalance is flagged only where the straggler check names no rank: then its edit is the
# straggler's own, every rank to the median, and the clean step the same with or without it)
ONLY_WHEN_FLAGGED = frozenset({"reduce_dtype", "load_imbalance"})
# what-ifs given as metrics only
EXTRA_EDITS: dict[str, Edit] = {"best_transfer": _comm_best}
EDIT_TEXT = {
    "dataloader_starvation": "every DataLoader wait removed",
    "input_stall": "every blocking host-to-device input copy removed (pageable copies included)",
    "exposed_communication": "every collective's transfer hidden (done when its last rank arrives)",
    "straggler": "the named rank(s)' work between collectives brought to the median rank's",
    "load_imbalance": "every rank's work between collectives brought to the median rank's",
    "launch_overhead": "host-launch gaps halved",
    "host_sync": "every synchronising drain removed",
    "reduce_dtype": "each bandwidth-bound fp32 gradient reduction's transfer halved (bf16 on the wire)",
    "gc_pause": "every garbage collection placed in the profiled steps removed",
}
# the critical-path parts each finding owns
CRITICAL_PARTS: dict[str, tuple[str, ...]] = {
    "dataloader_starvation": ("dataloader",),
    "input_stall": ("idle_input", "input_copy"),
    "exposed_communication": ("communication", "comm_wait"),
    "launch_overhead": ("idle_launch",),
    "host_sync": ("idle_sync",),
    "device_wait": ("idle_queued",),
    "gc_pause": ("gc",),
}


@dataclass(frozen=True, slots=True)
class StepModel:
    """The step graph with its unedited replay: the one model every what-if edits."""

    graph: sg.StepGraph | sg.GraphOnDisk
    base: sg.Replay | sg.ReplayOnDisk
    fidelity: float
    """Largest relative error of the unedited replay against the measured steps."""
    steps: int
    _savings: dict = field(default_factory=dict, compare=False, repr=False)
    """saving() by (cause, ranks): the checks, the straggler's per-rank effects and annotate ask
    the same questions, and each answer is a replay."""

    @property
    def trusted(self) -> bool:
        return self.fidelity <= FIDELITY_OK

    def edit(self, cause: str, ranks: tuple[int, ...] = (), w: np.ndarray | None = None,
             tr: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None] | None:
        """Weights with the cause removed (on top of w, tr; tr None: the graph's transfers, and so
        in what it returns); None when this run cannot express it."""
        fn = EXTRA_EDITS.get(cause) or EDITS.get(cause)
        if fn is None or (cause == "best_transfer" and self.steps < MIN_STEPS_FOR_BEST):
            return None
        # the graph's weights read (from disk: GraphOnDisk) only where none are given, its
        # transfers only for an edit that starts from them (tr None: the graph's, unchanged): read
        # always, two arrays a node were held beside the edit's own at the replays' height (#20)
        w0 = self.graph.lane_parts.total if w is None else w
        tr0 = self.graph.transfer if tr is None and cause in READS_TRANSFERS else tr
        w1, tr1 = fn(self.graph, w0, tr0, tuple(ranks))
        del w0, tr0  # compared with the graph's a block at a time below, not held beside the edit's
        if w is None and tr is None and self._as_graph(w1, tr1):
            return None  # the graph holds nothing this edit could change
        return w1, tr1

    def _as_graph(self, w: np.ndarray, tr: np.ndarray | None) -> bool:
        """w and tr (None: the graph's) are the graph's own weights and transfers."""
        g = self.graph
        for lo in range(0, g.n_nodes, sg.REPLAY_BLOCK):
            hi = lo + sg.REPLAY_BLOCK
            if not np.array_equal(w[lo:hi], g.lane_parts.total_stretch(lo, hi)) or \
                    (tr is not None and not np.array_equal(tr[lo:hi], g.stretch("transfer", lo, hi))):
                return False
        return True

    def saving(self, cause: str, ranks: tuple[int, ...] = ()) -> float | None:
        """Mean ms per step the replay gives back with the cause removed (None: not modelled)."""
        key = (cause, tuple(sorted(ranks)))
        if cause == "load_imbalance":
            key = ("straggler", ())  # every rank to the median, the same replay (_every_rank)
        if key not in self._savings:
            e = self.edit(cause, ranks)
            self._savings[key] = None if e is None else \
                max(self.base.mean_step_ms - sg.replay(self.graph, *e, path=False).mean_step_ms, 0.0)
        return self._savings[key]

    def without(self, causes: dict[str, tuple[int, ...]]) -> float:
        """Replayed mean step (ms) with all these causes removed together."""
        w, tr = self.graph.lane_parts.total, None
        # the collections' removal last: the median edit sets apart the part it removes, read from w
        for cause, ranks in sorted(causes.items(), key=lambda c: c[0] == "gc_pause"):
            e = self.edit(cause, ranks, w, tr)
            if e is not None:
                w, tr = e
        return sg.replay(self.graph, w, tr, path=False).mean_step_ms


def step_model(g: sg.StepGraph | sg.GraphOnDisk, spill: Spill | None = None) -> StepModel:
    """The model of `g`, its graph and its unedited replay's node arrays held on disk from here
    (step/graph.GraphOnDisk, ReplayOnDisk: why; in memory where no temporary file can be made).
    spill: the one `g` lies in when it is a GraphOnDisk (build_graph(run, spill=...): the graph
    never whole in memory), where the replay's arrays go too."""
    spill = spill if spill is not None else Spill()
    if isinstance(g, sg.StepGraph):
        # the graph in memory goes before the replay, which reads it back a block at a time: both
        # at once set the client's height at 1,024 ranks (#20). The caller's reference is ours
        # alone (step_model(build_graph(run))): the graph is freed here.
        g = sg.GraphOnDisk(g, spill)
    steps = len(set(g.step[g.kind == sg.STEP_END].tolist()))
    base = sg.replay(g)
    return StepModel(graph=g, base=sg.ReplayOnDisk(base, spill), fidelity=sg.fidelity(g, base), steps=steps)


@dataclass(frozen=True, slots=True)
class WhatIfs:
    findings: tuple[Finding, ...]
    """The findings with their replayed recoverable_ms (where modelled and trusted)."""
    summary: dict
    """For the report and the JSON's extras: fidelity, baseline, combined what-if, critical path,
    each cause's replayed cost whether flagged or not (for `diagnose scale`)."""


def _replayed(f: Finding, ms: float, base_ms: float, th: Thresholds) -> Finding:
    own = f.recoverable_ms
    share = min(ms / base_ms, 1.0) if base_ms > 0 else 0.0
    method = (f"Replayed on the step graph: the mean step with {EDIT_TEXT[f.id]}, every other dependency "
              f"kept, is this much shorter. The check's own estimate ({own:.1f} ms, metric own_estimate_ms): "
              + f.method)
    return replace(f, recoverable_ms=round(ms, 3), share_of_step=round(share, 4), severity=th.severity(share),
                   method=method, metrics={**f.metrics, "own_estimate_ms": own})


def finding_saving(m: StepModel, f: Finding) -> float | None:
    """What the replay gives back with f's cause removed, less what the probes say its part of the
    graph carried that removing the cause would not remove: garbage collections that ran inside
    DataLoader fetches and that the graph does not carry as its own part (`gc_in_wait_unplaced_ms`:
    a GPU rank's, a short one's, older probes'; they would stop the process elsewhere). None: not
    modelled."""
    ms = m.saving(f.id, tuple(f.ranks))
    return None if ms is None else max(ms - float(f.metrics.get("gc_in_wait_unplaced_ms", 0.0)), 0.0)


def annotate(findings: tuple[Finding, ...], m: StepModel, th: Thresholds,
             straggler_ranks: tuple[int, ...] = ()) -> WhatIfs:
    """Replace each finding's recoverable_ms by its replayed figure (see the module doc) and
    summarise the replay. straggler_ranks: the ranks the straggler check named, flagged or not."""
    g, base = m.graph, m.base
    cp = sg.critical_path(g, base)
    out = []
    flagged: dict[str, tuple[int, ...]] = {}
    for f in findings:
        extra: dict[str, float] = {}
        ms = finding_saving(m, f) if f.kind != "capacity" else None
        if ms is not None:
            extra["replay_recoverable_ms"] = round(ms, 3)
            flagged[f.id] = tuple(f.ranks)
        if f.id == "exposed_communication" and (best := m.saving("best_transfer")) is not None:
            extra["replay_at_best_transfer_ms"] = round(best, 3)
        if f.id in CRITICAL_PARTS and (ms is not None or f.over == "window"):  # not 0 for a cause the graph lacks
            extra["critical_path_ms"] = round(sum(cp.by_part_ms.get(p, 0.0) for p in CRITICAL_PARTS[f.id]), 3)
        elif f.id == "straggler":
            extra["critical_path_ms"] = round(sum(cp.by_rank_ms.get(r, 0.0) for r in f.ranks), 3)
        f = replace(f, metrics={**f.metrics, **extra}) if extra else f
        if ms is not None and m.trusted and f.over == "window":
            f = _replayed(f, ms, base.mean_step_ms, th)
        out.append(f)
    every = {c: (straggler_ranks if c == "straggler" else ()) for c in EDITS
             if c not in ONLY_WHEN_FLAGGED or c in flagged}
    by_cause = {c: m.saving(c, r) for c, r in every.items()}
    summary = {
        "measured_step_ms": round(float(np.mean(sg.measured_step_ms(g))), 3) if g.time.size else None,
        "replayed_step_ms": round(base.mean_step_ms, 3),
        "fidelity_max_error": round(m.fidelity, 4),
        "replaces_estimates": m.trusted,
        "combined_what_if_ms": round(base.mean_step_ms - m.without(flagged), 3),
        "by_cause_ms": {c: round(v, 3) for c, v in by_cause.items() if v is not None},
        "straggler_ranks": list(straggler_ranks),
        "clean_step_ms": round(m.without({c: r for c, r in every.items() if by_cause[c] is not None}), 3),
        "critical_path": {"by_part_ms": cp.by_part_ms, "by_rank_ms": {str(k): v for k, v in cp.by_rank_ms.items()},
                          "steps": cp.steps},
    }
    return WhatIfs(findings=tuple(out), summary=summary)
