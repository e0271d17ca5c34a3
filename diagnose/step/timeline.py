"""Per-rank timeline: step windows, activity lanes and the collectives table.

Built once per rank from its events; every analyzer reads from here, so all of
them share one definition of "compute", "communication" and "DataLoader wait".

Definitions (stated in the report):
- GPU traces: compute = union of non-communication kernels, memcpy and memset on
  any stream; communication = union of NCCL/RCCL kernels. The device view: time the
  GPU does useful work vs. time it only communicates or idles.
- CPU-only traces: compute = union of CPU ops and annotations on the training
  threads (not gloo's `pt_gloo_runloop` threads), minus DataLoader time and the
  data-parallel wrappers' communication work; communication = `gloo:*` transfers, `c10d::*`
  enqueue ops and that work (DDP's bucket copies and gradient division, FSDP2's all-gather and
  reduce-scatter spans with their copies and waits, a functional collective's `wait_tensor`).
  gloo names no collective's process group: a rank's collectives on several groups are matched
  as one group's, with a warning (`UNNAMED_GROUPS`). An `Optimizer.step` that runs the forward
  and backward inside it (a closure, as Lightning calls it) frames the step like ProfilerStep:
  its own time is not compute; so do the hook and module annotations of Lightning's profiler.
- DataLoader wait = union of `enumerate(DataLoader)#...__next__` spans.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from diagnose.ingest.load import (
    KIND_ANNOTATION,
    KIND_COMM_KERNEL,
    KIND_CPU_OP,
    KIND_KERNEL,
    KIND_MEMCPY,
    KIND_MEMSET,
    KIND_RUNTIME,
    RankTrace,
)
from diagnose.ingest.spill import Spilled, unspilled
from diagnose.step.appended import Appended
from diagnose.step.intervals import Intervals, merge, subtract, union

if TYPE_CHECKING:  # cover.py reads the idle model, which reads timelines
    from diagnose.step.cover import RankCover

DATALOADER = re.compile(r"^enumerate\(DataLoader\)#.*__next__")
PROFILER_STEP = re.compile(r"^ProfilerStep#(\d+)$")
H2D = re.compile(r"HtoD|Host to Device|H2D", re.IGNORECASE)
PAGEABLE_H2D = re.compile(r"^(?=.*?(?:HtoD|Host to Device|H2D))(?=.*?Pageable)", re.IGNORECASE | re.DOTALL)
"""Kineto names a copy `Memcpy HtoD (Pageable -> Device)` or `(Pinned -> Device)`. Anchored: one
attempt per name, linear in its length (names are untrusted input, some very long)."""
OPTIMIZER_STEP = re.compile(r"^Optimizer\.step#")
# Lightning's own PyTorchProfiler wraps each hook (`[pl][profile]...`) and, by default, each
# module's forward (`[pl][module]...`) in an annotation. They frame like ProfilerStep: the ops inside
# count, their own time does not (a rank's wait for a late peer's all-reduce and the late rank's
# sleep sit there; the same job recorded without them has neither span, and its verdict must not
# change with the profiler that recorded it)
FRAMEWORK_FRAME = re.compile(r"^\[pl\]\[(profile|module)\]")
AUTOGRAD_BACKWARD = re.compile(r"^autograd::engine::evaluate_function")
# torch.compile's frames (dynamo's entry into a compiled graph): the forward's; the backward of a
# compiled graph runs inside CompiledFunctionBackward
COMPILED_REGION = re.compile(r"^(Torch-Compiled Region|CompiledFunctionBackward$)")
CPU_COMM_TRANSFER = re.compile(r"^gloo:")
CPU_COMM_ENQUEUE = re.compile(r"^(c10d::|record_param_comms$|nccl:)")
# The data-parallel wrappers' own communication work on the host: DDP's bucketing (gradient
# division, copies into and out of buckets) and FSDP2's all-gathers and reduce-scatters with their
# copies in and out and their waits (a rank blocked in `FSDP::all_gather` for a late peer is
# waiting, not computing), and the wait for a functional collective (DTensor's, tensor
# parallelism's: on gloo the training thread blocks in `wait_tensor` until the transfer ends; counted
# as compute, a 2-D job's 150 ms straggler read as its peers computing). Communication overhead
# that grows with world size, not model compute.
COMM_WRAPPERS = re.compile(r"reducer::|^FSDP::(all_gather|post_backward_reduce|post_backward_rs_wait)"
                           r"|^_?c10d_functional::wait_tensor$")
# Point-to-point transfers (pipeline parallelism) are not collectives: nothing to match
# across all ranks. gloo records them on the training thread itself.
P2P = re.compile(r"^(gloo:(send|recv)|c10d::(send|recv_|recv_any_source_))$")
_DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2,
                "bfloat16": 2, "int": 4, "int32": 4, "long": 8, "int64": 8, "int8": 1, "uint8": 1,
                "char": 1, "byte": 1, "short": 2, "int16": 2, "bool": 1, "c10::half": 2,
                "c10::bfloat16": 2, "unsigned char": 1, "signed char": 1}

# element types as the trace spells them (record_param_comms' dtype, an op's Input type, an NCCL
# kernel's name) -> one short name; "" when not recorded
_PRECISION = {"float": "fp32", "float32": "fp32", "f32": "fp32", "double": "fp64", "float64": "fp64",
              "f64": "fp64", "half": "fp16", "float16": "fp16", "f16": "fp16", "c10::half": "fp16",
              "bfloat16": "bf16", "c10::bfloat16": "bf16", "bf16": "bf16", "float8_e4m3fn": "fp8",
              "float8_e5m2": "fp8", "c10::float8_e4m3fn": "fp8", "c10::float8_e5m2": "fp8"}
# the element type in an NCCL kernel's name: ncclKernel_AllReduce_RING_LL_Sum_float,
# ncclDevKernel_AllReduce_Sum_bf16_RING_LL
_KERNEL_DTYPE = re.compile(r"_(float|half|bf16|f16|f32|f64|double|bfloat16)(?:_|\(|$)", re.IGNORECASE)
LOW_PRECISION = frozenset({"bf16", "fp16", "fp8"})


def precision(t: object) -> str:
    """fp32, bf16, fp16, fp8, fp64, an integer type's own name, or "" (not recorded)."""
    if not isinstance(t, str) or not t:
        return ""
    return _PRECISION.get(t.lower(), t.lower().removeprefix("c10::"))


def _dtype_of(args: dict, name: str) -> str:
    """A collective's element type: record_param_comms' dtype, the op's first Input type (gloo),
    or the NCCL kernel's name."""
    d = args.get("dtype")
    if isinstance(d, str) and d:
        return precision(d)
    types = args.get("Input type")
    if isinstance(types, list) and types and isinstance(types[0], str) and types[0]:
        return precision(types[0])
    m = _KERNEL_DTYPE.search(name)
    return precision(m.group(1)) if m else ""


STEP_COLUMNS = ("step", "start", "end")


@dataclass(frozen=True, slots=True)
class Steps:
    """A rank's complete steps in time order, as parallel arrays: not a DataFrame, which held ~2 KB
    a rank in the parent for one row, and ~1.5 KB more once its columns were read (#20, the
    client's memory per rank). `frame()` gives the table where one is wanted."""

    step: np.ndarray
    """Step number (int64)."""
    start: np.ndarray
    """Start (us, file clock; float64)."""
    end: np.ndarray

    @classmethod
    def of(cls, df: pd.DataFrame) -> Steps:
        return cls(step=df["step"].to_numpy().astype(np.int64), start=df["start"].to_numpy(np.float64, copy=True),
                   end=df["end"].to_numpy(np.float64, copy=True))

    def __len__(self) -> int:
        return int(self.step.size)

    @property
    def dur(self) -> np.ndarray:
        return self.end - self.start

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame({"step": self.step, "start": self.start, "end": self.end})


COLLECTIVE_COLUMNS = ("step", "pg", "seq", "name", "arrival", "end", "bytes", "dtype", "row")


@dataclass(frozen=True, slots=True)
class RankTimeline:
    rank: int
    file: str
    is_gpu: bool
    step_source: str
    steps: Steps
    """The complete steps: step, start, end (us, file clock)."""
    compute: Intervals | None
    """Device work (GPU: kernels, copies, memsets; CPU: host ops on the training threads outside
    DataLoader waits and communication wrappers). This and the other interval sets, one interval
    per kernel or op, are None in the parent after the checks' per-rank reductions: it reads
    `cover` (step/cover.py), sized by steps and collectives (#20)."""
    comm: Intervals | None
    dataloader: Intervals | None
    host_busy: Intervals | None
    """CPU ops on the training threads (GPU traces: the host side that launches work)."""
    collectives: pd.DataFrame | Spilled
    """One row per collective instance on this rank, in order (COLLECTIVE_COLUMNS). On disk in the
    parent (ingest/assemble.Keep): read it with `own_collectives()`; the analysis reads the run's
    (Run.collectives), gathered from these once."""
    comm_threads: frozenset[str] | None
    """Thread ids that only run communication (gloo's runloop threads); only the reductions read
    them (None in the parent: even an empty set arrives as 216 bytes of its own)."""
    compiled: Intervals | None
    """Host time inside torch.compile'd code (`Torch-Compiled Region` spans on the training threads)."""
    warnings: tuple[str, ...]
    input_copies: Intervals | None = field(default_factory=Intervals.empty)
    """GPU: the device copying pageable host memory to itself with no kernel running alongside.
    A pageable copy runs at the host's staging speed and blocks the host meanwhile (recorded on an
    H200: 64 MiB in 9.1 ms pageable, 1.2 ms pinned); the input_stall check's cost."""
    device_timed: bool = False
    """GPU: the host ran ahead of the device in these steps, so they are timed as the device ran
    them (`device_steps`), not by the host's step spans."""
    cover: RankCover | None = None
    """What the parent reads of the interval sets (step/cover.py); set where the trace is read."""
    unnamed_groups: bool = False
    """gloo: this rank's collectives ran on several process groups (more runloop threads than one
    group starts; the trace's pg_config puts it in several), which the trace does not name: they
    are matched across ranks as one group's (`_several_gloo_groups`), and a warning says so."""

    def own_collectives(self) -> pd.DataFrame:
        return unspilled(self.collectives)

    def for_parent(self) -> RankTimeline:
        """The timeline as the parent keeps it once the per-rank reductions have read its sets."""
        return replace(self, compute=None, comm=None, dataloader=None, host_busy=None, compiled=None,
                       input_copies=None, comm_threads=None)


def _names_matching(ev: pd.DataFrame, pattern: re.Pattern) -> np.ndarray:
    """Boolean mask over rows whose name matches; the regex runs once per distinct name."""
    cats = ev["name"].cat.categories
    hit = np.fromiter((bool(pattern.search(c)) for c in cats), dtype=bool, count=len(cats))
    codes = ev["name"].cat.codes.to_numpy()
    return hit[codes] if len(cats) else np.zeros(len(ev), dtype=bool)


def _kind_mask(ev: pd.DataFrame, *kinds: str) -> np.ndarray:
    return ev["kind"].isin(kinds).to_numpy()


def find_steps(ev: pd.DataFrame) -> tuple[pd.DataFrame, str, list[str]]:
    """Step windows from ProfilerStep#N; else between Optimizer.step ends; drops a partial last step."""
    warnings: list[str] = []
    host = _kind_mask(ev, KIND_CPU_OP, KIND_ANNOTATION)
    ps = ev[host & _names_matching(ev, PROFILER_STEP)]
    if len(ps):
        steps = pd.DataFrame({
            "step": ps["name"].astype(str).str.extract(PROFILER_STEP.pattern)[0].astype(np.int64).to_numpy(),
            "start": ps["ts"].to_numpy(),
            "end": (ps["ts"] + ps["dur"]).to_numpy(),
        }).sort_values("start").drop_duplicates("step").reset_index(drop=True)
        source = "ProfilerStep"
        opt = ev[host & _names_matching(ev, OPTIMIZER_STEP)]
        if len(steps) >= 2:
            last = steps.iloc[-1]
            others = steps.iloc[:-1]
            has_opt = lambda s, e: bool(((opt["ts"] >= s) & (opt["ts"] < e)).any())  # noqa: E731
            others_opt = all(has_opt(r.start, r.end) for r in others.itertuples())
            short = (last.end - last.start) < 0.5 * float(np.median(others.end - others.start))
            if short or (len(opt) and others_opt and not has_opt(last.start, last.end)):
                warnings.append(f"dropped incomplete last step ProfilerStep#{int(last.step)}")
                steps = others.reset_index(drop=True)
        return steps, source, warnings
    opt = ev[host & _names_matching(ev, OPTIMIZER_STEP)].sort_values("ts", kind="stable")
    bw = np.sort(ev.loc[_kind_mask(ev, KIND_CPU_OP) & _names_matching(ev, AUTOGRAD_BACKWARD), "ts"].to_numpy())
    ends, stepped = iteration_ends((opt["ts"] + opt["dur"]).to_numpy(dtype=float), bw,
                                   opt["name"].astype(str).to_numpy(), _ops_inside(ev, opt))
    if len(ends) >= 2:
        steps = pd.DataFrame({"step": np.arange(1, len(ends), dtype=np.int64),
                              "start": ends[:-1], "end": ends[1:]})
        warnings.append("no ProfilerStep#N markers: steps taken between Optimizer.step ends" if not stepped else
                        "no ProfilerStep#N markers: steps taken between iterations' last Optimizer.step ends "
                        f"({stepped})")
        return steps, "optimizer_step", warnings
    return pd.DataFrame({c: pd.Series(dtype=np.float64) for c in STEP_COLUMNS}), "none", warnings


def _ops_inside(ev: pd.DataFrame, spans: pd.DataFrame) -> np.ndarray:
    """How many host ops start inside each span on its own thread: what an optimizer's step does,
    which its parameters fix (an Adam over 6 tensors ran 156 ops a step, one over 8 ran 208)."""
    ops = ev[_kind_mask(ev, KIND_CPU_OP)]
    op_tids, op_ts = _tid_codes(ops), ops["ts"].to_numpy(dtype=float)
    out = np.zeros(len(spans), dtype=np.int64)
    tids = _tid_codes(spans)
    for tid in set(tids):
        ts = np.sort(op_ts[op_tids == tid])
        mine = tids == tid
        s = spans["ts"].to_numpy(dtype=float)[mine]
        out[mine] = np.searchsorted(ts, s + spans["dur"].to_numpy(dtype=float)[mine], side="right") - \
            np.searchsorted(ts, s, side="left")
    return out


def _tid_codes(rows: pd.DataFrame) -> np.ndarray:
    """Each row's thread as a number, the same for rows of one trace's events (its category's code;
    as text where the column is not categorical)."""
    tid = rows["tid"]
    return tid.cat.codes.to_numpy() if isinstance(tid.dtype, pd.CategoricalDtype) else tid.astype(str).to_numpy()


MAX_CYCLE = 8
"""The most optimizer steps, each after its own backward, taken for one iteration's cycle."""


def _cycle(signatures: list) -> int:
    """The shortest period of the signatures seen at least twice over (1: none shorter holds)."""
    n = len(signatures)
    for p in range(1, min(MAX_CYCLE, n // 2) + 1):
        if all(signatures[i] == signatures[i + p] for i in range(n - p)):
            return p
    return 1


def iteration_ends(end: np.ndarray, backward: np.ndarray, names: np.ndarray,
                   inner: np.ndarray | None = None) -> tuple[np.ndarray, str]:
    """Where each training iteration ends, from the Optimizer.step spans' ends (the spans sorted by
    start), the starts of the autograd backward ops (sorted) and how many ops each span ran
    (`inner`); with,
    where an iteration steps more than one optimizer, how many and which ("" where each steps one).

    A job may step several optimizers an iteration (DLRM's sparse SGD and dense Adam, a model
    whose parameter groups each have their own), and an optimizer wrapper records its inner
    optimizer's step inside its own. Counting every Optimizer.step as a step's end halved the
    step and every ms per step with it (a 2-rank job with SGD and Adam and a 150 ms straggler:
    "15 steps, mean 74.8 ms" for 8 iterations of 150 ms). Two optimizer steps with no backward op
    starting between the first's end and the second's end stepped the same gradients: one
    iteration. A closure's step holds its own forward and backward, so it stays an iteration of
    its own. Where the trace has no backward op at all, each Optimizer.step ends a step, as
    before.

    Optimizers each after its own backward (a GAN's discriminator, then its generator) are told
    apart by what their steps do: the trace names an optimizer's class, not which one stepped,
    but a step's ops are fixed by its parameters. Where the steps' (class, ops) repeat in a
    cycle of p > 1, seen at least twice over, an iteration is one cycle (from the first step
    profiled; a cycle cut by the window's end is dropped). One optimizer stepping between
    alternating tasks repeats with period 1 and keeps a step each. Where nothing repeats exactly
    (an optimizer's first step making its state, a step a scaler skipped), each stays a step."""
    if len(end) == 0 or len(backward) == 0:
        return end, ""
    # a backward op starting in (end[i], end[i + 1]] separates the two; none: one iteration
    lo = np.searchsorted(backward, end[:-1], side="right")
    hi = np.searchsorted(backward, end[1:], side="right")
    new = np.concatenate(([True], hi > lo))
    group = np.cumsum(new) - 1
    out = np.full(int(group[-1]) + 1, -np.inf)
    np.maximum.at(out, group, end)
    counts = np.bincount(group)
    said = ""
    if len(out) < len(end):
        many = names[np.isin(group, np.flatnonzero(counts > 1))]
        kinds = ", ".join(sorted({n.removeprefix("Optimizer.step#") for n in many}))[:200]
        said = f"{int(np.median(counts))} optimizer steps an iteration, no backward between them: {kinds}"
    if inner is None:
        return out, said
    cuts = np.flatnonzero(new)[1:]
    sigs = [tuple(zip(n.tolist(), k.tolist())) for n, k in zip(np.split(names, cuts), np.split(inner, cuts))]
    p = _cycle(sigs)
    if p == 1:
        return out, said
    cycles = len(out) // p
    kinds = ", ".join(n.removeprefix("Optimizer.step#") for n, _ in (x for sig in sigs[:p] for x in sig))[:200]
    return out[p - 1:cycles * p:p], (f"{p} optimizer steps an iteration, each after its own backward, told apart "
                                     f"by the ops each step runs: {kinds}")


DEVICE_BEHIND = 0.05
"""How far the device's steps may differ in total from the host's before the steps are timed as
the device ran them: the replay's own fidelity bar (whatif.FIDELITY_OK)."""


def device_steps(ev: pd.DataFrame, steps: pd.DataFrame) -> tuple[pd.DataFrame, str | None]:
    """GPU: the steps as the device ran them, where the host ran ahead of it; with the warning
    that says so (None: the host's steps stand).

    A host that launches faster than the device runs (no sync in the loop, early in a job) ends
    its steps while their work still waits in the launch queue: its step spans measure how fast it
    launches, not how fast the job runs (recorded on an H200: host steps of 3.6-9.1 ms while the
    device ran 12.7 ms of work per step; once the queue was full, the host's steps took 12.6 ms:
    tests/fixtures/gpu_h200). Each step then runs on the device from the first device event
    launched inside it to the first one launched inside the next (the last step: its own device
    work, or its host span if longer and the device kept up). These windows replace the host's
    only when their total differs from the host's by more than DEVICE_BEHIND; else (the host
    keeps up, or runs a steady distance ahead) the host's windows stand, as every check reads
    them."""
    n = len(steps)
    if n == 0:
        return steps, None
    dev = ev[_kind_mask(ev, KIND_KERNEL, KIND_COMM_KERNEL, KIND_MEMCPY, KIND_MEMSET)]
    rt = ev[_kind_mask(ev, KIND_RUNTIME)]
    pos = launch_positions(dev["corr"].to_numpy(), rt)
    if not (pos >= 0).any():
        return steps, None
    start, end = steps["start"].to_numpy(dtype=float), steps["end"].to_numpy(dtype=float)
    launch = rt["ts"].to_numpy(dtype=float)[pos[pos >= 0]]
    d_start = dev["ts"].to_numpy(dtype=float)[pos >= 0]
    d_end = d_start + dev["dur"].to_numpy(dtype=float)[pos >= 0]
    k = np.searchsorted(start, launch, side="right") - 1
    inside = (k >= 0) & (launch < end[np.clip(k, 0, None)])
    if not inside.any():
        return steps, None
    k, d_start, d_end = k[inside], d_start[inside], d_end[inside]
    first = np.full(n, np.inf)
    last = np.full(n, -np.inf)
    np.minimum.at(first, k, d_start)
    np.maximum.at(last, k, d_end)
    if not np.isfinite(first).all() or (np.diff(first) <= 0).any():
        return steps, None  # a step launched nothing on the device, or out of order: keep the host's
    host = end - start
    # the last step: its own device work when the device began it only after the host had ended
    # it (still behind); else the longer of that and the host's span
    own = last[-1] - first[-1]
    dev_ms = np.append(np.diff(first), own if first[-1] >= end[-1] else max(own, host[-1]))
    if abs(dev_ms.sum() - host.sum()) <= DEVICE_BEHIND * host.sum():
        return steps, None
    lag = first - start
    return steps.assign(start=first, end=first + dev_ms), (
        f"the host ran ahead of the device (its launches waited up to {lag.max() / 1000:.1f} ms in the queue): "
        f"steps are timed as the device ran them, {dev_ms.mean() / 1000:.1f} ms on average against the host's "
        f"{host.mean() / 1000:.1f} ms")


def launch_positions(dev_corr: np.ndarray, rt: pd.DataFrame) -> np.ndarray:
    """Position in `rt` of each device event's launch call (-1: none)."""
    corr = rt["corr"].to_numpy()
    ok = corr >= 0
    pos = np.flatnonzero(ok)
    c = corr[ok]
    order = np.argsort(c, kind="stable")
    c, pos = c[order], pos[order]
    i = np.searchsorted(c, dev_corr)
    hit = (i < c.size) & (dev_corr >= 0)
    hit[hit] = c[i[hit]] == dev_corr[hit]
    out = np.full(dev_corr.size, -1, dtype=np.int64)
    out[hit] = pos[i[hit]]
    return out


def _bytes_of(args: dict) -> float:
    """Message size in bytes from record_param_comms / kernel args or Input Dims + type."""
    n = args.get("In msg nelems")
    dtype = args.get("dtype")
    if isinstance(n, (int, float)) and n > 0:
        size = _DTYPE_BYTES.get(str(dtype).lower(), 4)
        return float(n) * size
    dims = args.get("Input Dims")
    types = args.get("Input type")
    if isinstance(dims, list) and dims:
        first = dims[0]
        while isinstance(first, list) and first and isinstance(first[0], list):
            first = first[0]
        if isinstance(first, list) and all(isinstance(x, int) for x in first):
            numel = float(np.prod(first)) if first else 1.0
            t = types[0] if isinstance(types, list) and types else "float"
            return numel * _DTYPE_BYTES.get(str(t).lower(), 4)
    return float("nan")


def _assign_steps(ts: np.ndarray, steps: Steps) -> np.ndarray:
    """Step number of each timestamp, or -1 when it falls outside every step."""
    if len(steps) == 0 or ts.size == 0:
        return np.full(ts.size, -1, dtype=np.int64)
    i = np.searchsorted(steps.start, ts, side="right") - 1
    ok = (i >= 0) & (ts < steps.end[np.clip(i, 0, None)])
    out = np.full(ts.size, -1, dtype=np.int64)
    out[ok] = steps.step[i[ok]]
    return out


UNNAMED_GROUPS = "unnamed"
"""The group key of a gloo rank's collectives where they ran on several process groups, which the
trace does not name (RankTimeline.unnamed_groups): "group unnamed" beside their figures."""


def _own_groups(trace: RankTrace, rank: int) -> int:
    """How many process groups the trace's distributedInfo.pg_config puts this rank in (the
    groups' `ranks` lists; a group without them counted)."""
    info = trace.meta.get("distributedInfo")
    pgs = info.get("pg_config") if isinstance(info, dict) else None
    if not isinstance(pgs, list):
        return 0
    return sum(1 for g in pgs if isinstance(g, dict) and (not isinstance(g.get("ranks"), list) or rank in g["ranks"]))


GLOO_THREADS = 2
"""Worker threads a ProcessGroupGloo starts (torch's default, ProcessGroupGloo.Options.threads):
one group's collectives run on that many `pt_gloo_runloop` threads at most."""


def _several_gloo_groups(tids: np.ndarray) -> bool:
    """Whether gloo runloop threads `tids` ran more than one process group's collectives. A
    collective's annotation names no group on gloo (no record_param_comms; TRACE-FACTS.md): its
    thread is all that tells groups apart, each group running on its own GLOO_THREADS threads.
    Which group a thread is, the trace cannot say (their ids are not always consecutive within a
    group; a 2-D job's default group, idle while its `dp` and `tp` groups work, starts threads too)."""
    return np.unique(tids).size > GLOO_THREADS


def _collectives(trace: RankTrace, is_gpu: bool, steps: Steps, comm_tids: set[str], rank: int
                 ) -> tuple[pd.DataFrame, bool]:
    """The rank's collectives (COLLECTIVE_COLUMNS) and, on gloo, RankTimeline.unnamed_groups."""
    ev = trace.events
    args = trace.comm_args
    unnamed = False
    if is_gpu:
        sel = ev[_kind_mask(ev, KIND_COMM_KERNEL)].sort_values("ts")
        arrival = sel["ts"].to_numpy()
        # sizes and process group: on the kernel itself (new traces) or on the
        # record_param_comms op that launched it (same External id)
        rpc = ev[_kind_mask(ev, KIND_CPU_OP) & (ev["name"] == "record_param_comms").to_numpy()]
        by_ext = {}
        for row, ext in zip(rpc.index, rpc["ext"]):
            if ext >= 0 and row in args.index:
                by_ext[ext] = args.loc[row].dropna().to_dict()
        meta = []
        for row, ext in zip(sel.index, sel["ext"]):
            a = args.loc[row].dropna().to_dict() if row in args.index else {}
            if "In msg nelems" not in a and ext in by_ext:
                a = {**by_ext[ext], **a}
            meta.append(a)
        full = sel["name"].astype(str).to_numpy()
        names = sel["name"].astype(str).str.replace(r"\(.*$", "", regex=True).to_numpy()
        ends = (sel["ts"] + sel["dur"]).to_numpy()
        rows = sel.index.to_numpy()
    else:
        p2p = _names_matching(ev, P2P)
        mask = _names_matching(ev, CPU_COMM_TRANSFER) & _kind_mask(ev, KIND_ANNOTATION, KIND_CPU_OP) & ~p2p
        sel = ev[mask].sort_values("ts")
        enq = ev[_names_matching(ev, re.compile(r"^c10d::")) & _kind_mask(ev, KIND_CPU_OP) & ~p2p]
        enq = enq[~enq["tid"].astype(str).isin(comm_tids)].sort_values("ts")
        arrival = sel["ts"].to_numpy().copy()
        if len(enq) == len(sel) and len(sel):
            # gloo runs each op on a runloop thread, possibly queued behind the previous
            # one: the main thread's enqueue is when this rank was ready
            arrival = np.minimum(arrival, enq["ts"].to_numpy())
        meta = [args.loc[row].dropna().to_dict() if row in args.index else {} for row in sel.index]
        names = sel["name"].astype(str).to_numpy()
        full = names
        ends = (sel["ts"] + sel["dur"]).to_numpy()
        rows = sel.index.to_numpy()
        named = any("Process Group Name" in m for m in meta)
        unnamed = not named and _own_groups(trace, rank) > 1 and _several_gloo_groups(sel["tid"].astype(str).to_numpy())
    pg = np.array([str(m.get("Process Group Name", UNNAMED_GROUPS if unnamed else "default")) for m in meta],
                  dtype=object)
    nbytes = np.array([_bytes_of(m) for m in meta], dtype=np.float64)
    dtype = np.array([_dtype_of(m, n) for m, n in zip(meta, full)], dtype=object)
    step = _assign_steps(arrival, steps)
    df = pd.DataFrame({"step": step, "pg": pg, "name": names, "arrival": arrival, "end": ends,
                       "bytes": nbytes, "dtype": dtype, "row": rows})
    df["seq"] = df.groupby(["step", "pg"]).cumcount()
    return compact(df[list(COLLECTIVE_COLUMNS)]), unnamed


def gather_collectives(timelines: dict[int, RankTimeline]) -> dict[str, np.ndarray]:
    """Every rank's collectives inside its steps as column arrays (COLLECTIVE_COLUMNS, `rank`, and
    `dur`: end minus arrival), each rank's own clock, rank after rank ({} when none). Read once
    when the run is assembled (Run.collectives): read from each rank's frame for each table built
    from them, it was 0.2 s a table at 1,024 ranks. Texts (names, groups, dtypes) one object each:
    read back from disk, each rank's are copies of their own (0.9 MB at 1,024 ranks).

    Each column grows in one buffer as the ranks are read (step/appended.py), not as a list of
    every rank's arrays joined at the end: those were 11 small arrays a rank alive at once, and
    the client's resident memory rose 3.1 MB here at 1,024 replicated DLRM ranks against 0.7 at
    256 (#20: the client's memory per rank)."""
    cols = COLLECTIVE_COLUMNS + ("rank", "dur")
    out = {c: Appended() for c in cols}
    texts: dict[object, object] = {}
    for r in sorted(timelines):
        c = timelines[r].own_collectives()
        keep = c["step"].to_numpy() >= 0
        if not keep.any():
            continue
        for col in COLLECTIVE_COLUMNS:
            v = c[col].to_numpy()[keep]  # a copy (a mask selects)
            if v.dtype == object:
                v[:] = [texts.setdefault(x, x) if isinstance(x, str) else x for x in v]
            out[col].add(v)
        out["rank"].add(np.full(int(keep.sum()), r, dtype=np.int64))
        out["dur"].add((c["end"].to_numpy() - c["arrival"].to_numpy())[keep])  # numpy's: a Series' costs 0.1 ms
        del c, keep, v
    return {c: out.pop(c).array() for c in cols} if out["step"].n else {}


def compact(df: pd.DataFrame) -> pd.DataFrame:
    """A small per-rank table as the parent keeps it: text columns as plain objects and one block
    per type. Each pandas block (pandas 3 gives each inferred string column its own) costs about
    1 KB a rank whatever its rows (#20: the client's memory grows with the rank count)."""
    text = {c: object for c in df.columns if pd.api.types.is_string_dtype(df[c].dtype) and df[c].dtype != object}
    return (df.astype(text) if text else df).copy()


def build_timeline(trace: RankTrace, rank: int) -> RankTimeline:
    ev = trace.events
    warnings: list[str] = []
    steps, source, w = find_steps(ev)
    warnings += [f"rank {rank}: {x}" for x in w]
    kinds = ev["kind"]
    is_gpu = bool(kinds.isin([KIND_KERNEL, KIND_COMM_KERNEL]).any())
    device_timed = False
    if is_gpu:
        steps, ahead = device_steps(ev, steps)
        if ahead:
            warnings.append(f"rank {rank}: {ahead}")
            device_timed = True
    steps = Steps.of(steps)
    dl_mask = _names_matching(ev, DATALOADER) & _kind_mask(ev, KIND_ANNOTATION, KIND_CPU_OP)
    dl = ev[dl_mask]
    dataloader = union(dl["ts"], dl["ts"] + dl["dur"])

    transfer = _names_matching(ev, CPU_COMM_TRANSFER)
    # gloo's runloop threads; the training thread (which holds ProfilerStep) may record
    # gloo:send/recv itself and must stay a compute thread
    train_tids = set(ev.loc[_names_matching(ev, PROFILER_STEP), "tid"].astype(str))
    comm_tids = set(ev.loc[transfer, "tid"].astype(str)) - train_tids
    host_kinds = _kind_mask(ev, KIND_CPU_OP, KIND_ANNOTATION)
    on_comm_thread = ev["tid"].astype(str).isin(comm_tids).to_numpy()
    framing = frames(ev) | dl_mask
    cpu_comm = (transfer | _names_matching(ev, CPU_COMM_ENQUEUE)) & host_kinds
    host = ev[host_kinds & ~on_comm_thread & ~framing & ~cpu_comm]
    host_busy = union(host["ts"], host["ts"] + host["dur"])

    input_copies = Intervals.empty()
    if is_gpu:
        work = ev[_kind_mask(ev, KIND_KERNEL, KIND_MEMCPY, KIND_MEMSET)]
        compute = union(work["ts"], work["ts"] + work["dur"])
        ck = ev[_kind_mask(ev, KIND_COMM_KERNEL)]
        comm = union(ck["ts"], ck["ts"] + ck["dur"])
        copies = ev[_kind_mask(ev, KIND_MEMCPY) & _names_matching(ev, PAGEABLE_H2D)]
        if len(copies):
            kernels = ev[_kind_mask(ev, KIND_KERNEL, KIND_COMM_KERNEL)]
            input_copies = subtract(union(copies["ts"], copies["ts"] + copies["dur"]),
                                    union(kernels["ts"], kernels["ts"] + kernels["dur"]))
    else:
        wrappers = ev[host_kinds & _names_matching(ev, COMM_WRAPPERS)]
        wrapper_set = union(wrappers["ts"], wrappers["ts"] + wrappers["dur"])
        compute = subtract(subtract(host_busy, dataloader), wrapper_set)
        cc = ev[cpu_comm]
        comm = merge(union(cc["ts"], cc["ts"] + cc["dur"]), wrapper_set)
    collectives, unnamed = _collectives(trace, is_gpu, steps, comm_tids, rank)
    cr = ev[host_kinds & ~on_comm_thread & _names_matching(ev, COMPILED_REGION)]
    return RankTimeline(rank=rank, file=trace.path.name, is_gpu=is_gpu, step_source=source, steps=steps,
                        compute=compute, comm=comm, dataloader=dataloader, host_busy=host_busy,
                        collectives=collectives, comm_threads=frozenset(comm_tids),
                        compiled=union(cr["ts"], cr["ts"] + cr["dur"]), warnings=tuple(warnings),
                        input_copies=input_copies, device_timed=device_timed, unnamed_groups=unnamed)


def frames(ev: pd.DataFrame) -> np.ndarray:
    """Spans that frame work without being work: ProfilerStep#N, a closure's Optimizer.step, and
    Lightning's profiler annotations. The ops inside them count; their own time does not."""
    return _names_matching(ev, PROFILER_STEP) | _names_matching(ev, FRAMEWORK_FRAME) | closure_steps(ev)


def closure_steps(ev: pd.DataFrame) -> np.ndarray:
    """Optimizer.step annotations that run the whole forward and backward inside them: a closure
    (`optimizer.step(closure)`, as PyTorch Lightning and LBFGS call it). Such a span frames the step
    like ProfilerStep does: its own time is not work, it holds the thread's waits (a rank blocked at
    the end of backward for a late peer's all-reduce); the ops inside it still count."""
    opt = ev[_kind_mask(ev, KIND_CPU_OP, KIND_ANNOTATION) & _names_matching(ev, OPTIMIZER_STEP)]
    out = np.zeros(len(ev), dtype=bool)
    if not len(opt):
        return out
    bw = ev[_kind_mask(ev, KIND_CPU_OP) & _names_matching(ev, AUTOGRAD_BACKWARD)]
    for tid in set(opt["tid"].astype(str)):
        o = opt[opt["tid"].astype(str) == tid]
        b = np.sort(bw.loc[bw["tid"].astype(str) == tid, "ts"].to_numpy())
        first = np.searchsorted(b, o["ts"].to_numpy(), side="left")  # first backward op at or after each start
        holds = (first < len(b)) & (b[np.minimum(first, len(b) - 1)] < (o["ts"] + o["dur"]).to_numpy()) \
            if len(b) else np.zeros(len(o), dtype=bool)
        out[ev.index.get_indexer(o.index[holds])] = True
    return out


def runtime_launch_delay(ev: pd.DataFrame) -> np.ndarray:
    """Per kernel: its start minus the end of the runtime call that launched it (us)."""
    k = ev[_kind_mask(ev, KIND_KERNEL, KIND_COMM_KERNEL)]
    r = ev[_kind_mask(ev, KIND_RUNTIME)]
    k = k[k["corr"] >= 0]
    r = r[r["corr"] >= 0].drop_duplicates("corr")
    m = k[["corr", "ts"]].merge(
        pd.DataFrame({"corr": r["corr"].to_numpy(), "rend": (r["ts"] + r["dur"]).to_numpy()}), on="corr")
    return (m["ts"] - m["rend"]).to_numpy()
