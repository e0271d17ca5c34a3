"""Fail-slow: the job ran at one speed and then at a slower one. When, where, and what moved.

Measured from the probes' every-step record over the whole run (diagnose/step/changes.py), not
from the profiled steps: the change may come hours after the profiler window. The finding is the
slowdown that costs most: the job's step (median over ranks) after the change minus before,
per step since the change; its ranks are those whose own work (compute, the DataLoader) moved,
or every rank's communication when no rank's own work did. A direct measurement of two levels,
not a replay: the step graph holds only the profiled steps.
"""
from __future__ import annotations

import time

import numpy as np

from diagnose.analyzers.common import flag_or_pass, not_measurable, passed
from diagnose.context import Context
from diagnose.model import Check, Finding
from diagnose.probedata import has_device_times, job_step_ms
from diagnose.step.changes import Event, run_changes
from diagnose.thresholds import Thresholds
from diagnose.units import rank_ranges

ID = "fail_slow"
TITLE = "Fail-slow: the job got slower during the run"
WHAT = {"compute_ms": "compute", "dataloader_ms": "DataLoader wait", "comm_ms": "communication"}
FIX = {
    "compute_ms": ("The named rank(s) compute slower since the change: look at that host at that time: device "
                   "clocks and throttle reasons (nvidia-smi -q -d PERFORMANCE,TEMPERATURE), power capping, other "
                   "processes on it (a noisy neighbour, a runaway data job), then drain or replace it; the rest of "
                   "the job waits for it at every collective."),
    "dataloader_ms": ("Fetching batches slowed since the change: on every rank at once that is shared "
                      "infrastructure (the storage mount, the data service, the network to it); on one host, its "
                      "local disk or CPU. Check the storage's latency at that time; more DataLoader workers and "
                      "prefetching hide a slower source until it recovers."),
    "comm_ms": ("Communication slowed on every rank with no rank's own work moving: the network or its "
                "configuration (link errors or flaps, congestion from other jobs, NCCL falling back to a slower "
                "transport after a restart); check the fabric's counters and NCCL_DEBUG=INFO at that time."),
}
FIX_WAITED_FOR = ("The others wait longer at every collective for the named rank(s), whose own compute moved "
                  "little: something slows their side of each transfer. Look at that host at that time: another "
                  "process on its cores (the communication threads need CPU too), its CPU load and steal, its "
                  "network interface; then drain or fix it.")


MAX_SIGNALS = 4
"""Signals named in one line: the largest moves."""


def when(wall_s: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(wall_s)) if wall_s else "time unknown"


def describe(e: Event) -> str:
    """One line an on-call engineer reads: when, where, what moved, and what it costs."""
    what = (f"the others wait for it at collectives (communication {e.cause_delta_ms:+.1f} ms per step on rank(s) "
            f"{rank_ranges(e.waiting)}; its own work moved under the floor)" if e.waiting else
            f"{WHAT.get(e.cause, e.cause)} {e.cause_delta_ms:+.1f} ms per step")
    text = (f"from step {e.step} ({when(e.wall_s)}): {e.place}, {what}; the job's step {e.step_before_ms:.1f} -> "
            f"{e.step_after_ms:.1f} ms ({e.lost_ms:+.1f} ms)")
    if e.place == "every rank" and e.lost_ms > 0:
        text += "; no rank leads it: shared infrastructure (storage, network, the input pipeline)"
    if e.signals:
        text += "; with it: " + ", ".join(m.text for m in e.signals[:MAX_SIGNALS])
    return text


def host_timed_pace(r: int, ctx: Context) -> float | None:
    """The device's step (ms) in the profiled steps of rank r when the trace shows r's host ran
    ahead of its device (RankTimeline.device_timed) and r's every-step record has the host's times
    only (probes before device step timing); else None. A host with no sync in its loop ends its
    steps faster than its device runs them until the launch queue is full, then takes the
    device's time: in such a record, filling the queue looks like a slowdown."""
    tl, p = ctx.run.timelines.get(r), ctx.probes.get(r)
    if tl is None or p is None or not tl.device_timed:  # device-timed steps exist: device_steps
        return None
    if has_device_times(p):
        return None  # the record has the device's times: its changes are the job's
    return float(tl.steps.dur.mean()) / 1000


def queue_filled(e: Event, ctx: Context, th: Thresholds) -> float | None:
    """The device's step (ms) when this slowdown is a launch queue filling up, else None: every
    rank of it is host-timed (host_timed_pace) with profiled steps before the change, the level
    before is below the device's step there and the level after is that step, within
    fail_slow_effect (recorded on an H200: 3.0 -> 12.6 ms at step 64, the device at 12.7 ms in
    steps 4-8)."""
    paces = []
    for r in e.ranks:
        pace = host_timed_pace(r, ctx)
        if pace is None or int(ctx.run.timelines[r].steps.step.max()) >= e.step:
            return None
        paces.append(pace)
    if not paces:
        return None
    pace = max(paces)
    if e.step_before_ms < pace * (1 - th.fail_slow_effect) and abs(e.step_after_ms - pace) <= th.fail_slow_effect * pace:
        return pace
    return None


def analyze(ctx: Context, th: Thresholds) -> list[Check]:
    probes = {r: p for r, p in ctx.probes.items() if not p.steps.empty}
    if not probes:
        return [not_measurable(ID, TITLE, "no every-step record: run the job under `diagnose run` (the probes "
                               "log every step of every rank) to see when it got slow")]
    # steps the device did not time are left out of a device-timed rank's series (job_step_ms)
    timed = {r: int(np.isfinite(job_step_ms(p.steps)).sum()) for r, p in probes.items()}
    n = max(timed.values())
    untimed = max(len(p.steps) - timed[r] for r, p in probes.items())
    left_out = f" ({untimed} step(s) the device did not time left out)" if untimed else ""
    if n < 2 * th.fail_slow_min_segment:
        return [not_measurable(ID, TITLE, f"{n} steps recorded{left_out}: a change of speed needs "
                               f"{th.fail_slow_min_segment} steps on either side")]
    events = run_changes(probes, th.fail_slow_min_segment, th.fail_slow_effect)
    slower = [e for e in events if e.lost_ms > 0]
    paced = [(e, queue_filled(e, ctx, th)) for e in slower]
    filled = [(e, pace) for e, pace in paced if pace is not None]
    slower = [e for e, pace in paced if pace is None]
    if not slower and filled:
        e, pace = filled[0]
        return [passed(ID, TITLE, f"the host's steps got longer from step {e.step} ({e.step_before_ms:.1f} -> "
                       f"{e.step_after_ms:.1f} ms), but the device already ran {pace:.1f} ms per step in the "
                       "profiled steps before it: the host ran ahead of the device until its launch queue "
                       "filled; the job did not slow down")]
    if not slower:
        faster = f" ({len(events)} change(s) to a faster step)" if events else ""
        return [passed(ID, TITLE, f"steady over {n} steps on {len(probes)} rank(s): no slowdown of "
                       f"{th.fail_slow_effect:.0%} of the step or more lasting {th.fail_slow_min_segment} steps"
                       f"{faster}{left_out}")]
    e = max(slower, key=lambda x: x.lost_ms)
    share = e.lost_ms / e.step_after_ms if e.step_after_ms > 0 else 0.0
    metrics: dict[str, float | int | str] = {
        "change_step": e.step, "change_time": when(e.wall_s), "cause_component": e.cause, "place": e.place,
        "step_before_ms": round(e.step_before_ms, 3), "step_after_ms": round(e.step_after_ms, 3),
        "cause_delta_ms": round(e.cause_delta_ms, 3), "steps_recorded": n, "slowdowns_found": len(slower),
    }
    for c in e.changes:
        metrics[f"rank{c.rank}_{c.component}_delta_ms"] = round(c.delta_ms, 3)
    # profiled after the change (or the levels do not match the device's): the record cannot
    # tell a queue filling up from a slowdown; say so
    ahead = next((f"rank {r} ran ahead of its device in the profiled steps (the device at {pace:.1f} ms per step)"
                  for r in e.ranks if (pace := host_timed_pace(r, ctx)) is not None), None)
    if ahead:
        metrics["note"] = (f"{ahead} and its record times the host: a change to about the device's step may be its "
                           "launch queue filling up, not a slowdown (probes from this version time the device's "
                           "steps too)")
    if e.signals:
        metrics["signals_moved"] = "; ".join(m.text for m in e.signals[:MAX_SIGNALS])
    elif any(not p.telemetry.empty for p in probes.values()):
        metrics["signals_moved"] = "none of the host and device signals recorded moved with it"
    else:
        metrics["signals_moved"] = "no host or device signals recorded (probes before telemetry, or sampling off)"
    first = min(int(p.steps["step"].min()) for p in probes.values())
    last = max(int(p.steps["step"].max()) for p in probes.values())
    hosts = sorted({str(ctx.probes[r].meta["host"]) for r in e.ranks if ctx.probes[r].meta.get("host")})
    if hosts:
        metrics["hosts"] = ", ".join(hosts)
    # the profiled steps may all lie before the change: the title says which steps the figure is of
    title = f"Fail-slow: the job got slower from step {e.step} ({when(e.wall_s)}), {e.step_before_ms:.1f} -> " \
            f"{e.step_after_ms:.1f} ms per step"
    f = Finding(id=ID, title=title, severity=th.severity(share), recoverable_ms=round(e.lost_ms, 3),
                share_of_step=round(share, 4), ranks=e.ranks, metrics=metrics, events=(), over="run",
                fix=FIX_WAITED_FOR if e.waiting else FIX.get(e.cause, FIX["compute_ms"]),
                confidence="low" if ahead else "high"
                if min(e.step - first, last - e.step + 1) >= 3 * th.fail_slow_min_segment else "medium",
                method="The job's step time (median over ranks, every step from the probes' record) after the "
                       "change minus before it, per step since the change (binary segmentation of each rank's "
                       "step components: diagnose/step/changes.py); its share is of the step since the change.")
    said = describe(e) + (f"; perhaps no slowdown: {ahead}, and the record times the host: its launch queue may "
                          "have filled up" if ahead else "")
    return [flag_or_pass(f, th.fail_slow, th, said)]
