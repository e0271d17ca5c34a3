"""Find the per-rank trace files in what the user pointed at."""
from __future__ import annotations

import re
from pathlib import Path

from diagnose.errors import DiagnoseError
from diagnose.rundir import ATTEMPT, last_attempt

TRACE_SUFFIXES = (".json", ".json.gz")
# Our own outputs and sidecars live beside traces; they are not traces.
OWN_OUTPUTS = re.compile(r"(^diagnosis\.json$|^scaling\.json$|^diff\.json$|^capture\.json$|^hang\.json$|"
                         r"\.probe\.json$|\.capture\.json$|\.probe\.jsonl$|\.fr\.json$)")
_RANK_IN_NAME = re.compile(r"(?:rank|worker)[-_]?(\d+)", re.IGNORECASE)


def rank_from_name(path: Path) -> int | None:
    """`rank3`, `rank-3`, `rank_3`, `worker3` in the file name; None if absent."""
    m = _RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else None


def _is_file(p: Path) -> bool:
    try:
        return p.is_file()
    except OSError:
        return False


def _candidates(directory: Path) -> list[Path]:
    return sorted(
        p
        for p in _listdir(directory)
        # hidden names are temp files of a write in progress (ours and the profiler's): never traces
        if p.name.endswith(TRACE_SUFFIXES) and not p.name.startswith(".") and not OWN_OUTPUTS.search(p.name)
        and _is_file(p)
    )


def _listdir(directory: Path) -> list[Path]:
    try:
        return list(directory.iterdir())
    except OSError as exc:
        raise DiagnoseError(f"cannot list directory ({exc.strerror or exc})", directory) from None


def has_traces(directory: Path) -> bool:
    """The directory itself holds trace files (an unreadable one holds none we can use)."""
    try:
        return bool(_candidates(directory))
    except DiagnoseError:
        return False


def _subdirs_with_traces(directory: Path) -> list[Path]:
    out = []
    for d in sorted(_listdir(directory)):
        if d.name.startswith("."):
            continue  # a writer's private temp directory (safefs): its contents are not published yet
        try:
            if d.is_dir() and _candidates(d):
                out.append(d)
        except DiagnoseError:
            continue  # an unreadable subdirectory holds nothing we can use
    return out


def _runs_with_traces(parent: Path) -> list[Path]:
    from diagnose.rundir import TRACES, run_dirs

    return [r for r in run_dirs(parent)
            if (r / TRACES).is_dir() and has_traces(last_attempt(r / TRACES, has_traces)[0])]


def discover_traces(paths: list[str | Path]) -> list[Path]:
    """Files to load, from files and directories.

    A directory is searched itself; if it holds no trace, its immediate
    subdirectories are (`diagnose run` writes `DIR/traces/`). Traces in several
    subdirectories are refused rather than mixed: they are usually several runs.
    """
    found: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise DiagnoseError("no such file or directory", p)
        if _is_file(p):
            found.append(p)
            continue
        if not p.is_dir():
            raise DiagnoseError("not a regular file or a directory", p)
        files = _candidates(p)
        if not files:
            subdirs = _subdirs_with_traces(p)
            if len(subdirs) == 1:
                files = _candidates(subdirs[0])
            elif len(subdirs) > 1:
                names = ", ".join(d.name for d in subdirs)
                if all(ATTEMPT.match(d.name) for d in subdirs):  # probes/core.py: torchelastic restarts
                    last = last_attempt(p, has_traces)[0]
                    raise DiagnoseError(f"traces of {len(subdirs)} attempts of a job torchelastic restarted "
                                        f"({names}); pass one (the last: {last})", p)
                raise DiagnoseError(
                    f"traces in several subdirectories ({names}): likely several runs; pass one of them", p
                )
        if not files:
            runs = _runs_with_traces(p)
            if runs:  # `diagnose run --out` parent: say which run to pass, never guess one
                raise DiagnoseError(f"holds {len(runs)} run director{'y' if len(runs) == 1 else 'ies'} of "
                                    f"`diagnose run`, not traces; pass one (the newest: {runs[-1]})", p)
            raise DiagnoseError("no trace files (*.json, *.json.gz) found", p)
        found.extend(files)
    return list(dict.fromkeys(found))  # a file named twice is one file
