"""Is the profiled window like the rest of the run?

Every check reads the few profiled steps; every figure is a mean over them. A window that caught
the run at an unusual time describes those steps, not the run. The probes time every step, so the
window can be set against the run: each rank's profiled steps are the step records that lie inside
its trace (both on the host's wall clock: a Kineto trace's `baseTimeNanoseconds` plus its event
times, the probes' `time.time()`), the run is every other recorded step (the probes' step 0,
start-up, is never in the record). Each figure is the median over ranks of each rank's.

Two ways a window is unlike the run, told apart because their remedies differ (both may hold):
- `outliers`: the window's mean is off its own median (more than the run's is): a few steps
  inside it ran far from the rest (a validation or checkpoint that runs once in a thousand steps,
  caught by the window). The means every check reports carry them: profile at another time.
- `shifted`: the window's median step itself is off the run's: the whole window ran slower or
  faster. Either a phase of the run unlike the rest (warm-up, a slowdown that came or went), or
  the profiler's own cost, which on short steps is large (measured here: a 4.3 ms CPU step took
  8.5 ms profiled, `examples/train_ddp.py --pathology tiny-batch`): then the trace's per-op
  figures carry that cost too.
- `collections`: Python's full garbage collections ran inside the window (the probes time them):
  each stopped its rank for hundreds of ms. Where the probes placed every one of them in its step
  and the rank is a CPU rank (step/pauses.py), the step model carries them as their own part and
  the other figures are without them (`collections_placed`); elsewhere each reads, in the
  window's figures, as whatever the process was doing when it began (a DataLoader fetch, a
  collective, host gaps), and the caution says so. The gc_pause check sizes them over the run.
Either beyond WINDOW_UNLIKE_RUN (collections: GC_IN_WINDOW) is said beside the verdict.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diagnose.ingest.assemble import absolute_span_us
from diagnose.ingest.load import RankTrace
from diagnose.probedata import ProbeData, has_device_times, job_step_ms
from diagnose.thresholds import DEFAULT

WINDOW_UNLIKE_RUN = 0.25
"""The window's mean (or median) step this much above or below the run's: said beside the verdict."""
MIN_OTHERS = 10
"""Steps recorded outside the window, at the least, for the run to be set against it."""
GC_IN_WINDOW = DEFAULT.gc_pause
"""Full collections inside the window taking this share of its mean step (the gc_pause check's
default floor): said beside the verdict."""
SLACK_US = 1000.0
"""A step record lies in the window when it starts and ends within this of the trace's span."""


@dataclass(frozen=True, slots=True)
class WindowAgainstRun:
    window_step_ms: float
    """Mean profiled step (the figure the checks' means are over)."""
    run_step_ms: float
    """Mean of the run's other recorded steps."""
    window_median_ms: float
    run_median_ms: float
    window_steps: tuple[int, int]
    """The first and last step numbers profiled (the probes' numbering), over the ranks compared."""
    slowest_step: int
    """The profiled step furthest from the run's median step, on the rank with the largest such."""
    slowest_ms: float
    run_steps: int
    """Steps recorded outside the window (the rank with the most)."""
    ranks: int
    collections: tuple[tuple[int, int, float], ...] = ()
    """(rank, step, ms) of each full garbage collection inside the window, the longest first."""
    collections_ms_per_step: float = 0.0
    """Their time per profiled step, on the rank with the most."""
    collections_placed: bool = False
    """Every one of them is the step model's own part (step/pauses.py): the other figures are without them."""

    @property
    def ratio(self) -> float:
        return self.window_step_ms / self.run_step_ms

    @property
    def median_ratio(self) -> float:
        return self.window_median_ms / self.run_median_ms

    @property
    def kinds(self) -> tuple[str, ...]:
        """'shifted' (the window's median step off the run's), 'outliers' (its mean off its median
        by more than the run's is: a few steps far from the rest), both, or neither."""
        out = []
        if abs(self.median_ratio - 1.0) > WINDOW_UNLIKE_RUN:
            out.append("shifted")
        if abs(self.ratio / self.median_ratio - 1.0) > WINDOW_UNLIKE_RUN:
            out.append("outliers")
        if self.collections_ms_per_step >= GC_IN_WINDOW * self.window_step_ms > 0:
            out.append("collections")
        return tuple(out)

    @property
    def unlike(self) -> bool:
        return bool(self.kinds)

    def text(self) -> str:
        return caution(self.as_dict())

    def as_dict(self) -> dict:
        return {"window_step_ms": round(self.window_step_ms, 3), "run_step_ms": round(self.run_step_ms, 3),
                "window_median_ms": round(self.window_median_ms, 3), "run_median_ms": round(self.run_median_ms, 3),
                "window_steps": list(self.window_steps), "slowest_step": self.slowest_step,
                "slowest_ms": round(self.slowest_ms, 3), "run_steps": self.run_steps, "ranks": self.ranks,
                "ratio": round(self.ratio, 4), "median_ratio": round(self.median_ratio, 4),
                "kinds": list(self.kinds), "unlike": self.unlike,
                "collections": [[r, s, round(ms, 3)] for r, s, ms in self.collections[:6]],
                "collections_ms_per_step": round(self.collections_ms_per_step, 3),
                "collections_placed": self.collections_placed}


def caution(w: dict) -> str:
    """The line said beside the verdict for an unlike window (extras.window, written or read back)."""
    a, b = w["window_steps"]
    steps = f"step {a}" if a == b else f"steps {a}-{b}"
    kinds = w.get("kinds") or []
    parts = []
    if "shifted" in kinds:
        parts.append(f"the profiled {steps} ran at a median {w['window_median_ms']:.1f} ms a step, "
                     f"{w['median_ratio']:.2f}x the {w['run_median_ms']:.1f} ms of the run's {w['run_steps']} other "
                     "recorded steps: a phase unlike the rest (warm-up, a slowdown: `diagnose changes` shows the "
                     "run), or the profiler's own cost, large on short steps, which the trace's per-op figures "
                     "then carry too")
    if "outliers" in kinds:
        lead = f"step {w['slowest_step']}" if parts else f"the profiled {steps} include step {w['slowest_step']}"
        parts.append(f"{lead} at {w['slowest_ms']:.1f} ms against the run's median {w['run_median_ms']:.1f} "
                     f"(the window's mean {w['window_step_ms']:.1f} ms a step, {w['ratio']:.2f}x the run's "
                     f"{w['run_step_ms']:.1f}): the figures, means over the window, carry it; profile at a typical "
                     "time (--schedule WAIT,WARMUP,ACTIVE, or `diagnose capture` on the running job) to see the run's")
    if "collections" in kinds:
        each = "; ".join(f"rank {r} at step {s}: {ms:.0f} ms" for r, s, ms in w.get("collections", [])[:3])
        if w.get("collections_placed"):
            parts.append(f"full garbage collections ran inside the profiled steps ({each}): the probes placed each in "
                         "its step, and the other causes' figures are without them; the window's mean step carries "
                         "them, and the gc_pause check sizes them over the run")
        else:
            parts.append(f"full garbage collections ran inside the profiled steps ({each}): the window's figures carry "
                         "them as whatever the process was doing when each began (a DataLoader fetch, a collective, "
                         "host gaps); the gc_pause check sizes them over the run")
    return "; ".join(parts)


def in_window(steps, span: tuple[float, float]) -> np.ndarray:
    """Which of a rank's step records (ProbeData.steps) lie inside its trace's span (absolute us,
    ingest.assemble.absolute_span_us): its profiled steps."""
    start = steps["start"].to_numpy(dtype=float) * 1e6
    end = start + steps["dur_ms"].to_numpy(dtype=float) * 1e3
    return (start >= span[0] - SLACK_US) & (end <= span[1] + SLACK_US)


def window_mask(trace: RankTrace, steps) -> np.ndarray | None:
    """in_window for a rank's trace; None where the trace has no absolute clock."""
    span = absolute_span_us(trace) if trace.meta.get("baseTimeNanoseconds") else None
    return None if span is None else in_window(steps, span)


def window_against_run(traces: dict[int, RankTrace], probes: dict[int, ProbeData],
                       placed: frozenset[int] = frozenset()) -> WindowAgainstRun | None:
    """The profiled window against the rest of the run, where both are known (None otherwise:
    no every-step record, no absolute clock in the traces, too few steps outside the window).
    placed: the ranks whose collections in the window the step model carries (Context.pauses)."""
    means, medians, run_means, run_medians, first, last, far = [], [], [], [], [], [], []
    others = 0
    collections: list[tuple[int, int, float]] = []
    gc_per_step = 0.0
    for r, t in traces.items():
        p = probes.get(r)
        inside = window_mask(t, p.steps) if p is not None and not p.steps.empty else None
        if inside is None:
            continue
        if str(p.meta.get("device", "")).startswith("cuda") and not has_device_times(p):
            # a host that runs ahead of its device ends its steps early until the launch queue
            # fills (tests/fixtures/gpu_h200/none_long: 2.6 ms host steps in a 12.7 ms job)
            continue
        s = p.steps
        dur = job_step_ms(s)  # the device's step where timed, as the checks read it
        ok = ~np.isnan(dur)
        w, o = dur[inside & ok], dur[~inside & ok]
        if not len(w) or len(o) < MIN_OTHERS:
            continue
        means.append(float(np.mean(w)))
        medians.append(float(np.median(w)))
        run_means.append(float(np.mean(o)))
        run_medians.append(float(np.median(o)))
        steps = s["step"].to_numpy()[inside & ok]
        first.append(int(steps.min()))
        last.append(int(steps.max()))
        k = int(np.argmax(np.abs(w - run_medians[-1])))
        far.append((abs(float(w[k]) - run_medians[-1]), int(steps[k]), float(w[k])))
        others = max(others, len(o))
        if "gc_full_ms" in s:
            full = s["gc_full_ms"].fillna(0.0).to_numpy(dtype=float)[inside & ok]
            collections += [(int(r), int(st), float(ms)) for st, ms in zip(steps, full) if ms > 0]
            gc_per_step = max(gc_per_step, float(full.sum()) / len(w))
    if not means or float(np.median(run_means)) <= 0 or float(np.median(run_medians)) <= 0:
        return None
    _, step, ms = max(far)
    return WindowAgainstRun(window_step_ms=float(np.median(means)), run_step_ms=float(np.median(run_means)),
                            window_median_ms=float(np.median(medians)), run_median_ms=float(np.median(run_medians)),
                            window_steps=(min(first), max(last)), slowest_step=step, slowest_ms=ms,
                            run_steps=others, ranks=len(means),
                            collections=tuple(sorted(collections, key=lambda c: -c[2])),
                            collections_ms_per_step=gc_per_step,
                            collections_placed=bool(collections) and all(r in placed for r, _, _ in collections))
