"""Parse one Kineto / Chrome-trace file into a columnar table (a RankTrace).

Streaming: blocks are decompressed (`source`), cut into event chunks and parsed
(`stream`), and reduced chunk by chunk to integer-coded columns (`columns`). The raw
JSON and its Python objects never exist whole, so memory stays near the size of the
columns, whatever the file size.

Bad input (see docs/bad-input.md): anything unreadable raises DiagnoseError naming
the file and the problem; anything partly readable is read as far as it is valid,
with what was skipped counted in `warnings`. A truncated file (killed job) keeps its
events up to the last complete one (`salvaged`); steps that end after the cut are
dropped, since events written after it (later steps, and the threads or GPU activity
Kineto writes last) are missing.
"""
from __future__ import annotations

import gc
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from diagnose.errors import DiagnoseError
from diagnose.ingest.columns import (  # the vocabulary every stage uses, re-exported
    COLUMNS,
    COMM_KERNEL,
    KIND_ANNOTATION,
    KIND_COMM_KERNEL,
    KIND_CPU_OP,
    KIND_GPU_ANNOTATION,
    KIND_KERNEL,
    KIND_MEMCPY,
    KIND_MEMSET,
    KIND_RUNTIME,
    KINDS,
    KNOWN_UNUSED,
    EventTable,
)
from diagnose.ingest.discover import rank_from_name
from diagnose.ingest.jsonsafe import clean_str
from diagnose.ingest.source import ReadState, iter_blocks
from diagnose.ingest.spill import Spilled
from diagnose.ingest.stream import parse_stream

DEFAULT_MAX_BYTES = 8 * 1024**3
__all__ = ["COLUMNS", "COMM_KERNEL", "DEFAULT_MAX_BYTES", "KINDS", "KIND_ANNOTATION", "KIND_COMM_KERNEL",
           "KIND_CPU_OP", "KIND_GPU_ANNOTATION", "KIND_KERNEL", "KIND_MEMCPY", "KIND_MEMSET", "KIND_RUNTIME",
           "RankTrace", "base_offset_us", "load_trace"]
# Step markers, as timeline.py finds them (not imported: timeline imports this module).
_STEP_MARKER = re.compile(r"^(ProfilerStep#\d+$|Optimizer\.step#)")


def base_offset_us(meta: dict) -> float:
    """What puts a trace's event times on the wall clock (us): Kineto's `baseTimeNanoseconds`,
    where the file gives one; 0 where not (its times are then on a clock of their own)."""
    base = meta.get("baseTimeNanoseconds")
    return base / 1000 if type(base) is int and base > 0 else 0.0


@dataclass(slots=True)
class RankTrace:
    """One parsed trace file. `events` holds complete ('X') events only."""

    path: Path
    rank: int | None
    rank_source: str
    """'distributedInfo', 'file name' or 'assumed'."""
    meta: dict
    """Top-level keys other than traceEvents (distributedInfo, deviceProperties, ...)."""
    events: pd.DataFrame | Spilled
    """In the parent after the checks' per-rank reductions: the events cited as evidence, on disk
    (ingest/assemble.Keep; a Spilled, read back by Context.event_ref)."""
    comm_args: pd.DataFrame | None
    """Args of collective-describing events (and the input types of matrix ops: columns.MATRIX_OPS),
    indexed like `events`. None after the checks' per-rank reductions: only they read it, and an
    empty frame still costs the parent ~3 KB a rank (#20)."""
    thread_names: dict[str, str]
    """'pid:tid' -> the thread's name (M events). Empty after the checks' per-rank reductions."""
    flows: int = 0
    """Flow events ('s'/'f'): their absence in a GPU trace suggests sampled or filtered events."""
    dropped: int = 0
    """Events skipped as malformed (missing or non-numeric ts/dur, negative dur, unparseable)."""
    warnings: list[str] = field(default_factory=list)
    salvaged: bool = False
    """The file was cut (killed job): events up to the last complete one were kept and
    steps ending after the cut dropped. Findings that rely on this rank deserve less trust."""
    bytes_read: int = 0
    """Uncompressed size of the file."""
    span_us: tuple[float, float] | None = None
    """[first event start, last event end] in the file's clock, taken before any reduction."""
    hip: bool = False
    """AMD (hip* runtime calls) rather than CUDA."""

    @property
    def world_size(self) -> int | None:
        info = self.meta.get("distributedInfo") or {}
        ws = info.get("world_size") if isinstance(info, dict) else None
        return ws if type(ws) is int and ws > 0 else None

    @property
    def backend(self) -> str | None:
        info = self.meta.get("distributedInfo") or {}
        b = info.get("backend") if isinstance(info, dict) else None
        return b if isinstance(b, str) else None


def load_trace(path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES, typed: bool = True) -> RankTrace:
    """Parse one trace file. Raises DiagnoseError naming the file on bad input.

    typed=False reads every chunk on the generic path (tests check both paths agree)."""
    path = Path(path)
    state = ReadState(path=path, max_bytes=max_bytes)
    table = EventTable()
    gc_was = gc.isenabled()
    gc.disable()  # parsing allocates millions of short-lived containers: collector passes are pure cost
    try:
        res = parse_stream(iter_blocks(state), table.add, path, table.add_raw if typed else None)
    finally:
        if gc_was:
            gc.enable()
    salvaged = res.salvaged
    if res.values == 0:
        if salvaged or state.cut:
            raise DiagnoseError("truncated before the first complete event (killed job?)", path)
        raise DiagnoseError("no trace events (an empty traceEvents list, or metadata only)", path)
    if table.rows == 0:
        raise DiagnoseError(f"no usable events: none of its {res.values} events is a complete ('X') event "
                            "with numeric ts/dur in a known category", path)
    events, comm_args = table.frame()
    notes: list[str] = []
    if salvaged and table.last_ts is not None:
        events, n_cut = _drop_steps_after(events, table.last_ts)
        if n_cut:
            notes.append(f"{n_cut} step marker(s) after the cut dropped")
    warnings = _warnings(path.name, state, res, table, notes)
    rank, source = _rank(res.meta, path)
    span = (float(events["ts"].min()), float((events["ts"] + events["dur"]).max())) if len(events) else None
    hip = bool(events["name"].cat.categories.str.startswith("hip").any())
    return RankTrace(path=path, rank=rank, rank_source=source, meta=res.meta, events=events,
                     comm_args=comm_args, thread_names=table.thread_names, flows=table.flows,
                     dropped=table.dropped + res.bad, warnings=warnings, salvaged=salvaged,
                     bytes_read=state.total, span_us=span, hip=hip)


def _rank(meta: dict, path: Path) -> tuple[int | None, str]:
    info = meta.get("distributedInfo")
    if isinstance(info, dict) and type(info.get("rank")) is int and info["rank"] >= 0:
        return info["rank"], "distributedInfo"
    rank = rank_from_name(path)
    return (rank, "file name") if rank is not None else (None, "assumed")


def _drop_steps_after(events: pd.DataFrame, horizon: float) -> tuple[pd.DataFrame, int]:
    """Without the step markers that end after the cut: those steps lack events."""
    cats = events["name"].cat.categories
    is_marker = np.fromiter((bool(_STEP_MARKER.match(c)) for c in cats), dtype=bool, count=len(cats))
    if not is_marker.any():
        return events, 0
    marker = is_marker[events["name"].cat.codes.to_numpy()]
    late = marker & ((events["ts"] + events["dur"]).to_numpy() > horizon)
    n = int(late.sum())
    if n == 0:
        return events, 0
    # rows keep their index: comm_args and evidence refer to events by row label
    return events[~late], n


def _warnings(name: str, state: ReadState, res, table: EventTable, notes: list[str]) -> list[str]:
    out: list[str] = []
    cut = [x for x in (state.cut, *res.notes, *notes) if x]
    if res.salvaged:
        cut.append("findings that rely on this rank are less certain")
    cut += state.notes
    if cut:
        out.append(f"{name}: {'; '.join(cut)}")
    if res.bad:
        out.append(f"{name}: skipped {res.bad} unparseable stretch(es) of events")
    if table.dropped:
        out.append(f"{name}: skipped {table.dropped} malformed events (missing or non-numeric ts/dur, "
                   "negative dur, non-string name)")
    if res.invalid_utf8:
        out.append(f"{name}: invalid UTF-8 bytes replaced by U+FFFD")
    unknown = {k: n for k, n in table.unknown_categories.items() if k not in KNOWN_UNUSED}
    if unknown:
        shown = ", ".join(clean_str(str(k)[:40]) for k in list(unknown)[:5]) + (" ..." if len(unknown) > 5 else "")
        out.append(f"{name}: ignored {sum(unknown.values())} events in unrecognised categories ({shown})")
    return out
