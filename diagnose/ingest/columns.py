"""Parsed events -> one columnar table (the `events` frame every later stage reads).

One tight pass per chunk keeps only complete ('X') events of known categories, with
strings interned to integer codes (a name seen 100,000 times is stored once) and
numbers validated in bulk with numpy: ts and dur must be finite numbers (not strings,
not booleans) and dur >= 0; anything else is dropped and counted, never guessed.

Category names are normalised to one vocabulary (`KIND_*`), covering modern
(`kernel`, `cpu_op`, `cuda_runtime`, ...) and legacy 2021 (`Kernel`, `Operator`,
`Runtime`, ...) traces, NVIDIA and AMD.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Union

import msgspec
import numpy as np
import pandas as pd

from diagnose.ingest.jsonsafe import clean, clean_str

KIND_KERNEL = "kernel"
KIND_COMM_KERNEL = "comm_kernel"
KIND_MEMCPY = "memcpy"
KIND_MEMSET = "memset"
KIND_RUNTIME = "runtime"
KIND_CPU_OP = "cpu_op"
KIND_ANNOTATION = "annotation"
KIND_GPU_ANNOTATION = "gpu_annotation"

CATEGORY_KIND = {
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
KINDS = list(dict.fromkeys(CATEGORY_KIND.values())) + [KIND_COMM_KERNEL]
_KIND_CODE = {k: i for i, k in enumerate(KINDS)}
_CAT_CODE = {cat: _KIND_CODE[k] for cat, k in CATEGORY_KIND.items()}
_K_KERNEL = _KIND_CODE[KIND_KERNEL]
_K_COMM = _KIND_CODE[KIND_COMM_KERNEL]
# Categories real Kineto traces carry that no check reads: ignored without a warning.
KNOWN_UNUSED = frozenset({"python_function", "Trace", "ac2g", "fwdbwd", "async", "cpu_instant_event",
                          "overhead", "cuda_profiler_range", "mtia_runtime", "xpu_runtime",
                          "privateuse1_runtime", "Python", "python", "Unknown"})

# Communication kernels: NCCL (ncclKernel_*, ncclDevKernel_*), RCCL, and the
# custom all-reduce kernels some stacks use instead of NCCL.
COMM_KERNEL = re.compile(
    r"nccl|rccl|cross_device_reduce|multimem_all_reduce|one_shot_all_reduce|two_shot_all_reduce",
    re.IGNORECASE,
)
# Args kept for the few events that describe a collective, and for the matrix ops whose input
# types say in which precision the model computes (analyzers/reduce_dtype.py): the innermost ops
# that carry a matmul or convolution, so nested ones (aten::linear around aten::addmm) are not
# counted twice.
COMM_ARG_KEYS = ("Collective name", "In msg nelems", "Out msg nelems", "dtype", "Process Group Name",
                 "Group size", "Input Dims", "Input type")
MATRIX_OPS = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|addbmm|_convolution|convolution_backward|_scaled_mm"
                        r"|_scaled_dot_product_\w+_attention|_flash_attention_forward|_efficient_attention_forward)$")
NEEDS_ARGS = re.compile(r"^(record_param_comms|c10d::|gloo:|nccl:)|" + MATRIX_OPS.pattern[1:])
COLUMNS = ("name", "kind", "ts", "dur", "tid", "pid", "corr", "ext")
_MAX_STR = 200
_I64 = (-(2**63), 2**63 - 1)


# The typed fast path. A chunk is decoded straight into structs that hold only the fields read
# here (msgspec skips everything else without building it): about 1.8x faster than orjson's
# generic decode, and the pass reads attributes instead of looking up dict keys. The types are
# strict on purpose: any event the generic pass would have to judge (a non-numeric ts, an args
# that is not an object, a float tid, NaN, invalid UTF-8, deep nesting) fails the whole chunk,
# which is then decoded generically, so both paths give the same table on every input.
_Args = msgspec.defstruct("_Args", [
    ("correlation", Any, None),
    ("ext", Any, msgspec.field(name="External id", default=None)),
    ("ext_lower", Any, msgspec.field(name="external id", default=None)),
    ("thread", Any, msgspec.field(name="name", default=None)),
    *((f"a{i}", Any, msgspec.field(name=k, default=msgspec.UNSET)) for i, k in enumerate(COMM_ARG_KEYS)),
], gc=False)
_ARG_ATTRS = tuple((f"a{i}", k) for i, k in enumerate(COMM_ARG_KEYS))
_Id = Union[int, str, None]


class _Ev(msgspec.Struct, gc=False):
    ph: Union[str, None] = None
    cat: Union[str, None] = None
    name: Union[str, None] = None
    ts: Union[int, float, None] = None
    dur: Union[int, float, None] = None
    tid: _Id = None
    pid: _Id = None
    args: Union[_Args, None] = None  # type: ignore[valid-type]


_DECODER = msgspec.json.Decoder(list[_Ev])


@dataclass(slots=True)
class _Part:
    """One chunk's rows, validated; `arg_rows` index into this part."""

    name: np.ndarray
    kind: np.ndarray
    ts: np.ndarray
    dur: np.ndarray
    tid: np.ndarray
    pid: np.ndarray
    corr: np.ndarray
    ext: np.ndarray
    arg_rows: np.ndarray
    arg_vals: list[dict]


@dataclass(slots=True)
class EventTable:
    """Accumulates chunks of parsed events (`add`), then builds the frame (`frame`)."""

    rows: int = 0
    dropped: int = 0
    """Complete events skipped as malformed (not an object, missing or non-numeric ts/dur,
    negative dur, non-string name)."""
    flows: int = 0
    unknown_categories: dict = field(default_factory=dict)
    thread_names: dict[str, str] = field(default_factory=dict)
    last_ts: float | None = None
    """ts of the last kept event in file order: where the writer was when a file was cut."""
    _names: dict = field(default_factory=dict)
    _comm: list = field(default_factory=list)
    _needs_args: list = field(default_factory=list)
    _tids: dict = field(default_factory=dict)
    _pids: dict = field(default_factory=dict)
    _parts: list = field(default_factory=list)

    def add(self, events: list) -> None:
        try:
            raw = self._pass(events)
        except TypeError:  # an unhashable category/tid/pid (hostile input): make them hashable, once
            raw = self._pass([_hashable(e) for e in events])
        self._append(raw)

    def _append(self, raw: tuple) -> None:
        part = _validate(*raw[:-1])
        self.dropped += raw[-1] + (len(raw[2]) - len(part.ts))
        if len(part.ts):
            self.last_ts = float(part.ts[-1])
            self.rows += len(part.ts)
            self._parts.append(part)

    def add_raw(self, chunk: bytes) -> int | None:
        """Decode a chunk of comma-separated events on the typed path and add them: how many
        were read, or None (nothing added) when the chunk needs the generic path."""
        try:
            evs = _DECODER.decode(b"[" + chunk + b"]")
        # ValidationError is a DecodeError; msgspec guards its own recursion (RecursionError, no
        # crash), so the depth scan orjson needs is left to the generic path
        except (msgspec.DecodeError, RecursionError):
            return None
        self._append(self._pass_typed(evs))
        return len(evs)

    def _new_name(self, name: str) -> int:
        code = self._names[name] = len(self._names)
        self._comm.append(COMM_KERNEL.search(name) is not None)
        self._needs_args.append(NEEDS_ARGS.match(name) is not None)
        return code

    def _pass(self, events: list) -> tuple:
        """The per-event loop: the hot path of reading a trace, so kept flat and local."""
        names, tids, pids = self._names, self._tids, self._pids
        comm, needs = self._comm, self._needs_args
        cat_code = _CAT_CODE
        new_name = self._new_name
        n_c: list[int] = []
        k_c: list[int] = []
        ts: list = []
        du: list = []
        t_c: list[int] = []
        p_c: list[int] = []
        co: list = []
        ex: list = []
        arg_rows: list[int] = []
        arg_vals: list[dict] = []
        unknown: dict = {}
        dropped = flows = 0
        for e in events:
            if type(e) is not dict:
                dropped += 1
                continue
            ph = e.get("ph")
            if ph != "X":
                if ph == "s" or ph == "f":
                    flows += 1
                elif ph == "M":
                    self._metadata_event(e)
                continue
            cat = e.get("cat")
            k = cat_code.get(cat)
            if k is None:
                unknown[cat] = unknown.get(cat, 0) + 1
                continue
            name = e.get("name")
            t = e.get("ts")
            d = e.get("dur")
            tt = type(t)
            td = type(d)
            if type(name) is not str or (tt is not float and tt is not int) or (td is not float and td is not int):
                dropped += 1
                continue
            code = names.get(name)
            if code is None:
                code = new_name(name)
            tid = e.get("tid")
            tc = tids.get(tid)
            if tc is None:
                tc = tids[tid] = len(tids)
            pid = e.get("pid")
            pc = pids.get(pid)
            if pc is None:
                pc = pids[pid] = len(pids)
            a = e.get("args")
            if type(a) is dict:
                c = a.get("correlation")
                x = a.get("External id")
                if x is None:
                    x = a.get("external id")
                if k == _K_KERNEL and comm[code]:
                    k = _K_COMM
                if k == _K_COMM or needs[code]:
                    kept = _kept_args(a)
                    if kept:
                        arg_rows.append(len(n_c))
                        arg_vals.append(kept)
            else:
                c = x = -1
                if k == _K_KERNEL and comm[code]:
                    k = _K_COMM
            n_c.append(code)
            k_c.append(k)
            ts.append(t)
            du.append(d)
            t_c.append(tc)
            p_c.append(pc)
            co.append(c if type(c) is int else -1)
            ex.append(x if type(x) is int else -1)
        self.flows += flows
        for cat, n in unknown.items():
            self.unknown_categories[cat] = self.unknown_categories.get(cat, 0) + n
        return n_c, k_c, ts, du, t_c, p_c, co, ex, arg_rows, arg_vals, dropped

    def _pass_typed(self, events: list) -> tuple:
        """`_pass` over decoded structs: the same rules, attribute reads instead of dict lookups.
        The decoder already guarantees the types `_pass` checks (str name, numeric ts/dur).

        A second copy of the loop on purpose: one loop over both kinds would need an accessor call
        per field and event, which costs more than the typed decode saves. The tests hold the two
        to the same table (test_typed_fast_path_*)."""
        names, tids, pids = self._names, self._tids, self._pids
        comm, needs = self._comm, self._needs_args
        cat_code = _CAT_CODE
        new_name = self._new_name
        n_c: list[int] = []
        k_c: list[int] = []
        ts: list = []
        du: list = []
        t_c: list[int] = []
        p_c: list[int] = []
        co: list = []
        ex: list = []
        arg_rows: list[int] = []
        arg_vals: list[dict] = []
        unknown: dict = {}
        dropped = flows = 0
        for e in events:
            ph = e.ph
            if ph != "X":
                if ph == "s" or ph == "f":
                    flows += 1
                elif ph == "M":
                    self._metadata_typed(e)
                continue
            cat = e.cat
            k = cat_code.get(cat)
            if k is None:
                unknown[cat] = unknown.get(cat, 0) + 1
                continue
            name = e.name
            t = e.ts
            d = e.dur
            if name is None or t is None or d is None:
                dropped += 1
                continue
            code = names.get(name)
            if code is None:
                code = new_name(name)
            tid = e.tid
            tc = tids.get(tid)
            if tc is None:
                tc = tids[tid] = len(tids)
            pid = e.pid
            pc = pids.get(pid)
            if pc is None:
                pc = pids[pid] = len(pids)
            a = e.args
            if a is not None:
                c = a.correlation
                x = a.ext
                if x is None:
                    x = a.ext_lower
                if k == _K_KERNEL and comm[code]:
                    k = _K_COMM
                if k == _K_COMM or needs[code]:
                    kept = _kept_args_typed(a)
                    if kept:
                        arg_rows.append(len(n_c))
                        arg_vals.append(kept)
            else:
                c = x = -1
                if k == _K_KERNEL and comm[code]:
                    k = _K_COMM
            n_c.append(code)
            k_c.append(k)
            ts.append(t)
            du.append(d)
            t_c.append(tc)
            p_c.append(pc)
            co.append(c if type(c) is int else -1)
            ex.append(x if type(x) is int else -1)
        self.flows += flows
        for cat, n in unknown.items():
            self.unknown_categories[cat] = self.unknown_categories.get(cat, 0) + n
        return n_c, k_c, ts, du, t_c, p_c, co, ex, arg_rows, arg_vals, dropped

    def _metadata_typed(self, e: _Ev) -> None:
        a = e.args
        if e.name != "thread_name" or a is None:
            return
        pid, tid = e.pid, e.tid
        if type(a.thread) is str and pid is not None and tid is not None:
            self.thread_names[clean_str(f"{pid}:{tid}"[:_MAX_STR])] = clean_str(a.thread[:_MAX_STR])

    def _metadata_event(self, e: dict) -> None:
        if e.get("name") != "thread_name":
            return
        a = e.get("args")
        pid, tid = e.get("pid"), e.get("tid")
        if type(a) is dict and type(a.get("name")) is str and type(pid) in (int, str) and type(tid) in (int, str):
            self.thread_names[clean_str(f"{pid}:{tid}"[:_MAX_STR])] = clean_str(a["name"][:_MAX_STR])

    def frame(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """(events, comm_args): the events table and the args kept (collectives, matrix ops)."""
        parts = self._parts
        def col(key: str) -> np.ndarray:
            if parts:
                return np.concatenate([getattr(p, key) for p in parts])
            return np.zeros(0, dtype=np.float64 if key in ("ts", "dur") else np.int64)

        name = _categorical(col("name"), list(self._names), clean_str)
        tid = _categorical(col("tid"), list(self._tids), _label)
        pid = _categorical(col("pid"), list(self._pids), _label)
        frame = pd.DataFrame({
            "name": name,
            "kind": pd.Categorical.from_codes(col("kind").astype(np.int8), categories=KINDS),
            "ts": col("ts"),
            "dur": col("dur"),
            "tid": tid,
            "pid": pid,
            "corr": col("corr"),
            "ext": col("ext"),
        })
        rows, vals, offset = [], [], 0
        for p in parts:
            rows.append(p.arg_rows + offset)
            vals += p.arg_vals
            offset += len(p.ts)
        index = pd.Index(np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64), dtype=np.int64)
        return frame, pd.DataFrame(vals, index=index)


def _label(v) -> str:
    return clean_str(str(v)[:_MAX_STR])


def _categorical(codes: np.ndarray, keys: list, to_label) -> pd.Categorical:
    """Codes over interned raw keys -> a categorical of distinct labels, unused ones dropped.

    Distinct raw keys can share a label (tid 1 and "1"; two strings cleaned alike).
    """
    labels = [to_label(k) for k in keys]
    used = np.bincount(codes, minlength=len(labels)) > 0 if len(labels) else np.zeros(0, dtype=bool)
    uniq: dict[str, int] = {}
    remap = np.full(max(len(labels), 1), -1, dtype=np.int64)
    for i, lab in enumerate(labels):
        if used[i]:
            remap[i] = uniq.setdefault(lab, len(uniq))
    return pd.Categorical.from_codes(remap[codes] if codes.size else codes.astype(np.int64),
                                     categories=list(uniq))


def _floats(values: list) -> np.ndarray:
    try:
        return np.asarray(values, dtype=np.float64)
    except OverflowError:  # an integer beyond float range (hostile): not a time
        return np.asarray([_float(v) for v in values], dtype=np.float64)


def _float(v) -> float:
    try:
        return float(v)
    except OverflowError:
        return math.nan


def _ints(values: list) -> np.ndarray:
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        lo, hi = _I64
        return np.asarray([v if lo <= v <= hi else -1 for v in values], dtype=np.int64)


def _validate(n_c, k_c, ts, du, t_c, p_c, co, ex, arg_rows, arg_vals) -> _Part:
    t = _floats(ts)
    d = _floats(du)
    ok = np.isfinite(t) & np.isfinite(d) & (d >= 0)
    part = _Part(name=np.asarray(n_c, dtype=np.int64), kind=np.asarray(k_c, dtype=np.int8), ts=t, dur=d,
                 tid=np.asarray(t_c, dtype=np.int64), pid=np.asarray(p_c, dtype=np.int64), corr=_ints(co),
                 ext=_ints(ex), arg_rows=np.asarray(arg_rows, dtype=np.int64), arg_vals=arg_vals)
    if ok.all():
        return part
    new_row = np.cumsum(ok) - 1
    keep_args = ok[part.arg_rows] if part.arg_rows.size else np.zeros(0, dtype=bool)
    return _Part(name=part.name[ok], kind=part.kind[ok], ts=t[ok], dur=d[ok], tid=part.tid[ok], pid=part.pid[ok],
                 corr=part.corr[ok], ext=part.ext[ok], arg_rows=new_row[part.arg_rows[keep_args]],
                 arg_vals=[v for v, k in zip(arg_vals, keep_args) if k])


def _kept_args(a: dict) -> dict:
    kept = {}
    for k in COMM_ARG_KEYS:
        if k in a:
            v = a[k]
            kept[k] = clean_str(v[:_MAX_STR]) if type(v) is str else clean(v)
    return kept


def _kept_args_typed(a) -> dict:
    kept = {}
    for attr, k in _ARG_ATTRS:
        v = getattr(a, attr)
        if v is not msgspec.UNSET:
            kept[k] = clean_str(v[:_MAX_STR]) if type(v) is str else clean(v)
    return kept


def _hashable(e):
    """The event with unhashable category/tid/pid values replaced by a type placeholder."""
    if type(e) is not dict:
        return e
    out = dict(e)
    for key in ("cat", "tid", "pid"):
        v = out.get(key)
        if isinstance(v, (list, dict)):
            out[key] = f"<{type(v).__name__}>"
    return out
