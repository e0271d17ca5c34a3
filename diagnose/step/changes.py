"""When did the job get slow? Change points over a whole run, from the probes' every-step record.

The probes append every step of every rank to `rank{R}.steps.jsonl`, profiler or not. Per rank
this module builds one series per component of the step, over the whole record:
- `step_ms`: the step's wall time (on CUDA ranks the device's, where the probes timed it: a host
  that runs ahead of its device ends its steps early; probedata.job_step_ms);
- `dataloader_ms`: time blocked fetching the batch;
- `late_ms`: the rank's arrival at its collectives after the earliest rank's, summed over the
  step (a rank that computes longer arrives later: this is how a slowed rank shows);
- `comm_ms`: time in collectives (the wait for late peers included: where the others wait for a
  slowed rank, their comm_ms grows);
- `compute_ms`: the rest (step - dataloader - comm).
and finds where each series changes level.

Method: binary segmentation on the squared-error cost (the split that most reduces the sum of
squared deviations from segment means, found with cumulative sums: O(n) per search), recursing
into both halves. The search runs on the median of each BLOCK steps (one slow step, a checkpoint
save or a GC pause, is no change of level; and a fifth of the points to search); the split it
finds is then placed on the first step at the new level within a block either side. A split is
kept only when both sides have at least `min_segment` steps, the levels (the median of the
block medians either side) differ by at least `min_effect` of the rank's median step and
MIN_EFFECT_MS, and by Z standard errors (noise taken from the median absolute step-to-step
difference, robust to the level shift itself); a change reports those two levels. The noise of
a shared host makes runs of a few steps faster or slower (measured here: phases of 10-20 steps
where one rank runs 30% slower); the minimum segment and effect keep those from reading as events.
Why not `ruptures`: its binary segmentation runs its cost in Python per candidate split, and the
issue's scale (1,024 ranks x 100,000 steps: benchmarks/bench_changes.py) needs the
cumulative-sum search over numpy arrays; this is that search and nothing more.

Scale: the ranks are read one at a time (`find_events` takes a source of per-rank series), so the
analysis holds one rank's series, the changes found and one median per rank and segment, not the
run. The job's step before and after an event is the median over ranks of each rank's median
step over the segment (a second pass over the ranks, only when there are events).

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

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from diagnose.probedata import ProbeData, has_device_times, job_step_ms
from diagnose.units import rank_ranges

COMPONENTS = ("step_ms", "compute_ms", "dataloader_ms", "comm_ms", "late_ms")
OWN_WORK = ("compute_ms", "dataloader_ms")
"""What a rank does itself: a change there is a cause; a change in comm_ms or late_ms on the
others follows from it."""
BLOCK = 5
"""Steps per block median: the search runs on the median of each five steps."""
NOISE_STRIDE = 8
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
                 "gpu_power_w": 30.0, "run_wait": 0.1}
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
                "gpu_temp_c": ("GPU temperature", "{:.0f} C"), "gpu_power_w": ("GPU power", "{:.0f} W"),
                "run_wait": ("the training thread's wait for a CPU", "{:.0%}")}


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
    """Where the cause moved, the largest change first; for a communication change on some ranks
    only, the ranks the others wait for (`waiting`)."""
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
    waiting: tuple[int, ...] = ()
    """For a communication change on some ranks only: those ranks, whose collectives got longer
    waiting for `ranks` (the ranks the event names)."""

    @property
    def lost_ms(self) -> float:
        """Step time lost per step since the change (negative: the job got faster)."""
        return self.step_after_ms - self.step_before_ms


@dataclass(frozen=True, slots=True)
class RankSeries:
    """One rank's whole record as the analysis reads it: one entry per step, ascending."""

    rank: int
    host: str | None
    steps: np.ndarray
    start: np.ndarray
    """Epoch seconds of each step's start."""
    values: dict[str, np.ndarray]
    """COMPONENTS -> ms per step."""
    telemetry: pd.DataFrame | None = None


def rank_series(probes: dict[int, ProbeData]) -> Iterator[RankSeries]:
    """Each rank's series from the probes' records, one rank at a time."""
    lateness = _lateness(probes)
    for r, p in probes.items():
        s = p.steps
        if s.empty:
            continue
        s = s.drop_duplicates("step", keep="last").sort_values("step")
        step = job_step_ms(s)  # the device's where timed: a host running ahead is no fast job
        if np.isnan(step).any():  # steps the device did not time are left out, not stood in for
            s, step = s[~np.isnan(step)], step[~np.isnan(step)]
            if s.empty:
                continue
        loader = s["dataloader_ms"].fillna(0.0).to_numpy(dtype=float)
        comm = s["comm_ms"].fillna(0.0).to_numpy(dtype=float)
        steps = s["step"].to_numpy(dtype=np.int64)
        late = lateness.get(r, pd.Series(dtype=float)).reindex(steps).fillna(0.0).to_numpy(dtype=float)
        yield RankSeries(rank=r, host=str(p.meta["host"]) if p.meta.get("host") else None, steps=steps,
                         start=s["start"].to_numpy(dtype=float),
                         values={"step_ms": step, "compute_ms": np.clip(step - loader - comm, 0.0, None),
                                 "dataloader_ms": loader, "comm_ms": comm, "late_ms": late},
                         telemetry=p.telemetry)


def host_timed_gpu_ranks(probes: dict[int, ProbeData]) -> list[int]:
    """CUDA ranks whose record has only the host's step times (probes before device timing): on
    them a change to a slower step may be the host's launch queue filling up, not a slowdown."""
    return sorted(r for r, p in probes.items() if str(p.meta.get("device", "")).startswith("cuda")
                  and not has_device_times(p))


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


def _block_medians(x: np.ndarray) -> np.ndarray:
    """The median of each run of BLOCK consecutive steps (a trailing partial block is left out):
    one slow step in five moves nothing. Five strided views and a fixed network of minima and
    maxima, so it costs a few array passes, not a sort per block."""
    m = len(x) // BLOCK
    a, b, c, d, e = (x[i:m * BLOCK:BLOCK] for i in range(BLOCK))
    # the lowest and the highest of a..d cannot be the median of five; of what is left and e, the middle
    f = np.maximum(np.minimum(a, b), np.minimum(c, d))
    g = np.minimum(np.maximum(a, b), np.maximum(c, d))
    lo, hi = np.minimum(f, g), np.maximum(f, g)
    return np.maximum(lo, np.minimum(hi, e))


def _best_split(y: np.ndarray, min_segment: int) -> tuple[int, float, float] | None:
    """(t, mean of y[:t], mean of y[t:]) of the split of y that most reduces the squared error."""
    n = len(y)
    if n < 2 * min_segment:
        return None
    c = np.cumsum(y)
    t = np.arange(min_segment, n - min_segment + 1)
    left, right = c[t - 1] / t, (c[-1] - c[t - 1]) / (n - t)
    # the reduction of the squared error by a split at t is n_l n_r / n (mean_l - mean_r)^2
    diff = left - right
    k = int(np.argmax(t * (n - t) * diff * diff))
    return int(t[k]), float(left[k]), float(right[k])


def _refine(x: np.ndarray, lo: int, t0: int, hi: int, min_segment: int, a: float, b: float) -> int:
    """The first step at the new level near t0 (within a block either side): the split that
    best separates level a before from level b after, by absolute deviation (robust to one
    outlier at the edge)."""
    w0, w1 = max(lo + min_segment, t0 - BLOCK), min(hi - min_segment, t0 + BLOCK)
    if w0 >= w1:
        return min(max(t0, lo + min_segment), hi - min_segment)
    w = x[w0:w1]
    # moving the split from w0 to t puts x[w0:t] on level a instead of b
    cost = np.concatenate([[0.0], np.cumsum(np.abs(w - a) - np.abs(w - b))])
    return w0 + int(np.argmin(cost))


def change_points(x: np.ndarray, min_segment: int, min_delta_ms: float, y: np.ndarray | None = None) -> list[int]:
    """Indices where x changes level by min_delta_ms or more (each the first index of a new
    segment), ascending. y: x's block medians, when the caller has them already."""
    x = np.asarray(x, dtype=float)
    return _segment(x, _block_medians(x) if y is None else y, min_segment, min_delta_ms, {})


def _segment(x: np.ndarray, y: np.ndarray, min_segment: int, min_delta_ms: float,
             levels: dict[tuple[int, int], float]) -> list[int]:
    """change_points; `levels` collects the level of each segment it measured, (lo, hi) -> ms."""
    if len(x) < 2 * min_segment or not np.isfinite(x).all():
        return []
    need = max(min_delta_ms, MIN_EFFECT_MS)
    seg_blocks = max(1, -(-min_segment // BLOCK))
    sigma = None
    found: list[int] = []
    todo = [(0, len(x))]
    while todo and len(found) < MAX_CHANGES:
        lo, hi = todo.pop()
        bl, bh = -(-lo // BLOCK), hi // BLOCK
        best = _best_split(y[bl:bh], seg_blocks)
        # a candidate whose mean levels are not half the effect apart is no change: most series
        # end here, at the cost of the search alone
        if best is None or abs(best[2] - best[1]) < need / 2:
            continue
        t0 = min(max((bl + best[0]) * BLOCK, lo + min_segment), hi - min_segment)
        if t0 - lo < min_segment or hi - t0 < min_segment:
            continue
        t = _refine(x, lo, t0, hi, min_segment, best[1], best[2])
        a = levels[(lo, t)] = _level(y, lo, t)
        b = levels[(t, hi)] = _level(y, t, hi)
        if sigma is None:
            # noise: step-to-step differences are the noise twice over, and a level shift adds one
            # outlier; every NOISE_STRIDE-th pair of neighbours estimates it as well as all of them
            d = x[1::NOISE_STRIDE] - x[:-1:NOISE_STRIDE][:len(x[1::NOISE_STRIDE])]
            sigma = float(np.median(np.abs(d))) * 1.4826 / np.sqrt(2.0)
        se = sigma * np.sqrt(1.0 / (t - lo) + 1.0 / (hi - t))
        if abs(b - a) >= need and abs(b - a) >= Z * se:
            found.append(t)
            todo += [(lo, t), (t, hi)]
    return sorted(found)


def _level(y: np.ndarray, lo: int, hi: int) -> float:
    """The level of steps [lo, hi): the median of the block medians wholly inside (robust, and a
    fifth of the values to select from); of those it touches when none is wholly inside."""
    a, b = -(-lo // BLOCK), min(hi // BLOCK, len(y))
    if a >= b:
        a, b = lo // BLOCK, min(-(-hi // BLOCK), len(y))
    return float(np.median(y[a:b]))


def series_changes(rank: int, component: str, steps: np.ndarray, x: np.ndarray, min_segment: int,
                   min_delta_ms: float, y: np.ndarray | None = None) -> list[Change]:
    x = np.asarray(x, dtype=float)
    y = _block_medians(x) if y is None else y
    levels: dict[tuple[int, int], float] = {}
    cuts = _segment(x, y, min_segment, min_delta_ms, levels)
    if not cuts:
        return []
    bounds = [0, *cuts, len(x)]
    level = [levels.get((bounds[i], bounds[i + 1])) for i in range(len(bounds) - 1)]
    level = [_level(y, bounds[i], bounds[i + 1]) if v is None else v for i, v in enumerate(level)]
    return [Change(rank=rank, component=component, step=int(steps[cut]), before_ms=level[i], after_ms=level[i + 1])
            for i, cut in enumerate(cuts)]


def run_changes(probes: dict[int, ProbeData], min_segment: int = 20, min_effect: float = 0.2) -> tuple[Event, ...]:
    """Every event of the run, in step order (see the module doc)."""
    return find_events(lambda: rank_series(probes), min_segment, min_effect)


def find_events(source: Callable[[], Iterable[RankSeries]], min_segment: int = 20,
                min_effect: float = 0.2) -> tuple[Event, ...]:
    """Every event of the run, in step order. `source()` yields each rank's series; it is called
    once, and a second time only when there are events (for the job's step around them and the
    signals): the analysis holds one rank's series at a time, whatever the rank count."""
    changes: list[Change] = []
    starts: dict[tuple[int, int], float] = {}
    hosts: dict[int, str | None] = {}
    first = last = None
    for s in source():
        if len(s.steps) == 0:
            continue
        hosts[s.rank] = s.host
        first = int(s.steps[0]) if first is None else min(first, int(s.steps[0]))
        last = int(s.steps[-1]) if last is None else max(last, int(s.steps[-1]))
        # every component's change is measured against the rank's step: a rank's compute phase 30%
        # slower is a few percent of a step that also waits, communicates and loads
        blocks = {comp: _block_medians(np.asarray(s.values[comp], dtype=float)) for comp in COMPONENTS}
        whole = blocks["step_ms"] if len(blocks["step_ms"]) else s.values["step_ms"]
        floor = min_effect * float(np.median(whole))
        for comp in COMPONENTS:
            for c in series_changes(s.rank, comp, s.steps, s.values[comp], min_segment, floor, blocks[comp]):
                changes.append(c)
                starts[(s.rank, c.step)] = float(s.start[np.searchsorted(s.steps, c.step)])
    if first is None:
        return ()
    own = [c for c in changes if c.component in OWN_WORK or c.component == "comm_ms"]
    leads = []
    for cluster in _clusters(sorted(own, key=lambda c: c.step)):
        cause_changes = [c for c in cluster if c.component in OWN_WORK] or cluster
        lead = max(cause_changes, key=lambda c: abs(c.delta_ms))
        same = sorted((c for c in cause_changes if c.component == lead.component
                       and np.sign(c.delta_ms) == np.sign(lead.delta_ms)), key=lambda c: -abs(c.delta_ms))
        ranks = tuple(dict.fromkeys(c.rank for c in same))
        if lead.component == "comm_ms" and lead.delta_ms > 0 and 0 < len(set(ranks)) < len(hosts):
            # longer collectives on some ranks only, no rank's own work past its floor: in a
            # synchronous collective the ranks that wait longer wait for the others (recorded: a CPU
            # hog on rank 1's core slowed its gloo transfers; rank 0 waited +8 ms, rank 1's own
            # compute rose 3.6 ms, under the floor). The event names the ranks waited for.
            waited_for = tuple(r for r in sorted(hosts) if r not in ranks)
            leads.append((lead, waited_for, ranks))
            continue
        leads.append((lead, ranks, ()))
    if not leads:
        return ()
    cuts = [first, *(lead.step for lead, _, _ in leads), last + 1]
    # the second pass: each rank's median step in each segment between the events, and the signals
    # of the events' ranks around each event
    per_segment: list[list[float]] = [[] for _ in range(len(cuts) - 1)]
    moves: dict[tuple[int, int], list[tuple[float, SignalMove]]] = {}
    wanted = {r: [i for i, (_, ranks, _) in enumerate(leads) if r in ranks] for r in hosts}
    for s in source():
        if len(s.steps) == 0:
            continue
        edges = np.searchsorted(s.steps, cuts)
        for j in range(len(cuts) - 1):
            if edges[j + 1] > edges[j]:
                per_segment[j].append(float(np.median(s.values["step_ms"][edges[j]:edges[j + 1]])))
        for i in wanted.get(s.rank, ()):
            moves[(i, s.rank)] = _rank_moves(s.rank, s.host, s.telemetry, cuts[i], leads[i][0].step, cuts[i + 2])
    job = [float(np.median(v)) if v else float("nan") for v in per_segment]
    events = []
    for i, (lead, ranks, waiting) in enumerate(leads):
        found = [m for r in ranks for m in moves.get((i, r), [])]
        events.append(Event(step=lead.step, wall_s=starts.get((lead.rank, lead.step)),
                            cause=lead.component, ranks=ranks, place=_place(ranks, hosts),
                            step_before_ms=job[i], step_after_ms=job[i + 1], cause_delta_ms=lead.delta_ms,
                            waiting=waiting,
                            changes=tuple(c for c in changes if abs(c.step - lead.step) <= CLUSTER_STEPS),
                            signals=tuple(m for _, m in sorted(found, key=lambda x: -x[0]))))
    return tuple(events)


def signal_moves(probes: dict[int, ProbeData], ranks, lo: int, step: int, hi: int) -> tuple[SignalMove, ...]:
    """The telemetry signals of `ranks` whose median over the samples in steps [lo, step) differs
    from the one over (step, hi) by SIGNAL_FLOORS and SIGNAL_REL (the sample taken during the step
    of the change straddles it: left out)."""
    out = []
    for r in ranks:
        p = probes.get(r)
        if p is not None:
            out += _rank_moves(r, str(p.meta["host"]) if p.meta.get("host") else None, p.telemetry, lo, step, hi)
    return tuple(m for _, m in sorted(out, key=lambda x: -x[0]))


def _rank_moves(r: int, host: str | None, t: pd.DataFrame | None, lo: int, step: int,
                hi: int) -> list[tuple[float, SignalMove]]:
    """signal_moves for one rank: (relative move, move) pairs."""
    if t is None or t.empty:
        return []
    out = []
    s = t["step"].to_numpy()
    before, after = t[(s >= lo) & (s < step)], t[(s > step) & (s < hi)]
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
    return out


def _clusters(changes: list[Change]) -> list[list[Change]]:
    out: list[list[Change]] = []
    for c in changes:
        if out and c.step - out[-1][0].step <= CLUSTER_STEPS:
            out[-1].append(c)
        else:
            out.append([c])
    return out


def _place(ranks: tuple[int, ...], hosts: dict[int, str | None]) -> str:
    """One rank, the ranks of one host and no other, or every rank (hosts: every rank read -> its host)."""
    every = set(hosts)
    if len(every) > 1 and set(ranks) == every:
        return "every rank"
    known = {r: h for r, h in hosts.items() if h}
    if len(set(known.values())) > 1 and len(known) == len(every):
        mine = {known[r] for r in ranks}
        if len(mine) == 1 and {r for r in every if known[r] in mine} == set(ranks):
            return f"host {next(iter(mine))}"
    return ("rank " if len(ranks) == 1 else "ranks ") + rank_ranges(ranks)


MAX_POINTS = 600
"""Points per line in the report's whole-run chart: steps are taken in buckets beyond this."""
HEAT_POINTS = 150
MAX_HEAT_RANKS = 256
"""The rank-by-time heatmap: at most this many columns (buckets of steps) and rows (ranks; the
busiest by median own time kept), so a 1,024-rank run's report stays a few hundred KB."""


@dataclass(frozen=True, slots=True)
class OverTime:
    """Every step of the run as the report draws it: per bucket of `bucket` consecutive steps, the
    median step time of each rank and of the job (median over ranks at each step); and each
    rank's own time per step (less its collectives) in coarser buckets (`heat_bucket`) for the
    rank-by-time heatmap."""

    bucket: int
    steps: tuple[int, ...]
    """First step of each bucket."""
    job_ms: tuple[float, ...]
    ranks: dict[int, tuple[float, ...]]
    """At most `max_ranks` ranks, the slowest (by median step) first kept."""
    heat_bucket: int = 1
    heat_steps: tuple[int, ...] = ()
    heat: dict[int, tuple[float | None, ...]] = field(default_factory=dict)
    """rank -> its median own time per step (the step less its collectives: compute and DataLoader)
    per heat bucket, at most MAX_HEAT_RANKS ranks, in rank order."""


def over_time(probes: dict[int, ProbeData], max_points: int = MAX_POINTS, max_ranks: int = 16) -> OverTime | None:
    """The whole run's step times, bucketed (None: no every-step record)."""
    every = list(rank_series(probes))
    if not every:
        return None
    series = {s.rank: pd.Series(s.values["step_ms"], index=s.steps) for s in every}
    step = pd.concat(series, axis=1).sort_index()
    first, last = int(step.index.min()), int(step.index.max())
    bucket, key, per = _bucketed(step, first, last, max_points)
    job = step.median(axis=1).groupby(key).median()
    by_median = sorted(series, key=lambda r: -float(series[r].median()))
    # the heatmap shows each rank's own time (the step less its collectives): in synchronous
    # training every rank's step is the slowest rank's, so step times would colour every row alike
    own = {s.rank: pd.Series(s.values["step_ms"] - s.values["comm_ms"], index=s.steps) for s in every}
    keep = sorted(own, key=lambda r: -float(own[r].median()))[:MAX_HEAT_RANKS]
    hb, _, heat = _bucketed(pd.concat({r: own[r] for r in sorted(keep)}, axis=1).sort_index(), first, last,
                            HEAT_POINTS)
    return OverTime(bucket=bucket, steps=tuple(int(first + k * bucket) for k in per.index),
                    job_ms=tuple(round(float(v), 3) for v in job.to_numpy()),
                    ranks={r: _rounded(per[r]) for r in sorted(by_median[:max_ranks])},
                    heat_bucket=hb, heat_steps=tuple(int(first + k * hb) for k in heat.index),
                    heat={r: _rounded(heat[r]) for r in heat.columns})


def _bucketed(step: pd.DataFrame, first: int, last: int, points: int) -> tuple[int, np.ndarray, pd.DataFrame]:
    """(steps per bucket, each step's bucket, per bucket each column's median) for at most `points` buckets."""
    bucket = max(1, -(-(last - first + 1) // points))
    key = (step.index.to_numpy() - first) // bucket
    return bucket, key, step.groupby(key).median()


def _rounded(col: pd.Series) -> tuple[float | None, ...]:
    return tuple(None if np.isnan(v) else round(float(v), 3) for v in col.to_numpy())
