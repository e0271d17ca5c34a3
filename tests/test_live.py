"""`diagnose watch` on recorded light-mode step logs (no job needed)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from diagnose.live import render, snapshot


def _write(d, now, late_s=0.030, steps=30, step_s=0.2):
    for r, late in ((0, 0.0), (1, late_s)):
        rows = [{"step": s, "start": now + s * step_s, "dur_ms": step_s * 1000, "dataloader_ms": 1.0, "comm_ms": 35.0,
                 "collectives": [["ddp_bucket_allreduce", 150.0 + late * 1000, 30.0, 4096, "default"]]}
                for s in range(1, steps)]
        (d / f"rank{r}.steps.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n")


def test_ranks_in_step_show_no_slowest_rank_but_the_late_one(tmp_path):
    now = 1_000_000.0
    _write(tmp_path, now)
    text = render(snapshot(tmp_path, window=20, now=now + 30 * 0.2 + 1))
    assert "slowest rank" not in text and "all ranks at step 29" in text
    assert "<- late at collectives" in text and "straggler: rank 1" in text


def test_a_job_that_stopped_is_said_to_have_stopped(tmp_path):
    now = 1_000_000.0
    _write(tmp_path, now)
    view = snapshot(tmp_path, window=20, now=now + 30 * 0.2 + 45)
    assert view.quiet_s > 40
    assert view.suspicion.startswith("no rank has finished a step for 4")
    assert "stopped or is stuck" in render(view)
    assert "over its last steps: straggler: rank 1" in view.suspicion  # what its last steps showed
    # a few seconds of quiet in a 200 ms-step job is not a stop
    assert "stopped" not in snapshot(tmp_path, window=20, now=now + 30 * 0.2 + 3).suspicion


def test_a_run_that_ended_is_not_called_stuck(tmp_path):
    """`diagnose watch --once` on a finished run (its launcher's lock released) said "the job has
    stopped or is stuck (`diagnose hang` tells which)" under its own "the run has finished" line
    until 2026-12-07."""
    from click.testing import CliRunner

    from diagnose.cli import main
    from diagnose.rundir import LOCK, RunLock

    now = 1_000_000.0
    traces = tmp_path / "traces"
    traces.mkdir()
    _write(traces, now)
    view = snapshot(traces, window=20, now=now + 30 * 0.2 + 45, ended=True)
    assert view.suspicion.startswith("the run has ended; over its last steps: straggler: rank 1")
    RunLock.acquire(tmp_path).release()  # the lock file a finished `diagnose run` leaves, released
    assert (tmp_path / LOCK).exists()
    res = CliRunner().invoke(main, ["watch", str(tmp_path), "--once"])
    assert res.exit_code == 0, res.output
    assert "the run has finished" in res.output and "the run has ended" in res.output
    assert "stuck" not in res.output, res.output


def test_capture_on_a_job_whose_logs_went_stale_returns_at_once(tmp_path):
    import time

    from click.testing import CliRunner

    from diagnose.cli import main

    _write(tmp_path, time.time() - 600)  # no lock file (a probes.watch() run), last step 10 min ago
    t = time.monotonic()
    res = CliRunner().invoke(main, ["capture", str(tmp_path), "--steps", "3", "--timeout", "120"])
    assert time.monotonic() - t < 10
    import re

    m = re.search(r"no rank has finished a step for (\d+) s", res.output)
    assert res.exit_code == 2 and m and int(m.group(1)) >= 590, res.output
    assert not (tmp_path / "capture.json").exists()  # nothing was asked of a job that is gone


def test_hang_on_step_logs_that_still_move_says_not_stuck(tmp_path):
    import time

    from click.testing import CliRunner

    from diagnose.cli import main

    _write(tmp_path, time.time() - 30 * 0.2)  # the last steps finished just now
    res = CliRunner().invoke(main, ["hang", str(tmp_path), "--timeout", "20"])
    assert res.exit_code == 0 and res.output.startswith("NOT STUCK: every rank finished a step"), res.output
    assert not list(tmp_path.glob("hang*"))


def test_watch_marks_a_change_of_speed_over_the_whole_record():
    """tests/fixtures/light_failslow: the rank-1 slowdown from step ~150 is marked live, with the
    same words `diagnose changes` prints; a steady run gets no mark."""
    from diagnose.analyzers.fail_slow import describe
    from diagnose.probedata import load_probe_data
    from diagnose.step.changes import run_changes
    from diagnose.thresholds import DEFAULT

    fix = Path(__file__).parent / "fixtures" / "light_failslow"
    (e,) = run_changes(load_probe_data([fix / "rank"]), DEFAULT.fail_slow_min_segment, DEFAULT.fail_slow_effect)
    view = snapshot(fix / "rank", window=20)
    assert view.change == "since " + describe(e).removeprefix("from ")
    assert view.change.startswith(f"since step {e.step} (") and "rank 1, compute +" in view.change
    assert f"changed: since step {e.step}" in render(view)
    assert snapshot(fix / "steady", window=20).change is None


def _replay(src: Path, dst: Path, upto: int) -> list[tuple[Path, list[str]]]:
    """Copy a recorded run's sidecars and its step lines up to step `upto`; return, per rank
    file, the lines still to come."""
    import json
    import shutil

    rest = []
    for f in sorted(src.iterdir()):
        if f.name.endswith(".steps.jsonl"):
            lines = f.read_text().splitlines(keepends=True)
            early = [x for x in lines if json.loads(x)["step"] < upto]
            (dst / f.name).write_text("".join(early))
            rest.append((dst / f.name, lines[len(early):]))
        else:
            shutil.copy(f, dst / f.name)
    return rest


def test_wait_for_change_returns_the_slowdown_once_it_is_recorded(tmp_path):
    """`capture --on-change`'s wait, on the recorded rank-1 slowdown (from step ~150) replayed as
    a running job would write it: nothing before the change; the change once its steps arrive."""
    import threading

    from diagnose.live import slowdowns, wait_for_change

    fix = Path(__file__).parent / "fixtures" / "light_failslow"
    rest = _replay(fix / "rank", tmp_path, upto=140)
    assert slowdowns(tmp_path) == ()
    assert wait_for_change(tmp_path, timeout_s=0.3, poll_s=0.1) is None

    def write_the_rest():
        time.sleep(0.3)
        for path, lines in rest:
            with path.open("a") as f:
                f.writelines(lines)

    t = threading.Thread(target=write_the_rest)
    t.start()
    e = wait_for_change(tmp_path, timeout_s=30, poll_s=0.1, known=())
    t.join()
    assert e is not None and abs(e.step - 150) <= 3 and e.ranks == (1,) and e.lost_ms > 0
    # a change already in the record when the wait begins is not waited for
    assert wait_for_change(tmp_path, timeout_s=0.2, poll_s=0.1) is None


def test_capture_on_change_without_a_slowdown_captures_nothing(tmp_path):
    from click.testing import CliRunner

    from diagnose.cli import main

    fix = Path(__file__).parent / "fixtures" / "light_failslow"
    _replay(fix / "steady", tmp_path, upto=10**9)
    res = CliRunner().invoke(main, ["capture", str(tmp_path), "--on-change", "0.5"])
    assert res.exit_code == 2 and "no slowdown within 0.5 s: nothing captured" in res.output, res.output
    assert not list(tmp_path.glob("capture*")) and not list(tmp_path.glob("*.control*"))
    res = CliRunner().invoke(main, ["capture", str(tmp_path), "--on-change", "-1"])
    assert res.exit_code == 2 and "--on-change -1" in res.output


def _ended_view(d: Path):
    last = json.loads((d / "rank0.steps.jsonl").read_text().splitlines()[-1])
    return snapshot(d, window=20, now=last["start"] + last["dur_ms"] / 1000 + 1, ended=True)


def test_watch_shows_each_ranks_wait_for_a_core_and_suspects_contention():
    """On call, a host with too few cores (tests/fixtures/cpu_cores_contended_2rank): the step logs
    alone showed a 232 ms step with 1-2% data wait and "nothing stands out"; the probes' telemetry
    says each training thread waits for a core about half the time."""
    fix = Path(__file__).parent / "fixtures"
    view = _ended_view(fix / "cpu_cores_contended_2rank")
    waits = {x.rank: x.cpu_wait for x in view.ranks}
    for r in (0, 1):
        lines = (fix / "cpu_cores_contended_2rank" / f"rank{r}.telemetry.jsonl").read_text().splitlines()
        recent = [json.loads(x)["run_wait"] for x in lines][-10:]
        assert waits[r] == sum(recent) / len(recent)
    assert min(waits.values()) > 0.4
    assert "CPU contention: rank 1's training thread waits for a core 51% of the time" in view.suspicion
    assert " cpu wait " in render(view) and "  51% " in render(view)
    # cores to spare: shown, not suspected; older probes without the samples: "-", not 0%
    calm = _ended_view(fix / "cpu_uneven_sampled_2rank")
    assert all(x.cpu_wait < 0.05 for x in calm.ranks) and "CPU contention" not in calm.suspicion
    old = _ended_view(fix / "cpu_gc_pauses_2rank")
    assert all(x.cpu_wait is None for x in old.ranks)
    assert all(row.split()[5] == "-" for row in render(old).splitlines()[1:3])
