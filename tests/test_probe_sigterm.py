"""SIGTERM reaches a probed rank even while it is blocked in a collective (probes/sigterm.py), and
the watch that makes it so never ends a process SIGTERM was not meant to end.

Real processes started as `diagnose run` starts them (the bootstrap on PYTHONPATH, the probes
installed when torch is imported); a rank blocks in a gloo all_reduce for a peer that comes late."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from diagnose.launch import probe_env
from tests.conftest import _free_port

pytestmark = pytest.mark.e2e
pytest.importorskip("torch")

LATE_S = 40  # the peer's delay: far above the watch's grace (2 s) and this machine's noise

RANK = textwrap.dedent("""
    import os, signal, sys, time
    import torch, torch.distributed as dist
    rank = int(os.environ["RANK"])
    if os.environ.get("OWN_HANDLER") == "1":  # a job (or torchrun's agent) with its own SIGTERM handler
        signal.signal(signal.SIGTERM, lambda s, f: print("own handler ran", flush=True))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 1:
        time.sleep(float(os.environ["LATE_S"]))
    busy_until = time.monotonic() + float(os.environ.get("BUSY_S", "0"))
    if os.environ.get("BUSY_S"):  # the watch alone, told the probe's own work holds the main thread
        from diagnose.probes.sigterm import flush_on_sigterm
        flush_on_sigterm(lambda: None, busy=lambda: time.monotonic() < busy_until)
    print("in all_reduce", flush=True)
    dist.all_reduce(torch.ones(1000))  # rank 0 waits here, inside one C++ call
    print("all_reduce done", flush=True)
""")


def _pair(tmp_path, probes: bool, **extra):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "LATE_S": str(LATE_S), "OMP_NUM_THREADS": "1", **extra}
    if probes:
        env = probe_env(tmp_path / "traces", "off", base=env)
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    late = subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    waiting = subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": "0"}, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    line = waiting.stdout.readline()
    assert "in all_reduce" in line, line
    time.sleep(1.0)  # inside the call now
    return waiting, late


def _ended_within(proc, seconds: float) -> float | None:
    t0 = time.monotonic()
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None
    return time.monotonic() - t0


@pytest.mark.parametrize("probes", [False, True])
def test_sigterm_ends_a_rank_blocked_in_a_collective(tmp_path, probes):
    """Until 2026-12-07, under the probes it lived on until the late peer came (35.9 s of a 40 s
    delay; a hung job's rank, until gloo's 30-minute timeout): the probe's Python handler waited
    for the main thread. The same job without the probes is the reference."""
    waiting, late = _pair(tmp_path, probes)
    try:
        waiting.send_signal(signal.SIGTERM)
        took = _ended_within(waiting, 15)
        assert took is not None, "the rank ignored SIGTERM while blocked in all_reduce"
        assert waiting.returncode == -signal.SIGTERM  # ended as SIGTERM ends a process, not by an exit code
    finally:
        for p in (waiting, late):
            p.kill()
            p.communicate()


def test_the_probes_own_work_on_the_main_thread_is_waited_for(tmp_path):
    """A window's stop and export (seconds for a large trace) hold the main thread, and their
    flush is worth having: the watch waits while the probe says it is busy (here 4 s from the
    call, SIGTERM at 1 s), then its grace (2 s), and only then ends the process."""
    waiting, late = _pair(tmp_path, False, BUSY_S="4")
    try:
        waiting.send_signal(signal.SIGTERM)
        took = _ended_within(waiting, 20)
        assert took is not None and 3.5 <= took <= 10.0, took  # ~5 s: 3 s busy after the SIGTERM, then 2
        assert waiting.returncode == -signal.SIGTERM
    finally:
        for p in (waiting, late):
            p.kill()
            p.communicate()


def test_a_sigterm_handler_of_the_jobs_own_is_left_to_the_job(tmp_path):
    """torchrun's agent imports torch (so the probes install there too) and then sets its own
    SIGTERM handler, as a job checkpointing on preemption does: the watch must not end such a
    process; its own handler runs when the call returns, as without the probes."""
    waiting, late = _pair(tmp_path, True, OWN_HANDLER="1")
    try:
        waiting.send_signal(signal.SIGTERM)
        assert _ended_within(waiting, 4) is None, "a process with its own SIGTERM handler was ended"
    finally:
        for p in (waiting, late):
            p.kill()
            p.communicate()


def test_a_forked_child_s_sigterm_never_ends_its_parent(tmp_path):
    """A forked child inherits the watch's pipe, not its thread: a SIGTERM sent to it at once
    (before its fork handlers ran) must not read as the parent's. Before the pause around forks
    this ended the parent 3 times in 3; a fork from another thread retires the watch."""
    script = tmp_path / "fork.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, threading, time
        import torch

        def fork_and_kill():
            pid = os.fork()
            if pid == 0:
                time.sleep(1)
                os._exit(0)
            os.kill(pid, signal.SIGTERM)  # at once: the child may not have run its fork handlers yet
            os.waitpid(pid, 0)

        fork_and_kill()  # from the main thread: the watch pauses around it
        t = threading.Thread(target=fork_and_kill)  # from another: the watch retires
        t.start()
        t.join()
        time.sleep(3)  # more than the watch's grace (2 s): a parent ended by mistake ends here
        print("parent lived on", flush=True)
    """))
    env = probe_env(tmp_path / "traces", "off", base={**os.environ, "OMP_NUM_THREADS": "1"})
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert "parent lived on" in res.stdout


def test_a_wakeup_fd_of_the_jobs_own_stays_in_place(tmp_path):
    """A job that set a signal wakeup fd before importing torch (asyncio's signal handling does)
    keeps it: the watch stands aside rather than take it."""
    script = tmp_path / "wakeup.py"
    script.write_text(textwrap.dedent("""
        import os, signal
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w)
        import torch  # the probes install here
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, "the probes did not install"
        print("still the job's:", signal.set_wakeup_fd(-1) == w, flush=True)
    """))
    env = probe_env(tmp_path / "traces", "off", base={**os.environ, "OMP_NUM_THREADS": "1"})
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "still the job's: True" in res.stdout
