"""Shared fixtures: the real traces in ../shared/traces and real torchrun jobs."""
from __future__ import annotations

import fcntl
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# DIAGNOSE_SHARED_TRACES: where ../shared/traces is when the tests run from a copy of the
# repository (the mutation run's mutants/ folder)
SHARED = Path(os.environ.get("DIAGNOSE_SHARED_TRACES") or ROOT.parent / "shared" / "traces")
EXAMPLE = ROOT / "examples" / "train_ddp.py"


def shared(name: str) -> Path:
    p = SHARED / name
    if not p.exists():
        pytest.skip(f"shared trace set {name} not found at {p} (clone without ../shared)")
    return p


def _mutant() -> str:
    """The mutant a mutation run (benchmarks/mutation.py, with mutmut) has switched on in this
    process: part of every cache key below, so that no mutant is tested against results the
    unmutated code made. While mutmut records which tests reach which function ("stats"), each
    test gets its own key: a test that read another test's cached diagnosis would otherwise not
    be counted as reaching the analyzers, and would never be run against their mutants."""
    m = os.environ.get("MUTANT_UNDER_TEST", "")
    if m == "stats":
        return "stats:" + os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    return m


_LOAD_PHASE: set[str] = set()
"""mutmut's names of the analyzer functions that ran while a run was loaded (each check's
per-rank reduce phase and what it calls), seen while the unmutated code loaded each run. A
mutant anywhere else cannot change a loaded run: it reuses the unmutated load (made before
mutmut forks the process that tests it) and only the analysis is repeated. A mutant in this set
loads its own. (Not knowing a function can only make its mutant look harmless, never hide one
that is caught: the score errs low.)"""


def _load_key() -> str:
    m = _mutant()
    if m and not m.startswith("stats:") and m.rsplit("__mutmut_", 1)[0] not in _LOAD_PHASE:
        return ""
    return m


def _load(paths: list[Path]):
    from diagnose.analyzers import reduce_rank
    from diagnose.ingest.assemble import load_run

    if os.environ.get("MUTANT_UNDER_TEST") != "":  # not mutmut's unmutated run: just load
        return load_run(paths, reduce=reduce_rank)

    def seen(frame, event, arg):
        if event == "call" and frame.f_code.co_name.endswith("__mutmut_orig"):
            _LOAD_PHASE.add(f'{frame.f_globals.get("__name__")}.{frame.f_code.co_name[:-len("__mutmut_orig")]}')

    sys.setprofile(seen)
    try:
        return load_run(paths, reduce=reduce_rank, jobs=1)  # in this process, where the profiler sees it
    finally:
        sys.setprofile(None)


@functools.cache
def _run(path: str, key: str):
    return _load([Path(path)])


@functools.cache
def _diagnosis(path: str, mutant: str, overrides: tuple[tuple[str, float], ...] = ()):
    """A diagnosis as `diagnose analyze` makes it (diagnose_paths), from the cached load."""
    import dataclasses

    from diagnose.pipeline import diagnose_run
    from diagnose.probedata import load_probe_data
    from diagnose.thresholds import DEFAULT

    run = _run(path, _load_key())
    probes = load_probe_data([path])
    extra = [w for p in probes.values() for w in p.warnings]
    th = dataclasses.replace(DEFAULT, **dict(overrides))
    return diagnose_run(dataclasses.replace(run, warnings=run.warnings + extra) if extra else run, th, probes)


FLOORS = ("input_bound", "input_stall", "communication", "straggler", "launch_overhead", "cpu_op_overhead",
          "pipeline_bubble", "checkpoint", "host_sync", "device_wait", "grad_sync", "reduce_dtype", "healthy_floor_ms")
"""Every floor a time check flags from: all at zero, every check that can measure its cause flags."""


def shared_diagnosis(name: str):
    """The diagnosis of one shared trace set with default thresholds, made once per test session
    (a Diagnosis is frozen: tests read it, never change it)."""
    return _diagnosis(str(shared(name)), _mutant())


def floor_diagnosis(name: str):
    """The diagnosis of one shared trace set with every flag floor at zero: each check that can
    measure its cause flags, so the finding it would print just past its threshold (ranks, cited
    events, confidence, notes) can be read and pinned on every trace, not only where it fires."""
    return _diagnosis(str(shared(name)), _mutant(), tuple((f, 0.0) for f in FLOORS))


def threshold_diagnosis(path: Path, **thresholds: float):
    """The diagnosis of a shared trace set or recorded job with these thresholds changed, once per session."""
    return _diagnosis(str(path), _mutant(), tuple(sorted(thresholds.items())))


def fixture_diagnosis(path: Path):
    """The diagnosis of a recorded job kept in tests/fixtures, once per test session."""
    return _diagnosis(str(path), _mutant())


def shared_run(name: str):
    """One shared trace set loaded as a Run, once per test session (read it, never change it)."""
    return _run(str(shared(name)), _load_key())


def fixture_run(path: Path):
    """A recorded job kept in tests/fixtures, loaded as a Run once per test session."""
    return _run(str(path), _load_key())


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A directory `build(directory)` fills, made once for the whole test session: the two
    pytest-xdist workers share one (the first builds it under a lock, the other waits for it), so
    a slow build costs the machine once, not once per core."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the workers' temp directories sit side by side under this one
    out, done = base / f"built-{name}", base / f"built-{name}.done"
    with open(base / f"built-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            out.mkdir(exist_ok=True)
            build(out)
            done.touch()
    return out


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


@pytest.fixture
def gloo_world_of_one():
    """A real gloo process group of one rank in this process, destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _compile_the_package() -> None:
    """Byte-compile the repository's own code once. These machines set PYTHONDONTWRITEBYTECODE,
    so every `diagnose ...` subprocess a test starts (dozens) would otherwise compile the whole
    package again from source (0.7 s each here); Python still reads a .pyc it finds up to date.
    Installed libraries are compiled by pip already."""
    import compileall
    for folder in ("diagnose", "probes", "reports", "examples"):
        if (ROOT / folder).is_dir():
            compileall.compile_dir(ROOT / folder, quiet=2)


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """`pytest -q` (the README's command) still names each test file as it starts, so a long run
    shows where it is (pytest shows file names only at default verbosity)."""
    _compile_the_package()
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None and config.getoption("verbose") < 0:
        tr.showfspath = True


def kept_once(loaded, disk: bool = True) -> None:
    """What the parent keeps of each rank (#20: the client's memory per rank). File metadata, cut
    to the keys read after loading (assemble.META_READ: distributedInfo without the rank, which
    made each rank's differ; the trace's name gone), is one object for every rank of one host
    (checked by identity, not by equality). With a disk, what is read once or for a few ranks lies
    in the spill file (ingest/spill.py); without one, it stays in memory and the ranks' repeated
    op names are one object each."""
    from diagnose.ingest.assemble import META_READ
    from diagnose.ingest.spill import Spilled, SpilledMap

    ok = [x for x in loaded if x.trace is not None]
    assert len(ok) >= 2
    first = ok[0].trace
    assert set(first.meta) <= set(META_READ) and "deviceProperties" in first.meta
    assert "rank" not in first.meta["distributedInfo"] and first.meta["distributedInfo"]["world_size"] == 8
    assert len({x.trace.rank for x in ok}) == len(ok)  # each rank's own, read at loading
    for x in ok[1:]:
        assert x.trace.meta is first.meta
        assert x.trace.rank_source is first.rank_source and x.timeline.step_source is ok[0].timeline.step_source
    on_disk = [(x.facts, x.trace.events, x.idle, x.timeline.collectives, x.timeline.cover.lanes,
                x.timeline.cover.drawing, x.timeline.cover.exposed) for x in ok]
    assert all(isinstance(f, SpilledMap) == disk and all(isinstance(o, Spilled) == disk for o in rest)
               for f, *rest in on_disk)
    if not disk:
        names_once([x.facts["straggler"] for x in ok])
        first = {n: n for n, _, _ in ok[0].facts["straggler"].ops}
        cited = {n: n for x in ok for n in x.trace.events["name"] if n in first}  # one copy of each name seen
        shared = sum(1 for x in ok for n in x.trace.events["name"] if n in cited and n is cited[n])
        assert cited and shared == sum(1 for x in ok for n in x.trace.events["name"] if n in cited)


def names_once(ops) -> None:
    """The ranks' op summaries (why_late.RankOps) share each name they repeat: one object."""
    first = {n: n for n, _, _ in ops[0].ops}
    common = 0
    for o in ops[1:]:
        for n, _, _ in o.ops:
            if n in first:
                assert n is first[n]
                common += 1
    assert common > 100  # the eight DLRM ranks run the same kernels