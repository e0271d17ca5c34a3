"""One run profiled in several windows: one trace a rank a window, the last whole one analysed.

torch.profiler's schedule repeats (`schedule(wait, warmup, active)` repeats until the profiler
stops: its `repeat=0` is the default) and `tensorboard_trace_handler` writes each window to a file
of its own, `{worker}.{time_ns}.pt.trace.json[.gz]` (`worker`: `{host}_{pid}` unless the job names
it); the probes' `--schedule W,U,A,R` write `rank{R}.{ms}.pt.trace.json.gz` the same way. A job
that ends inside a window writes that window cut short (torch's `stop()` exports what it has).

Other layouts hold windows too: a subdirectory a window (torchtitan's
`profile_trace/iteration_N/rank{R}_trace.json`), a subdirectory a rank, or names without a stamp
that name a rank twice (`trace_step10_rank0.json`); there the files are grouped by the rank their
first bytes give.

Several traces a rank are only taken for one run's windows where each file says so: the files of
one group come from one process (the same pid, host and rank in their first bytes) and start one
after the other. Anything else (two runs written into one directory, a file copied) stays the
loader's error ("two traces for rank R", "traces in several subdirectories"): mixed runs are
refused, never guessed. The first bytes are read only where the names suggest windows.
"""
from __future__ import annotations

import itertools
import re
import statistics
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from diagnose.errors import DiagnoseError
from diagnose.ingest.discover import discover_traces, has_traces, rank_from_name
from diagnose.ingest.load import base_offset_us
from diagnose.ingest.source import GZIP_MAGIC
from diagnose.ingest.stream import peek
from diagnose.rundir import ATTEMPT

STAMPED = re.compile(r"^(.+)\.(\d+)\.pt\.trace\.json(\.gz)?$")
"""`{stem}.{stamp}.pt.trace.json[.gz]`: the name a window's trace gets (tensorboard_trace_handler,
probes/core.py)."""
PEEK_BYTES = 256 << 10
"""Decompressed bytes read of each file: Kineto writes the rank, host and process first."""
WHOLE = 0.75
"""A window whose file is under this share of its stem's median window is taken for one the run
ended inside (fewer steps, or none whole): the last whole window is analysed instead. Windows of
one schedule record the same steps, so their files are of a size; a cut one is a fraction."""
_HOST_CATS = frozenset({"cpu_op", "Operator", "user_annotation", "python_function", "cuda_runtime",
                        "Runtime", "cuda_driver"})


@dataclass(frozen=True, slots=True)
class Header:
    """What a trace's first bytes say of where it came from."""

    rank: int | None
    host: str | None
    pid: int | None
    start_us: float | None
    """The earliest host event or process record among the first bytes, on the absolute clock
    where the file gives its base (same process: same clock either way)."""


def _first_bytes(path: Path) -> bytes:
    """The file's first PEEK_BYTES, decompressed. Not source.iter_blocks: its first block
    decompresses up to 4 MiB (0.3 ms here against 5.4 for the first block of a 1 MiB gzip trace of
    ../shared/traces, edge_hta_ddp_world1_v100), and this runs on every file of a suspect directory."""
    with open(path, "rb") as f:
        data = f.read(64 << 10)
        if data[:2] != GZIP_MAGIC:
            return data + f.read(max(0, PEEK_BYTES - len(data)))
        z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        out = bytearray()
        while len(out) < PEEK_BYTES and data:
            out += z.decompress(data, PEEK_BYTES - len(out))
            data = z.unconsumed_tail or (b"" if z.eof else f.read(64 << 10))
        return bytes(out)


def read_header(path: Path) -> Header | None:
    """None where the first bytes are not a Kineto trace's (or cannot be read)."""
    try:
        got = peek(_first_bytes(path))
    except (OSError, zlib.error, ValueError):
        return None
    if got is None:
        return None
    meta, events = got
    info = meta.get("distributedInfo")
    rank = info.get("rank") if isinstance(info, dict) else None
    host = meta.get("host_name")
    off = base_offset_us(meta)
    pid, starts = None, []
    for e in events:
        if not isinstance(e, dict) or type(e.get("ts")) not in (int, float):
            continue
        if e.get("ph") == "X" and e.get("cat") in _HOST_CATS:
            pid = e.get("pid") if pid is None else pid
            starts.append(e["ts"])
        elif e.get("ph") == "M" and e.get("name") == "process_name":
            starts.append(e["ts"])
    if pid is None:  # no host event among the first bytes: the process record names it
        pid = next((e.get("pid") for e in events if isinstance(e, dict) and e.get("ph") == "M"
                    and e.get("name") == "process_name"), None)
    return Header(rank=rank if type(rank) is int else None, host=host if isinstance(host, str) else None,
                  pid=pid if type(pid) is int else None, start_us=min(starts) + off if starts else None)


def _one_process(files: list[Path], heads: list[Header | None]) -> list[Path] | None:
    """The files in the order they were recorded if they are one process's windows, else None."""
    if any(h is None or h.pid is None or h.start_us is None for h in heads):
        return None
    ids = {(h.rank, h.host, h.pid) for h in heads}  # type: ignore[union-attr]
    if len(ids) != 1:
        return None
    order = sorted(range(len(files)), key=lambda i: heads[i].start_us)  # type: ignore[union-attr]
    starts = [heads[i].start_us for i in order]  # type: ignore[union-attr]
    if any(b <= a for a, b in itertools.pairwise(starts)):  # a copy: the same start twice
        return None
    return [files[i] for i in order]


@dataclass(frozen=True, slots=True)
class Choice:
    files: list[Path]
    """One window's trace a rank: the last whole window every rank wrote, or the one asked for."""
    note: str
    analysed: int = 1
    """The window read, counted from 1."""
    written: int = 1
    """The most windows a rank wrote."""
    every_rank: int = 1
    """Windows 1..every_rank were written by every rank."""
    cut: tuple[int, ...] = ()
    """Windows whose traces look cut short by the run's end (smaller than the rank's others)."""
    asked: bool = False

    def as_dict(self) -> dict:
        """diagnosis.json's `extras.profiled_windows` (schema 1.13)."""
        return {"analysed": self.analysed, "written": self.written, "every_rank": self.every_rank,
                "cut": list(self.cut), "asked": self.asked}


def _size(f: Path) -> int:
    try:
        return f.stat().st_size
    except OSError:
        return 0


def _nested(p: Path) -> list[Path] | None:
    """The traces in p's subdirectories where p holds none itself and several of them do (a
    subdirectory a window, as torchtitan's `iteration_N/rank{R}_trace.json`, or a subdirectory a
    rank): what discover_traces refuses as "likely several runs" until the files say otherwise.
    torchelastic's attempts are left to it (rundir.last_attempt)."""
    if not p.is_dir() or has_traces(p):
        return None
    try:
        subdirs = [d for d in sorted(p.iterdir()) if not d.name.startswith(".") and has_traces(d)]
    except OSError:
        return None
    if len(subdirs) < 2 or all(ATTEMPT.match(d.name) for d in subdirs):
        return None
    return [f for d in subdirs for f in discover_traces([d])]


def _by_stem(files: list[Path]) -> dict[str, list[Path]] | None:
    """Files of one directory by their name's stem (`{stem}.{stamp}.pt.trace.json`): a stem a
    process; None where a name is not of that form."""
    stems: dict[str, list[Path]] = {}
    for f in files:
        m = STAMPED.match(f.name)
        if m is None:
            return None  # a trace of another kind beside them: not windows alone
        stems.setdefault(str(f.parent / m.group(1)), []).append(f)
    return stems


def _by_rank(files: list[Path], heads: dict[Path, Header | None]) -> dict[str, list[Path]] | None:
    """Files by the rank their first bytes (else their name) give: where the names do not say
    which are one process's (several directories, or names without a stamp)."""
    ranks: dict[str, list[Path]] = {}
    for f in files:
        h = heads[f]
        r = h.rank if h is not None and h.rank is not None else rank_from_name(f)
        if r is None:
            return None
        ranks.setdefault(f"rank {r:09d}", []).append(f)
    return ranks


def trace_files(paths: list[str | Path]) -> tuple[list[Path], list[Path]]:
    """The traces under the paths, each once, and which of the paths held them in subdirectories
    (`_nested`); DiagnoseError as discover_traces raises it."""
    files: list[Path] = []
    nested: list[Path] = []
    for p in paths:
        below = _nested(Path(p))
        files += below if below is not None else discover_traces([p])
        nested += [Path(p)] if below is not None else []
    return list(dict.fromkeys(files)), nested


def choose_window(paths: list[str | Path], window: int | None = None) -> Choice | None:
    """The traces of `paths` narrowed to one window a rank where they are one run's repeated
    windows (module doc); None where they are not (the paths are read as they are). window: the
    one asked for (`--window`: 1 the first, -1 the last every rank wrote, cut or not) instead of
    the last whole one; DiagnoseError where not every rank wrote it."""
    try:
        files, nested = trace_files(paths)
    except DiagnoseError:
        return None  # said where the traces are read
    heads: dict[Path, Header | None] = {}
    groups = None if nested else _by_stem(files)
    if groups is None or max((len(v) for v in groups.values()), default=0) < 2:
        named = [rank_from_name(f) for f in files]  # `trace_step10_rank0.json`: a rank named twice
        if not nested and (None in named or len(set(named)) == len(named)):
            return None
        heads = {f: read_header(f) for f in files}
        groups = _by_rank(files, heads)
    if not groups:
        return None
    most = max(len(v) for v in groups.values())
    if most < 2:
        if not nested:
            return None
        where = ", ".join(map(str, nested))
        return Choice(files=[v[0] for _, v in sorted(groups.items())],
                      note=f"{where}: a trace a rank in its subdirectories, read as one run's")
    ordered: dict[str, list[Path]] = {}
    for key, group in sorted(groups.items()):
        got = _one_process(group, [heads[f] if f in heads else read_header(f) for f in group]) \
            if len(group) > 1 else group
        if got is None:
            return None
        ordered[key] = got
    common = min(len(v) for v in ordered.values())
    short = set()
    for v in ordered.values():
        if len(v) > 1:
            sizes = [_size(f) for f in v]
            mid = statistics.median(sizes)
            short |= {k + 1 for k, s in enumerate(sizes) if s < WHOLE * mid}
    whole = [k for k in range(1, common + 1) if k not in short]
    k = whole[-1] if whole else common
    if window is not None:
        k = window if window > 0 else common + 1 + window
        if not 1 <= k <= common:
            raise DiagnoseError(f"--window {window}: every rank wrote windows 1-{common} (-1 the last of them)",
                                Path(paths[0]))
    chosen = [v[k - 1] for v in ordered.values()]
    where = ", ".join(map(str, nested)) if nested else ", ".join(sorted({str(f.parent) for f in files}))
    inside = sorted({f.parent.name for f in chosen})
    cut = sorted(w for w in short if k <= w <= most)
    which = "the one asked for" if window is not None else "the last whole one every rank wrote"
    note = (f"{where}: {most} profiled windows a rank (a repeating profiler schedule writes one trace a "
            f"window); {which} (window {k}"
            + (f": {inside[0]}" if nested and len(inside) == 1 else "") + ") is analysed"
            + (f"; window {', '.join(map(str, cut))} looks cut short by the run's end (a smaller trace)"
               if cut else "")
            + "; --window K analyses another")
    return Choice(files=chosen, note=note, analysed=k, written=most, every_rank=common, cut=tuple(sorted(short)),
                  asked=window is not None)


def wall_time(us: float | None) -> str | None:
    """A header's start as a UTC time, where it is on the wall clock (the file gave its base)."""
    if us is None or us <= 1e15:
        return None
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(us / 1e6))


def _who(h: Header) -> str:
    when = wall_time(h.start_us)
    return f"pid {h.pid}" + (f" from {when}" if when else "")


def two_of_a_rank(a: Path, b: Path) -> str:
    """What the first bytes of two traces of one rank say they are, for the loader's "two traces
    for rank R" error: two processes (two runs written into one directory), one process's two
    windows, or one recording twice."""
    ha, hb = read_header(a), read_header(b)
    if ha is None or hb is None or ha.pid is None or hb.pid is None:
        return "(mixed runs or repeated captures?); pass one run's files"
    if (ha.pid, ha.host) != (hb.pid, hb.host):
        return (f"from two processes ({_who(ha)}; {_who(hb)}): two runs in one directory; pass one run's files "
                "(or pick one: analyze --run K, diff --before-run/--after-run K, scale --run N=K; 1 the first, "
                "-1 the newest)")
    if ha.start_us == hb.start_us:
        return "of one recording (a copy?); pass one of them"
    return "from one process: two profiled windows of one run; pass one window's files, one a rank"
