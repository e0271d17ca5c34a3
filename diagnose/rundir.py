"""Run directories: every `diagnose run` / `diagnose demo` writes into a fresh one.

Layout: `--out PARENT` holds one directory per run, named by its local start time
(`20261201-153000`; `-2`, `-3`... for runs started in the same second), each holding
`traces/` (per-rank traces and probe sidecars), `diagnosis.json`, `report.html` and `.lock`.
A job torchelastic may restart (`torchrun --max-restarts N`, N > 0) writes each attempt into
`traces/attempt{K}/` (probes/core.py): the analysis reads the last one that holds traces and
names the others (`last_attempt`).

Why fresh: two runs in one directory mixed their traces ("two traces for rank 0") and step
logs, and a job that wrote nothing was "diagnosed" from the previous run's traces. The name is
taken with an exclusive mkdir, so two concurrent runs never share a directory.

Why the lock: the launcher holds an exclusive `flock` on `.lock` for the run's life (the job's
leader process shares it), so a second writer into the same run directory is refused, and the
on-call commands tell a live run from a finished one by trying the lock (`run_is_live`).
"""
from __future__ import annotations

import fcntl
import os
import re
import stat
import time
from collections.abc import Callable
from pathlib import Path

from diagnose.errors import DiagnoseError
from diagnose.probes.safefs import SafeDir, shared_warning

TRACES = "traces"
LOCK = ".lock"
RUN_NAME = re.compile(r"^(\d{8}-\d{6})(?:-(\d+))?$")
ATTEMPT = re.compile(r"^attempt(\d+)$")
MAX_SAME_SECOND = 1000


def create_run_dir(parent: Path, now: float | None = None) -> Path:
    """PARENT/<YYYYmmdd-HHMMSS>[-N] with an empty traces/ inside; raises OSError when it cannot be made."""
    parent.mkdir(parents=True, exist_ok=True)
    base = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    for i in range(1, MAX_SAME_SECOND + 1):
        run = parent / (base if i == 1 else f"{base}-{i}")
        try:
            os.mkdir(run)  # exclusive: a concurrent run that took this name makes us try the next one
        except FileExistsError:
            continue
        # through the new directory's descriptor: a name swapped for a symlink meanwhile is refused
        with SafeDir.open(run, create=False, strict=True) as d:
            d.subdir(TRACES).close()
        return run
    raise FileExistsError(f"{parent}: {MAX_SAME_SECOND} runs already started in the same second")


class RunLock:
    """The exclusive lock a run holds on RUN_DIR/.lock while its job runs and is analysed."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        path = run_dir / LOCK
        # no symlink, no FIFO: a planted .lock must not redirect or block the launcher
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise DiagnoseError("not a regular file", path)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DiagnoseError("another `diagnose run` is writing into this run directory", run_dir) from None
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path)

    def release(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)  # closing our descriptor drops our hold; the job's leader may still hold it

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def run_of(path: Path) -> Path:
    """The run directory of a run directory, of its traces/ folder or of an attempt's in it."""
    if ATTEMPT.match(path.name) and path.parent.name == TRACES:
        path = path.parent
    return path.parent if path.name == TRACES else path


def run_is_live(run_dir: str | Path) -> bool | None:
    """True while a `diagnose run` (or its job) holds the run's lock; False once released (the run
    finished, or its launcher was killed); None without a lock file (not made by `diagnose run`)."""
    path = run_of(Path(run_dir)) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return None
        return False
    finally:
        os.close(fd)  # also drops the shared lock we may have taken


def _order(name: str) -> tuple[str, int] | None:
    m = RUN_NAME.match(name)
    return (m.group(1), int(m.group(2) or 1)) if m else None


def run_dirs(parent: Path) -> list[Path]:
    """The timestamped run directories in PARENT, oldest first (by name: the start time)."""
    try:
        entries = [(key, p) for p in parent.iterdir() if (key := _order(p.name)) is not None]
    except OSError:
        return []
    return [p for key, p in sorted(entries) if p.is_dir() and not p.is_symlink()]


def newest_run(parent: Path, accept: Callable[[Path], bool]) -> Path | None:
    """The newest run directory in PARENT that `accept`s, or None."""
    for run in reversed(run_dirs(parent)):
        if accept(run):
            return run
    return None


def resolve_run(path: Path) -> Path:
    """A run directory as given, or the newest one with traces when PATH is the parent (`--out`)."""
    if (path / TRACES).is_dir() or not run_dirs(path):
        return path
    return newest_run(path, lambda r: (r / TRACES).is_dir()) or path


def sharing_warning(run_dir: Path) -> str | None:
    """One line when others may replace names in the run directory or its parent (group or world
    writable, no sticky bit); None otherwise."""
    for d in (run_dir, run_dir.parent):
        try:
            w = shared_warning(os.stat(d), str(d))
        except OSError:
            continue
        if w:
            return w
    return None


def attempts(directory: Path) -> list[Path]:
    """The torchelastic attempts' subdirectories of a probe directory, first to last (by number)."""
    try:
        found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := ATTEMPT.match(p.name))]
    except OSError:
        return []
    return [p for _, p in sorted(found) if p.is_dir() and not p.is_symlink()]


def last_attempt(path: Path, holds: Callable[[Path], bool]) -> tuple[Path, str | None]:
    """PATH, or, when PATH (a probe directory, or a run directory holding one in traces/) holds a
    restarted job's attempts, the last of them that `holds` what the caller reads, with one line
    naming it and the others; (PATH, None) for any other directory."""
    for d in (path, path / TRACES):
        runs = attempts(d)
        if runs:
            break
    else:
        return path, None
    chosen = next((a for a in reversed(runs) if holds(a)), None)
    if chosen is None:
        return path, None
    others = [a.name for a in runs if a != chosen]
    if not others:
        return chosen, None
    return chosen, (f"{d}: the job was restarted by torchelastic ({len(runs)} attempts); read its last attempt "
                    f"with data, {chosen.name} (an earlier one: diagnose analyze {d / others[-1]})")
