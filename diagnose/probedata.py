"""Read the probes' sidecars (`rank{R}.probe.json`, `rank{R}.steps.jsonl`) beside the traces.

They add what a few profiled steps cannot: every step's time, DataLoader wait and
collective arrivals, and run metadata (batch size, num_workers, model size). The
analysis works without them; with them, verdicts rest on every step.

Sidecars are untrusted like traces (a shared run directory, a job killed mid-write), so they get
the trace loader's guards: regular files only, opened non-blocking (a FIFO cannot stall the
reader), size caps, depth limits; a bad sidecar becomes one warning naming the file, never a
traceback. Step logs are read from the end, the newest MAX_STEP_LINES lines only, each line parsed
straight into typed columns: memory follows the lines kept, not the file or a dict per step.
"""
from __future__ import annotations

import math
import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pandas as pd

from diagnose.errors import one_line
from diagnose.ingest import jsonsafe
from diagnose.probes.core import MAX_GC_PASSES  # read a step record, as many as the probes write
from diagnose.probes.safefs import UnsafePath, open_regular, read_regular
from diagnose.probes.telemetry import SIGNALS as TELEMETRY_SIGNALS  # a missing one is NaN here, never 0
from diagnose.rundir import ATTEMPT

_SIDE = re.compile(r"^rank(\d+)\.(probe\.json|steps\.jsonl|steps\.1\.jsonl|telemetry\.jsonl)$")
MAX_STEP_LINES = 200_000  # bound memory on very long runs: the newest steps matter most
MAX_STEP_LINE_BYTES = 4 << 20
"""One step's record; thousands of collectives fit. A longer line is skipped, so a line without
a newline cannot make the reader hold a whole file."""
MAX_PROBE_JSON_BYTES = 16 << 20
"""probe.json holds metadata (a few KiB; per-save checkpoint records on long runs)."""
MAX_WORLD_SIZE = 1 << 20
"""Larger than any job; a sidecar claiming more is ignored (1e10 ranks made `hang` build a 1e10 list)."""
MAX_STEP = 1 << 62
READ_BLOCK = 1 << 20
BATCH_LINES = 4096
MAX_TELEMETRY_LINES = 100_000
"""Host and device samples kept per rank, the newest (2 days at the probes' one per 2 s)."""
STEP_COLUMNS = ["step", "start", "dur_ms", "dataloader_ms", "comm_ms", "device_ms", "first_batch_ms", "gc_ms",
                "gc_full", "gc_full_ms", "dataloader_gc_ms", "run_wait_ms"]
COLLECTIVE_COLUMNS = ["step", "seq", "name", "arrival", "dur_ms", "bytes", "group"]
GC_PASS_COLUMNS = ["step", "start", "dur_ms", "generation", "in_fetch"]
OPTIONAL_STEP_FIELDS = ("first_batch_ms", "gc_ms", "gc_full", "gc_full_ms", "dataloader_gc_ms")
"""Step-record fields the probes write only when non-zero (and older probes not at all): read as 0."""


@dataclass(frozen=True, slots=True)
class ProbeData:
    rank: int
    meta: dict
    steps: pd.DataFrame
    """step, start (epoch s), dur_ms (the host's), dataloader_ms, first_batch_ms (of it, the wait
    for a training iterator's first batch: an epoch's start; 0 where none, or the probe predates
    it), comm_ms, device_ms (the step as the device ran it, CUDA ranks; NaN where not timed),
    gc_ms, gc_full and gc_full_ms (time in Python's garbage collections of generations 1 and 2,
    how many were full passes and their time; 0 where none, or the probe predates their timing:
    its metadata's `gc` says it timed them), dataloader_gc_ms (of dataloader_ms, collections
    inside the fetches), run_wait_ms (the training thread's wait for a core during the step; NaN
    where not read: older probes, not Linux, the first step); warm-up step 0 excluded."""
    collectives: pd.DataFrame
    """step, seq, name, arrival (epoch s), dur_ms, bytes, group."""
    gc_passes: pd.DataFrame = field(default_factory=pd.DataFrame)
    """step, start (epoch s), dur_ms, generation, in_fetch (bool: inside a DataLoader fetch): each
    full collection, and each middle-generation one of a millisecond or more, where it ran (probes
    whose metadata `gc` says `placed`; empty otherwise)."""
    partial: bool = False
    warnings: tuple[str, ...] = field(default_factory=tuple)
    telemetry: pd.DataFrame = field(default_factory=pd.DataFrame)
    """wall (epoch s), step, and TELEMETRY_SIGNALS, one row per sample in time order (probes/telemetry.py);
    empty without the file."""


def has_device_times(p: ProbeData) -> bool:
    """The record carries steps as the device ran them (probes that time CUDA steps)."""
    return "device_ms" in p.steps and bool(p.steps["device_ms"].notna().any())


def signal_mean(p: ProbeData, name: str) -> float:
    """Mean of a telemetry signal (TELEMETRY_SIGNALS) over the rank's samples; NaN where the probes
    never read it (a missing sample is NaN, never 0)."""
    t = p.telemetry
    if t.empty or name not in t:
        return math.nan
    v = t[name].to_numpy(dtype=float)
    return float(np.nanmean(v)) if np.isfinite(v).any() else math.nan


RUN_WAIT_SAMPLES = 2
"""Telemetry samples of run_wait a rank needs for its share (one per 2 s: a run of a few seconds)."""


RUN_WAIT_STEPS = 5
"""Recorded steps with the training thread's run-queue wait a rank needs for its share from them."""


def run_wait_basis(p: ProbeData) -> tuple[float, str] | None:
    """The rank's training thread's share of wall time spent ready to run and waiting for a core,
    and what it is over: its recorded steps where the probes read the wait at every step end
    (run_wait_ms: every step, runs of a second too), else its telemetry samples (`run_wait`, one
    per 2 s); None with fewer than RUN_WAIT_STEPS such steps and RUN_WAIT_SAMPLES samples."""
    s = p.steps
    if not s.empty and "run_wait_ms" in s:
        w, dur = s["run_wait_ms"].to_numpy(dtype=float), s["dur_ms"].to_numpy(dtype=float)
        ok = np.isfinite(w) & np.isfinite(dur)
        if ok.sum() >= RUN_WAIT_STEPS and dur[ok].sum() > 0:
            return float(min(w[ok].sum() / dur[ok].sum(), 1.0)), f"{int(ok.sum())} recorded steps"
    t = p.telemetry
    if t.empty or "run_wait" not in t:
        return None
    w = t["run_wait"].to_numpy(dtype=float)
    ok = np.isfinite(w)
    return (float(np.mean(w[ok])), f"{int(ok.sum())} telemetry samples") if ok.sum() >= RUN_WAIT_SAMPLES else None


def run_wait_shares(probes: dict[int, ProbeData]) -> dict[int, float]:
    """run_wait_basis's share of every rank that has one."""
    return {r: b[0] for r, b in ((r, run_wait_basis(p)) for r, p in probes.items()) if b is not None}


def host_cores(p: ProbeData) -> int | None:
    """The rank's host's CPU count as its probes read it (None where not recorded)."""
    n = p.meta.get("cpu_count")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def ranks_on_host(probes: dict[int, ProbeData], rank: int) -> int:
    """Ranks whose probes name the same host as `rank`'s (1 where it names none)."""
    host = probes[rank].meta.get("host")
    return sum(1 for p in probes.values() if p.meta.get("host") == host) if host else 1


def job_step_ms(steps: pd.DataFrame) -> np.ndarray:
    """Each step's time as the job ran it: on a rank whose probes timed steps on the device, the
    device's, NaN for a step it did not time (a host that runs ahead of its device ends its steps
    early, probes/device_steps.py: standing in for the device, its time would mix two clocks in
    one series; recorded on an H200, the last 25 of 300 steps untimed, the host's 2-3 ms beside
    the device's 12.7 read as a change to a faster step); else the host's."""
    host = steps["dur_ms"].to_numpy(dtype=float)
    if "device_ms" not in steps:
        return host
    dev = steps["device_ms"].to_numpy(dtype=float)
    return dev if np.isfinite(dev).any() else host


def sane_world_size(value) -> int | None:
    """A sidecar's world size when it is one a job can have (an int in 1..MAX_WORLD_SIZE), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_WORLD_SIZE:
        return value
    return None


def read_json_sidecar(path: Path, max_bytes: int = MAX_PROBE_JSON_BYTES):
    """A JSON sidecar's value. Raises ValueError with a one-line reason naming the file for anything
    unusable: not a regular file (FIFO, device), too large, not JSON, nested too deep."""
    try:
        data = read_regular(path, max_bytes)
    except UnsafePath as exc:
        raise ValueError(one_line(str(exc))) from None
    except OSError as exc:
        raise ValueError(one_line(f"{path}: cannot read ({exc.strerror or exc})")) from None
    try:
        return jsonsafe.loads(data)
    except ValueError as exc:  # orjson's JSONDecodeError (its depth limit too) and TooDeep
        raise ValueError(one_line(f"{path}: not valid JSON ({exc})")) from None


def as_number(x) -> float:
    """A finite float, else NaN (a string or a nested value in a numeric field is not a number)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        try:
            f = float(x)
        except OverflowError:
            return math.nan
        return f if math.isfinite(f) else math.nan
    return math.nan


class _Columns:
    """Step records parsed straight into typed columns (no dict kept per step)."""

    __slots__ = ("step", "start", "dur", "dl", "comm", "run_wait", "optional", "c_step", "c_seq", "c_name", "c_arrival", "c_dur",
                 "c_bytes", "c_group", "d_step", "d_ms", "g_step", "g_start", "g_dur", "g_gen", "g_fetch", "codes")

    def __init__(self, codes: dict[str, int]) -> None:
        self.step, self.c_step = array("q"), array("q")
        self.start, self.dur, self.dl, self.comm = array("d"), array("d"), array("d"), array("d")
        self.run_wait = array("d")  # NaN where the record has none (older probes): not 0
        self.optional = {k: array("d") for k in OPTIONAL_STEP_FIELDS}
        self.c_seq, self.c_name, self.c_group = array("q"), array("q"), array("q")
        self.c_arrival, self.c_dur, self.c_bytes = array("d"), array("d"), array("d")
        self.d_step, self.d_ms = array("q"), array("d")  # earlier steps as the device ran them
        self.g_step, self.g_gen, self.g_fetch = array("q"), array("q"), array("q")  # garbage collections
        self.g_start, self.g_dur = array("d"), array("d")
        self.codes = codes  # shared string table: a collective's name and group are stored once

    def _code(self, s: str) -> int:
        code = self.codes.get(s)
        if code is None:
            code = self.codes[s] = len(self.codes)
        return code

    def add(self, r) -> None:
        """One step record; anything malformed is left out (the warm-up step 0 too). Device times
        count from any record, the probe's closing one (device times alone, no step) too."""
        if not isinstance(r, dict):
            return
        dev = r.get("device_ms")
        if isinstance(dev, list):
            for d in dev[:4096]:
                if (isinstance(d, list) and len(d) == 2 and isinstance(d[0], int) and not isinstance(d[0], bool)
                        and 0 < d[0] < MAX_STEP and as_number(d[1]) >= 0):
                    self.d_step.append(d[0])
                    self.d_ms.append(as_number(d[1]))
        step = r.get("step")
        if not (isinstance(step, int) and not isinstance(step, bool) and 0 < step < MAX_STEP):
            return
        start, dur = as_number(r.get("start")), as_number(r.get("dur_ms"))
        if math.isnan(start) or math.isnan(dur):
            return
        self.step.append(step)
        self.start.append(start)
        self.dur.append(dur)
        self.dl.append(as_number(r.get("dataloader_ms")))
        for k, column in self.optional.items():
            column.append(as_number(r.get(k, 0.0)))
        self.comm.append(as_number(r.get("comm_ms")))
        self.run_wait.append(as_number(r.get("run_wait_ms")))
        passes = r.get("gc_passes")
        if isinstance(passes, list):
            for g in passes[:MAX_GC_PASSES]:
                if not (isinstance(g, list) and len(g) == 4 and type(g[2]) is int and 0 < g[2] <= 2):
                    continue
                offset, gdur = as_number(g[0]), as_number(g[1])
                if math.isnan(offset) or not gdur > 0:
                    continue
                self.g_step.append(step)
                self.g_start.append(start + offset / 1000)
                self.g_dur.append(gdur)
                self.g_gen.append(g[2])
                self.g_fetch.append(1 if g[3] == 1 else 0)
        colls = r.get("collectives")
        if not isinstance(colls, list):
            return
        for seq, c in enumerate(colls):
            if not (isinstance(c, list) and len(c) >= 5 and isinstance(c[0], str)
                    and isinstance(c[4], (str, int)) and not isinstance(c[4], bool)):
                continue
            offset, cdur = as_number(c[1]), as_number(c[2])
            if math.isnan(offset) or math.isnan(cdur):
                continue
            self.c_step.append(step)
            self.c_seq.append(seq)
            self.c_name.append(self._code(c[0]))
            self.c_arrival.append(start + offset / 1000)
            self.c_dur.append(cdur)
            self.c_bytes.append(as_number(c[3]))
            self.c_group.append(self._code(str(c[4])))


def _frames(chunks: list[_Columns], codes: dict[str, int]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The chunks' columns joined in order, as the steps, collectives and gc passes frames. Each column's
    chunks are dropped once joined, so the peak holds about one extra column, not a second copy."""
    def col(name: str, dtype) -> np.ndarray:
        parts = [np.frombuffer(getattr(c, name), dtype=dtype) for c in chunks if len(getattr(c, name))]
        joined = np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
        del parts
        for c in chunks:
            setattr(c, name, array(getattr(c, name).typecode))
        return joined

    def optional(key: str) -> np.ndarray:  # as col(), for a field of OPTIONAL_STEP_FIELDS
        parts = [np.frombuffer(c.optional[key], dtype=np.float64) for c in chunks if len(c.optional[key])]
        joined = np.concatenate(parts) if parts else np.empty(0, dtype=np.float64)
        del parts
        for c in chunks:
            c.optional[key] = array("d")
        return joined

    step = col("step", np.int64)
    d_step, d_ms = col("d_step", np.int64), col("d_ms", np.float64)
    device = np.full(step.size, np.nan)
    if d_step.size and step.size:
        # a step's device time arrives in a later step's record: matched by step number (the last
        # reading of a step wins, as the last record of a step does)
        timed = pd.Series(d_ms, index=d_step)
        device = timed[~timed.index.duplicated(keep="last")].reindex(step).to_numpy(dtype=np.float64)
    steps = pd.DataFrame({"step": step, "start": col("start", np.float64), "dur_ms": col("dur", np.float64),
                          "dataloader_ms": col("dl", np.float64), "comm_ms": col("comm", np.float64),
                          "device_ms": device, **{k: optional(k) for k in OPTIONAL_STEP_FIELDS},
                          "run_wait_ms": col("run_wait", np.float64)},
                         columns=STEP_COLUMNS, copy=False)
    g_step = col("g_step", np.int64)
    passes = pd.DataFrame({"step": g_step, "start": col("g_start", np.float64), "dur_ms": col("g_dur", np.float64),
                           "generation": col("g_gen", np.int64), "in_fetch": col("g_fetch", np.int64) > 0},
                          columns=GC_PASS_COLUMNS, copy=False) if len(g_step) else pd.DataFrame()
    names = np.array(list(codes), dtype=object)
    c_step = col("c_step", np.int64)
    if not len(c_step):
        return steps, pd.DataFrame(), passes
    colls = pd.DataFrame({"step": c_step, "seq": col("c_seq", np.int64), "name": names[col("c_name", np.int64)],
                          "arrival": col("c_arrival", np.float64), "dur_ms": col("c_dur", np.float64),
                          "bytes": col("c_bytes", np.float64), "group": names[col("c_group", np.int64)]},
                         columns=COLLECTIVE_COLUMNS, copy=False)
    return steps, colls, passes


def _lines_newest_first(f: BinaryIO, size: int) -> Iterator[bytes | None]:
    """The file's lines from the end, newest first, reading blocks backwards (bounded memory).

    The first item is what follows the last newline (b"" for a file that ends with one: a rank
    killed mid-write leaves half a line there). None stands for a line over MAX_STEP_LINE_BYTES."""
    pos, tail, skipping = size, b"", False
    while pos > 0:
        n = min(READ_BLOCK, pos)
        pos -= n
        f.seek(pos)
        block = f.read(n)
        parts = block.split(b"\n")
        if len(parts) == 1:  # no newline in this block: the line goes on further back
            if not skipping:
                tail = block + tail
                if len(tail) > MAX_STEP_LINE_BYTES:
                    tail, skipping = b"", True
            continue
        last = None if skipping else parts[-1] + tail
        yield None if last is None or len(last) > MAX_STEP_LINE_BYTES else last
        for line in reversed(parts[1:-1]):
            yield line if len(line) <= MAX_STEP_LINE_BYTES else None
        tail, skipping = parts[0], False
        if len(tail) > MAX_STEP_LINE_BYTES:
            tail, skipping = b"", True
    yield None if skipping else tail


@dataclass(slots=True)
class _StepRead:
    chunks: list[_Columns]
    """Newest first; each chunk in file order."""
    codes: dict[str, int]
    lines: int = 0
    partial: bool = False
    bad: int = 0
    too_long: int = 0
    first_error: str = ""


def _read_steps(path: Path, into: _StepRead, budget: int) -> None:
    """The newest `budget` lines of a steps log into `into` (newest chunk first)."""
    with open_regular(path) as f:
        size = f.seek(0, 2)
        batch: list[bytes] = []

        def flush() -> None:
            chunk = _Columns(into.codes)
            for raw in reversed(batch):  # back to file order: collectives keep their issue order
                try:
                    chunk.add(jsonsafe.loads(raw))
                except ValueError as exc:
                    into.bad += 1
                    into.first_error = into.first_error or one_line(str(exc))[:120]
            into.chunks.append(chunk)
            batch.clear()

        first = True
        for line in _lines_newest_first(f, size):
            if first:
                first = False
                if line:  # no newline at the end: the record being written when the rank died
                    try:
                        jsonsafe.loads(line)
                    except ValueError:
                        into.partial = True
                        continue
                    batch.append(line)
                    into.lines += 1
                continue
            if line is None:
                into.too_long += 1
                into.lines += 1
            elif line.strip():
                batch.append(line)
                into.lines += 1
            if len(batch) >= BATCH_LINES:
                flush()
            if into.lines >= budget:
                break
        if batch:
            flush()


@dataclass(frozen=True, slots=True)
class StepLog:
    steps: pd.DataFrame
    collectives: pd.DataFrame
    gc_passes: pd.DataFrame
    partial: bool
    """The log ends in a cut line (the rank died mid-write)."""
    warnings: list[str]


def load_steps(files: dict[str, Path], max_lines: int = MAX_STEP_LINES) -> StepLog:
    """Steps, collectives and garbage collections from a rank's step logs (the rotated `.1`
    generation holds older steps), the newest max_lines lines in all; warnings naming files."""
    codes: dict[str, int] = {}
    chunks: list[_Columns] = []
    partial, warnings, used = False, [], 0
    for key in ("steps.jsonl", "steps.1.jsonl"):  # newest first, so the line budget keeps the newest
        if key not in files or used >= max_lines:
            continue
        read = _StepRead(chunks=[], codes=codes)
        try:
            _read_steps(files[key], read, max_lines - used)
        except UnsafePath as exc:
            warnings.append(f"{one_line(str(exc))}: step log ignored")
            continue
        except OSError as exc:
            warnings.append(f"{one_line(files[key].name)}: unreadable ({exc.strerror or exc})")
            continue
        chunks += read.chunks
        used += read.lines
        partial = partial or read.partial
        if read.bad:
            warnings.append(f"{one_line(files[key].name)}: {read.bad} line(s) not valid JSON skipped "
                            f"(first: {read.first_error})")
        if read.too_long:
            warnings.append(f"{one_line(files[key].name)}: {read.too_long} line(s) longer than "
                            f"{MAX_STEP_LINE_BYTES >> 20} MiB skipped")
    steps, colls, passes = _frames(chunks[::-1], codes)
    return StepLog(steps=steps, collectives=colls, gc_passes=passes, partial=partial, warnings=warnings)


def load_telemetry(path: Path, max_lines: int = MAX_TELEMETRY_LINES) -> tuple[pd.DataFrame, list[str]]:
    """A rank's telemetry samples (newest max_lines), each signal a float column (NaN: missing);
    a bad line is skipped and counted in one warning naming the file."""
    cols: dict[str, list[float]] = {k: [] for k in ("wall", "step", *TELEMETRY_SIGNALS)}
    bad = 0
    try:
        with open_regular(path) as f:
            size = f.seek(0, 2)
            for i, line in enumerate(_lines_newest_first(f, size)):
                if not line or not line.strip():
                    continue
                try:
                    rec = jsonsafe.loads(line)
                except ValueError:
                    bad += i > 0  # the first is after the last newline: a sample cut by a killed rank
                    continue
                if not isinstance(rec, dict):
                    bad += 1
                    continue
                for k, v in cols.items():
                    v.append(as_number(rec.get(k)))
                if len(cols["wall"]) >= max_lines:
                    break
    except (OSError, UnsafePath, ValueError) as exc:
        return pd.DataFrame(), [f"{path.name}: {one_line(str(exc))[:120]}: telemetry ignored"]
    frame = pd.DataFrame({k: np.asarray(v[::-1], dtype=float) for k, v in cols.items()})
    frame = frame[np.isfinite(frame["wall"]) & np.isfinite(frame["step"])].reset_index(drop=True)
    warnings = [f"{path.name}: {bad} unreadable line(s) skipped"] if bad else []
    return frame, warnings


def probe_from_rows(rank: int, meta: dict, rows: list, partial: bool = False,
                    warnings: tuple[str, ...] = ()) -> ProbeData:
    """ProbeData from parsed step records (the warm-up step 0 and malformed records are left out)."""
    codes: dict[str, int] = {}
    chunk = _Columns(codes)
    for r in rows:
        chunk.add(r)
    steps, colls, passes = _frames([chunk], codes)
    return ProbeData(rank=rank, meta=meta, steps=steps, collectives=colls, gc_passes=passes, partial=partial,
                     warnings=warnings)


def _schedule(value) -> dict | None:
    """The profiler schedule a sidecar states, its fields as ints (else the field is left out)."""
    if not isinstance(value, dict):
        return None
    out = {k: v for k in ("wait", "warmup", "active", "repeat")
           if isinstance(v := value.get(k), int) and not isinstance(v, bool) and 0 <= v <= 1_000_000}
    if isinstance(value.get("enabled"), bool):
        out["enabled"] = value["enabled"]
    return out


def has_records(d: Path) -> bool:
    """D holds some rank's probe records (rank*.probe.json, rank*.steps.jsonl, ...); an unreadable
    directory holds none we can use."""
    try:
        return any(_SIDE.match(f.name) for f in d.iterdir())
    except OSError:
        return False


def read_meta(path: Path) -> dict:
    """Run metadata from a probe.json; raises ValueError naming the file."""
    body = read_json_sidecar(path)
    if not isinstance(body, dict):
        raise ValueError(f"{one_line(str(path))}: not a JSON object")
    meta = body.get("meta") if isinstance(body.get("meta"), dict) else {}
    # cut deep values: the metadata is written into diagnosis.json by recursive code
    meta = jsonsafe.clean(meta)
    return {**meta, "schedule": _schedule(body.get("schedule")), "final": body.get("final") is True}


def _dirs(paths: list[str | Path]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        d = p if p.is_dir() else p.parent
        out.append(d)
        if p.is_dir():
            try:
                # hidden: a writer's private temp directory (safefs), its files not published yet;
                # attempt{N}: another attempt of a restarted job (rundir.last_attempt picks one)
                out += [s for s in sorted(d.iterdir()) if s.is_dir() and not s.name.startswith(".")
                        and not ATTEMPT.match(s.name)]
            except OSError:
                continue
    return out


def load_probe_data(paths: list[str | Path]) -> dict[int, ProbeData]:
    found: dict[int, dict[str, Path]] = {}
    for d in _dirs(paths):
        try:
            entries = list(d.iterdir())
        except OSError:
            continue
        for f in entries:
            m = _SIDE.match(f.name)
            if m:
                found.setdefault(int(m.group(1)), {})[m.group(2)] = f
    out: dict[int, ProbeData] = {}
    for rank, files in found.items():
        warnings: list[str] = []
        meta: dict = {}
        if "probe.json" in files:
            try:
                meta = read_meta(files["probe.json"])
            except ValueError as exc:
                warnings.append(f"{exc}: sidecar ignored")
        log = load_steps(files)
        warnings += log.warnings
        telemetry = pd.DataFrame()
        if "telemetry.jsonl" in files:
            telemetry, more = load_telemetry(files["telemetry.jsonl"])
            warnings += more
        out[rank] = ProbeData(rank=rank, meta=meta, steps=log.steps, collectives=log.collectives,
                              gc_passes=log.gc_passes, partial=log.partial, warnings=tuple(warnings),
                              telemetry=telemetry)
    return out


def every_step_lateness(probes: dict[int, ProbeData]) -> pd.DataFrame:
    """Per matched collective (step, group, seq) in the probes: each rank's arrival lateness
    vs the median (ms) and which rank came last. Ranks on one host share the epoch clock."""
    frames = [p.collectives.assign(rank=r) for r, p in probes.items() if not p.collectives.empty]
    if len(frames) < 2:
        return pd.DataFrame()
    c = pd.concat(frames, ignore_index=True)
    c["seq"] = c.groupby(["rank", "step", "group"]).cumcount()
    n = c.groupby(["step", "group", "seq"])["rank"].transform("size")
    c = c[n >= 2].copy()
    c["lateness_ms"] = (c["arrival"] - c.groupby(["step", "group", "seq"])["arrival"].transform("median")) * 1000
    return c


def every_step_last(every: pd.DataFrame) -> pd.DataFrame:
    """Per matched collective of `every` (every_step_lateness's frame), indexed by (step, group,
    seq): the rank that came last and its gap over the next-latest arrival (s; 0 without one),
    the waiting that rank alone held. The straggler and uneven-work checks both read it."""
    key = ["step", "group", "seq"]
    if every.empty:
        return pd.DataFrame({"rank": pd.Series(dtype=int), "gap": pd.Series(dtype=float)})
    at = every.groupby(key)["arrival"].idxmax()
    gap = (every.groupby(key)["arrival"].max() - every.drop(index=at).groupby(key)["arrival"].max()).fillna(0.0)
    last = every.loc[at].set_index(key)["rank"].reindex(gap.index)
    return pd.DataFrame({"rank": last.astype(int), "gap": gap})
