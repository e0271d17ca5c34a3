"""Fail-slow on real 2-rank gloo jobs under `diagnose run`: a fault that starts mid-run is found
within a few steps of its start, with the right component and rank(s); a steady run of the same
length reports none."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from diagnose.step.changes import BLOCK
from tests.conftest import EXAMPLE, ROOT, _free_port, run_dir

pytestmark = pytest.mark.e2e
pytest.importorskip("torch")

# a ~11 ms CPU step (4 ms on CI's machine) that drifts by more than 20% for minutes on a shared 2-core
# host, under a 40 ms wait that stands for the device: 180 steps take about 15 s with the startup.
# The fault from step 90: 90 steps either side, 4.5 times the locator's shortest segment (20)
# (240 steps from 120 until 2026-12-07: the e2e phase had grown to 11.7 of .ci/run's 15 minutes)
JOB = ("--steps", "180", "--hidden", "256", "--repeat", "2", "--batch-size", "64", "--device-ms", "40")
FROM = 90
# how near FROM a change must be found: the locator places it on the first step at the new level
# within a block either side of its search (diagnose/step/changes.py), and a slow phase of a shared
# host right before the fault is that new level to it (CI, 2026-12-07: the hog's change at step
# 116, its four steps before it slow)
NEAR = BLOCK


def launch(out, *fault, schedule="off", job=JOB, env=None):
    cmd = [sys.executable, "-m", "diagnose.cli", "run", "--out", str(out), "--schedule", schedule, "--",
           sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           str(EXAMPLE), *job, *fault]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def changes(out) -> str:
    res = subprocess.run([sys.executable, "-m", "diagnose.cli", "changes", str(out)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_one_rank_slowed_mid_run_is_the_top_finding(tmp_path):
    """Profiled early (steps 4-8, before the fault): the other checks see a healthy window; the
    every-step record shows rank 1 computing 20 ms more per step from step FROM."""
    launch(tmp_path, "--slow-from-step", str(FROM), "--slow-rank", "1", "--slow-compute-ms", "20", schedule="2,2,5")
    d = json.loads((run_dir(tmp_path) / "diagnosis.json").read_text())
    f = d["findings"][0]
    assert f["id"] == "fail_slow" and f["ranks"] == [1], [(x["id"], x["recoverable_ms"]) for x in d["findings"]]
    m = f["metrics"]
    assert abs(m["change_step"] - FROM) <= NEAR and m["cause_component"] == "compute_ms" and m["place"] == "rank 1"
    assert 15 < m["cause_delta_ms"] < 40 and f["recoverable_ms"] > 10, m
    out = changes(tmp_path)
    m = re.search(r"from step (\d+) .*: rank 1, compute \+", out)
    assert m and abs(int(m.group(1)) - FROM) <= NEAR, out


def test_a_slower_input_pipeline_on_every_rank(tmp_path):
    launch(tmp_path, "--slow-from-step", str(FROM), "--slow-loader-ms", "0.3")
    out = changes(tmp_path)
    step = int(re.search(r"from step (\d+) .*: every rank, DataLoader wait \+", out).group(1))
    assert abs(step - FROM) <= NEAR, out
    assert "shared infrastructure" in out and out.count("from step") == 1, out


def test_a_steady_run_reports_no_change(tmp_path):
    launch(tmp_path)
    assert "none: the job ran at one speed" in changes(tmp_path)


# rank 1's CPU part must be a large share of its step for a hog sharing its core to show: a
# larger model, a shorter device wait. At --hidden 512 a faster host (2026-12-04: 30 ms steps, not
# 46) put most of the hog's cost in rank 1's gloo transfer, below the compute floor; at 1024 rank
# 1's compute went 44.8 -> 68.4 ms per step
HOG_JOB = ("--steps", "180", "--hidden", "1024", "--repeat", "2", "--batch-size", "64", "--device-ms", "20")


def test_a_cpu_hog_on_one_ranks_core_is_found_and_the_cpu_load_moved_with_it(tmp_path):
    """Each rank pinned to its own core; from step FROM a busy-looping process shares rank 1's
    core. The change is rank 1's compute, and the telemetry of its core says why."""
    launch(tmp_path, "--pin-cores", "--cpu-hog", "--slow-from-step", str(FROM), "--slow-rank", "1", job=HOG_JOB,
           env={"DIAGNOSE_TELEMETRY_S": "0.5"})
    out = changes(tmp_path)
    # the hog's change among every change listed: a slow phase of this shared 2-core host before
    # the fault can be a real change of its own, listed first (CI, 2026-12-07: rank 1's compute at
    # step 108, then the hog's at 120 with its core's CPU busy)
    found = [(int(s), w) for s, w in re.findall(r"from step (\d+) .*: rank 1, compute \+.*; with it: (.*)", out)]
    assert any(abs(s - FROM) <= NEAR and "rank 1" in w and "CPU busy" in w for s, w in found), out


def test_capture_on_change_profiles_the_steps_after_the_slowdown(tmp_path):
    """`diagnose capture --on-change`: asked before the fault starts, it waits for the job to get
    slower (seen once 20 steps at the new speed are recorded), then profiles the next steps; the
    captured window shows the slowed rank."""
    from tests.test_e2e_oncall import profiler_steps, start_job, wait_for_steps

    # the capture fires ~20-50 steps after the change (20 at the new speed, then a poll of 2 s) and
    # profiles 4: 250 steps leave ~100 to spare and ~20 s less of CI than 420 did (15 min: .ci/run)
    job = start_job(tmp_path, *JOB[2:], "--steps", "250", "--slow-from-step", str(FROM), "--slow-rank", "1",
                    "--slow-compute-ms", "40")
    try:
        wait_for_steps(tmp_path, 30)
        res = subprocess.run([sys.executable, "-m", "diagnose.cli", "capture", str(tmp_path), "--on-change", "120",
                              "--steps", "4", "--timeout", "90"], capture_output=True, text=True, timeout=300,
                             cwd=ROOT)
        assert res.returncode == 0, res.stderr[-3000:]
        m = re.search(r"change: from step (\d+) .*: rank 1, compute \+", res.stderr)
        assert m and abs(int(m.group(1)) - FROM) <= NEAR, res.stderr
        cap = next((run_dir(tmp_path) / "traces").glob("capture-*"))
        s0, s1 = (profiler_steps(cap / f"rank{r}.pt.trace.json.gz") for r in (0, 1))
        assert s0 == s1 and len(s0) == 4 and min(s0) > FROM + 20, s0
        d = json.loads((cap / "diagnosis.json").read_text())
        assert d["findings"] and d["findings"][0]["ranks"] == [1], [(f["id"], f["ranks"]) for f in d["findings"]]
    finally:
        out, err = job.communicate(timeout=240)
    assert job.returncode == 0, err[-3000:]
