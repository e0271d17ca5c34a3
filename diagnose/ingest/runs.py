"""Several runs written into one directory: which files are which run, and the one asked for.

Rerunning a job into the same directory is the commonest way to get two traces for one rank:
`tensorboard_trace_handler` names each file `{host}_{pid}.{time_ns}.pt.trace.json`, so a rerun
adds its files beside the last run's. The loader refuses such a directory ("two traces for rank
R ... two runs in one directory"): the runs are never mixed, and which one a user wants is never
guessed. `diagnose analyze --run K` picks one: 1 the first, -1 the newest.

A run is told from another by what each file's first bytes say (windows.read_header: the rank,
the host and the pid of the process that wrote it, and when it started): one process a rank, the
processes of one run starting before any of the next run's. Taken for runs only where the
files say so unambiguously: every process named by its bytes, and the runs apart in time (the gap
between one run's last process start and the next run's first wider than either run's own spread
of starts). A process of one job counted into another's run would widen that run's spread past
the gap: two jobs whose processes started interleaved stay refused. Runs may differ in their
ranks (a job rerun on more devices: `diagnose scale`'s question); the chosen run's missing ranks
are said as any run's are.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from diagnose.errors import DiagnoseError
from diagnose.ingest.discover import rank_from_name
from diagnose.ingest.windows import Header, read_header, trace_files, wall_time


@dataclass(frozen=True, slots=True)
class RunChoice:
    files: list[Path]
    """The chosen run's traces (each rank's process's files: its windows, if it wrote several)."""
    note: str
    """The warning that says which run of how many, and when each started."""


@dataclass(frozen=True, slots=True)
class Process:
    """One process that wrote traces: its rank, when its first trace starts, its files in order."""

    rank: int
    start_us: float
    files: tuple[Path, ...]


def _processes(files: list[Path]) -> list[Process] | None:
    """The processes that wrote the files, in the order they started; None where a file's first
    bytes do not say which process wrote it, or one process wrote traces of two ranks."""
    by: dict[tuple[str | None, int], list[tuple[Path, Header]]] = {}
    for f in files:
        h = read_header(f)
        if h is None or h.pid is None or h.start_us is None:
            return None
        by.setdefault((h.host, h.pid), []).append((f, h))
    out = []
    for got in by.values():
        ranks = {h.rank if h.rank is not None else rank_from_name(f) for f, h in got}
        if len(ranks) != 1:
            return None
        rank = ranks.pop()
        out.append(Process(rank=0 if rank is None else rank, start_us=min(h.start_us for _, h in got),
                            files=tuple(f for f, _ in sorted(got, key=lambda fh: fh[1].start_us))))
    return sorted(out, key=lambda p: p.start_us)


def split_runs(files: list[Path]) -> list[list[Process]] | None:
    """The files' processes as runs one after the other (module doc), oldest first; None where
    they are not that (one run, or files that do not say)."""
    procs = _processes(files)
    if procs is None:
        return None
    runs: list[list[Process]] = [[]]
    for p in procs:
        if any(q.rank == p.rank for q in runs[-1]):
            runs.append([])
        runs[-1].append(p)
    if len(runs) < 2:
        return None
    spread = [r[-1].start_us - r[0].start_us for r in runs]
    for k in range(len(runs) - 1):
        gap = runs[k + 1][0].start_us - runs[k][-1].start_us
        if gap <= max(spread[k], spread[k + 1]):
            return None  # interleaved: two jobs at once, not one run after another
    return runs


def choose_run(paths: list[str | Path], run: int) -> RunChoice:
    """The files of run `run` (1 the first, -1 the newest) among several written into the paths;
    DiagnoseError where they do not hold several runs one after another, or not that many."""
    files, _ = trace_files(paths)
    runs = split_runs(files) if len(files) > 1 else None
    where = Path(paths[0])
    if runs is None:
        raise DiagnoseError(f"--run {run}: not several runs one after another here (each rank's traces from one "
                            "process, or files that do not say which process wrote them)", where)
    k = run if run > 0 else len(runs) + 1 + run
    if not 1 <= k <= len(runs):
        raise DiagnoseError(f"--run {run}: {len(runs)} runs here (1 the first, -1 the newest)", where)
    chosen = runs[k - 1]
    starts = ", ".join(f"{i + 1}: {wall_time(r[0].start_us) or f'{r[0].start_us / 1e6:.0f} s'}"
                       for i, r in enumerate(runs))
    others = sum(len(p.files) for r in runs if r is not chosen for p in r)
    note = (f"{where}: {len(runs)} runs written into one place (started {starts}); run {k} is analysed "
            f"(--run {run}), the other runs' {others} trace(s) are not read")
    return RunChoice(files=[f for p in sorted(chosen, key=lambda p: p.rank) for f in p.files], note=note)
