"""Run directories on shared filesystems, the probe side (issue 13): symlinks, FIFOs, devices and
forged control files planted by another user or by mistake must not hurt the job or the user.

Attacks are real: real symlinks, a real FIFO, /dev/zero, a second user (uid 65534 in a forked
child, so these tests need root and skip with the reason otherwise), real training jobs.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from diagnose.probes.capture import OnDemandCapture, valid_request
from diagnose.probes.core import Probe, Schedule
from diagnose.probes.hang import HangWatcher
from diagnose.probes.safefs import SafeDir, UnsafePath, write_atomic

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
OTHER = 65534  # nobody
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as a second user needs root (setuid in a child)")


@pytest.fixture
def shared_dir():
    """A directory every user may write to, without the sticky bit (the dangerous kind)."""
    d = Path(tempfile.mkdtemp(prefix="diag-shared-", dir="/tmp"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def victim(tmp_path):
    v = tmp_path / "secret"
    v.write_text("the victim's own data\n")
    v.chmod(0o600)
    return v


def as_other_user(target, *args) -> int:
    """fork; the child drops to uid/gid 65534 and runs target(*args); returns the pid."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(OTHER)
            os.setuid(OTHER)
            target(*args)
        finally:
            os._exit(0)
    return pid


def wait_child(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _swap_hidden_for_traps(d: str, victim: str, final: str) -> None:
    """What a racer does in a non-sticky directory: every temp entry is replaced by a symlink to
    the victim, or (a directory) moved away and replaced by one holding such a symlink."""
    while True:
        for name in os.listdir(d):
            if not name.startswith(".") or name.endswith(".moved"):
                continue
            p = os.path.join(d, name)
            try:
                if os.path.isdir(p) and not os.path.islink(p):
                    os.rename(p, p + ".moved")
                    os.mkdir(p)
                    os.symlink(victim, os.path.join(p, final))
                else:
                    os.unlink(p)
                    os.symlink(victim, p)
            except OSError:
                pass
            try:  # the exporter's old predictable companion name
                os.symlink(victim, p + ".gz")
            except OSError:
                pass


# ---- 1. atomic writes ---------------------------------------------------------------------------
@needs_root
def test_write_atomic_never_touches_a_victim_file_through_swapped_temp_names(shared_dir, victim):
    # a report-sized payload (pages are ~5 MB): the write is long enough for the racer to win
    # against a writer that chmods by path (the old one lost 3 of 3 runs of this loop)
    racer = as_other_user(_swap_hidden_for_traps, str(shared_dir), str(victim), "report.html")
    payload = b"<html>" + b"x" * 5_000_000
    try:
        for _ in range(60):
            write_atomic(shared_dir / "report.html", payload)
    finally:
        wait_child(racer)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert victim.read_text() == "the victim's own data\n"
    write_atomic(shared_dir / "report.html", b"<html>last</html>")
    final = shared_dir / "report.html"
    assert not final.is_symlink() and final.read_bytes() == b"<html>last</html>"


def test_write_atomic_respects_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        write_atomic(tmp_path / "probe.json", b"{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "probe.json").stat().st_mode) == 0o600
    write_atomic(tmp_path / "report.html", b"x")  # the usual umask 022
    assert stat.S_IMODE((tmp_path / "report.html").stat().st_mode) == 0o644 & ~old


def test_a_shared_directory_without_the_sticky_bit_is_named(shared_dir, tmp_path):
    with SafeDir.open(shared_dir, strict=False) as d:
        assert d.warning and "sticky" in d.warning
    with SafeDir.open(tmp_path / "mine") as d:
        assert d.warning is None


# ---- 2. trace export ----------------------------------------------------------------------------
def _job(out: Path, *args: str, schedule: str = "off", env_extra: dict | None = None) -> subprocess.Popen:
    from diagnose.launch import probe_env

    env = {**probe_env(out, schedule), **(env_extra or {})}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return subprocess.Popen([sys.executable, str(EXAMPLE), "--batch-size", "32", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)


@pytest.mark.e2e
@needs_root
def test_trace_export_never_writes_through_planted_symlinks(shared_dir, victim):
    out = shared_dir / "traces"
    out.mkdir()
    out.chmod(0o777)  # a group-writable probe directory (the probe names it, and goes on)
    racer = as_other_user(_swap_hidden_for_traps, str(out), str(victim), "trace.json.gz")
    try:
        job = _job(out, "--steps", "14", schedule="1,1,3,2")
        _, err = job.communicate(timeout=180)
    finally:
        wait_child(racer)
    assert job.returncode == 0, err[-2000:]
    assert victim.read_text() == "the victim's own data\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    from diagnose.ingest import load_trace

    traces = [p for p in out.glob("rank0.*.pt.trace.json.gz") if not p.is_symlink()]
    assert traces, sorted(p.name for p in out.iterdir())
    for t in traces:
        assert len(load_trace(t).events) > 0


# ---- 3. control files that would stall a rank -----------------------------------------------------
def _steps(out: Path) -> int:
    try:
        return (out / "rank0.steps.jsonl").read_bytes().count(b"\n")
    except OSError:
        return 0


def _advances(out: Path, by: int = 5, within_s: float = 30.0) -> bool:
    start = _steps(out)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if _steps(out) >= start + by:
            return True
        time.sleep(0.1)
    return False


def _plant(path: Path, kind: str) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        path.symlink_to("/dev/zero")
    elif kind == "huge":
        with open(path, "wb") as f:  # sparse: 200 MB by size, nothing written
            f.truncate(200 * 1024**2)


@pytest.mark.e2e
def test_fifo_dev_zero_and_huge_control_files_do_not_stall_training(tmp_path):
    out = tmp_path / "traces"
    job = _job(out, "--steps", "100000")
    try:
        assert _advances(out, by=3, within_s=60), "the job never started stepping"
        for kind in ("fifo", "zero", "huge"):
            _plant(out / "capture.json", kind)
            _plant(out / "hang.json", kind)
            assert _advances(out), f"training stalled with a {kind} control file in place"
        # polling went on: well-formed requests written after the bad ones are still served
        last = json.loads((out / "rank0.steps.jsonl").read_text().splitlines()[-1])["step"]
        for name, body in (("capture.json", {"id": "good", "start_step": last + 8, "steps": 2}),
                           ("hang.json", {"id": "h1", "time": time.time()})):
            (out / name).unlink()
            (out / f".{name}.new").write_text(json.dumps(body))
            os.replace(out / f".{name}.new", out / name)
        deadline = time.monotonic() + 60
        done = out / "capture-good" / "rank0.capture.json"
        dump = out / "hang-h1" / "rank0.fr.json"
        while time.monotonic() < deadline and not (done.exists() and dump.exists()):
            time.sleep(0.2)
        assert done.exists() and json.loads(done.read_text())["status"] == "done"
        assert dump.exists()
    finally:
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=60)
    assert "disabled after error" not in err, err[-2000:]


# ---- 4. pre-planted symlinks and directories ---------------------------------------------------------
@pytest.mark.e2e
def test_a_planted_step_log_symlink_is_not_appended_to(tmp_path, victim):
    out = tmp_path / "traces"
    out.mkdir()
    (out / "rank0.steps.jsonl").symlink_to(victim)
    job = _job(out, "--steps", "6")
    _, err = job.communicate(timeout=120)
    assert job.returncode == 0, err[-2000:]
    assert victim.read_text() == "the victim's own data\n"
    assert err.count("step log disabled after error") == 1, err[-2000:]
    assert (out / "rank0.probe.json").exists()  # the rest of the probe kept working


def _probe(tmp_path: Path) -> Probe:
    return Probe(tmp_path / "traces", rank=0, world_size=1, schedule=Schedule(enabled=False))


def _request(d: Path, name: str, body: dict) -> None:
    (d / f".{name}.x").write_text(json.dumps(body))
    os.replace(d / f".{name}.x", d / name)


def test_capture_and_hang_directories_planted_as_symlinks_are_refused(tmp_path):
    p = _probe(tmp_path)
    d = p.directory()
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    (d.path / "capture-c1").symlink_to(victim_dir)
    (d.path / "hang-h1").symlink_to(victim_dir)
    cap = OnDemandCapture(p)
    _request(d.path, "capture.json", {"id": "c1", "start_step": 0, "steps": 2})  # already missed: a status
    cap.poll(5)
    w = HangWatcher(d, 0, lambda exc: None)
    _request(d.path, "hang.json", {"id": "h1", "time": time.time()})
    with pytest.raises(UnsafePath, match="symlink"):  # the watcher's thread logs it once and polls on
        w.poll()
    assert list(victim_dir.iterdir()) == []
    p.close()


@needs_root
def test_a_directory_planted_by_another_user_is_refused(tmp_path):
    p = _probe(tmp_path)
    d = p.directory()
    planted = d.path / "capture-c2"
    planted.mkdir()
    os.chown(planted, OTHER, OTHER)
    cap = OnDemandCapture(p)
    _request(d.path, "capture.json", {"id": "c2", "start_step": 0, "steps": 2})
    cap.poll(5)
    assert list(planted.iterdir()) == []
    with pytest.raises(UnsafePath, match="owned by uid 65534"):
        d.subdir("capture-c2")
    p.close()


# ---- 7. ranks: from the process group; children are not ranks ---------------------------------------
CHILD_SCRIPT = """
import subprocess, sys, torch
m = torch.nn.Linear(4, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(3):
    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
if sys.argv[1:] == ["parent"]:
    subprocess.run([sys.executable, __file__, "child"], check=True)
"""


@pytest.mark.e2e
def test_a_child_of_a_rank_writes_nothing_as_that_rank(tmp_path):
    from diagnose.launch import probe_env

    script = tmp_path / "job.py"
    script.write_text(CHILD_SCRIPT)
    out = tmp_path / "traces"
    env = {**probe_env(out, "off"), "RANK": "0", "WORLD_SIZE": "1"}
    res = subprocess.run([sys.executable, str(script), "parent"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(x) for x in (out / "rank0.steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # the parent's three steps, not the child's too
    assert sorted(p.name for p in out.iterdir()) == ["rank0.probe.json", "rank0.steps.jsonl",
                                                     "rank0.telemetry.jsonl"]  # the rank's own only


@pytest.mark.e2e
def test_ranks_started_by_mp_spawn_without_rank_in_the_environment(tmp_path):
    """`diagnose run -- python train.py --spawn 2`: torch.multiprocessing.spawn starts the ranks, no
    RANK anywhere; each rank names its files by its process-group rank, and the injected straggler
    (rank 1) is found."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    res = subprocess.run([sys.executable, "-m", "diagnose.cli", "run", "--out", str(tmp_path / "runs"), "--",
                          sys.executable, str(EXAMPLE), "--spawn", "2", "--pathology", "straggler"],
                         capture_output=True, text=True, timeout=240, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    from tests.conftest import run_dir

    run = run_dir(tmp_path / "runs")
    names = sorted(p.name for p in (run / "traces").iterdir())
    assert [n for n in names if n.endswith(".probe.json")] == ["rank0.probe.json", "rank1.probe.json"], names
    assert sum(n.endswith(".pt.trace.json.gz") for n in names) == 2, names
    d = json.loads((run / "diagnosis.json").read_text())
    assert d["findings"][0]["id"] == "straggler" and d["findings"][0]["ranks"] == [1], res.stdout


# ---- 8. the launcher's path ----------------------------------------------------------------------------
def test_the_bootstrap_directory_holds_sitecustomize_only():
    from diagnose.launch import bootstrap_dir, probe_env

    assert sorted(p.name for p in bootstrap_dir().iterdir() if p.name != "__pycache__") == ["sitecustomize.py"]
    env = probe_env(Path("/tmp/x"), "off", base={"PYTHONPATH": "/user/lib"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(bootstrap_dir()), "/user/lib"]


USER_JOB = """
import os, sys, torch
import reports
m = torch.nn.Linear(4, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(3):
    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
open(sys.argv[1], "w").write(reports.WHO + "\\n" + os.environ["PYTHONPATH"])
"""


@pytest.mark.e2e
def test_a_users_own_reports_module_is_the_one_imported_inside_the_job(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "reports.py").write_text("WHO = 'the user'\n")
    (tmp_path / "job.py").write_text(USER_JOB)
    res = subprocess.run([sys.executable, "-m", "diagnose.cli", "run", "--schedule", "off", "--out",
                          str(tmp_path / "runs"), "--", sys.executable, str(tmp_path / "job.py"),
                          str(tmp_path / "seen")], env={**os.environ, "PYTHONPATH": str(lib)},
                         capture_output=True, text=True, timeout=180, cwd=tmp_path)
    who, path = (tmp_path / "seen").read_text().split("\n", 1)
    assert who == "the user", res.stderr[-2000:]
    assert path.split(os.pathsep)[1:] == [str(lib)]
    assert list((tmp_path / "runs").rglob("rank0.steps.jsonl")), res.stderr[-2000:]  # and it was probed


# ---- 10. forged and malformed requests -------------------------------------------------------------------
def test_request_ids_are_matched_whole():
    ok = {"id": "abc", "start_step": 5, "steps": 3}
    assert valid_request(ok)
    for bad in ({**ok, "id": "abc\n"}, {**ok, "id": "../x"}, {**ok, "steps": 0}, {**ok, "steps": 1001},
                {**ok, "steps": True}, {**ok, "start_step": -1}, {**ok, "start_step": 2.0}, ["abc"]):
        assert not valid_request(bad), bad


def test_forged_hang_requests_get_one_dump_per_interval(tmp_path):
    d = SafeDir.open(tmp_path / "traces")
    w = HangWatcher(d, 0, lambda exc: None)
    for i in range(5):
        _request(d.path, "hang.json", {"id": f"h{i}", "time": time.time()})
        w._seen = None  # a distinct request each time, whatever the file system's mtime granularity
        w.poll()
    assert sorted(p.name for p in d.path.glob("hang-*")) == ["hang-h0"]
    w._next_ok = 0.0  # the interval passed
    w._seen = None
    w.poll()
    assert sorted(p.name for p in d.path.glob("hang-*")) == ["hang-h0", "hang-h4"]


def test_a_bad_control_file_is_ignored_and_polling_goes_on(tmp_path):
    p = _probe(tmp_path)
    d = p.directory()
    cap = OnDemandCapture(p)
    for body in ('{"id": "x", "start_step": ' + "[" * 100_000, "not json", '{"id": 3}'):
        (d.path / "capture.json").write_text(body)
        cap._seen = None
        cap.poll(5)
    _request(d.path, "capture.json", {"id": "late", "start_step": 0, "steps": 1})
    cap.poll(5)  # a valid request after the bad ones: answered (missed: its start has passed)
    assert json.loads((d.path / "capture-late" / "rank0.capture.json").read_text())["status"] == "missed"
    p.close()


def test_concurrent_collectives_count_once_in_the_step_record(tmp_path):
    """DDP's bucket all-reduces overlap: the step record's comm_ms (what `diagnose watch` shows)
    is the time some collective was in flight, never more than the step."""
    p = _probe(tmp_path)
    t = time.perf_counter()
    p.on_collective("all_reduce", t, t + 0.030, 1024, "0")
    p.on_collective("all_reduce", t + 0.010, t + 0.040, 1024, "0")  # overlaps the first by 20 ms
    p.on_collective("all_reduce", t + 0.050, t + 0.055, 1024, "0")
    time.sleep(0.06)
    p.on_step()
    p.close()
    rec = json.loads((tmp_path / "traces" / "rank0.steps.jsonl").read_text().splitlines()[0])
    assert rec["comm_ms"] == pytest.approx(45.0, abs=1e-3)  # 0-40 and 50-55, not 30 + 30 + 5
    assert rec["comm_ms"] <= rec["dur_ms"]


def test_a_temp_directory_swapped_before_it_is_opened_is_refused_and_the_write_retried(tmp_path, monkeypatch):
    """The race the swapped-temp-names test loses about once in a few hundred writes, made certain:
    right after our mkdir, our temp directory is moved away and a symlink to elsewhere put in its
    place. The writer refuses it (never writes through it) and retries with a fresh name."""
    from diagnose.probes import safefs

    d = tmp_path / "shared"
    d.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    real_mkdir, swapped = os.mkdir, []

    def mkdir_then_swap(name, mode=0o777, *, dir_fd=None):
        real_mkdir(name, mode, dir_fd=dir_fd)
        if not swapped and str(name).endswith(safefs.TMP_SUFFIX):
            os.rename(name, f"{name}.moved", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.symlink(elsewhere, name, dir_fd=dir_fd)
            swapped.append(name)

    monkeypatch.setattr(safefs.os, "mkdir", mkdir_then_swap)
    write_atomic(d / "report.html", b"<html>ok</html>")
    assert swapped and (d / "report.html").read_bytes() == b"<html>ok</html>"
    assert not any(elsewhere.iterdir())  # nothing was written through the planted link
