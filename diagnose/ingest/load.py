"""Parse one Kineto / Chrome-trace file into a columnar table.

One parse per file (orjson, garbage collector paused), one pass over the events,
no per-event Python objects kept: the result is a pandas frame with categorical
strings and a few numeric columns, plus the trace's metadata.

Category names are normalised to one vocabulary (`KIND_*`), covering modern
(`kernel`, `cpu_op`, `cuda_runtime`, ...) and legacy 2021 (`Kernel`, `Operator`,
`Runtime`, ...) traces, NVIDIA and AMD.
"""
from __future__ import annotations

import gc
import gzip
import math
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson
import pandas as pd

from diagnose.errors import DiagnoseError
from diagnose.ingest.discover import rank_from_name

KIND_KERNEL = "kernel"
KIND_COMM_KERNEL = "comm_kernel"
KIND_MEMCPY = "memcpy"
KIND_MEMSET = "memset"
KIND_RUNTIME = "runtime"
KIND_CPU_OP = "cpu_op"
KIND_ANNOTATION = "annotation"
KIND_GPU_ANNOTATION = "gpu_annotation"

_CATEGORY_KIND = {
    "kernel": KIND_KERNEL,
    "Kernel": KIND_KERNEL,
    "gpu_memcpy": KIND_MEMCPY,
    "Memcpy": KIND_MEMCPY,
    "gpu_memset": KIND_MEMSET,
    "Memset": KIND_MEMSET,
    "cuda_runtime": KIND_RUNTIME,
    "Runtime": KIND_RUNTIME,
    "cuda_driver": KIND_RUNTIME,
    "cpu_op": KIND_CPU_OP,
    "Operator": KIND_CPU_OP,
    "user_annotation": KIND_ANNOTATION,
    "gpu_user_annotation": KIND_GPU_ANNOTATION,
}
KINDS = list(dict.fromkeys(_CATEGORY_KIND.values())) + [KIND_COMM_KERNEL]

# Communication kernels: NCCL (ncclKernel_*, ncclDevKernel_*), RCCL, and the
# custom all-reduce kernels some stacks use instead of NCCL.
COMM_KERNEL = re.compile(
    r"nccl|rccl|cross_device_reduce|multimem_all_reduce|one_shot_all_reduce|two_shot_all_reduce",
    re.IGNORECASE,
)
# Args kept for the few events that describe a collective.
_COMM_ARG_KEYS = ("Collective name", "In msg nelems", "Out msg nelems", "dtype", "Process Group Name",
                  "Group size", "Input Dims", "Input type")
_NEEDS_ARGS = re.compile(r"^(record_param_comms|c10d::|gloo:|nccl:)")

COLUMNS = ("name", "kind", "ts", "dur", "tid", "pid", "corr", "ext")

DEFAULT_MAX_BYTES = 8 * 1024**3


@dataclass(slots=True)
class RankTrace:
    """One parsed trace file. `events` holds complete ('X') events only."""

    path: Path
    rank: int | None
    rank_source: str
    """'distributedInfo', 'file name' or 'assumed'."""
    meta: dict
    """Top-level keys other than traceEvents (distributedInfo, deviceProperties, ...)."""
    events: pd.DataFrame
    comm_args: pd.DataFrame
    """Args of collective-describing events, indexed like `events`."""
    thread_names: dict[str, str]
    flows: int = 0
    """Flow events ('s'/'f'): their absence in a GPU trace suggests sampled or filtered events."""
    dropped: int = 0
    """Events skipped as malformed (missing or non-numeric ts/dur, negative dur)."""
    warnings: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int | None:
        info = self.meta.get("distributedInfo") or {}
        ws = info.get("world_size")
        return ws if isinstance(ws, int) and ws > 0 else None

    @property
    def backend(self) -> str | None:
        info = self.meta.get("distributedInfo") or {}
        b = info.get("backend")
        return b if isinstance(b, str) else None


def read_bytes(path: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[bytes, str | None]:
    """Whole (decompressed) file, bounded by max_bytes. Returns (data, warning).

    A truncated .gz (a killed job) yields what could be decompressed and a warning.
    """
    try:
        if path.name.endswith(".gz"):
            chunks: list[bytes] = []
            total = 0
            d = zlib.decompressobj(wbits=47)  # gzip or zlib header
            warning = None
            with open(path, "rb") as f:
                while True:
                    raw = f.read(1 << 20)
                    if not raw:
                        if not d.eof:
                            warning = "gzip stream ends early (file truncated)"
                        break
                    try:
                        out = d.decompress(raw, max_bytes + 1 - total)
                    except zlib.error as exc:
                        raise DiagnoseError(f"not a valid gzip file ({exc})", path) from None
                    total += len(out)
                    chunks.append(out)
                    if total > max_bytes:
                        raise DiagnoseError(
                            f"expands beyond {max_bytes / 1024**3:.1f} GiB (decompression bomb?); "
                            "raise --max-trace-gb if it is genuine", path)
                    if d.eof:
                        break
            return b"".join(chunks), warning
        size = path.stat().st_size
        if size > max_bytes:
            raise DiagnoseError(f"is {size / 1024**3:.1f} GiB, over the {max_bytes / 1024**3:.1f} GiB limit "
                                "(raise --max-trace-gb)", path)
        return path.read_bytes(), None
    except OSError as exc:
        raise DiagnoseError(f"cannot read ({exc.strerror or exc})", path) from None


def _salvage(data: bytes) -> tuple[object, int] | None:
    """A truncated trace parsed up to its last complete event, or None.

    Kineto writes one event per line; cut at the last complete line that closes an
    event and close the list and the object.
    """
    end = len(data)
    for _ in range(64):
        cut = data.rfind(b"}", 0, end)
        if cut < 0:
            return None
        for closer in (b"]}", b"]"):
            try:
                return orjson.loads(data[: cut + 1] + closer), cut + 1
            except orjson.JSONDecodeError:
                continue
        end = cut
    return None


def parse_json(path: Path, data: bytes) -> tuple[object, str | None]:
    if not data.strip():
        raise DiagnoseError("empty file", path)
    gc_was = gc.isenabled()
    gc.disable()  # the parse allocates millions of objects that are all live: GC passes are pure cost
    try:
        return orjson.loads(data), None
    except orjson.JSONDecodeError as exc:
        salvaged = _salvage(data)
        if salvaged is None:
            raise DiagnoseError(f"not valid JSON ({exc.msg} at byte {exc.pos})", path) from None
        obj, upto = salvaged
        return obj, f"truncated at byte {len(data)}: salvaged events up to byte {upto}"
    except RecursionError:
        raise DiagnoseError("JSON nested too deeply (not a trace)", path) from None
    finally:
        if gc_was:
            gc.enable()


def _num(v) -> float | None:
    if type(v) is float:
        return v if math.isfinite(v) else None
    if type(v) is int:
        return float(v)
    return None


def _int_or(v, default: int = -1) -> int:
    return v if type(v) is int else default


def _events_frame(raw_events: list) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, str], int, int]:
    names: list[str] = []
    kinds: list[str] = []
    ts: list[float] = []
    dur: list[float] = []
    tids: list[str] = []
    pids: list[str] = []
    corr: list[int] = []
    ext: list[int] = []
    arg_rows: list[int] = []
    arg_vals: list[dict] = []
    thread_names: dict[str, str] = {}
    dropped = 0
    flows = 0
    cat_kind = _CATEGORY_KIND
    comm_re = COMM_KERNEL
    args_re = _NEEDS_ARGS
    for e in raw_events:
        if type(e) is not dict:
            dropped += 1
            continue
        ph = e.get("ph")
        if ph != "X":
            if ph == "s" or ph == "f":
                flows += 1
            elif ph == "M" and e.get("name") == "thread_name":
                a = e.get("args")
                if type(a) is dict and type(a.get("name")) is str:
                    thread_names[f"{e.get('pid')}:{e.get('tid')}"] = a["name"][:200]
            continue
        kind = cat_kind.get(e.get("cat"))
        if kind is None:
            continue
        t = _num(e.get("ts"))
        d = _num(e.get("dur"))
        name = e.get("name")
        if t is None or d is None or d < 0 or type(name) is not str:
            dropped += 1
            continue
        a = e.get("args")
        if type(a) is not dict:
            a = {}
        if kind == KIND_KERNEL and comm_re.search(name):
            kind = KIND_COMM_KERNEL
        if kind == KIND_COMM_KERNEL or args_re.match(name):
            kept = {k: a[k] for k in _COMM_ARG_KEYS if k in a}
            if kept:
                arg_rows.append(len(names))
                arg_vals.append(kept)
        names.append(name)
        kinds.append(kind)
        ts.append(t)
        dur.append(d)
        tids.append(str(e.get("tid")))
        pids.append(str(e.get("pid")))
        corr.append(_int_or(a.get("correlation")))
        ext.append(_int_or(a.get("External id", a.get("external id"))))
    frame = pd.DataFrame(
        {
            "name": pd.Categorical(names),
            "kind": pd.Categorical(kinds, categories=KINDS),
            "ts": np.asarray(ts, dtype=np.float64),
            "dur": np.asarray(dur, dtype=np.float64),
            "tid": pd.Categorical(tids),
            "pid": pd.Categorical(pids),
            "corr": np.asarray(corr, dtype=np.int64),
            "ext": np.asarray(ext, dtype=np.int64),
        }
    )
    comm_args = pd.DataFrame(arg_vals, index=pd.Index(arg_rows, dtype=np.int64))
    return frame, comm_args, thread_names, dropped, flows


def load_trace(path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> RankTrace:
    """Parse one trace file. Raises DiagnoseError naming the file on bad input."""
    path = Path(path)
    data, read_warning = read_bytes(path, max_bytes)
    obj, parse_warning = parse_json(path, data)
    del data
    if isinstance(obj, list):  # the Chrome trace "array format"
        meta: dict = {}
        raw_events = obj
    elif isinstance(obj, dict) and isinstance(obj.get("traceEvents"), list):
        raw_events = obj.pop("traceEvents")
        meta = obj
    else:
        raise DiagnoseError("JSON but not a trace (no traceEvents list)", path)
    events, comm_args, thread_names, dropped, flows = _events_frame(raw_events)
    del raw_events, obj
    warnings = [w for w in (read_warning, parse_warning) if w]
    if warnings:
        warnings = [f"{path.name}: {'; '.join(warnings)}"]
    if dropped:
        warnings.append(f"{path.name}: skipped {dropped} malformed events")

    info = meta.get("distributedInfo")
    rank, source = None, "assumed"
    if isinstance(info, dict) and type(info.get("rank")) is int and info["rank"] >= 0:
        rank, source = info["rank"], "distributedInfo"
    else:
        rank = rank_from_name(path)
        if rank is not None:
            source = "file name"
    return RankTrace(path=path, rank=rank, rank_source=source, meta=meta, events=events,
                     comm_args=comm_args, thread_names=thread_names, flows=flows, dropped=dropped,
                     warnings=warnings)
