"""Shared fixtures: the real traces in ../shared/traces and real torchrun jobs."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "traces"
EXAMPLE = ROOT / "examples" / "train_ddp.py"


def shared(name: str) -> Path:
    p = SHARED / name
    if not p.exists():
        pytest.skip(f"shared trace set {name} not found at {p} (clone without ../shared)")
    return p


@functools.cache
def shared_diagnosis(name: str):
    """The diagnosis of one shared trace set with default thresholds, made once per test session
    (a Diagnosis is frozen: tests read it, never change it)."""
    from diagnose.pipeline import diagnose_paths

    return diagnose_paths([shared(name)])


@functools.cache
def shared_run(name: str):
    """One shared trace set loaded as a Run, once per test session (read it, never change it)."""
    from diagnose.analyzers import reduce_rank
    from diagnose.ingest.assemble import load_run

    return load_run([shared(name)], reduce=reduce_rank)


def run_dir(out: Path) -> Path:
    """The one run directory `diagnose run --out OUT` made in OUT (it writes into a fresh OUT/<time>/)."""
    from diagnose.rundir import run_dirs

    runs = run_dirs(out)
    assert len(runs) == 1, f"expected one run directory in {out}, found {[r.name for r in runs]}"
    return runs[0]


def torchrun(out: Path, *args: str, nproc: int = 2, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the example DDP job for real (gloo, CPU), writing profiler traces to out."""
    pytest.importorskip("torch")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={_free_port()}",
           str(EXAMPLE), "--trace-dir", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
