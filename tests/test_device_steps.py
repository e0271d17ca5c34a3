"""Steps timed as the device ran them (probes/device_steps.py, diagnose/probedata.py job_step_ms):
the pairing of step events, the record's `device_ms`, and a host that ran ahead of its device
read as no slowdown. The CUDA calls themselves ran on an H200 (tests/fixtures/gpu_h200:
none_long_timed, none_long_drained, checked in tests/test_gpu_fixtures.py): what runs here is
everything around them, on plain numbers."""
from __future__ import annotations

import json
import time
from collections import deque

import numpy as np
import pytest

from diagnose.probedata import job_step_ms, load_probe_data
from diagnose.probes.device_steps import DeviceSteps, drain, pair_completed
from diagnose.step.changes import host_timed_gpu_ranks, run_changes


class Stamp:
    """A point on the device's clock that has or has not run yet (what a CUDA event answers)."""

    def __init__(self, t_ms: float, ran: bool = True) -> None:
        self.t_ms, self.ran = t_ms, ran

    def elapsed_time(self, other: "Stamp") -> float:
        return other.t_ms - self.t_ms


def test_a_step_is_timed_once_both_of_its_bounds_have_run():
    pending = deque([(1, Stamp(0.0)), (2, Stamp(12.5)), (3, Stamp(25.25)), (4, Stamp(40.0, ran=False))])
    got = pair_completed(pending, lambda s: s.ran)
    # step 2 ran from step 1's end to its own; step 4's end has not run: step 4 waits
    assert got == [[2, 12.5], [3, 12.75]]
    assert [s for s, _ in pending] == [3, 4]
    pending[1][1].ran = True
    assert pair_completed(pending, lambda s: s.ran) == [[4, 14.75]] and len(pending) == 1
    assert pair_completed(deque(), lambda s: True) == []


def test_no_cuda_no_events():
    """Off CUDA (no torch, or CUDA never initialised) nothing is recorded and nothing touches CUDA."""
    d = DeviceSteps()
    d.mark(1)
    d.mark(2)
    assert d.resolved() == []


def _write(tmp_path, rows, device="cuda"):
    (tmp_path / "rank0.steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rank0.probe.json").write_text(json.dumps({"meta": {"rank": 0, "world_size": 1, "device": device,
                                                                    "host": "h"}}))


def _rows(n, host_ms, device_ms):
    rows = []
    for s in range(1, n + 1):
        r = {"step": s, "start": 1000.0 + s * 0.0125, "dur_ms": host_ms(s), "dataloader_ms": 0.1, "comm_ms": 0.0,
             "collectives": []}
        if s > 3:  # a step's device time arrives three steps later, as the device is behind
            r["device_ms"] = [[s - 3, device_ms(s - 3)]]
        rows.append(r)
    return rows


def test_a_host_running_ahead_then_throttled_is_no_slowdown_when_the_device_is_timed(tmp_path):
    """The record as a CUDA rank with no sync in its loop writes it: host steps of 2 ms until its
    launch queue fills at step 150, then 12.5 ms; the device ran 12.5 ms a step throughout."""
    _write(tmp_path, _rows(300, lambda s: 2.0 if s < 150 else 12.5, lambda s: 12.5 + 0.01 * (s % 3)))
    p = load_probe_data([tmp_path])
    steps = p[0].steps
    assert np.isfinite(steps["device_ms"]).sum() == 297 and steps["device_ms"].iloc[:297].between(12.5, 12.53).all()
    # the last three steps' device times never came: left out, the host's times do not stand in
    assert np.isnan(job_step_ms(steps)[-3:]).all() and np.isfinite(job_step_ms(steps)[:-3]).all()
    assert run_changes(p) == () and host_timed_gpu_ranks(p) == []
    # the same record without the device's times reads as a slowdown at step 150, and says why it may not be
    rows = _rows(300, lambda s: 2.0 if s < 150 else 12.5, lambda s: 12.5)
    for r in rows:
        r.pop("device_ms", None)
    _write(tmp_path, rows)
    p = load_probe_data([tmp_path])
    (e,) = run_changes(p)
    assert abs(e.step - 150) <= 3 and host_timed_gpu_ranks(p) == [0]


def test_a_real_slowdown_on_the_device_is_still_found(tmp_path):
    """The device itself slows from step 150 (12.5 -> 20 ms): found, from its own times."""
    _write(tmp_path, _rows(300, lambda s: 2.0, lambda s: 12.5 if s < 150 else 20.0))
    (e,) = run_changes(load_probe_data([tmp_path]))
    assert abs(e.step - 150) <= 3 and e.step_after_ms - e.step_before_ms == pytest.approx(7.5, abs=0.05)


def test_malformed_device_entries_are_left_out(tmp_path):
    rows = _rows(30, lambda s: 5.0, lambda s: 6.0)
    rows[10]["device_ms"] = "x"
    rows[11]["device_ms"] = [[True, 3.0], [-1, 3.0], [5, -2.0], [5, "a"], [9], None]
    _write(tmp_path, rows)
    steps = load_probe_data([tmp_path])[0].steps
    timed = steps.set_index("step")["device_ms"]
    assert np.isnan(timed[8]) and np.isnan(timed[9])  # their entries were in the malformed records
    assert timed[7] == 6.0 and timed.notna().sum() == 25



def test_at_close_the_steps_still_queued_are_polled_for_a_bounded_time():
    """The device finishes the queued steps while the probe polls (each poll runs one more):
    all come back; a device that never finishes costs the timeout, not a hang."""
    stamps = [Stamp(12.5 * i, ran=i < 2) for i in range(6)]
    pending = deque((i + 1, s) for i, s in enumerate(stamps))

    def done(s):
        if not s.ran:  # one more event runs with each look at a pending one
            s.ran = True
            return False
        return True

    assert drain(pending, done, timeout_s=5.0, poll_s=0.0) == [[2, 12.5], [3, 12.5], [4, 12.5], [5, 12.5],
                                                                [6, 12.5]]
    assert len(pending) == 1
    stuck = deque([(1, Stamp(0.0)), (2, Stamp(5.0, ran=False))])
    t0 = time.monotonic()
    assert drain(stuck, lambda s: s.ran, timeout_s=0.05) == [] and len(stuck) == 2
    assert time.monotonic() - t0 < 2.0


def test_the_closing_line_of_device_times_counts(tmp_path):
    """The probe's last line carries only `device_ms` (the steps drained at close): read as the
    device times of the steps it names, no step of its own."""
    rows = _rows(30, lambda s: 2.0, lambda s: 12.5)
    rows.append({"device_ms": [[28, 12.5], [29, 12.5], [30, 12.5]]})
    _write(tmp_path, rows)
    steps = load_probe_data([tmp_path])[0].steps
    assert len(steps) == 30 and np.isfinite(steps["device_ms"]).all()
