"""`diagnose run`: launch a user's command with the probes injected, then diagnose it.

The probes ride in through PYTHONPATH: `probes/bootstrap/sitecustomize.py` is
imported by every Python process of the job (torchrun's workers included) and
installs the hooks once the script imports torch. Nothing in the user's script
changes. This module imports no torch itself.

Each run writes into a fresh run directory (`diagnose.rundir`). The job runs in its own
session, so a terminal's Ctrl-C reaches only the launcher, which forwards SIGINT, SIGTERM
and SIGHUP to the job's whole process group, waits for it, then analyses what it wrote.
"""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import threading
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Literal

import click

from diagnose.errors import DiagnoseError, one_line
from diagnose.rundir import TRACES, RunLock, create_run_dir, last_attempt, sharing_warning
from diagnose.units import rank_ranges


def probes_dir() -> Path:
    from diagnose import probes

    return Path(probes.__file__).resolve().parent


def bootstrap_dir() -> Path:
    return probes_dir() / "bootstrap"


FLIGHT_RECORDER_ENV = {
    # torch.distributed's Flight Recorder, a ring of each rank's last collectives, for `diagnose hang`;
    # it must be on before the process group starts. Off unless asked (`diagnose run
    # --flight-recorder`): with it, a 2-rank gloo job of examples/train_ddp.py aborted at exit
    # ("terminate called without an active exception", exit -6) in 1 of 8 runs here and once in CI;
    # 0 of 12 without. A probe must never crash the job it watches.
    "TORCH_FR_BUFFER_SIZE": "2000",
    # without the Python stack it records per collective: the stack is the recorder's whole cost
    # (benchmarks/bench_flight_recorder.py, 6 pairs: median x1.24 per gloo all-reduce with torch's
    # default stack capture, x0.92 and x0.98 without, i.e. within this machine's noise)
    # and the JSON dump `diagnose hang` reads does not carry it
    "TORCH_INCLUDE_STACK_TRACE": "0",
}


def probe_env(traces: Path, schedule: str, base: dict | None = None, flight_recorder: bool = False) -> dict:
    env = dict(os.environ if base is None else base)
    # only the bootstrap directory (it holds sitecustomize.py alone) goes ahead of the user's path;
    # it loads the probes by the absolute path below, so site-packages never moves forward
    parts = [str(bootstrap_dir())] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["DIAGNOSE_PROBE_PKG"] = str(probes_dir())
    env["DIAGNOSE_PROBE_DIR"] = str(traces.resolve())
    env["DIAGNOSE_PROBE_SCHEDULE"] = schedule
    if flight_recorder:
        for k, v in FLIGHT_RECORDER_ENV.items():  # a job's own settings win
            env.setdefault(k, v)
    # kineto prints "USDT: ... profiler_start" / "profiler_stop" for every profiled window: noise
    # the probes cause. Its only level above them is "nothing", which hides its errors too (a job
    # that sets KINETO_LOG_LEVEL keeps its choice; 4 shows errors and those lines again).
    env.setdefault("KINETO_LOG_LEVEL", "6")
    return env


def quiet_launcher(command: list[str], env: dict) -> dict:
    """torchrun prints a four-line banner when it sets OMP_NUM_THREADS=1 for more than one process
    per node; setting that same value first gives the job the same setting without the banner.
    Only where torchrun itself would have set it (the user's choice, if any, stands)."""
    if "OMP_NUM_THREADS" in env or not command:
        return env
    head = Path(command[0]).name
    is_torchrun = head == "torchrun" or any(
        a in ("torch.distributed.run", "torch.distributed.launch") and i > 0 and command[i - 1] == "-m"
        for i, a in enumerate(command[:4]))
    if not is_torchrun:
        return env
    nproc = None
    script = next((i for i, a in enumerate(command) if a.endswith(".py")), len(command))
    for i, a in enumerate(command[:script]):  # torchrun's own options, not the script's
        for flag in ("--nproc_per_node", "--nproc-per-node"):
            if a == flag and i + 1 < script:
                nproc = command[i + 1]
            elif a.startswith(flag + "="):
                nproc = a.split("=", 1)[1]
    if nproc is not None and nproc.isdigit() and int(nproc) > 1:
        return {**env, "OMP_NUM_THREADS": "1"}
    return env


FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GRACE_S = 10.0
"""After a forwarded signal and the job leader's exit: how long the rest of its process group
(torchrun's workers) gets to exit before it is killed, so that no job process is left behind."""
QUIET_TAIL = 3000

Status = Literal["analysed", "no_traces", "analysis_failed", "no_probes", "not_started"]


@dataclass(frozen=True, slots=True)
class RunOutcome:
    code: int
    """The job's exit status as a shell reports it: 128+N for a death by signal N."""
    run_dir: Path | None
    """The fresh run directory; None when none could be made (the job then ran without probes)."""
    status: Status

    @property
    def analysed(self) -> bool:
        return self.status == "analysed"


def exit_status(returncode: int) -> int:
    """Popen's -N (killed by signal N) as 128+N: sys.exit(-9) would exit 247, not a shell's 137."""
    return 128 - returncode if returncode < 0 else returncode


class _Forwarder:
    """Signal handlers that pass SIGINT/SIGTERM/SIGHUP on to the job's process group.

    Installed before the job starts (a signal in between is remembered and sent once it exists);
    each signal is forwarded as it comes, so a second Ctrl-C forwards again."""

    def __init__(self) -> None:
        self.pgid: int | None = None
        self.received: list[int] = []
        self._prev: dict[int, object] = {}

    def __enter__(self) -> _Forwarder:
        if threading.current_thread() is threading.main_thread():  # handlers can be set there only
            for sig in FORWARDED:
                self._prev[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, prev in self._prev.items():
            signal.signal(sig, prev)

    def started(self, pgid: int) -> None:
        self.pgid = pgid
        for sig in self.received:
            _signal_group(pgid, sig)

    def _handle(self, signum: int, _frame) -> None:
        self.received.append(signum)
        if self.pgid is not None:
            _signal_group(self.pgid, signum)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap_group(pgid: int, grace_s: float = GRACE_S) -> None:
    """Wait for the rest of the job's process group to exit; kill what is left after grace_s."""
    deadline = time.monotonic() + grace_s
    while _group_alive(pgid):
        if time.monotonic() >= deadline:
            click.echo(f"diagnose: job processes still running {grace_s:g} s after the signal: killing them",
                       err=True)
            _signal_group(pgid, signal.SIGKILL)
            return
        time.sleep(0.1)


def run_job(command: list[str], env: dict | None, quiet: bool = False, pass_fds: tuple[int, ...] = ()) -> int | None:
    """Run the job in its own session, forwarding signals; its exit status (128+N for signal N),
    or None when it cannot be started (a one-line error is printed)."""
    sink = subprocess.PIPE if quiet else None
    with _Forwarder() as fwd:
        try:
            proc = subprocess.Popen(command, env=env, stdout=sink, stderr=sink, text=True, errors="replace",
                                    start_new_session=True, pass_fds=pass_fds)
        except OSError as exc:
            click.echo(f"diagnose: error: cannot start {one_line(command[0])!r}: {exc.strerror or exc}", err=True)
            return None
        fwd.started(proc.pid)  # start_new_session: the job's pid is its process group id
        job_out, job_err = proc.communicate()
        if proc.returncode < 0 and not fwd.received:
            _signal_group(proc.pid, signal.SIGTERM)  # the leader died of a signal: stop what it left behind
        if fwd.received or proc.returncode < 0:
            _reap_group(proc.pid)
    code = exit_status(proc.returncode)
    if quiet and code != 0:
        click.echo((job_err or job_out or "")[-QUIET_TAIL:], err=True)
    return code


def run_with_probes(command: list[str], out: Path, schedule: str, quiet_job: bool = False,
                    echo: bool = True, flight_recorder: bool = False, link=None) -> RunOutcome:
    """Run `command` under the probes in a fresh run directory under `out`, then analyse what it wrote.

    quiet_job: keep the job's own output out of the terminal (the demo) unless it fails.
    echo: print the diagnosis summary (the run directory line and problems are printed always).
    flight_recorder: turn on torch.distributed's Flight Recorder, for `diagnose hang`.
    """
    try:
        run_dir = create_run_dir(out)
        lock = RunLock.acquire(run_dir)
    except (OSError, DiagnoseError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        click.echo(f"diagnose: warning: cannot create a run directory in {one_line(str(out))} ({one_line(why)}); "
                   "running without probes", err=True)
        code = run_job(command, None, quiet_job)
        return RunOutcome(127 if code is None else code, None, "no_probes" if code is not None else "not_started")
    with lock:
        click.echo(f"diagnose: run directory {one_line(str(run_dir))}", err=True)
        shared = sharing_warning(run_dir)
        if shared:
            click.echo(f"diagnose: warning: {one_line(shared)}", err=True)
        traces = run_dir / TRACES
        env = quiet_launcher(command, probe_env(traces, schedule, flight_recorder=flight_recorder))
        # the job's leader shares the lock: the run stays "live" for `watch`/`capture`/`hang`
        # as long as the job does, even if this launcher is killed
        code = run_job(command, env, quiet_job, pass_fds=(lock.fd,))
        if code is None:
            return RunOutcome(127, run_dir, "not_started")
        own: list[Path] = []
        hint = (f"analyse the job's own traces with the probes' records (diagnose analyze THEIR_DIR --probes "
                f"{one_line(str(run_dir))}), or run the job without its profiler")
        if not _wrote_traces(traces):
            # never diagnose anything else: a verdict here could only come from a stale file
            itself, own = _job_profiler(traces)
            if own:
                where = ", ".join(sorted({one_line(str(f.parent)) for f in own})[:4])
                click.echo(f"diagnose: the job ran its own torch.profiler (exit {code}); torch records one profiler "
                           f"at a time, so the probes recorded no trace: analysing the {len(own)} trace(s) the job "
                           f"wrote in this run ({where}) with the probes' records", err=True)
            elif itself:
                click.echo(f"diagnose: the job ran its own torch.profiler (exit {code}); torch records one "
                           f"profiler at a time, so the probes recorded no trace: {hint}", err=True)
                return RunOutcome(code, run_dir, "no_traces")
            else:
                click.echo(f"diagnose: the job wrote no traces (exit {code}); nothing to analyse"
                           f"{_before_the_window(traces, schedule)}", err=True)
                return RunOutcome(code, run_dir, "no_traces")
        from diagnose.output import analyze_outputs

        try:
            d = analyze_outputs([str(f) for f in own] or [str(traces)], run_dir, echo=echo, link=link,
                                probe_paths=[str(_records(traces))] if own else None)
        except DiagnoseError as exc:
            click.echo(f"diagnose: could not analyse the run: {exc}" + (f"; {hint}" if own else ""), err=True)
            return RunOutcome(code, run_dir, "analysis_failed")
    nodes = nodes_of(command)
    if nodes and d.run.ranks_missing:
        # after the lock is released: the other nodes' launchers wait for it as this one waits for theirs
        _with_other_nodes(run_dir, traces, d, nodes, echo, link)
    return RunOutcome(code, run_dir, "analysed")


def _with_other_nodes(run_dir: Path, traces: Path, d, nodes: int, echo: bool, link) -> None:
    """A node's run of a multi-node job: every node's ranks analysed together where their run
    directories sit side by side (diagnose/multinode.py), else how to do it."""
    from diagnose.multinode import TOGETHER, find_together
    from diagnose.output import analyze_outputs

    def say(text: str) -> None:
        click.echo(f"diagnose: {one_line(text)}", err=True)

    try:
        found = find_together(run_dir, say)
    except KeyboardInterrupt:  # Ctrl-C while waiting for the other nodes: this node's analysis stands
        say("stopped waiting for the other nodes' runs; this node's analysis above stands")
        return
    if found is None:
        say(f"the job spans {nodes} nodes and this node's run directory holds rank(s) "
            f"{rank_ranges(d.run.ranks_found)} of {d.run.world_size}: its verdict cannot see the others. "
            f"Analyse every node's ranks together: diagnose analyze {traces} OTHER_RUN/traces ... "
            "(each node's `diagnose run` makes its own run directory, side by side in a shared --out; "
            "on node-local disks, --cluster: docs/cluster.md)")
        return
    paths = [str(n.traces) for n in found.members]
    dirs = " ".join(paths)
    if found.still_running:
        say(f"{len(found.still_running)} other node run(s) still running after the wait "
            f"({', '.join(str(p) for p in found.still_running)}): once they end, diagnose analyze {dirs}")
        return
    if found.elsewhere is not None:
        say(f"every node's ranks are analysed together by another node's launcher, into {found.elsewhere}")
        return
    out = run_dir / TOGETHER
    ranks = sorted(set().union(*(n.ranks for n in found.members)))
    say(f"every node's ranks together: {len(found.members)} run directories, rank(s) {rank_ranges(ranks)} "
        f"of {d.run.world_size}, into {out}")
    try:
        out.mkdir()
        analyze_outputs(paths, out, echo=echo, link=link)
    except (OSError, DiagnoseError) as exc:
        say(f"could not analyse every node's ranks together: {exc}; diagnose analyze {dirs}")


def _records(traces: Path) -> Path:
    """Where the probes' records are: the traces directory, or a restarted job's last attempt in it."""
    from diagnose.probedata import has_records

    return last_attempt(traces, has_records)[0]


_MAX_SIDECARS = 4096
"""Ranks' sidecars read for the job's own profiler: a bound on what a run directory makes us read."""


def _job_profiler(traces: Path) -> tuple[bool, list[Path]]:
    """(a rank's probe saw the job start a torch.profiler of its own (probes.core.on_job_profiler),
    the traces that profiler wrote in this run as the probes saw it export them
    (probes.core.on_job_trace: each rank's last few)), each sidecar read once. Only regular files
    of ours with a trace's name: a sidecar is the job's writing, and a forged one must not point
    the analysis at a FIFO or another user's files."""
    from diagnose.ingest.discover import TRACE_SUFFIXES
    from diagnose.probedata import read_meta
    from diagnose.probes.core import JOB_TRACES_KEPT

    itself = False
    found: dict[Path, None] = {}
    for sidecar in sorted(_records(traces).glob("rank*.probe.json"))[:_MAX_SIDECARS]:
        try:
            meta = read_meta(sidecar)
        except ValueError:
            continue
        itself |= meta.get("job_profiler") is True
        named = meta.get("job_traces")
        for p in named[-JOB_TRACES_KEPT:] if isinstance(named, list) else []:
            if not isinstance(p, str) or not p.endswith(TRACE_SUFFIXES) or not os.path.isabs(p):
                continue
            try:
                st = os.lstat(p)
            except (OSError, ValueError):
                continue
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                found[Path(p)] = None
    return itself, list(found) if itself else []


def _before_the_window(traces: Path, schedule: str) -> str:
    """Why no trace, when the probes' step logs say it: every rank ended before the profiler's
    window began (a short test run under the default 2,2,5); '' otherwise."""
    from diagnose.probedata import has_records
    from diagnose.probes.core import Schedule

    sch = Schedule.parse(schedule)
    if not sch.enabled:
        return (" (--schedule off: timings only, in the run directory's step logs: `diagnose changes "
                f"{one_line(str(traces.parent))}` reads them)")
    logs = last_attempt(traces, has_records)[0]
    steps = []
    for log in sorted(logs.glob("rank*.steps.jsonl"))[:64]:
        try:
            with log.open("rb") as f:  # a step's line (not the device's last-steps line of a CUDA rank)
                steps.append(sum(1 for line in f if line.startswith(b'{"step"')))
        except OSError:
            continue
    first = sch.wait + sch.warmup + 1  # the first recorded step, counted from 1
    if not steps or max(steps) >= first:
        return ""
    ran = max(steps)
    earlier = f" or an earlier window (--schedule 0,1,{ran - 1})" if ran >= 2 else ""
    return (f": the job ran {ran} step(s), and the profiler's window (--schedule {schedule}) records from step "
            f"{first}; rerun with more steps{earlier}")


def _wrote_traces(traces: Path) -> bool:
    from diagnose.ingest.discover import discover_traces, has_traces

    try:
        return bool(discover_traces([last_attempt(traces, has_traces)[0]]))
    except DiagnoseError:
        return False


def nodes_of(command: list[str], env: dict | None = None) -> int | None:
    """How many nodes the job spans when more than one: torchrun's --nnodes (N, or MIN:MAX: at
    most MAX; read before the script's own arguments), else the Slurm allocation the launcher
    runs in; None for one node or unknown."""
    env = os.environ if env is None else env
    launcher = command[:next((i for i, a in enumerate(command) if a.endswith(".py")), len(command))]
    values = [a.split("=", 1)[1] for a in launcher if a.startswith("--nnodes=")]
    values += [b for a, b in pairwise(launcher) if a == "--nnodes"]
    if values:
        try:
            n = max(int(x) for x in values[-1].split(":"))
        except ValueError:
            return None
    else:
        n = next((int(env[k]) for k in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES") if env.get(k, "").isdigit()), None)
    return n if n and n > 1 else None


def script_args(command: list[str]) -> list[str]:
    """The script part of a `python train.py ARGS` command, for `diagnose scale` to run under its own
    torchrun (`-m pkg` becomes torchrun's `--module pkg`)."""
    script = list(command)
    if script and Path(script[0]).name.startswith("python"):
        script = script[1:]
    if not script:
        raise DiagnoseError("give the script command after --: python train.py ARGS")
    if Path(script[0]).name == "torchrun" or script[:2] == ["-m", "torch.distributed.run"]:
        raise DiagnoseError("give the script command (python train.py ...); diagnose scale runs torchrun itself")
    if script[0] == "-m":
        script = ["--module", *script[1:]]
    return script


def with_batch(args: list[str], flag: str, value: int) -> list[str]:
    """ARGS with the per-rank batch flag set to `value`: its value replaced (`--flag V` or
    `--flag=V`), filled in when the flag ends the command, else the flag appended."""
    out = list(args)
    for i, a in enumerate(out):
        if a == flag:
            if i + 1 < len(out):
                out[i + 1] = str(value)
            else:
                out.append(str(value))  # the flag was the last argument: give it its value
            return out
        if a.startswith(flag + "="):
            out[i] = f"{flag}={value}"
            return out
    return out + [flag, str(value)]
