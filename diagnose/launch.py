"""`diagnose run`: launch a user's command with the probes injected, then diagnose it.

The probes ride in through PYTHONPATH: `probes/bootstrap/sitecustomize.py` is
imported by every Python process of the job (torchrun's workers included) and
installs the hooks once the script imports torch. Nothing in the user's script
changes. This module imports no torch itself.
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import click

from diagnose.errors import DiagnoseError


def bootstrap_dir() -> Path:
    import probes

    return Path(probes.__file__).resolve().parent / "bootstrap"


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
    boot = str(bootstrap_dir())
    # the probes package itself must be importable from the job, wherever it runs from
    pkg_root = str(bootstrap_dir().parent.parent)
    parts = [boot, pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["DIAGNOSE_PROBE_DIR"] = str(traces.resolve())
    env["DIAGNOSE_PROBE_SCHEDULE"] = schedule
    if flight_recorder:
        for k, v in FLIGHT_RECORDER_ENV.items():  # a job's own settings win
            env.setdefault(k, v)
    return env


def run_with_probes(command: list[str], out: Path, schedule: str, quiet_job: bool = False,
                    echo: bool = True, flight_recorder: bool = False) -> int:
    """Run `command` under the probes, analyse what it wrote; return the command's exit code.

    quiet_job: keep the job's own output out of the terminal (the demo) unless it fails.
    flight_recorder: turn on torch.distributed's Flight Recorder, for `diagnose hang`.
    """
    traces = out / "traces"
    try:
        traces.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        click.echo(f"diagnose: warning: cannot create {traces} ({exc.strerror}); running without probes", err=True)
        return subprocess.call(command)
    env = probe_env(traces, schedule, flight_recorder=flight_recorder)
    sink = subprocess.PIPE if quiet_job else None
    try:
        proc = subprocess.Popen(command, env=env, stdout=sink, stderr=sink, text=True)
    except OSError as exc:
        click.echo(f"diagnose: error: cannot start {command[0]!r}: {exc.strerror or exc}", err=True)
        return 127
    # Ctrl-C goes to the whole process group already; forward SIGTERM so the job can clean up
    prev = signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
    try:
        job_out, job_err = proc.communicate()
        code = proc.returncode
    finally:
        signal.signal(signal.SIGTERM, prev)
    if quiet_job and code != 0:
        click.echo((job_err or job_out or "")[-3000:], err=True)
    from diagnose.cli import analyze_outputs

    try:
        analyze_outputs([str(traces)], out, echo=echo)
    except DiagnoseError as exc:
        click.echo(f"diagnose: could not analyse the run: {exc}", err=True)
    return code
