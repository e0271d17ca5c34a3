"""Run directories, signals and the files the commands read (issue 13, command side).

Real files, FIFOs, processes and jobs: each `diagnose run` / `demo` writes into a fresh run
directory under a lock; Ctrl-C reaches the job and leaves nothing behind; sidecars and control
files that are FIFOs, nesting bombs, huge or absurd give one line, never a hang or a traceback.
"""
from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from diagnose.cli import main
from diagnose.errors import DiagnoseError
from diagnose.launch import exit_status, script_args, with_batch
from diagnose.oncall import probe_dir
from diagnose.probedata import MAX_STEP_LINE_BYTES, MAX_STEP_LINES, load_probe_data, load_steps
from diagnose.rundir import RunLock, create_run_dir, newest_run, run_dirs, run_is_live
from tests.conftest import EXAMPLE, ROOT, _free_port, run_dir
from tests.test_straggler import write_pair

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def cli(*args: str, timeout: float = 60, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diagnose.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=ENV)


def step_lines(n: int, start: int = 1) -> str:
    rows = [{"step": s, "start": 1_000_000.0 + s * 0.2, "dur_ms": 200.0, "dataloader_ms": 1.0, "comm_ms": 5.0,
             "collectives": [["ddp_bucket_allreduce", 150.0, 30.0, 4096, "default"]]} for s in range(start, start + n)]
    return "".join(json.dumps(r) + "\n" for r in rows)


def one_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1, text
    return lines[0]


# ---- run directories and their lock ---------------------------------------------------------

def test_run_dirs_are_fresh_even_within_one_second(tmp_path):
    now = time.mktime((2026, 12, 1, 15, 30, 0, 0, 0, -1))
    made: list[Path] = []
    threads = [threading.Thread(target=lambda: made.append(create_run_dir(tmp_path, now))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    names = sorted(p.name for p in made)
    assert len(set(names)) == 8 and "20261201-153000" in names and "20261201-153000-8" in names
    assert all((p / "traces").is_dir() for p in made)
    # newest by start time, then by suffix (-10 after -9, not after -1)
    for i in range(9, 11):
        create_run_dir(tmp_path, now)
    assert run_dirs(tmp_path)[-1].name == "20261201-153000-10"


def test_lock_refuses_a_second_writer_and_tells_live_from_finished(tmp_path):
    run = create_run_dir(tmp_path)
    assert run_is_live(run) is None  # no lock file: not (yet) a run `diagnose run` holds
    with RunLock.acquire(run):
        assert run_is_live(run) is True and run_is_live(run / "traces") is True
        with pytest.raises(DiagnoseError, match="another `diagnose run` is writing"):
            RunLock.acquire(run)
    assert run_is_live(run) is False
    (tmp_path / "fifo-run").mkdir()
    os.mkfifo(tmp_path / "fifo-run" / ".lock")
    assert run_is_live(tmp_path / "fifo-run") is None  # a planted FIFO neither blocks nor counts


def test_on_call_commands_take_the_parent_and_pick_the_newest_run_with_probe_files(tmp_path):
    old, new, empty = (create_run_dir(tmp_path, t) for t in (1e9, 2e9, 3e9))
    for run in (old, new):
        (run / "traces" / "rank0.steps.jsonl").write_text(step_lines(3))
    notes: list[str] = []
    assert probe_dir(tmp_path, notes.append) == new / "traces"  # `empty` wrote nothing: skipped
    assert notes == [f"diagnose: using the newest run in {tmp_path}: {new.name}"]
    assert probe_dir(old) == old / "traces" and newest_run(tmp_path, lambda r: True) == empty


def test_missing_script_never_prints_a_verdict_from_an_earlier_run(tmp_path):
    # an earlier run in the new layout, and one in the old (traces straight in --out), both analysed
    earlier = tmp_path / "20200101-000000"
    for d in (earlier / "traces", tmp_path / "traces"):
        d.mkdir(parents=True)
        write_pair(d, [1] * 6, late_us=2_000.0)
        assert cli("analyze", str(d), "--out", str(d.parent)).returncode == 0
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    res = cli("run", "--out", str(tmp_path), "--", sys.executable, "nonexistent.py", cwd=tmp_path)
    assert res.returncode == 2, res.stderr  # python's own exit code for a missing script
    assert "VERDICT" not in res.stdout + res.stderr
    assert "diagnose: the job wrote no traces (exit 2); nothing to analyse" in res.stderr
    assert f"diagnose: run directory {tmp_path}/" in res.stderr
    assert {p: p.read_bytes() for p in before} == before  # the earlier reports untouched


@pytest.mark.e2e
def test_a_job_killed_by_sigkill_exits_137(tmp_path):
    res = cli("run", "--out", str(tmp_path), "--", sys.executable, "-c",
              "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert res.returncode == 137, res.stderr
    assert "the job wrote no traces (exit 137)" in res.stderr
    assert exit_status(-15) == 143 and exit_status(3) == 3


@pytest.mark.e2e
def test_the_job_shares_the_lock_and_capture_refuses_a_finished_run(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-m", "diagnose.cli", "run", "--out", str(tmp_path), "--",
                                 sys.executable, "-c", "import time; time.sleep(4)"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    deadline = time.monotonic() + 30
    while not (runs := run_dirs(tmp_path)) or run_is_live(runs[0]) is not True:
        assert time.monotonic() < deadline, "the run directory never became live"
        time.sleep(0.05)
    time.sleep(1.0)  # the job is sleeping now
    launcher.kill()  # the launcher dies; its job still runs and still holds the lock
    launcher.wait()
    assert run_is_live(runs[0]) is True
    while run_is_live(runs[0]):
        assert time.monotonic() < deadline, "the lock outlived the job"
        time.sleep(0.1)
    (runs[0] / "traces" / "rank0.steps.jsonl").write_text(step_lines(5))
    t = time.monotonic()
    res = CliRunner().invoke(main, ["capture", str(tmp_path), "--steps", "2", "--timeout", "60"])
    assert time.monotonic() - t < 10.0  # at once: the bug waited the whole --timeout (60 s here)
    assert res.exit_code == 2 and "the run has finished" in res.output.splitlines()[-1], res.output


# ---- real 2-rank jobs: demo twice, Ctrl-C ------------------------------------------------------

@pytest.mark.e2e
def test_demo_twice_in_one_directory(tmp_path):
    pytest.importorskip("torch")
    for attempt in (1, 2):
        res = cli("demo", "--out", "d", timeout=240, cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.startswith("VERDICT:"), res.stdout
    runs = run_dirs(tmp_path / "d")
    assert len(runs) == 2 and all((r / "report.html").exists() and (r / "diagnosis.json").exists() for r in runs)
    for r in runs:  # each run analysed its own two ranks, nothing mixed in
        assert json.loads((r / "diagnosis.json").read_text())["run"]["ranks_found"] == [0, 1]


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id), from /proc."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(d.name)] = (int(fields[1]), int(fields[3]))
    return out


def _descendants(pid: int) -> set[int]:
    table = _proc_table()
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, (ppid, _) in table.items() if ppid == p}
        todo += list(kids - found)
        found |= kids
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.e2e
def test_ctrl_c_stops_every_job_process_and_analyses_what_was_written(tmp_path):
    pytest.importorskip("torch")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "diagnose.cli", "run", "--out", str(tmp_path), "--schedule", "1,1,2", "--",
         sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
         str(EXAMPLE), "--steps", "5000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)
    try:
        deadline = time.monotonic() + 90
        steps = []
        while len(steps) < 2 or steps[-1] <= steps[0]:  # steps advancing on rank 0, past the traced ones
            if launcher.poll() is not None:  # say why: a red test must name what broke
                err = launcher.stderr.read()
                # the rank's own last words (an abort's reason: a C++ exception, glibc's heap check)
                # come before torchrun's summary: both
                why = [ln.strip() for ln in err.splitlines()
                       if any(k in ln for k in ("terminate called", "what():", "Error: ", "Exception: ",
                                                "malloc", "free(", "corrupted"))][:8]
                pytest.fail(f"the launcher exited {launcher.returncode} before stepping: {why} ... {err[-1500:]}")
            assert time.monotonic() < deadline, "the job did not start stepping"
            time.sleep(0.5)
            log = next(iter(tmp_path.glob("*/traces/rank0.steps.jsonl")), None)
            n = len(log.read_text().splitlines()) if log else 0
            steps = [*steps, n] if n >= 8 else []
        job = _descendants(launcher.pid)
        assert len(job) >= 3, job  # torchrun and its two workers
        os.kill(launcher.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends the foreground process
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    gone_by = time.monotonic() + 5
    while any(_alive(p) for p in job) and time.monotonic() < gone_by:
        time.sleep(0.1)
    assert not [p for p in job if _alive(p)], "job processes left running"
    # torchrun turns SIGINT into exit 1 after stopping its workers; a job that dies of it exits 130
    assert launcher.returncode in (1, 130), err[-3000:]
    assert (run_dir(tmp_path) / "diagnosis.json").exists(), err[-3000:]
    assert out.startswith("VERDICT:"), out


# ---- sidecars and control files ----------------------------------------------------------------

def test_fifo_sidecars_do_not_hang_analyze_or_watch(tmp_path):
    write_pair(tmp_path, [1] * 6, late_us=2_000.0)
    os.mkfifo(tmp_path / "rank0.steps.jsonl")
    os.mkfifo(tmp_path / "rank0.probe.json")
    (tmp_path / "rank1.steps.jsonl").write_text(step_lines(10))
    res = cli("analyze", str(tmp_path), "--out", str(tmp_path / "out"), timeout=60)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "rank0.steps.jsonl: a FIFO, not a regular file" in res.stdout
    assert "rank0.probe.json: a FIFO, not a regular file" in res.stdout
    res = cli("watch", str(tmp_path), "--once", timeout=30)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    warn = [ln for ln in res.stdout.splitlines() if ln.startswith("warning:")]
    assert len(warn) == 1 and "rank0.steps.jsonl: a FIFO" in warn[0], res.stdout
    assert "   1      10" in res.stdout  # rank 1's view is still there


def test_nesting_bombs_in_sidecars_are_warnings(tmp_path):
    write_pair(tmp_path, [1] * 6, late_us=2_000.0)
    (tmp_path / "rank0.probe.json").write_bytes(b'{"meta": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    deep = b'{"step": 3, "start": 1, "dur_ms": 1, "collectives": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    (tmp_path / "rank0.steps.jsonl").write_bytes(step_lines(2).encode() + deep + step_lines(2, start=4).encode())
    # within the parser's depth limit, too deep for recursive code that writes diagnosis.json
    (tmp_path / "rank1.probe.json").write_bytes(b'{"world_size": 2, "meta": {"x": ' + b"[" * 1000 + b"]" * 1000
                                                + b"}}")
    p = load_probe_data([tmp_path])
    assert [len(p[r].steps) for r in (0, 1)] == [4, 0]
    (w_meta, w_steps) = p[0].warnings
    assert "rank0.probe.json: not valid JSON (depth limit exceeded" in w_meta
    assert w_steps.startswith("rank0.steps.jsonl: 1 line(s) not valid JSON skipped (first: depth limit")
    res = cli("analyze", str(tmp_path), "--out", str(tmp_path / "out"))
    assert res.returncode == 0 and "Traceback" not in res.stderr + res.stdout, res.stderr
    assert "rank0.probe.json: not valid JSON" in res.stdout
    res = cli("watch", str(tmp_path), "--once")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr


def test_step_logs_keep_the_newest_lines_and_skip_overlong_ones(tmp_path):
    old, cur = tmp_path / "rank0.steps.1.jsonl", tmp_path / "rank0.steps.jsonl"
    old.write_text(step_lines(30))
    cur.write_bytes(step_lines(10, start=31).encode() + b'{"x": "' + b"a" * (MAX_STEP_LINE_BYTES + 10) + b'"}\n'
                    + step_lines(10, start=41).encode() + b'{"step": 51, "sta')  # the job died mid-line
    log = load_steps({"steps.jsonl": cur, "steps.1.jsonl": old}, max_lines=25)
    steps, colls, partial, warnings = log.steps, log.collectives, log.partial, log.warnings
    assert list(steps["step"]) == list(range(27, 51)) and partial  # 24 steps + the long line = 25 lines
    assert list(colls["step"]) == list(range(27, 51))
    assert warnings == ["rank0.steps.jsonl: 1 line(s) longer than 4 MiB skipped"]


def test_an_89_mb_steps_log_is_read_in_bounded_memory(tmp_path):
    log = tmp_path / "rank0.steps.jsonl"
    colls = ",".join(f'["ddp_bucket_allreduce",{150.2 + 10 * k:.1f},30.1,{4096 * (k + 1)},"default"]' for k in range(4))
    line = ('{{"step":{s},"start":{t:.6f},"dur_ms":201.3,"dataloader_ms":0.82,"comm_ms":40.1,'
            f'"collectives":[{colls}]}}}}\n')
    with open(log, "w") as f:
        f.writelines(line.format(s=s, t=1.7e9 + s * 0.2) for s in range(1, 285_001))
    size = log.stat().st_size
    assert size > 85e6
    # VmHWM: the peak RSS of this process image. Not getrusage's ru_maxrss: across fork and exec it
    # keeps the parent's peak (this pytest process's, 299 MB after the e2e tests here)
    probe = ("import re, sys\nfrom diagnose.probedata import load_probe_data\n"
             "p = load_probe_data([sys.argv[1]])[0]\n"
             "hwm = int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))\n"
             "print(len(p.steps), p.steps['step'].min(), len(p.collectives), hwm * 1024)")
    res = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    n_steps, first, n_colls, peak = map(int, res.stdout.split())
    print(f"{size / 1e6:.0f} MB steps log: peak RSS {peak / 1e6:.0f} MB ({peak / size:.1f}x the file)")
    assert (n_steps, first, n_colls) == (MAX_STEP_LINES, 285_001 - MAX_STEP_LINES, 4 * MAX_STEP_LINES)  # the newest
    # measured here: 90 MB file, 187 MB peak for the whole process, pandas included (the old reader: 933 MB)
    assert peak < 3 * size


def test_absurd_world_size_in_a_sidecar_is_ignored_by_hang(tmp_path):
    (tmp_path / "rank0.steps.jsonl").write_text(step_lines(5))
    (tmp_path / "rank0.probe.json").write_text('{"world_size": 1e10}')
    (tmp_path / "rank1.steps.jsonl").write_text(step_lines(5))
    (tmp_path / "rank1.probe.json").write_text(json.dumps({"world_size": 10**10}))
    res = cli("hang", str(tmp_path), "--timeout", "1")
    assert "MemoryError" not in res.stderr and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.splitlines()
    assert sum("is not a plausible number of ranks; ignored" in ln for ln in lines) == 2, res.stderr
    assert "asked 2 rank(s)" in res.stderr  # the ranks seen, not 1e10 of them
    assert res.returncode == 2 and "no rank answered" in lines[-1]


def test_fifo_flight_recorder_dump_is_one_line(tmp_path):
    os.mkfifo(tmp_path / "rank0.fr.json")
    res = CliRunner().invoke(main, ["hang", str(tmp_path)])
    assert res.exit_code == 2 and "rank0.fr.json: a FIFO, not a regular file" in one_line(res.output)


@pytest.mark.parametrize("steps", ["2000", "0", "-3"])
def test_capture_steps_out_of_bounds_fail_at_once(tmp_path, steps):
    t = time.monotonic()
    res = CliRunner().invoke(main, ["capture", str(tmp_path), "--steps", steps, "--timeout", "60"])
    assert time.monotonic() - t < 10.0  # at once: the bug waited the whole --timeout (60 s here)
    assert res.exit_code == 2 and f"--steps {steps}: must be 1..1000" in one_line(res.output)
    assert not (tmp_path / "capture.json").exists()


@pytest.mark.parametrize("schedule", ["x", "1,2", "1,-1,3", "2,2,0", "1,2,3,4,5", "1.5,2,3"])
def test_bad_schedule_fails_at_once(tmp_path, schedule):
    for cmd in (["run", "--out", str(tmp_path), "--schedule", schedule, "--", "true"],
                ["scale", "--nproc", "1,2", "--out", str(tmp_path), "--schedule", schedule, "--", "python", "t.py"]):
        t = time.monotonic()
        res = CliRunner().invoke(main, cmd)
        assert time.monotonic() - t < 10.0  # before any job starts (a busy machine still answers in ms)
        assert res.exit_code == 2 and one_line(res.output).startswith("diagnose: error: --schedule"), res.output
    assert not list(tmp_path.iterdir())  # no run directory, no job


def test_batch_flag_rewrite():
    assert with_batch(["t.py", "--bs"], "--bs", 16) == ["t.py", "--bs", "16"]  # the last argument: no IndexError
    assert with_batch(["t.py", "--bs", "64", "--lr", "1"], "--bs", 16) == ["t.py", "--bs", "16", "--lr", "1"]
    assert with_batch(["t.py", "--bs=64"], "--bs", 16) == ["t.py", "--bs=16"]
    assert with_batch(["t.py"], "--bs", 16) == ["t.py", "--bs", "16"]
    assert script_args(["python3", "-m", "pkg.train", "--x"]) == ["--module", "pkg.train", "--x"]
    for bad in (["python"], ["torchrun", "t.py"], ["python", "-m", "torch.distributed.run", "t.py"]):
        with pytest.raises(DiagnoseError):
            script_args(bad)


def test_hta_budget_counts_every_gzip_member(tmp_path):
    from diagnose.hta.runner import _total_expanded, expanded_bytes

    big = tmp_path / "rank0.json.gz"
    # one 8 MiB member, then an empty one: the gzip trailer (ISIZE) says 0 for the whole file
    big.write_bytes(gzip.compress(b" " * (8 << 20)) + gzip.compress(b""))
    assert int.from_bytes(big.read_bytes()[-4:], "little") == 0
    assert expanded_bytes(big, 64 << 20) == 8 << 20
    assert _total_expanded([big, big], 1 << 20) > 1 << 20  # stops counting once over the budget


def test_escape_sequences_in_trace_fields_do_not_reach_the_terminal(tmp_path):
    import dataclasses

    from diagnose.output import terminal_summary
    from diagnose.pipeline import diagnose_paths

    write_pair(tmp_path, [1] * 6, late_us=2_000.0)
    evil = "\x1b]0;owned\x07\x1b[2J\x1b[31m"
    for f in tmp_path.glob("rank*.pt.trace.json"):
        doc = orjson.loads(f.read_bytes())
        doc["distributedInfo"]["backend"] = "gloo" + evil  # printed on the summary's run line
        for e in doc["traceEvents"]:
            if e["name"] == "aten::mm":
                e["name"] = "aten::mm" + evil
        f.write_bytes(orjson.dumps(doc))
    d = diagnose_paths([tmp_path])
    d = dataclasses.replace(d, run=dataclasses.replace(d.run, device_name="A100" + evil),
                            warnings=[*d.warnings, "op " + evil])
    text = terminal_summary(d)
    assert "\x1b" not in text and "\x07" not in text
    assert "gloo\\x1b]0;owned\\x07" in text and "A100\\x1b" in text


def test_the_jobs_own_traces_are_read_only_where_a_sidecar_may_point(tmp_path):
    """`diagnose run` analyses the traces the probes saw the job export (rank*.probe.json's
    `job_traces`). A sidecar is written by the job: one forged in a shared run directory must not
    make the launcher read a FIFO (a hang), a directory, a link, a file of another name or
    another user's file; the job's real trace is read, once."""
    from diagnose.launch import _job_profiler

    traces = tmp_path / "traces"
    traces.mkdir()
    job = tmp_path / "job"
    job.mkdir()
    real = job / "vm_1.1.pt.trace.json.gz"
    real.write_bytes(b"x")
    fifo = job / "fifo.pt.trace.json"
    os.mkfifo(fifo)
    link = job / "link.pt.trace.json"
    link.symlink_to(real)
    other = job / "other.pt.trace.json"
    other.write_bytes(b"x")
    if os.getuid() == 0:
        os.chown(other, 12345, 12345)
    (job / "notes.txt").write_text("x")
    (job / "dir.json").mkdir()
    named = [str(real), str(fifo), str(link), str(other), str(job / "notes.txt"), str(job / "dir.json"),
             "vm_1.1.pt.trace.json.gz", str(job / "gone.json"), 17, str(real)]
    for r in (0, 1):
        (traces / f"rank{r}.probe.json").write_text(json.dumps({"meta": {"job_profiler": True, "job_traces": named}}))
    expect = [real] if os.getuid() == 0 else [real, other]
    assert _job_profiler(traces) == (True, expect)
