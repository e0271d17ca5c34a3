"""`diagnose watch`: a live terminal view of a running job, from the light-mode files.

Read-only: safe over a shared filesystem, never writes into the run. The suspicion
shown is provisional: it uses the same thresholds as the analyzers, over the last
steps' timings only (no trace), and says so.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from diagnose.errors import one_line
from diagnose.oncall import live_tails, progress
from diagnose.probedata import ProbeData, every_step_lateness, load_telemetry, probe_from_rows, run_wait_basis
from diagnose.thresholds import DEFAULT, Thresholds


@dataclass(frozen=True, slots=True)
class RankLive:
    rank: int
    step: int
    step_ms: float
    dataloader_share: float
    comm_ms: float
    age_s: float
    """Seconds since this rank's last finished step."""
    cpu_wait: float | None = None
    """Share of wall time its training thread waited for a core over the last LIVE_SAMPLES
    telemetry samples (None: not sampled, older probes, not Linux)."""


@dataclass(frozen=True, slots=True)
class LiveView:
    ranks: tuple[RankLive, ...]
    slowest_rank: int | None
    behind_steps: int
    late_rank: int | None
    late_ms: float
    suspicion: str
    window: int
    warnings: tuple[str, ...] = ()
    """Step logs skipped because they cannot be read safely (a FIFO, a device), one line each."""
    quiet_s: float = 0.0
    """Seconds since any rank last finished a step."""
    change: str | None = None
    """The latest slowdown over the whole record (diagnose/step/changes.py), as "since step N ..."."""


LIVE_SAMPLES = 10
"""Telemetry samples read a rank for its CPU wait (one per 2 s by default: the last ~20 s)."""
STALE_MIN_S = 15.0
STALE_STEPS = 10
"""No rank finishing a step for STALE_STEPS median steps (at least STALE_MIN_S): the job has
stopped or is stuck, and the view says so instead of a provisional suspicion."""


def snapshot(pdir: Path, window: int = 20, th: Thresholds = DEFAULT, now: float | None = None,
             ended: bool = False) -> LiveView:
    """ended: the run's launcher has finished (its lock released): quiet ranks are not stuck."""
    now = time.time() if now is None else now
    warnings: list[str] = []
    tails = {r: t[-window:] for r, t in live_tails(pdir, warnings).items() if t}
    recorded = {r: probe_from_rows(r, {}, t) for r, t in tails.items()}
    ranks = []
    for r, t in sorted(tails.items()):
        durs = [x["dur_ms"] for x in t]
        dl = [x.get("dataloader_ms", 0.0) / x["dur_ms"] for x in t if x["dur_ms"] > 0]
        last = t[-1]
        ranks.append(RankLive(rank=r, step=last["step"], step_ms=statistics.median(durs),
                              dataloader_share=statistics.median(dl) if dl else 0.0,
                              comm_ms=statistics.median(x.get("comm_ms", 0.0) for x in t),
                              age_s=max(0.0, now - (last["start"] + last["dur_ms"] / 1000)),
                              cpu_wait=_cpu_wait(pdir, recorded[r], warnings)))
    if not ranks:
        return LiveView((), None, 0, None, 0.0, "no finished step yet", window, tuple(warnings))
    furthest = max(x.step for x in ranks)
    slowest = min(ranks, key=lambda x: (x.step, -x.age_s))
    late_rank, late_ms = None, 0.0
    lat = every_step_lateness(recorded)
    if not lat.empty:
        keys = ["step", "group", "seq"]
        last = lat.loc[lat.groupby(keys)["arrival"].idxmax()]
        share = last["rank"].value_counts(normalize=True)
        cand = int(share.idxmax())
        if share[cand] >= th.straggler_consistency:
            late_rank = cand
            # what the others wait for that rank alone: last minus second-latest arrival
            second = lat.groupby(keys)["arrival"].apply(lambda a: a.nlargest(2).iloc[-1])
            gap = (last.set_index(keys)["arrival"] - second) * 1000
            late_ms = float(gap[last.set_index(keys)["rank"] == cand].mean())
    step_ms = statistics.median(x.step_ms for x in ranks)
    suspects = []
    worst_dl = max(ranks, key=lambda x: x.dataloader_share)
    if worst_dl.dataloader_share >= th.input_bound:
        suspects.append((worst_dl.dataloader_share * step_ms,
                         f"dataloader starvation: rank {worst_dl.rank} waits {worst_dl.dataloader_share:.0%} "
                         "of each step for data"))
    if late_rank is not None and late_ms / step_ms >= th.straggler:
        suspects.append((late_ms, f"straggler: rank {late_rank} arrives last at collectives, "
                                  f"{late_ms:.1f} ms after the others"))
    waiting = [x for x in ranks if x.cpu_wait is not None]
    worst_cpu = max(waiting, key=lambda x: x.cpu_wait) if waiting else None
    if worst_cpu is not None and worst_cpu.cpu_wait >= th.cpu_contention:
        suspects.append((worst_cpu.cpu_wait * worst_cpu.step_ms,
                         f"CPU contention: rank {worst_cpu.rank}'s training thread waits for a core "
                         f"{worst_cpu.cpu_wait:.0%} of the time"))
    comm = statistics.median(x.comm_ms for x in ranks)
    if comm / step_ms >= th.communication and late_rank is None:
        suspects.append((comm, f"communication: collectives take {comm / step_ms:.0%} of each step"))
    suspicion = max(suspects)[1] if suspects else "nothing stands out"
    suspicion = f"{suspicion} (provisional: timings of the last {window} steps, no trace)"
    moving = progress(tails, now, min_s=STALE_MIN_S, steps=STALE_STEPS)
    quiet = min(moving.ages.values())
    if ended:
        suspicion = f"the run has ended; over its last steps: {suspicion}"
    elif len(moving.quiet) == len(moving.ages):
        suspicion = (f"no rank has finished a step for {quiet:.0f} s: the job has stopped or is stuck "
                     f"(`diagnose hang` tells which); over its last steps: {suspicion}")
    return LiveView(tuple(ranks), slowest.rank, furthest - slowest.step, late_rank, late_ms, suspicion, window,
                    tuple(warnings), quiet_s=quiet, change=latest_change(pdir, th))


def _cpu_wait(pdir: Path, recorded: ProbeData, warnings: list[str]) -> float | None:
    """The rank's training thread's recent wait for a core, as a share of wall time: over the view's
    steps (`recorded`, their run_wait_ms), else over its last LIVE_SAMPLES telemetry samples (older
    probes); None where its probes read none (probedata.run_wait_basis)."""
    basis = run_wait_basis(recorded)
    path = pdir / f"rank{recorded.rank}.telemetry.jsonl"
    if basis is None and path.exists():
        t, bad = load_telemetry(path, max_lines=LIVE_SAMPLES)
        warnings.extend(bad)
        basis = run_wait_basis(replace(recorded, telemetry=t))
    return None if basis is None else basis[0]


def slowdowns(pdir: Path, th: Thresholds = DEFAULT) -> tuple:
    """The changes to a slower step over every step recorded so far (diagnose/step/changes.py),
    in step order. Reads the whole record (bounded by the reader's line budget)."""
    from diagnose.probedata import load_probe_data
    from diagnose.step.changes import run_changes

    probes = {r: p for r, p in load_probe_data([pdir]).items() if not p.steps.empty}
    if not probes or max(len(p.steps) for p in probes.values()) < 2 * th.fail_slow_min_segment:
        return ()
    return tuple(e for e in run_changes(probes, th.fail_slow_min_segment, th.fail_slow_effect) if e.lost_ms > 0)


def latest_change(pdir: Path, th: Thresholds = DEFAULT) -> str | None:
    """The latest change to a slower step, as the on-call line `diagnose changes` prints (with
    the signals that moved with it), or None."""
    from diagnose.analyzers.fail_slow import describe

    slower = slowdowns(pdir, th)
    return "since " + describe(slower[-1]).removeprefix("from ") if slower else None


def wait_for_change(pdir: Path, timeout_s: float, poll_s: float = 2.0, th: Thresholds = DEFAULT,
                    known: tuple | None = None, alive=lambda: True):
    """The first slowdown that was not in the record when the wait began (`known`: the events
    already seen; read now when None), or None after timeout_s or once `alive()` is false. A
    change is seen once th.fail_slow_min_segment steps at the new speed are recorded: that many
    steps after it."""
    from diagnose.step.changes import CLUSTER_STEPS

    seen = [e.step for e in (slowdowns(pdir, th) if known is None else known)]
    deadline = time.monotonic() + timeout_s
    while True:
        t = time.monotonic()
        # the same change found again moves by a few steps as more of it is recorded
        new = [e for e in slowdowns(pdir, th) if all(abs(e.step - s) > CLUSTER_STEPS for s in seen)]
        if new:
            return new[0]
        if time.monotonic() >= deadline or not alive():
            return None
        # each poll reads every rank's whole record: on a large run, wait at least twice as long
        # as a read takes, so the wait never becomes a busy loop over a shared filesystem
        pause = max(poll_s, 2 * (time.monotonic() - t))
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))


def render(view: LiveView) -> str:
    lines = [f"{'rank':>4} {'step':>7} {'step ms':>9} {'data wait':>9} {'comm ms':>8} {'cpu wait':>8} {'last seen':>9}"]
    for x in view.ranks:
        mark = " <- slowest" if x.rank == view.slowest_rank and view.behind_steps > 0 else ""
        mark += " <- late at collectives" if x.rank == view.late_rank else ""
        cpu = f"{x.cpu_wait:>8.0%}" if x.cpu_wait is not None else f"{'-':>8}"  # not sampled: not 0
        lines.append(f"{x.rank:>4} {x.step:>7} {x.step_ms:>9.1f} {x.dataloader_share:>9.0%} {x.comm_ms:>8.1f} "
                     f"{cpu} {x.age_s:>8.1f}s{mark}")
    if view.slowest_rank is not None and view.behind_steps > 0:
        lines.append(f"slowest rank: {view.slowest_rank}, {view.behind_steps} step(s) behind the furthest")
    elif view.ranks:  # in step: which rank is slow is the late-at-collectives mark's to say
        lines.append(f"all ranks at step {view.ranks[0].step}")
    if view.change:
        lines.append(f"changed: {view.change}")
    lines.append(f"suspicion: {view.suspicion}")
    lines += [f"warning: {one_line(w)}" for w in view.warnings]
    return "\n".join(lines)
