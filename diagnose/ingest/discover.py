"""Find the per-rank trace files in what the user pointed at."""
from __future__ import annotations

import re
from pathlib import Path

from diagnose.errors import DiagnoseError

TRACE_SUFFIXES = (".json", ".json.gz")
# Our own outputs and sidecars live beside traces; they are not traces.
OWN_OUTPUTS = re.compile(r"(^diagnosis\.json$|^scaling\.json$|^diff\.json$|^capture\.json$|\.probe\.json$|"
                         r"\.capture\.json$|\.probe\.jsonl$)")
_RANK_IN_NAME = re.compile(r"(?:rank|worker)[-_]?(\d+)", re.IGNORECASE)


def rank_from_name(path: Path) -> int | None:
    """`rank3`, `rank-3`, `rank_3`, `worker3` in the file name; None if absent."""
    m = _RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else None


def _candidates(directory: Path) -> list[Path]:
    return sorted(
        p
        for p in directory.iterdir()
        if p.is_file() and p.name.endswith(TRACE_SUFFIXES) and not OWN_OUTPUTS.search(p.name)
    )


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
        if p.is_file():
            found.append(p)
            continue
        files = _candidates(p)
        if not files:
            subdirs = sorted(d for d in p.iterdir() if d.is_dir() and _candidates(d))
            if len(subdirs) == 1:
                files = _candidates(subdirs[0])
            elif len(subdirs) > 1:
                names = ", ".join(d.name for d in subdirs)
                raise DiagnoseError(
                    f"traces in several subdirectories ({names}): likely several runs; pass one of them", p
                )
        if not files:
            raise DiagnoseError("no trace files (*.json, *.json.gz) found", p)
        found.extend(files)
    return found
