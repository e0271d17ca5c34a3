"""Is the profiled window like the rest of the run?

Every check reads the few profiled steps; every figure is a mean over them. A window that caught
the run at an unusual time (its first, slower steps; a validation or checkpoint that runs once in
a thousand steps; the minutes before a slowdown) describes those steps, not the run. The probes
time every step, so the window can be set against the run: each rank's profiled steps are the
step records that lie inside its trace (both on the host's wall clock: a Kineto trace's
`baseTimeNanoseconds` plus its event times, the probes' `time.time()`), the run is every other
recorded step (the probes' step 0, start-up, is never in the record). Compared as means, the
figure the checks report: a window whose mean step is more than WINDOW_UNLIKE_RUN away from the
run's says so beside the verdict. Both are the median over ranks of each rank's mean.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diagnose.ingest.assemble import absolute_span_us
from diagnose.ingest.load import RankTrace
from diagnose.probedata import ProbeData, has_device_times, job_step_ms

WINDOW_UNLIKE_RUN = 0.25
"""The window's mean step this much above or below the run's: the figures may not be the run's."""
MIN_OTHERS = 10
"""Steps recorded outside the window, at the least, for the run to be set against it."""
SLACK_US = 1000.0
"""A step record lies in the window when it starts and ends within this of the trace's span."""


@dataclass(frozen=True, slots=True)
class WindowAgainstRun:
    window_step_ms: float
    run_step_ms: float
    window_steps: tuple[int, int]
    """The first and last step numbers profiled (the probes' numbering), over the ranks compared."""
    run_steps: int
    """Steps recorded outside the window (the rank with the most)."""
    ranks: int

    @property
    def ratio(self) -> float:
        return self.window_step_ms / self.run_step_ms

    @property
    def unlike(self) -> bool:
        return abs(self.ratio - 1.0) > WINDOW_UNLIKE_RUN

    def text(self) -> str:
        a, b = self.window_steps
        steps = f"step {a}" if a == b else f"steps {a}-{b}"
        return (f"the profiled {steps} averaged {self.window_step_ms:.1f} ms a step, {self.ratio:.2f}x the "
                f"{self.run_step_ms:.1f} ms of the run's {self.run_steps} other recorded steps: the figures describe "
                "those steps; profile at a typical time (--schedule WAIT,WARMUP,ACTIVE, or `diagnose capture` on "
                "the running job) to see the run's")

    def as_dict(self) -> dict:
        return {"window_step_ms": round(self.window_step_ms, 3), "run_step_ms": round(self.run_step_ms, 3),
                "window_steps": list(self.window_steps), "run_steps": self.run_steps, "ranks": self.ranks,
                "ratio": round(self.ratio, 4), "unlike": self.unlike}


def window_against_run(traces: dict[int, RankTrace], probes: dict[int, ProbeData]) -> WindowAgainstRun | None:
    """The profiled window against the rest of the run, where both are known (None otherwise:
    no every-step record, no absolute clock in the traces, too few steps outside the window)."""
    window, rest, first, last, others = [], [], [], [], 0
    for r, t in traces.items():
        p = probes.get(r)
        span = absolute_span_us(t)
        if p is None or p.steps.empty or span is None or not t.meta.get("baseTimeNanoseconds"):
            continue
        if str(p.meta.get("device", "")).startswith("cuda") and not has_device_times(p):
            # a host that runs ahead of its device ends its steps early until the launch queue
            # fills (tests/fixtures/gpu_h200/none_long: 2.6 ms host steps in a 12.7 ms job)
            continue
        s = p.steps
        dur = job_step_ms(s)  # the device's step where timed, as the checks read it
        start = s["start"].to_numpy(dtype=float) * 1e6
        end = start + s["dur_ms"].to_numpy(dtype=float) * 1e3
        inside = (start >= span[0] - SLACK_US) & (end <= span[1] + SLACK_US)
        ok = ~np.isnan(dur)
        w, o = dur[inside & ok], dur[~inside & ok]
        if not len(w) or len(o) < MIN_OTHERS:
            continue
        window.append(float(np.mean(w)))
        rest.append(float(np.mean(o)))
        steps = s["step"].to_numpy()[inside]
        first.append(int(steps.min()))
        last.append(int(steps.max()))
        others = max(others, len(o))
    if not window:
        return None
    run_ms = float(np.median(rest))
    if run_ms <= 0:
        return None
    return WindowAgainstRun(window_step_ms=float(np.median(window)), run_step_ms=run_ms,
                            window_steps=(min(first), max(last)), run_steps=others, ranks=len(window))
