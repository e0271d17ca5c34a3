"""When did the job get slow? Change points over a whole run, from the probes' every-step record.

The probes append every step of every rank to `rank{R}.steps.jsonl`, profiler or not. Per rank
this module builds one series per component of the step, over the whole record:
- `step_ms`: the step's wall time;
- `dataloader_ms`: time blocked fetching the batch;
- `late_ms`: the rank's arrival at its collectives after the earliest rank's, summed over the
  step (a rank that computes longer arrives later: this is how a slowed rank shows);
- `comm_ms`: time in collectives (the wait for late peers included: where the others wait for a
  slowed rank, their comm_ms grows);
- `compute_ms`: the rest (step - dataloader - comm).
and finds where each series changes level.

Method: binary segmentation on the squared-error cost (the split that most reduces the sum of
squared deviations from segment means, found with cumulative sums: O(n) per search), recursing
into both halves, on the series after a running median of MEDIAN_WINDOW steps (one slow step, a
checkpoint save or a GC pause, is no change of level). A split is kept only when both sides have
at least `min_segment` steps, the levels differ by at least `min_effect` of the rank's median step
and MIN_EFFECT_MS, and by Z standard errors (noise taken from the median absolute step-to-step
difference, robust to the level shift itself). The noise of a shared host makes runs of a few
steps faster or slower (measured here: phases of 10-20 steps where one rank runs 30% slower); the
minimum segment and effect keep those from reading as events.
Why not `ruptures`: its binary segmentation runs its cost in Python per candidate split, and the
issue's scale (1,024 ranks x 100,000 steps) needs the cumulative-sum search over numpy arrays;
this is that search and nothing more.

Changes on different ranks and components within CLUSTER_STEPS of each other are one event. An
event's cause is the component that moved most among those a rank does itself (compute, the
DataLoader; communication only when no rank's own work moved: a slower link), its ranks the ones
where that component moved, and its place one rank, one host (every rank of a host, no other:
from the sidecars' host names) or every rank (shared infrastructure: storage, network, the
input pipeline).

Each event is then annotated with the host and device signals that moved with it (the probes'
`rank{R}.telemetry.jsonl`, probes/telemetry.py): per rank of the event, the median of each signal
over the samples of the segment before the change and of the segment after it, kept when it moved
by at least its floor (SIGNAL_FLOORS) and by a fifth. A signal the probe could not read is
missing there and never reads as a move.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from diagnose.probedata import ProbeData

COMPONENTS = ("step_ms", "compute_ms", "dataloader_ms", "comm_ms", "late_ms")
OWN_WORK = ("compute_ms", "dataloader_ms")
"""What a rank does itself: a change there is a cause; a change in comm_ms or late_ms on the
others follows from it."""
MEDIAN_WINDOW = 5
Z = 6.0
"""Standard errors between two levels for a split to count: far beyond what autocorrelated step
noise gives by chance over tens of steps."""
MIN_EFFECT_MS = 1.0
"""Below this a level change is timer noise on any host."""
MAX_CHANGES = 8
"""Per series: more changes than this in one run is noise, not a story an on-call engineer reads."""
CLUSTER_STEPS = 10


@dataclass(frozen=True, slots=True)
class Change:
    rank: int
    component: str
    step: int
    """The first step at the new level."""
    before_ms: float
    """Median of the component over the segment before (raw steps, not the filtered series)."""
    after_ms: float

    @property
    def delta_ms(self) -> float:
        return self.after_ms - self.before_ms


SIGNAL_FLOORS = {"cpu_busy": 0.15, "cpu_steal": 0.05, "load1": 0.5, "proc_cpu": 0.15,
                 "invol_switches_per_s": 20.0, "rss_mb": 256.0, "sm_clock_mhz": 100.0, "gpu_temp_c": 8.0,
                 "gpu_power_w": 30.0}
"""The least move of each signal that annotates a change: well above what a steady run's samples
wander by (a share of CPU time, a load average, CPU seconds per second, switches per second, MB,
MHz, degrees C, W). gpu_throttle: any change of the reasons."""
SIGNAL_REL = 0.2
MIN_SAMPLES = 2
"""Samples needed on each side of a change to compare a signal."""
SIGNAL_WORDS = {"cpu_busy": ("CPU busy", "{:.0%}"), "cpu_steal": ("CPU steal", "{:.0%}"),
                "load1": ("load average", "{:.1f}"), "proc_cpu": ("the rank's CPU use", "{:.2f} s/s"),
                "invol_switches_per_s": ("involuntary context switches", "{:,.0f}/s"),
                "rss_mb": ("resident memory", "{:,.0f} MB"), "sm_clock_mhz": ("SM clock", "{:,.0f} MHz"),
                "gpu_temp_c": ("GPU temperature", "{:.0f} C"), "gpu_power_w": ("GPU power", "{:.0f} W")}


@dataclass(frozen=True, slots=True)
class SignalMove:
    """A host or device signal that moved with a change."""

    signal: str
    rank: int
    host: str | None
    before: float
    after: float

    @property
    def text(self) -> str:
        where = f"rank {self.rank}" + (f" ({self.host})" if self.host else "")
        if self.signal == "gpu_throttle":
            return f"{where} throttle reasons {_throttle(self.before)} -> {_throttle(self.after)}"
        words, fmt = SIGNAL_WORDS[self.signal]
        return f"{where} {words} {fmt.format(self.before)} -> {fmt.format(self.after)}"


def _throttle(bits: float) -> str:
    from diagnose.probes.telemetry import THROTTLE

    b = int(bits)
    return ", ".join(name for bit, name in THROTTLE.items() if b & bit) or "none"


@dataclass(frozen=True, slots=True)
class Event:
    """Changes at about the same step, read together."""

    step: int
    wall_s: float | None
    """The step's start (epoch seconds) on the leading rank."""
    cause: str
    """The component that moved: compute_ms, dataloader_ms or comm_ms."""
    ranks: tuple[int, ...]
    """Where the cause moved, the largest change first."""
    place: str
    """"rank R", "ranks R, S", "host H" or "every rank"."""
    step_before_ms: float
    """The job's step (median over ranks) before and after the change."""
    step_after_ms: float
    cause_delta_ms: float
    """The cause's change on the leading rank."""
    changes: tuple[Change, ...]
    signals: tuple[SignalMove, ...] = ()
    """Host and device signals that moved with it, the largest relative move first (may be empty)."""

    @property
    def lost_ms(self) -> float:
        """Step time lost per step since the change (negative: the job got faster)."""
        return self.step_after_ms - self.step_before_ms


def rank_series(probes: dict[int, ProbeData]) -> dict[int, pd.DataFrame]:
    """Per rank: one row per step (index `step`), the COMPONENTS as columns, and `start`."""
    lateness = _lateness(probes)
    out = {}
    for r, p in probes.items():
        s = p.steps
        if s.empty:
            continue
        s = s.drop_duplicates("step", keep="last").set_index("step").sort_index()
        frame = pd.DataFrame({"start": s["start"], "step_ms": s["dur_ms"],
                              "dataloader_ms": s["dataloader_ms"].fillna(0.0), "comm_ms": s["comm_ms"].fillna(0.0)})
        frame["compute_ms"] = (frame["step_ms"] - frame["dataloader_ms"] - frame["comm_ms"]).clip(lower=0.0)
        frame["late_ms"] = lateness.get(r, pd.Series(dtype=float)).reindex(frame.index).fillna(0.0)
        out[r] = frame
    return out


def _lateness(probes: dict[int, ProbeData]) -> dict[int, pd.Series]:
    """rank -> per step, its arrivals after the earliest rank's, summed over its collectives (ms)."""
    frames = [p.collectives.assign(rank=r) for r, p in probes.items() if not p.collectives.empty]
    if len(frames) < 2:
        return {}
    c = pd.concat(frames, ignore_index=True)
    c["seq"] = c.groupby(["rank", "step", "group"]).cumcount()
    key = ["step", "group", "seq"]
    c = c[c.groupby(key)["rank"].transform("size") >= 2]
    c = c.assign(late=(c["arrival"] - c.groupby(key)["arrival"].transform("min")) * 1000)
    per = c.groupby(["rank", "step"])["late"].sum()
    return {int(r): per.xs(r, level="rank") for r in per.index.get_level_values("rank").unique()}


def _running_median(x: np.ndarray, w: int) -> np.ndarray:
    if len(x) < w:
        return x.copy()
    pad = w // 2
    padded = np.concatenate([np.full(pad, x[0]), x, np.full(pad, x[-1])])
    return np.median(np.lib.stride_tricks.sliding_window_view(padded, w), axis=1)


def _best_split(y: np.ndarray, min_segment: int) -> tuple[int, float] | None:
    """(t, mean difference) of the split of y into y[:t], y[t:] that most reduces the squared error."""
    n = len(y)
    if n < 2 * min_segment:
        return None
    c = np.cumsum(y)
    t = np.arange(min_segment, n - min_segment + 1)
    left, right = c[t - 1], c[-1] - c[t - 1]
    # the reduction of the squared error by a split at t is n_l n_r / n (mean_l - mean_r)^2
    diff = left / t - right / (n - t)
    gain = t * (n - t) * diff * diff
    k = int(np.argmax(gain))
    return int(t[k]), float(diff[k])


def change_points(x: np.ndarray, min_segment: int, min_delta_ms: float) -> list[int]:
    """Indices where x changes level by min_delta_ms or more (each the first index of a new
    segment), ascending."""
    x = np.asarray(x, dtype=float)
    if len(x) < 2 * min_segment or not np.isfinite(x).all():
        return []
    y = _running_median(x, MEDIAN_WINDOW)
    # noise: step-to-step differences are the noise twice over, and a level shift adds one outlier
    sigma = float(np.median(np.abs(np.diff(x)))) * 1.4826 / np.sqrt(2.0) if len(x) > 2 else 0.0
    found: list[int] = []
    todo = [(0, len(x))]
    while todo and len(found) < MAX_CHANGES:
        lo, hi = todo.pop()
        best = _best_split(y[lo:hi], min_segment)
        if best is None:
            continue
        t, _ = best
        a, b = float(np.median(x[lo:lo + t])), float(np.median(x[lo + t:hi]))
        se = sigma * np.sqrt(1.0 / t + 1.0 / (hi - lo - t))
        if abs(b - a) >= max(min_delta_ms, MIN_EFFECT_MS) and abs(b - a) >= Z * se:
            found.append(lo + t)
            todo += [(lo, lo + t), (lo + t, hi)]
    return sorted(found)


def series_changes(rank: int, component: str, steps: np.ndarray, x: np.ndarray, min_segment: int,
                   min_delta_ms: float) -> list[Change]:
    cuts = change_points(x, min_segment, min_delta_ms)
    bounds = [0, *cuts, len(x)]
    out = []
    for i, cut in enumerate(cuts):
        before = float(np.median(x[bounds[i]:cut]))
        after = float(np.median(x[cut:bounds[i + 2]]))
        out.append(Change(rank=rank, component=component, step=int(steps[cut]), before_ms=before, after_ms=after))
    return out


def run_changes(probes: dict[int, ProbeData], min_segment: int = 20, min_effect: float = 0.2) -> tuple[Event, ...]:
    """Every event of the run, in step order (see the module doc)."""
    series = rank_series(probes)
    if not series:
        return ()
    # every component's change is measured against the rank's step: a rank's compute phase 30%
    # slower is a few percent of a step that also waits, communicates and loads
    changes = [c for r, f in series.items() for comp in COMPONENTS
               for c in series_changes(r, comp, f.index.to_numpy(), f[comp].to_numpy(dtype=float), min_segment,
                                       min_effect * float(f["step_ms"].median()))]
    own = [c for c in changes if c.component in OWN_WORK or c.component == "comm_ms"]
    leads = []
    for cluster in _clusters(sorted(own, key=lambda c: c.step)):
        cause_changes = [c for c in cluster if c.component in OWN_WORK] or cluster
        lead = max(cause_changes, key=lambda c: abs(c.delta_ms))
        same = sorted((c for c in cause_changes if c.component == lead.component
                       and np.sign(c.delta_ms) == np.sign(lead.delta_ms)), key=lambda c: -abs(c.delta_ms))
        leads.append((lead, tuple(dict.fromkeys(c.rank for c in same))))
    job = pd.concat([f["step_ms"] for f in series.values()], axis=1).median(axis=1).sort_index()
    cuts = [job.index.min(), *(lead.step for lead, _ in leads), job.index.max() + 1]
    events = []
    for i, (lead, ranks) in enumerate(leads):
        before = job[(job.index >= cuts[i]) & (job.index < cuts[i + 1])]
        after = job[(job.index >= cuts[i + 1]) & (job.index < cuts[i + 2])]
        start = series[lead.rank]["start"]
        events.append(Event(step=lead.step, wall_s=float(start[lead.step]) if lead.step in start.index else None,
                            cause=lead.component, ranks=ranks, place=_place(ranks, series, probes),
                            step_before_ms=float(before.median()), step_after_ms=float(after.median()),
                            cause_delta_ms=lead.delta_ms,
                            changes=tuple(c for c in changes if abs(c.step - lead.step) <= CLUSTER_STEPS),
                            signals=signal_moves(probes, ranks, cuts[i], lead.step, cuts[i + 2])))
    return tuple(events)


def signal_moves(probes: dict[int, ProbeData], ranks, lo: int, step: int, hi: int) -> tuple[SignalMove, ...]:
    """The telemetry signals of `ranks` whose median over the samples in steps [lo, step) differs
    from the one over (step, hi) by SIGNAL_FLOORS and SIGNAL_REL (the sample taken during the step
    of the change straddles it: left out)."""
    out = []
    for r in ranks:
        p = probes.get(r)
        t = p.telemetry if p is not None else None
        if t is None or t.empty:
            continue
        s = t["step"].to_numpy()
        before, after = t[(s >= lo) & (s < step)], t[(s > step) & (s < hi)]
        host = str(p.meta["host"]) if p.meta.get("host") else None
        for sig in ("gpu_throttle", *SIGNAL_FLOORS):
            if sig not in t:
                continue
            a, b = before[sig].dropna(), after[sig].dropna()
            if len(a) < MIN_SAMPLES or len(b) < MIN_SAMPLES:
                continue  # missing on this host (no NVML, no /proc), or too few samples
            if sig == "gpu_throttle":
                x, y = float(a.mode().iloc[0]), float(b.mode().iloc[0])
                if x != y:
                    out.append((float("inf"), SignalMove(sig, r, host, x, y)))
                continue
            x, y = float(a.median()), float(b.median())
            rel = abs(y - x) / max(abs(x), 1e-9)
            if abs(y - x) >= SIGNAL_FLOORS[sig] and rel >= SIGNAL_REL:
                out.append((rel, SignalMove(sig, r, host, x, y)))
    return tuple(m for _, m in sorted(out, key=lambda x: -x[0]))


def _clusters(changes: list[Change]) -> list[list[Change]]:
    out: list[list[Change]] = []
    for c in changes:
        if out and c.step - out[-1][0].step <= CLUSTER_STEPS:
            out[-1].append(c)
        else:
            out.append([c])
    return out


def _place(ranks: tuple[int, ...], series: dict[int, pd.DataFrame], probes: dict[int, ProbeData]) -> str:
    every = set(series)
    if len(every) > 1 and set(ranks) == every:
        return "every rank"
    hosts = {r: str(p.meta.get("host")) for r, p in probes.items() if p.meta.get("host")}
    if len(set(hosts.values())) > 1 and all(r in hosts for r in every):
        mine = {hosts[r] for r in ranks}
        if len(mine) == 1 and {r for r in every if hosts[r] in mine} == set(ranks):
            return f"host {next(iter(mine))}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


MAX_POINTS = 600
"""Points per line in the report's whole-run chart: steps are taken in buckets beyond this."""


@dataclass(frozen=True, slots=True)
class OverTime:
    """Every step of the run as the report draws it: per bucket of `bucket` consecutive steps, the
    median step time of each rank and of the job (median over ranks at each step)."""

    bucket: int
    steps: tuple[int, ...]
    """First step of each bucket."""
    job_ms: tuple[float, ...]
    ranks: dict[int, tuple[float, ...]]
    """At most `max_ranks` ranks, the slowest (by median step) first kept."""


def over_time(probes: dict[int, ProbeData], max_points: int = MAX_POINTS, max_ranks: int = 16) -> OverTime | None:
    """The whole run's step times, bucketed (None: no every-step record)."""
    series = rank_series(probes)
    if not series:
        return None
    step = pd.concat({r: f["step_ms"] for r, f in series.items()}, axis=1).sort_index()
    first, last = int(step.index.min()), int(step.index.max())
    bucket = max(1, -(-(last - first + 1) // max_points))
    key = (step.index.to_numpy() - first) // bucket
    per = step.groupby(key).median()
    job = step.median(axis=1).groupby(key).median()
    keep = sorted(series, key=lambda r: -float(series[r]["step_ms"].median()))[:max_ranks]
    return OverTime(bucket=bucket, steps=tuple(int(first + k * bucket) for k in per.index),
                    job_ms=tuple(round(float(v), 3) for v in job.to_numpy()),
                    ranks={r: tuple(None if np.isnan(v) else round(float(v), 3) for v in per[r].to_numpy())
                           for r in sorted(keep)})
