"""The labelled CUDA recordings (tests/fixtures/gpu_h200, README there): each injected cause is
the one the tool ranks first, and each figure it gives is checked against the raw events (or the
probes' raw every-step record) computed here, with json and gzip alone."""
from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from diagnose.cli import main
from diagnose.pipeline import diagnose_paths
from diagnose.probedata import job_step_ms, load_probe_data
from diagnose.step.changes import run_changes

FIX = Path(__file__).parent / "fixtures" / "gpu_h200"
DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH = ("cuda_runtime", "cuda_driver")

_diagnoses: dict = {}


def diagnosis(name: str):
    if name not in _diagnoses:
        _diagnoses[name] = diagnose_paths([FIX / name])
    return _diagnoses[name]


def events(name: str) -> list[dict]:
    return json.load(gzip.open(next((FIX / name).glob("*.pt.trace.json.gz"))))["traceEvents"]


def host_steps(ev: list[dict]) -> list[tuple[float, float]]:
    """The profiled steps' host spans (ProfilerStep#N on the host, not its device-side copy)."""
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in ev
                  if e.get("cat") == "user_annotation" and e.get("name", "").startswith("ProfilerStep#"))


def union(spans) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap(spans, lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans)


def busy(ev) -> list[tuple[float, float]]:
    return union((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") in DEVICE)


def record_steps(name: str) -> dict[int, float]:
    rows = [json.loads(x) for x in (FIX / name / "rank0.steps.jsonl").read_text().splitlines()]
    return {r["step"]: r["dur_ms"] for r in rows}


def steady_host_ms(name: str, lo: int, hi: int) -> float:
    """The host's step once its launch queue is full: the job's real pace (README)."""
    return statistics.median(v for k, v in record_steps(name).items() if lo <= k < hi)


TOP = {"none": None, "tiny-kernels": "launch_overhead", "pageable-copy": "input_stall", "pinned-copy": None,
       "item-sync": "host_sync", "stream-wait": None, "cuda-graph": "launch_overhead", "cuda-graph-hidden": None,
       "host-stall": "launch_overhead", "host-stall-hidden": None, "dataloader": "dataloader_starvation",
       "dataloader_nw4": None, "dataloader_nw4_long": None}


@pytest.mark.parametrize("name", sorted(TOP))
def test_the_injected_cause_ranks_first_and_nothing_else_is_flagged(name):
    d = diagnosis(name)
    assert [f.id for f in d.findings] == ([TOP[name]] if TOP[name] else []), [(f.id, f.recoverable_ms)
                                                                              for f in d.findings]
    assert d.run.device.startswith("cuda")


@pytest.mark.parametrize("name, long, lo", [("none", "none_long", 40), ("dataloader_nw4", "dataloader_nw4_long", 100)])
def test_a_host_running_ahead_is_timed_by_its_device(name, long, lo):
    """The host's profiled steps (2.8-9.1 ms) are how fast it launched; the job ran at the pace its
    host settled to once the launch queue was full (the long twin's record, steps lo..240):
    the step the tool gives is that pace within 5% (the fidelity bar), and it says why."""
    d = diagnosis(name)
    host = statistics.fmean(b - a for a, b in host_steps(events(name))) / 1000
    pace = steady_host_ms(long, lo, 240)
    assert host < 0.5 * pace  # the recording shows what it is labelled with
    assert d.run.mean_step_ms[0] == pytest.approx(pace, rel=0.05)
    assert any("the host ran ahead of the device" in w for w in d.warnings), d.warnings


def test_a_host_that_keeps_up_keeps_its_own_steps():
    """A host-bound run (the DataLoader starves it) is timed by the host's steps, as recorded."""
    spans = host_steps(events("dataloader"))
    d = diagnosis("dataloader")
    assert d.run.mean_step_ms[0] == pytest.approx(statistics.fmean(b - a for a, b in spans) / 1000, abs=1e-3)
    assert not any("ran ahead" in w for w in d.warnings)


def test_a_pageable_copy_is_the_input_stall_and_pinning_it_gives_back_what_was_predicted():
    """input_stall's figure is the pageable copies' time per step (no kernel runs beside them: one
    stream); the step predicted without them is the pinned twin's within 8%: the prediction
    removes the whole copy, and the pinned copy still takes 1.2 ms (6% of its step)."""
    ev = events("pageable-copy")
    spans = host_steps(ev)
    copies = [e for e in ev if e.get("cat") == "gpu_memcpy" and "Pageable" in e["name"] and "HtoD" in e["name"]]
    per_step = sum(overlap([(c["ts"], c["ts"] + c["dur"])], a, b) for c in copies for a, b in spans) / len(spans)
    assert per_step > 8000  # the injected 64 MiB at the host's staging speed
    f = diagnosis("pageable-copy").findings[0]
    assert f.recoverable_ms == pytest.approx(per_step / 1000, rel=0.02)
    predicted = diagnosis("pageable-copy").run.mean_step_ms[0] - f.recoverable_ms
    measured = diagnosis("pinned-copy").run.mean_step_ms[0]
    assert predicted == pytest.approx(measured, rel=0.08)
    assert predicted <= measured  # an upper bound on the saving
    pinned = [e for e in events("pinned-copy") if e.get("cat") == "gpu_memcpy" and e["args"].get("bytes", 0) > 2**25]
    assert all("Pinned" in e["name"] for e in pinned) and statistics.median(e["dur"] for e in pinned) < 2000


def test_item_sync_costs_the_host_work_after_each_sync():
    """After each `.item()` (its device-to-host copy) the device waits until the host has done
    its 3 ms of work and launched the backward: the gap after the copy, from the raw events."""
    ev = events("item-sync")
    dev = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev if e.get("cat") in DEVICE)
    spans = host_steps(ev)
    gaps = []
    for a, b, name in dev:
        if "DtoH" in name and any(lo <= a < hi for lo, hi in spans):
            nxt = min(s for s, _, _ in dev if s > b)
            gaps.append(nxt - b)
    assert len(gaps) == len(spans) and all(3000 <= g <= 4000 for g in gaps), gaps  # 3 ms injected
    f = diagnosis("item-sync").findings[0]
    assert f.recoverable_ms == pytest.approx(statistics.fmean(gaps) / 1000, rel=0.05)
    assert f.metrics["sync_calls_per_step"] == 1.0


def test_dataloader_starvation_is_the_idle_under_next_and_the_fix_gives_what_was_predicted():
    """The device idle under the DataLoader's __next__ spans, per step, from the raw events; the
    step predicted without it is the num_workers=4 twin's pace (its long record, steps 100-240)
    within 5%."""
    ev = events("dataloader")
    spans = host_steps(ev)
    dl = union((e["ts"], e["ts"] + e["dur"]) for e in ev
               if e.get("name", "").startswith("enumerate(DataLoader)") and "__next__" in e["name"])
    b = busy(ev)
    idle = 0.0
    for lo, hi in spans:
        for a, z in dl:
            a, z = max(a, lo), min(z, hi)
            if z > a:
                idle += (z - a) - overlap(b, a, z)
    f = diagnosis("dataloader").findings[0]
    assert f.recoverable_ms == pytest.approx(idle / len(spans) / 1000, rel=0.03)
    predicted = diagnosis("dataloader").run.mean_step_ms[0] - f.recoverable_ms
    assert predicted == pytest.approx(steady_host_ms("dataloader_nw4_long", 100, 240), rel=0.05)


@pytest.mark.parametrize("name, op", [("cuda-graph", "host_bookkeeping"), ("host-stall", "cpu_augment")])
def test_a_host_stall_is_launch_time_even_when_an_input_copy_ends_it(name, op):
    """25 ms of host work per step against 12.7 ms of device work: the device idles about the
    difference and more. Each idle gap inside a step (raw), and the launch check's own figure is
    their sum per step less the part under DataLoader spans (within 5%); a gap that an input copy
    ends counts as launch time when the copy was called after the device went idle (the
    cuda-graph run's gaps all end with one)."""
    ev = events(name)
    spans = host_steps(ev)
    b = busy(ev)
    idle = sum((hi - lo) - overlap(b, lo, hi) for lo, hi in spans) / len(spans) / 1000
    assert idle > 12.0
    f = diagnosis(name).findings[0]
    assert f.metrics["own_estimate_ms"] == pytest.approx(idle, rel=0.05)
    assert f.metrics["long_gaps_ms_per_step"] > 0.9 * f.metrics["own_estimate_ms"]
    assert any(e.get("name") == op for e in ev)  # the host work the recording injected
    # named by the user's own region around the ops that ran in the gaps, not by aten::mm alone
    assert f.metrics["long_gap_host_ops_ms_per_step"].startswith(f"{op} > aten::mm ")


@pytest.mark.parametrize("name", ["cuda-graph-hidden", "host-stall-hidden", "stream-wait", "none", "pinned-copy",
                                  "dataloader_nw4"])
def test_host_work_the_queue_hides_costs_nothing(name):
    """The device is busy nearly all of every step (as the tool times it): its idle is under the
    launch check's 10% of the step, and nothing is flagged."""
    d = diagnosis(name)
    assert all(c.status != "flagged" for c in d.checks)
    assert statistics.fmean(s.other_ms for s in d.breakdown) < 0.10 * d.run.mean_step_ms[0]


def test_nvml_signals_were_recorded_on_the_gpu():
    t = load_probe_data([FIX / "none_long"])[0].telemetry
    assert len(t) >= 5 and (t["sm_clock_mhz"] == 1980.0).all() and t["gpu_power_w"].notna().all()
    assert (t["gpu_throttle"] == 0).all()


def test_a_launch_queue_filling_up_is_no_fail_slow():
    """dataloader_nw4_long's host steps go from ~3 to 12.6 ms at step 64 with nothing changed: the
    profiled steps (before it) show the device at 12.7 ms per step already. fail_slow passes and
    says why; `diagnose changes` (records alone) reports the change with a note."""
    rec = record_steps("dataloader_nw4_long")
    assert statistics.median(rec[k] for k in range(10, 60)) < 6 and steady_host_ms("dataloader_nw4_long", 70, 240) > 12
    (c,) = [c for c in diagnosis("dataloader_nw4_long").checks if c.id == "fail_slow"]
    assert c.status == "passed" and "launch queue filled" in c.reason and "12.7 ms" in c.reason
    out = CliRunner().invoke(main, ["changes", str(FIX / "dataloader_nw4_long")]).output
    assert "from step 6" in out and "note: rank(s) 0 ran on CUDA" in out


def test_a_change_before_the_profiled_steps_on_a_host_ahead_rank_is_low_confidence():
    """none_long was profiled at steps ~252-256, after its queue first filled (step 33): the
    record cannot tell that change from a slowdown, so the finding says so at low confidence."""
    (c,) = [c for c in diagnosis("none_long").checks if c.id == "fail_slow"]
    assert c.finding is not None and c.finding.confidence == "low" and "launch queue" in c.reason
    assert "ran ahead of its device" in c.finding.metrics["note"]


def test_ddp_on_one_nccl_rank_communicates_nothing():
    """The 1-rank DDP job on NCCL: at world size 1 DDP skips its gradient all-reduce (torch 2.11),
    so the trace has no NCCL kernel and the record no collective; the tool reads one process
    that does not communicate, not a communication problem."""
    ev = events("ddp_nccl")
    assert not [e for e in ev if e.get("cat") == "kernel" and "nccl" in e["name"].lower()]
    rows = [json.loads(x) for x in (FIX / "ddp_nccl" / "rank0.steps.jsonl").read_text().splitlines()]
    assert not any(r["collectives"] for r in rows)
    d = diagnosis("ddp_nccl")
    (c,) = [c for c in d.checks if c.id == "exposed_communication"]
    assert c.status == "passed" and "world size 1" in c.reason, c.reason


def test_a_record_with_the_devices_times_is_taken_as_the_jobs():
    """The same host-ahead run, its record carrying the device's step times (as probes from this
    version write them): fail_slow reads the record as the job, with no queue to explain away."""
    import dataclasses

    from diagnose.analyzers.fail_slow import host_timed_pace
    from diagnose.context import build_context
    from tests.conftest import fixture_run

    run = fixture_run(FIX / "dataloader_nw4_long")
    probes = load_probe_data([FIX / "dataloader_nw4_long"])
    assert host_timed_pace(0, build_context(run, probes)) == pytest.approx(diagnosis("dataloader_nw4_long").run
                                                                          .mean_step_ms[0], abs=1e-3)
    timed = {0: dataclasses.replace(probes[0], steps=probes[0].steps.assign(device_ms=12.6))}
    assert host_timed_pace(0, build_context(run, timed)) is None
    assert host_timed_pace(0, build_context(fixture_run(FIX / "dataloader"), load_probe_data([FIX / "dataloader"]))) is None


def test_steps_the_device_did_not_time_are_left_out_not_stood_in_for_by_the_hosts():
    """none_long_timed (probes with device timing, before the closing drain): the job ended with
    its last 25 steps queued, so their device times never came; the host's own times there are
    2-3 ms (the profiler's export had drained the queue). Standing in for the device, they read
    as a change to a faster step at step 275; left out, the run is steady at the device's pace."""
    name = "none_long_timed"
    rows = [json.loads(x) for x in (FIX / name / "rank0.steps.jsonl").read_text().splitlines()]
    timed = {s: ms for r in rows for s, ms in r.get("device_ms", [])}
    untimed = [r["step"] for r in rows if r["step"] > 0 and r["step"] not in timed]
    assert untimed == list(range(275, 300))
    assert statistics.median(r["dur_ms"] for r in rows if 275 <= r["step"] < 285) < 5
    assert statistics.median(v for k, v in timed.items() if 40 <= k < 250) == pytest.approx(12.7, abs=0.1)
    probes = load_probe_data([FIX / name])
    assert run_changes(probes) == ()
    ms = job_step_ms(probes[0].steps)
    assert int(np.isnan(ms).sum()) == 25
    (c,) = [c for c in diagnosis(name).checks if c.id == "fail_slow"]
    assert c.status == "passed" and "faster" not in c.reason, c.reason
    assert "steady over 274 steps" in c.reason and "(25 step(s) the device did not time left out)" in c.reason


def test_at_close_the_probe_times_the_steps_still_queued():
    """none_long_drained: the same run with probes that poll the device at close: the last line carries only the 25 steps the device finished after the host's
    last step, so every step is timed as the device ran it."""
    rows = [json.loads(x) for x in (FIX / "none_long_drained" / "rank0.steps.jsonl").read_text().splitlines()]
    assert set(rows[-1]) == {"device_ms"} and [s for s, _ in rows[-1]["device_ms"]] == list(range(275, 300))
    steps = load_probe_data([FIX / "none_long_drained"])[0].steps
    assert len(steps) == 299 and np.isfinite(job_step_ms(steps)).all()
    assert statistics.median(job_step_ms(steps)) == pytest.approx(12.7, abs=0.1)
