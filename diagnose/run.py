"""Assemble a Run: load every rank's trace, check they belong together, align clocks.

Policy for bad input (see README "Bad input"): a file that cannot be used is
skipped with its reason when other ranks remain (degrade); when nothing usable
remains, the first file's problem is raised (error, exit 2).
"""
from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from diagnose.errors import DiagnoseError
from diagnose.ingest import discover_traces, load_trace
from diagnose.ingest.load import DEFAULT_MAX_BYTES, RankTrace
from diagnose.timeline import RankTimeline, build_timeline

# Below this total size, worker processes cost more to start than they save.
PARALLEL_MIN_BYTES = 64 * 1024**2


@dataclass(slots=True)
class Run:
    traces: dict[int, RankTrace]
    timelines: dict[int, RankTimeline]
    world_size: int | None
    backend: str | None
    clock_offsets_us: dict[int, float]
    """Added to each rank's timestamps to put it on rank-reference time."""
    warnings: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.timelines)

    @property
    def missing_ranks(self) -> list[int]:
        if not self.world_size:
            return []
        return [r for r in range(self.world_size) if r not in self.timelines]

    @property
    def is_gpu(self) -> bool:
        return any(t.is_gpu for t in self.timelines.values())


def _load_one(args: tuple[str, int]) -> tuple[RankTrace | None, str | None]:
    path, max_bytes = args
    try:
        return load_trace(path, max_bytes), None
    except DiagnoseError as exc:
        return None, str(exc)


def load_files(files: list[Path], max_bytes: int, jobs: int | None) -> tuple[list[RankTrace], list[str]]:
    total = sum(f.stat().st_size for f in files)
    work = [(str(f), max_bytes) for f in files]
    workers = min(jobs or os.cpu_count() or 1, len(files))
    if workers > 1 and total >= PARALLEL_MIN_BYTES:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(_load_one, work))
    else:
        results = [_load_one(w) for w in work]
    traces = [t for t, _ in results if t is not None]
    errors = [e for _, e in results if e is not None]
    return traces, errors


def _assign_ranks(traces: list[RankTrace], warnings: list[str]) -> dict[int, RankTrace]:
    by_rank: dict[int, RankTrace] = {}
    unknown = [t for t in traces if t.rank is None]
    if unknown:
        if len(traces) == 1:
            unknown[0].rank = 0
            warnings.append(f"{unknown[0].path.name}: no rank in distributedInfo or file name; assumed rank 0")
        else:
            names = ", ".join(t.path.name for t in unknown)
            raise DiagnoseError(f"cannot tell the rank of {names} (no distributedInfo, no rankN/workerN "
                                "in the name); rename the files rankN.json or pass them one at a time",
                                unknown[0].path)
    for t in traces:
        assert t.rank is not None
        if t.rank in by_rank:
            raise DiagnoseError(f"two traces for rank {t.rank}: {by_rank[t.rank].path.name} and "
                                f"{t.path.name} (mixed runs or repeated captures?); pass one run's files",
                                t.path.parent)
        by_rank[t.rank] = t
    return by_rank


def _check_one_run(by_rank: dict[int, RankTrace]) -> int | None:
    sizes = {r: t.world_size for r, t in by_rank.items() if t.world_size}
    distinct = sorted(set(sizes.values()))
    if len(distinct) > 1:
        parts = "; ".join(f"world size {w}: " + ", ".join(by_rank[r].path.name for r in sizes if sizes[r] == w)
                          for w in distinct)
        raise DiagnoseError(f"files from different runs ({parts}); pass one run's files",
                            next(iter(by_rank.values())).path.parent)
    return distinct[0] if distinct else None


def _align_clocks(run_tl: dict[int, RankTimeline], traces: dict[int, RankTrace],
                  warnings: list[str]) -> dict[int, float]:
    """Offsets that put every rank on the reference rank's clock.

    Ranks on one host share a clock (offset 0). Across hosts, matched collectives
    end together (everyone leaves a collective when the last one arrives and the
    transfer completes), so the median end-time difference is the clock offset.
    """
    offsets = {r: 0.0 for r in run_tl}
    hosts = {r: traces[r].meta.get("host_name") for r in run_tl}
    known = {h for h in hosts.values() if isinstance(h, str)}
    if len(known) <= 1 and all(isinstance(h, str) for h in hosts.values()):
        return offsets
    ref = min(run_tl)
    ref_c = run_tl[ref].collectives.set_index(["step", "pg", "seq"])["end"]
    if ref_c.empty:
        if len(known) > 1:
            warnings.append("ranks on several hosts and no collectives to align their clocks on: "
                            "cross-host timings are unaligned")
        return offsets
    for r, tl in run_tl.items():
        if r == ref or (isinstance(hosts[r], str) and hosts[r] == hosts[ref]):
            continue
        mine = tl.collectives.set_index(["step", "pg", "seq"])["end"]
        joined = pd.concat([ref_c.rename("ref"), mine.rename("me")], axis=1, join="inner")
        if len(joined) == 0:
            continue
        diff = (joined["ref"] - joined["me"]).to_numpy()
        off = float(np.median(diff))
        spread = float(np.median(np.abs(diff - off)))
        # same-host clocks agree to microseconds; only correct a clear, consistent offset
        if abs(off) > max(50.0, 5 * spread):
            offsets[r] = off
            warnings.append(f"rank {r}: clock offset {off / 1000:.3f} ms vs rank {ref} "
                            f"(from {len(joined)} matched collectives) applied")
    return offsets


def load_run(paths: list[str | Path], *, max_bytes: int = DEFAULT_MAX_BYTES, jobs: int | None = None) -> Run:
    files = discover_traces(paths)
    traces, errors = load_files(files, max_bytes, jobs)
    if not traces:
        raise DiagnoseError(errors[0] if len(errors) == 1 else f"{errors[0]} (and {len(errors) - 1} more)")
    warnings: list[str] = []
    skipped = list(errors)
    warnings += [f"skipped {e}" for e in errors]
    for t in traces:
        warnings += t.warnings
    by_rank = _assign_ranks(traces, warnings)
    world = _check_one_run(by_rank)
    timelines: dict[int, RankTimeline] = {}
    for r, t in sorted(by_rank.items()):
        tl = build_timeline(t, r)
        warnings += tl.warnings
        if len(tl.steps) == 0:
            skipped.append(f"{t.path}: no complete training step (no ProfilerStep#N or Optimizer.step markers)")
            continue
        timelines[r] = tl
    if not timelines:
        first = next(iter(by_rank.values())).path
        raise DiagnoseError("no complete training step found (no ProfilerStep#N or Optimizer.step markers; "
                            "an inference or non-training trace?)", first if len(by_rank) == 1 else first.parent)
    for s in skipped[len(errors):]:
        warnings.append(f"skipped {s}")
    backends = {t.backend for t in by_rank.values() if t.backend}
    run = Run(traces={r: by_rank[r] for r in timelines}, timelines=timelines, world_size=world,
              backend=next(iter(backends)) if len(backends) == 1 else None, clock_offsets_us={},
              warnings=warnings, skipped=skipped)
    run.clock_offsets_us = _align_clocks(timelines, run.traces, warnings)
    if run.missing_ranks:
        found = len(run.ranks)
        miss = run.missing_ranks
        shown = ", ".join(map(str, miss[:10])) + (" ..." if len(miss) > 10 else "")
        warnings.append(f"{found} of {world} ranks: missing rank(s) {shown}")
    return run
