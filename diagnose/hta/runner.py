"""Run HTA in a separate process, with a size budget and a time limit.

`run_hta(files, ...) -> HtaResult` never raises for anything HTA or the traces do: every
outcome is a status and, per analysis, either numbers or "HTA could not analyse this
trace: <reason>".

Why a child process: HTA's loader forks a pool, can take tens of seconds and most of a
GiB on a large trace, and some analyses hang or assert on odd input; a child can be
killed (its whole process group) on the time limit without harming the caller.
Why a staging directory: HTA reads every *.json / *.gz in its directory and crashes on a
stray file, and detects ranks with a regex that needs a space after `"rank":`; the
stage holds only links to our files, and the worker is told each file's rank.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from diagnose.errors import DiagnoseError
from diagnose.ingest.source import ReadState, iter_blocks

Status = Literal["ok", "not_requested", "not_installed", "failed", "skipped"]
COULD_NOT = "HTA could not analyse this trace: "
DEFAULT_BUDGET_MB = 256.0
"""Expanded (uncompressed) trace bytes HTA may load, all ranks together. HTA's load time and
memory grow with events x steps: a 100 MB, 132-step trace took 19.5 s and 754 MB peak."""
DEFAULT_TIMEOUT_S = 180.0
INSTALL_HINT = "pip install 'torch-diagnose[hta]' (traceinsight, HTA's current name, plus psutil)"
LOG_TAIL = 2000


@dataclass(frozen=True, slots=True)
class Analysis:
    """One HTA analysis: numbers when it ran, else why not (a sentence starting COULD_NOT)."""

    name: str
    data: dict | None = None
    """Per-rank numbers as the worker wrote them (microseconds, ratios 0..1)."""
    error: str | None = None
    seconds: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.data is not None


@dataclass(frozen=True, slots=True)
class HtaResult:
    status: Status
    reason: str = ""
    """Empty when status is 'ok'; else one sentence a user can act on."""
    version: str | None = None
    ranks: tuple[int, ...] = ()
    steps: tuple[int, ...] = ()
    """ProfilerStep numbers HTA kept (it drops the last step by default)."""
    load_s: float | None = None
    seconds: float | None = None
    analyses: dict[str, Analysis] = field(default_factory=dict)

    def get(self, name: str) -> Analysis:
        return self.analyses.get(name) or Analysis(name, error=COULD_NOT + (self.reason or "analysis not run"))


def hta_importable() -> str | None:
    """None when `import hta` works here; else why not. Cheap: hta/__init__ imports nothing heavy."""
    try:
        import hta  # noqa: F401
    except ImportError as exc:
        return f"HTA is not installed ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return None


def expanded_bytes(path: Path, limit: int) -> int:
    """Uncompressed size, counted up to just past `limit` by streaming the file through ingest's
    reader (every gzip member in turn). Not the gzip trailer's size field: it describes the last
    member only, so appending an empty member made a huge trace look empty to the budget."""
    if not _is_gzip(path):
        return path.stat().st_size
    state = ReadState(path=path, max_bytes=limit)
    try:
        for _ in iter_blocks(state):
            pass
    except DiagnoseError as exc:
        if state.total > limit:
            return state.total
        raise OSError(str(exc)) from None
    return state.total


def _total_expanded(paths: list[Path], budget: int) -> int:
    """All ranks' uncompressed bytes; once over the budget, the count stops (the answer is known)."""
    total = 0
    for p in paths:
        total += expanded_bytes(p, budget - total)
        if total > budget:
            break
    return total


def _stage(files: dict[int, Path], root: Path) -> dict[int, str]:
    """Link (or copy) each trace into root/traces under a rank-prefixed name; return rank -> name."""
    stage = root / "traces"
    stage.mkdir()
    names = {}
    for rank, src in sorted(files.items()):
        name = f"rank{rank}__{src.name}"
        if not name.endswith((".json", ".gz")):
            name += ".gz" if _is_gzip(src) else ".json"
        dst = stage / name
        try:
            os.symlink(src.resolve(), dst)
        except OSError:
            shutil.copyfile(src, dst)
        names[rank] = name
    return names


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _kill_group(proc: subprocess.Popen) -> None:
    killpg = getattr(os, "killpg", None)  # POSIX; elsewhere only the worker itself can be killed
    try:
        if killpg is None:
            raise ProcessLookupError
        killpg(proc.pid, signal.SIGKILL)  # the worker and the pool it forked: its own session
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _worker_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])  # so the child imports this same diagnose
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["MPLBACKEND"] = "Agg"
    return env


def _tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:LOG_TAIL]


def run_hta(files: dict[int, str | Path], *, budget_mb: float = DEFAULT_BUDGET_MB,
            timeout_s: float = DEFAULT_TIMEOUT_S, critical_path: bool = True) -> HtaResult:
    """Run HTA's analyses on these per-rank traces in a child process. Never raises for bad input."""
    if budget_mb <= 0 or timeout_s <= 0:
        raise ValueError("budget_mb and timeout_s must be positive")
    why = hta_importable()
    if why:
        return HtaResult("not_installed", why)
    paths = {int(r): Path(p) for r, p in files.items()}
    if not paths:
        return HtaResult("failed", COULD_NOT + "no trace files were given")
    budget = int(budget_mb * 1024**2)
    try:
        total = _total_expanded(list(paths.values()), budget)
    except OSError as exc:
        return HtaResult("failed", COULD_NOT + f"cannot read the trace files ({exc})")
    if total > budget:
        # counting stopped past the budget: the figure is a lower bound
        return HtaResult("skipped", f"HTA was not run: the traces expand to at least {total / 1024**2:,.0f} MB, over "
                         f"the {budget_mb:,.0f} MB budget (HTA's load time and memory grow with trace size; raise "
                         "the budget to run it anyway)")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diagnose-hta-") as tmp:
        root = Path(tmp)
        try:
            names = _stage(paths, root)
        except OSError as exc:
            return HtaResult("failed", COULD_NOT + f"cannot stage the trace files ({exc})")
        spec, result_path, log = root / "spec.json", root / "result.json", root / "worker.log"
        spec.write_text(json.dumps({"trace_dir": str(root / "traces"), "files": names,
                                    "critical_path": critical_path}))
        timed_out = False
        with open(log, "wb") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "diagnose.hta.worker", str(spec), str(result_path)],
                                    cwd=tmp, env=_worker_env(), stdin=subprocess.DEVNULL, stdout=logf,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc, timed_out = None, True
            except BaseException:
                _kill_group(proc)  # Ctrl-C: leave no HTA process behind
                raise
        try:
            raw = json.loads(result_path.read_text())
        except (OSError, ValueError):
            raw = {}
        return _result(raw, rc, timed_out, timeout_s, _tail(log), round(time.perf_counter() - t0, 3),
                       critical_path)


def _result(raw: dict, rc: int | None, timed_out: bool, timeout_s: float, log_tail: str, seconds: float,
            critical_path: bool) -> HtaResult:
    common = {"version": raw.get("hta_version"), "ranks": tuple(raw.get("ranks") or ()),
              "steps": tuple(raw.get("steps") or ()), "load_s": raw.get("load_s"), "seconds": seconds}
    if raw.get("import_error"):
        return HtaResult("not_installed", f"HTA is installed but cannot be imported ({raw['import_error']}); "
                         f"{INSTALL_HINT}", **common)
    if raw.get("no_gpu"):
        return HtaResult("failed", COULD_NOT + raw["no_gpu"], **common)
    if raw.get("load_error"):
        return HtaResult("failed", COULD_NOT + f"loading failed ({raw['load_error']})", **common)
    limit = f"the {timeout_s:g} s time limit was reached before this analysis finished"
    if timed_out and "load_s" not in raw:
        return HtaResult("failed", COULD_NOT + f"the {timeout_s:g} s time limit was reached while HTA loaded "
                         "the traces (raise the time limit, or lower the trace size)", **common)
    if rc not in (0, None) and not raw.get("analyses"):
        return HtaResult("failed", COULD_NOT + f"the HTA process exited with status {rc}"
                         + (f" ({log_tail})" if log_tail else ""), **common)
    wanted = ["temporal", "overlap", "idle", "launch"] + (["critical_path"] if critical_path else [])
    analyses = {}
    for name in wanted:
        a = (raw.get("analyses") or {}).get(name)
        if a is None:
            why = limit if timed_out else f"the HTA process stopped (status {rc}) before this analysis"
            analyses[name] = Analysis(name, error=COULD_NOT + why)
        elif a.get("ok"):
            analyses[name] = Analysis(name, data=a.get("data") or {}, seconds=a.get("seconds"))
        else:
            analyses[name] = Analysis(name, error=COULD_NOT + str(a.get("error")), seconds=a.get("seconds"))
    if not any(a.ok for a in analyses.values()):
        first = next(iter(analyses.values()))
        return HtaResult("failed", first.error or COULD_NOT + "every analysis failed", analyses=analyses, **common)
    return HtaResult("ok", "", analyses=analyses, **common)

