"""What-ifs by replaying the step graph (diagnose/step/graph.py) with one cause removed.

Each finding whose cause the graph can edit gets two figures beside its own estimate:
- `replay_recoverable_ms`: the unedited replay's mean step minus the replay's with the cause
  removed (a freed wait that exposes another saves nothing; a cause hidden under a longer
  one costs nothing);
- `critical_path_ms`: the time its part spends on the critical path per step.
The combined what-if removes every flagged cause at once, which is not the sum of the single ones.
The edits, one per finding id:
- dataloader_starvation: DataLoader waits removed;
- straggler: the named ranks' work between anchors brought to the median rank's;
- exposed_communication: each collective's transfer at its best over the profiled steps (given
  only with MIN_STEPS_FOR_BEST steps or more: with fewer, "best" is just the one seen);
- host_sync: sync drains removed; launch_overhead: host-launch gaps halved;
- input_stall: blocking input copies removed (the idle model's input class).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from diagnose.model import Finding
from diagnose.step import graph as sg

Edit = Callable[[sg.StepGraph, np.ndarray, np.ndarray, Finding], tuple[np.ndarray, np.ndarray]]


def _parts(fracs: dict[str, float]) -> Edit:
    def edit(g, w, tr, f):
        cut = sum(frac * g.lane_parts[:, sg.PARTS.index(p)] for p, frac in fracs.items())
        return np.maximum(w - cut, 0.0), tr
    return edit


def _straggler(g, w, tr, f):
    return sg.rank_at_median(g, set(f.ranks), w), tr


def _comm(g, w, tr, f):
    return w, np.minimum(tr, sg.best_transfers(g))


EDITS: dict[str, Edit] = {
    "dataloader_starvation": _parts({"dataloader": 1.0}),
    "input_stall": _parts({"idle_input": 1.0}),
    "exposed_communication": _comm,
    "straggler": _straggler,
    "launch_overhead": _parts({"idle_launch": 0.5}),
    "host_sync": _parts({"idle_sync": 1.0}),
}
# the critical-path parts each finding owns
CRITICAL_PARTS: dict[str, tuple[str, ...]] = {
    "dataloader_starvation": ("dataloader",),
    "input_stall": ("idle_input",),
    "exposed_communication": ("communication",),
    "launch_overhead": ("idle_launch",),
    "host_sync": ("idle_sync",),
    "device_wait": ("idle_queued",),
}


MIN_STEPS_FOR_BEST = 3


@dataclass(frozen=True, slots=True)
class WhatIfs:
    findings: tuple[Finding, ...]
    """The findings with replay_recoverable_ms / critical_path_ms added to their metrics."""
    summary: dict
    """For the report and the JSON's extras: fidelity, baseline, combined what-if, critical path."""


def annotate(findings: tuple[Finding, ...], g: sg.StepGraph) -> WhatIfs:
    base = sg.replay(g)
    w0, tr0 = g.lane_parts.sum(axis=1), g.transfer
    cp = sg.critical_path(g, base)
    out = []
    w_all, tr_all = w0.copy(), tr0.copy()
    steps = len(set(g.step[g.kind == sg.STEP_END].tolist()))
    for f in findings:
        edit = EDITS.get(f.id)
        if f.id == "exposed_communication" and steps < MIN_STEPS_FOR_BEST:
            edit = None
        extra: dict[str, float] = {}
        if edit is not None:
            w, tr = edit(g, w0, tr0, f)
            extra["replay_recoverable_ms"] = round(base.mean_step_ms - sg.replay(g, w, tr).mean_step_ms, 3)
            w_all, tr_all = edit(g, w_all, tr_all, f)
        if f.id in CRITICAL_PARTS:
            extra["critical_path_ms"] = round(sum(cp.by_part_ms.get(p, 0.0) for p in CRITICAL_PARTS[f.id]), 3)
        elif f.id == "straggler":
            extra["critical_path_ms"] = round(sum(cp.by_rank_ms.get(r, 0.0) for r in f.ranks), 3)
        out.append(replace(f, metrics={**f.metrics, **extra}) if extra else f)
    combined = base.mean_step_ms - sg.replay(g, w_all, tr_all).mean_step_ms
    summary = {
        "measured_step_ms": round(float(np.mean(list(sg.measured_step_ms(g).values()))), 3)
        if g.time.size else None,
        "replayed_step_ms": round(base.mean_step_ms, 3),
        "fidelity_max_error": round(sg.fidelity(g, base), 4),
        "combined_what_if_ms": round(combined, 3),
        "critical_path": {"by_part_ms": cp.by_part_ms, "by_rank_ms": {str(k): v for k, v in cp.by_rank_ms.items()},
                          "steps": cp.steps},
    }
    return WhatIfs(findings=tuple(out), summary=summary)
