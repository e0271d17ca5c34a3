"""On-call: capture a running job on demand, a stuck rank, and the live view."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time

import pytest

from diagnose.live import render, snapshot
from diagnose.oncall import live_tails, progress
from diagnose.rundir import run_dirs
from tests.conftest import EXAMPLE, ROOT, _free_port, run_dir

pytestmark = pytest.mark.e2e
pytest.importorskip("torch")


def start_job(out, *args, schedule="off", run_flags=()):
    cmd = [sys.executable, "-m", "diagnose.cli", "run", "--out", str(out), "--schedule", schedule, *run_flags, "--",
           sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           str(EXAMPLE), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)


def wait_for_steps(out, n, timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = run_dirs(out)  # `diagnose run` writes into a fresh OUT/<time>/
        d = runs[0] / "traces" if runs else out / "traces"
        if d.exists() and len(live_tails(d)) == 2 and all(len(t) >= n for t in live_tails(d).values()):
            return
        time.sleep(0.5)
    raise AssertionError("job did not start stepping")


def cli(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "diagnose.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def profiler_steps(path):
    ev = json.load(gzip.open(path))["traceEvents"]
    return sorted(int(e["name"].split("#")[1]) for e in ev if e.get("name", "").startswith("ProfilerStep#"))


def test_capture_a_running_job(tmp_path):
    steps = 45  # about 14 s at ~300 ms per step (the straggler sleeps 150 ms of them): the capture
    # of 4 steps takes a few seconds once asked (after step 5: done by step ~15), so the job is still
    # running when it ends (70 steps until 2026-12-07: .ci/run's 15 minutes)
    job = start_job(tmp_path, "--pathology", "straggler", "--steps", str(steps))
    try:
        wait_for_steps(tmp_path, 5)
        watched = cli("watch", str(tmp_path), "--once")
        assert watched.returncode == 0 and "rank" in watched.stdout
        res = cli("capture", str(tmp_path), "--steps", "4", "--timeout", "90")
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.startswith("VERDICT: Straggler"), res.stdout
        cap = next((run_dir(tmp_path) / "traces").glob("capture-*"))
        d = json.loads((cap / "diagnosis.json").read_text())
        assert d["findings"][0]["id"] == "straggler" and d["findings"][0]["ranks"] == [1]
        s0, s1 = (profiler_steps(cap / f"rank{r}.pt.trace.json.gz") for r in (0, 1))
        assert s0 == s1 and len(s0) == 4 and d["run"]["steps_analysed"] == 4
        # the run's own sidecars are read beside the capture: no check asks for `diagnose run`
        said = {c["id"]: c["reason"] for c in d["checks"]}
        assert not any("run under `diagnose run`" in r for r in said.values()), said
    finally:
        out, err = job.communicate(timeout=240)
    assert job.returncode == 0, err[-3000:]
    # the job ran every step it was asked for, capture or not
    for r in (0, 1):
        lines = (run_dir(tmp_path) / "traces" / f"rank{r}.steps.jsonl").read_text().splitlines()
        assert len(lines) == steps


def test_stuck_rank_is_reported_not_waited_for(tmp_path):
    # ranks train independently (no gradient sync), so rank 0 can finish the capture alone
    job = start_job(tmp_path, "--no-ddp", "--steps", "400", "--batch-size", "32",
                    "--stall-rank", "1", "--stall-at-step", "12", "--stall-s", "45")
    try:
        wait_for_steps(tmp_path, 12)
        t = time.monotonic()
        res = cli("capture", str(tmp_path), "--steps", "3", "--timeout", "10")  # rank 0's 3 steps: ~1 s
        assert time.monotonic() - t < 60
        assert "rank 1 did not reach step" in res.stderr, res.stderr
        cap = next((run_dir(tmp_path) / "traces").glob("capture-*"))
        assert (cap / "rank0.pt.trace.json.gz").exists() and not (cap / "rank1.pt.trace.json.gz").exists()
        d = json.loads((cap / "diagnosis.json").read_text())
        assert d["run"]["ranks_missing"] == [1]
    finally:
        os.killpg(job.pid, 15)  # torchrun passes SIGTERM on to its workers
        try:
            job.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, 9)
            job.communicate()


def test_watch_renders_recorded_light_mode_files(tmp_path):
    now = 1_000_000.0
    for r, late in ((0, 0.0), (1, 0.030)):
        rows = [{"step": s, "start": now + s * 0.2, "dur_ms": 200.0, "dataloader_ms": 1.0,
                 "comm_ms": 40.0 if r == 0 else 5.0,
                 "collectives": [["ddp_bucket_allreduce", 150.0 + late * 1000, 30.0, 4096, "default"]]}
                for s in range(1, 30)]
        (tmp_path / f"rank{r}.steps.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    view = snapshot(tmp_path, window=20, now=now + 30 * 0.2 + 1)
    assert view.late_rank == 1 and 25 < view.late_ms < 35
    text = render(view)
    assert "straggler: rank 1" in text and "provisional" in text
    res = cli("watch", str(tmp_path), "--once")
    assert res.returncode == 0 and "straggler: rank 1" in res.stdout


def test_hang_names_the_rank_that_did_not_enter_the_collective(tmp_path):
    # DDP: rank 1 sleeps before step 150's forward, so rank 0 waits inside the all-reduce of step 150
    job = start_job(tmp_path, "--steps", "400", "--batch-size", "32",
                    "--stall-rank", "1", "--stall-at-step", "150", "--stall-s", "45", run_flags=["--flight-recorder"])
    try:
        wait_for_steps(tmp_path, 3)
        # still stepping: not stuck, said at once, and nothing is asked of the job
        res = cli("hang", str(tmp_path), "--timeout", "20")
        assert res.returncode == 0 and res.stdout.startswith("NOT STUCK: every rank finished a step"), res.stdout
        assert not list((run_dir(tmp_path) / "traces").glob("hang-*"))
        wait_for_steps(tmp_path, 150)
        # rank 0 is now blocked in the collective, rank 1 asleep before it; `hang` asks for dumps
        # once the step logs show no progress (a few seconds)
        pdir = run_dir(tmp_path) / "traces"
        deadline = time.monotonic() + 30
        while progress(live_tails(pdir)).moving([]):
            assert time.monotonic() < deadline, "the stalled job kept finishing steps"
            time.sleep(0.5)
        t = time.monotonic()
        res = cli("hang", str(tmp_path), "--timeout", "20")
        assert time.monotonic() - t < 30
        assert res.returncode == 0, res.stderr
        assert res.stdout.startswith("HANG HINT: rank(s) 1 did not enter"), res.stdout
        assert "rank(s) 0 entered collective #" in res.stdout and "rank 1: last entered #" in res.stdout
        dumps = list((run_dir(tmp_path) / "traces").glob("hang-*/rank*.fr.json"))
        assert sorted(p.name for p in dumps) == ["rank0.fr.json", "rank1.fr.json"]
        # the same dumps, read offline, give the same verdict
        offline = cli("hang", str(dumps[0].parent))
        assert offline.stdout.splitlines()[0] == res.stdout.splitlines()[0]
    finally:
        os.killpg(job.pid, 15)
        try:
            job.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, 9)
            job.communicate()
