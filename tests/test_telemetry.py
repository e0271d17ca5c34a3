"""Host and device signals sampled by the probes (probes/telemetry.py) and what the fail-slow
analysis makes of them (diagnose/step/changes.py): recorded where this machine has them, missing
(null, never 0) where it does not, and named with a change only when they moved with it."""
from __future__ import annotations

import json
import time
import statistics
from pathlib import Path

import pandas as pd
import pytest

from diagnose.probedata import load_probe_data, load_telemetry
from diagnose.probes.core import Probe, Schedule
from diagnose.probes.telemetry import GPU_SIGNALS, SIGNALS, Sampler
from diagnose.step.changes import SIGNAL_FLOORS, run_changes, signal_moves
from diagnose.thresholds import DEFAULT

FIX = Path(__file__).parent / "fixtures" / "light_failslow"


def test_a_sample_has_every_signal_and_no_gpu_reads_as_missing():
    s = Sampler(write=lambda line: None, current_step=lambda: 7, on_error=lambda exc: None)
    assert s.sample() is None  # the first reading is the baseline of the rates
    t0 = time.process_time()
    while time.process_time() - t0 < 0.05:  # some CPU time between the readings: several of /proc's 10 ms ticks
        sum(i * i for i in range(20_000))
    line = s.sample()
    assert set(SIGNALS) <= set(line) and line["step"] == 7
    json.dumps(line, allow_nan=False)
    if Path("/proc/stat").exists():
        assert 0.0 <= line["cpu_busy"] <= 1.0 and 0.0 <= line["cpu_steal"] <= 1.0
        assert line["rss_mb"] > 10 and line["proc_cpu"] > 0 and line["invol_switches_per_s"] >= 0
        assert line["load1"] >= 0
    # this machine has no NVML device: its signals are missing, not zero
    assert all(line[k] is None for k in GPU_SIGNALS)


def test_the_probe_writes_samples_beside_the_steps_and_they_read_back(tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("DIAGNOSE_TELEMETRY_S", "0.2")
    p = Probe(tmp_path, rank=0, world_size=1, schedule=Schedule(enabled=False))
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        time.sleep(0.01)
        p.on_step()
    p.close()
    lines = [json.loads(x) for x in (tmp_path / "rank0.telemetry.jsonl").read_text().splitlines()]
    assert len(lines) >= 3
    steps = [x["step"] for x in lines]
    assert steps == sorted(steps) and steps[-1] > 0
    (probe,) = load_probe_data([tmp_path]).values()
    t = probe.telemetry
    assert list(t["step"]) == steps and t["rss_mb"].tolist() == [x["rss_mb"] for x in lines]
    assert t["sm_clock_mhz"].isna().all()  # missing stays missing (NaN), never 0


def test_sampling_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("DIAGNOSE_TELEMETRY_S", "0")
    p = Probe(tmp_path, rank=0, world_size=1, schedule=Schedule(enabled=False))
    for _ in range(3):
        p.on_step()
    p.close()
    assert not (tmp_path / "rank0.telemetry.jsonl").exists()


def test_bad_telemetry_lines_are_skipped_with_one_warning(tmp_path):
    f = tmp_path / "rank0.telemetry.jsonl"
    f.write_text('{"wall": 1.0, "step": 3, "cpu_busy": 0.5, "sm_clock_mhz": null}\n'
                 'not json\n[1, 2]\n{"wall": 2.0, "step": 4, "cpu_busy": "lots", "rss_mb": [1]}\n'
                 '{"wall": 3.0, "step": 5, "cpu_bu')  # cut mid-line, as by a killed rank
    t, warnings = load_telemetry(f)
    assert t["step"].tolist() == [3.0, 4.0]
    assert t["cpu_busy"].tolist()[0] == 0.5 and t[["cpu_busy", "rss_mb", "sm_clock_mhz"]].iloc[1].isna().all()
    assert t["sm_clock_mhz"].isna().all()
    assert warnings == ["rank0.telemetry.jsonl: 2 unreadable line(s) skipped"]  # the cut last one is no error


def _probes_with(telemetry: dict[int, pd.DataFrame]):
    import dataclasses

    probes = load_probe_data([FIX / "rank"])
    return {r: dataclasses.replace(p, telemetry=telemetry.get(r, pd.DataFrame())) for r, p in probes.items()}


def _samples(steps, **signals):
    return pd.DataFrame({"wall": [float(s) for s in steps], "step": [float(s) for s in steps], **signals})


def test_a_signal_that_moved_with_the_change_is_named_with_it_and_one_that_did_not_is_not():
    """The recorded rank-1 slowdown (from step ~150) with samples every 10 steps: rank 1's host CPU
    busy goes 40% -> 95% at the change, its resident memory stays put; rank 0 unchanged."""
    (plain,) = run_changes(load_probe_data([FIX / "rank"]), DEFAULT.fail_slow_min_segment, DEFAULT.fail_slow_effect)
    assert plain.signals == ()  # recorded before the probes sampled anything
    steps = list(range(5, 300, 10))
    busy = [0.4 if s < plain.step else 0.95 for s in steps]
    probes = _probes_with({1: _samples(steps, cpu_busy=busy, rss_mb=[900.0] * len(steps)),
                           0: _samples(steps, cpu_busy=[0.4] * len(steps))})
    (e,) = run_changes(probes, DEFAULT.fail_slow_min_segment, DEFAULT.fail_slow_effect)
    assert e.step == plain.step and e.ranks == (1,)
    (m,) = e.signals
    assert (m.signal, m.rank, m.before, m.after) == ("cpu_busy", 1, 0.4, 0.95)
    assert m.text.startswith("rank 1") and m.text.endswith("CPU busy 40% -> 95%")
    from diagnose.analyzers import fail_slow

    assert fail_slow.describe(e).endswith("; with it: " + m.text)


def test_a_move_below_its_floor_or_a_missing_signal_is_no_annotation():
    (plain,) = run_changes(load_probe_data([FIX / "rank"]), DEFAULT.fail_slow_min_segment, DEFAULT.fail_slow_effect)
    steps = list(range(5, 300, 10))
    floor = SIGNAL_FLOORS["cpu_busy"]
    small = [0.5 if s < plain.step else 0.5 + floor * 0.9 for s in steps]
    probes = _probes_with({1: _samples(steps, cpu_busy=small, sm_clock_mhz=[float("nan")] * len(steps))})
    assert signal_moves(probes, (1,), 1, plain.step, 400) == ()
    at = [0.5 if s < plain.step else 0.5 + floor for s in steps]
    probes = _probes_with({1: _samples(steps, cpu_busy=at)})
    (m,) = signal_moves(probes, (1,), 1, plain.step, 400)
    assert m.after - m.before == pytest.approx(floor)


def test_a_change_of_throttle_reasons_is_named():
    (plain,) = run_changes(load_probe_data([FIX / "rank"]), DEFAULT.fail_slow_min_segment, DEFAULT.fail_slow_effect)
    steps = list(range(5, 300, 10))
    bits = [0.0 if s < plain.step else float(0x40 | 0x80) for s in steps]
    (m,) = signal_moves(_probes_with({1: _samples(steps, gpu_throttle=bits)}), (1,), 1, plain.step, 400)
    assert m.text.endswith("throttle reasons none -> thermal (software), thermal (hardware)")


def test_the_fail_slow_finding_says_when_no_signal_was_recorded():
    from diagnose.analyzers import fail_slow
    from diagnose.context import build_context
    from tests.conftest import fixture_run

    run = fixture_run(Path(__file__).parent / "fixtures" / "cpu_checkpoint_2rank")
    (c,) = fail_slow.analyze(build_context(run, load_probe_data([FIX / "rank"])), DEFAULT)
    assert c.finding.metrics["signals_moved"].startswith("no host or device signals recorded")
    steps = list(range(5, 300, 10))
    flat = _probes_with({1: _samples(steps, cpu_busy=[0.4] * len(steps))})
    (c,) = fail_slow.analyze(build_context(run, flat), DEFAULT)
    assert c.finding.metrics["signals_moved"] == "none of the host and device signals recorded moved with it"


def test_a_recorded_cpu_hog_on_one_ranks_core_is_annotated_with_that_cores_load():
    """tests/fixtures/light_failslow/hog (README): the change and its annotation against the raw
    telemetry lines: rank 1's core busy share, median before and after the change."""
    (e,) = run_changes(load_probe_data([FIX / "hog"]), DEFAULT.fail_slow_min_segment, DEFAULT.fail_slow_effect)
    assert abs(e.step - 120) <= 3 and e.cause == "compute_ms" and e.ranks == (1,)
    rows = [json.loads(x) for x in (FIX / "hog" / "rank1.telemetry.jsonl").read_text().splitlines()]
    before = statistics.median(x["cpu_busy"] for x in rows if x["step"] < e.step)
    after = statistics.median(x["cpu_busy"] for x in rows if x["step"] > e.step)
    busy = [m for m in e.signals if m.signal == "cpu_busy"]
    assert [m.rank for m in busy] == [1]
    assert (busy[0].before, busy[0].after) == (pytest.approx(before), pytest.approx(after))
    assert before < 0.7 and after > 0.95
