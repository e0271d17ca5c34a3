"""4. Micro-batch too small / launch (host) overhead.

GPU traces. Estimation: the mean per-step time the device idles (no kernel, copy or
collective, outside DataLoader waits) while the host is busy in CPU ops other than
synchronisation calls: the host cannot launch work fast enough. Job-level: median rank.

CPU-only traces. Estimation: per-op overhead = for every op in the step, its self
time up to that op's fixed cost, taken as the self time of its fastest instance on
the rank (where the work is smallest): the cost each op pays whatever its size,
which a larger micro-batch amortises.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from diagnose.analyzers.common import confidence_for, flag_or_pass, not_measurable
from diagnose.context import Context
from diagnose.intervals import covered, intersect, merge, subtract, union
from diagnose.ingest.load import (KIND_ANNOTATION, KIND_COMM_KERNEL, KIND_CPU_OP, KIND_KERNEL, KIND_RUNTIME,
                                  RankTrace)
from diagnose.model import Check, Finding
from diagnose.thresholds import Thresholds
from diagnose.timeline import (CPU_COMM_ENQUEUE, CPU_COMM_TRANSFER, DATALOADER, PROFILER_STEP, RankTimeline,
                               _names_matching, runtime_launch_delay)

ID = "launch_overhead"
TITLE = "Micro-batch too small / launch overhead (device waits for the host)"
FIX_GPU = ("Give the device bigger, fewer kernels: raise the micro-batch (keep the global batch with gradient "
           "accumulation), torch.compile the model (fuses ops), or capture the step with CUDA graphs; "
           "move Python work out of the step.")
FIX_CPU = ("Per-op overhead dominates: raise the micro-batch (with gradient accumulation to keep the global "
           "batch), fuse ops with torch.compile, and keep Python work out of the step.")
SYNC = re.compile(r"Synchronize|cudaMemcpy$|hipMemcpy$|EventQuery|StreamQuery", re.IGNORECASE)
DENSE = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|conv|_convolution|mkldnn_convolution|"
                   r"cudnn_convolution|_scaled_dot_product|scaled_dot_product|einsum)")


@dataclass(frozen=True, slots=True)
class HostBound:
    """GPU rank: device idle while the host is busy, and the kernel/launch figures behind it."""

    ms: float
    """Mean per-step device idle (outside DataLoader waits) while the host runs non-sync CPU ops."""
    idle_us: float
    host_in_idle_us: float
    kernels_per_step: float
    median_kernel_us: float | None
    median_launch_delay_us: float | None
    linked: int
    """Kernels linked to their launch (correlation ids)."""
    kernels: int
    evidence: tuple[tuple[int, str], ...]
    """(row, note): the host ops during the longest such idle gaps."""


@dataclass(frozen=True, slots=True)
class OpOverhead:
    """CPU rank: per-op fixed cost per step."""

    ms: float
    ops_per_step: float | None
    """None: no host ops in the steps."""
    fixed_cost_us: float | None
    dense_share: float | None
    typical_rows: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RankLaunch:
    gpu: HostBound | None
    cpu: OpOverhead | None

    @property
    def rows(self) -> tuple[int, ...]:
        return (tuple(r for r, _ in self.gpu.evidence) if self.gpu else ()) + (self.cpu.typical_rows if self.cpu else ())


def reduce(trace: RankTrace, tl: RankTimeline) -> RankLaunch:
    if tl.is_gpu:
        return RankLaunch(gpu=_host_bound(trace.events, tl), cpu=None)
    return RankLaunch(gpu=None, cpu=_op_overhead(trace.events, tl))


def _host_bound(ev: pd.DataFrame, tl: RankTimeline) -> HostBound:
    lo, hi = tl.steps["start"].to_numpy(), tl.steps["end"].to_numpy()
    busy = merge(merge(tl.compute, tl.comm), tl.dataloader)
    idle = subtract(union(lo, hi), busy)
    sync = ev[(ev["kind"] == KIND_RUNTIME).to_numpy() & _names_matching(ev, SYNC)]
    host = subtract(tl.host_busy, union(sync["ts"], sync["ts"] + sync["dur"]))
    host_idle = intersect(idle, host)
    k = ev[ev["kind"].isin([KIND_KERNEL, KIND_COMM_KERNEL]).to_numpy()]
    k_in = k[(k["ts"] >= lo.min()) & (k["ts"] < hi.max())]
    d = runtime_launch_delay(ev)
    evidence = []
    # evidence: the longest idle gaps while the host was busy
    if len(host_idle):
        for i in np.argsort(host_idle.ends - host_idle.starts)[-2:]:
            s, e = float(host_idle.starts[i]), float(host_idle.ends[i])
            ops = ev[(ev["kind"].isin([KIND_CPU_OP, KIND_ANNOTATION]).to_numpy()) & (ev["ts"] <= s).to_numpy()
                     & ((ev["ts"] + ev["dur"]) >= e).to_numpy()]
            if len(ops):
                evidence.append((int(ops["dur"].idxmin()), f"device idle {(e - s) / 1000:.2f} ms during this host op"))
    return HostBound(ms=float(np.mean(covered(host_idle, lo, hi))) / 1000, idle_us=idle.total,
                     host_in_idle_us=host_idle.total, kernels_per_step=len(k_in) / max(len(lo), 1),
                     median_kernel_us=float(np.median(k_in["dur"])) if len(k_in) else None,
                     median_launch_delay_us=float(np.median(d)) if d.size else None, linked=int(d.size),
                     kernels=len(k), evidence=tuple(evidence))


def _gpu(ctx: Context, th: Thresholds) -> Check:
    run = ctx.run
    facts = {r: f.gpu for r, f in ctx.facts("launch_overhead").items() if f.gpu is not None}
    per_rank = {r: f.ms for r, f in facts.items()}
    metrics: dict[str, float | int | str] = {}
    refs = [ctx.event_ref(r, row, note) for r, f in facts.items() for row, note in f.evidence]
    idle_total = sum(f.idle_us for f in facts.values())
    host_in_idle = sum(f.host_in_idle_us for f in facts.values())
    linked = sum(f.linked for f in facts.values())
    n_kernels_all = sum(f.kernels for f in facts.values())
    # medians over ranks of each rank's median: a rank reports its median, not its every kernel
    kernel_us = [f.median_kernel_us for f in facts.values() if f.median_kernel_us is not None]
    delay_us = [f.median_launch_delay_us for f in facts.values() if f.median_launch_delay_us is not None]
    ms = float(np.median(list(per_rank.values())))
    share = ms / ctx.mean_step_ms
    metrics.update({
        "device_idle_host_busy_ms_per_step": round(ms, 3),
        "share_of_step": round(share, 4),
        "device_idle_share": round(float(ctx.table["other_ms"].sum() / ctx.table["step_ms"].sum()), 4),
        "host_busy_share_of_idle": round(host_in_idle / idle_total, 4) if idle_total else 0.0,
        "kernels_per_step": round(float(np.median([f.kernels_per_step for f in facts.values()])), 1),
        "median_kernel_us": round(float(np.median(kernel_us)), 2) if kernel_us else 0.0,
        "median_launch_delay_us": round(float(np.median(delay_us)), 2) if delay_us else "not linked",
    })
    base = "high" if kernel_us and np.median(kernel_us) < 50 else "medium"
    linked_share = linked / n_kernels_all if n_kernels_all else 0.0
    metrics["kernels_linked_to_launch"] = round(linked_share, 3)
    if linked_share < 0.5 or not any(run.traces[r].flows for r in run.ranks):
        # sampled or filtered trace (no launch->kernel flows): missing events look like idle time
        base = "low"
        metrics["note"] = "trace looks sampled or filtered (no flow events): idle time may be overstated"
    ranks = tuple(r for r, v in per_rank.items() if v / ctx.mean_step_ms >= th.launch_overhead) or tuple(run.ranks)
    f = Finding(
        id=ID, title=TITLE, severity=th.severity(share), recoverable_ms=round(ms, 3), share_of_step=round(share, 4),
        ranks=ranks, metrics=metrics, events=tuple(refs[:6]), fix=FIX_GPU, confidence=confidence_for(ctx, base),
        method="Median over ranks of per-step device idle time (outside DataLoader waits) during which the "
               "host is busy in non-synchronising CPU ops.")
    return flag_or_pass(f, th.launch_overhead, th, f"the device idles {ms:.1f} ms per step ({share:.0%}) while "
                        "the host is busy: host-bound")


def _self_times(df: pd.DataFrame) -> np.ndarray:
    """Self time of each op (duration minus its direct children), per thread.

    Rows must be sorted by (tid, ts, -dur). One stack walk: CPU-only traces hold
    tens of thousands of ops per step at most, so a Python loop is fast enough here.
    """
    ts = df["ts"].to_numpy()
    end = ts + df["dur"].to_numpy()
    tids = df["tid"].to_numpy()
    self_t = df["dur"].to_numpy().copy()
    stack: list[int] = []
    prev_tid = None
    for i in range(len(ts)):
        if tids[i] != prev_tid:
            stack.clear()
            prev_tid = tids[i]
        while stack and end[stack[-1]] <= ts[i]:
            stack.pop()
        if stack:
            self_t[stack[-1]] -= min(end[i], end[stack[-1]]) - ts[i]
        stack.append(i)
    return np.maximum(self_t, 0.0)


def _op_overhead(ev: pd.DataFrame, tl: RankTimeline) -> OpOverhead:
    host_kinds = ev["kind"].isin([KIND_CPU_OP, KIND_ANNOTATION]).to_numpy()
    comm_tids = tl.comm_threads
    excl = (_names_matching(ev, PROFILER_STEP) | _names_matching(ev, DATALOADER)
            | _names_matching(ev, CPU_COMM_ENQUEUE) | _names_matching(ev, CPU_COMM_TRANSFER))
    ops = ev[host_kinds & ~excl & ~ev["tid"].astype(str).isin(comm_tids).to_numpy()]
    ops = ops.assign(tid=ops["tid"].astype(str)).sort_values(["tid", "ts", "dur"], ascending=[True, True, False])
    ops = ops.assign(self_us=_self_times(ops))
    # ops inside a DataLoader fetch are input work, counted by the dataloader check
    if len(tl.dataloader):
        inside = covered(tl.dataloader, ops["ts"], ops["ts"] + ops["dur"]) > 0
        ops = ops[~inside]
    lo, hi = tl.steps["start"].to_numpy(), tl.steps["end"].to_numpy()
    if ops.empty:
        return OpOverhead(ms=0.0, ops_per_step=None, fixed_cost_us=None, dense_share=None, typical_rows=())
    # an op's fixed cost is at most its fastest instance's self time: at that size
    # the work is smallest, so what remains is dispatch and bookkeeping
    fixed_cost = ops.groupby("name", observed=True)["self_us"].transform("min").to_numpy()
    floor = float(np.median(fixed_cost))
    idx = np.searchsorted(lo, ops["ts"].to_numpy(), side="right") - 1
    ok = (idx >= 0) & (ops["ts"].to_numpy() < hi[np.clip(idx, 0, None)])
    fixed = np.bincount(idx[ok], weights=np.minimum(ops["self_us"].to_numpy(), fixed_cost)[ok], minlength=len(lo))
    n_ops = np.bincount(idx[ok], minlength=len(lo))
    dense = ops[_names_matching(ops, DENSE)]
    c = covered(tl.compute, lo, hi).sum()
    typical = ops.iloc[np.argsort(np.abs(ops["self_us"].to_numpy() - floor))[:2]].index
    return OpOverhead(ms=float(np.mean(fixed)) / 1000, ops_per_step=float(np.mean(n_ops)), fixed_cost_us=floor,
                      dense_share=float(dense["self_us"].sum() / c) if c else 0.0,
                      typical_rows=tuple(int(i) for i in typical))


def _cpu(ctx: Context, th: Thresholds) -> Check:
    run = ctx.run
    facts = {r: f.cpu for r, f in ctx.facts("launch_overhead").items() if f.cpu is not None}
    per_rank = {r: f.ms for r, f in facts.items()}
    measured = [f for f in facts.values() if f.ops_per_step is not None]
    ops_per_step = [f.ops_per_step for f in measured]
    floors = [f.fixed_cost_us for f in measured]
    dense_shares = [f.dense_share for f in measured]
    refs = [ctx.event_ref(r, i, "a typical op: fixed cost dominates") for r, f in facts.items()
            for i in f.typical_rows]
    ms = float(np.median(list(per_rank.values())))
    share = ms / ctx.mean_step_ms
    metrics: dict[str, float | int | str] = {
        "op_overhead_ms_per_step": round(ms, 3),
        "share_of_step": round(share, 4),
        "ops_per_step": round(float(np.median(ops_per_step)), 1) if ops_per_step else 0,
        "median_fixed_cost_per_op_us": round(float(np.median(floors)), 2) if floors else 0.0,
        "dense_math_share_of_compute": round(float(np.median(dense_shares)), 4) if dense_shares else 0.0,
    }
    ranks = tuple(r for r, v in per_rank.items() if v / ctx.mean_step_ms >= th.cpu_op_overhead) or tuple(run.ranks)
    f = Finding(
        id=ID, title=TITLE, severity=th.severity(share), recoverable_ms=round(ms, 3), share_of_step=round(share, 4),
        ranks=ranks, metrics=metrics, events=tuple(refs[:4]), fix=FIX_CPU, confidence=confidence_for(ctx, "medium"),
        method="Median over ranks of the per-step sum, over ops, of each op's self time up to that op's fixed "
               "cost (its fastest instance's self time): the cost a larger micro-batch amortises.")
    return flag_or_pass(f, th.cpu_op_overhead, th, f"per-op overhead is {ms:.1f} ms per step ({share:.0%}) over "
                        f"{metrics['ops_per_step']} ops: the micro-batch is too small to amortise it")


def analyze(ctx: Context, th: Thresholds) -> list[Check]:
    if ctx.run.is_gpu:
        return [_gpu(ctx, th)]
    gpus = [p for t in ctx.run.traces.values() for p in t.meta.get("deviceProperties") or []]
    if gpus:
        return [not_measurable(ID, TITLE, "the trace lists GPUs but holds no GPU events (CUDA activity not "
                               "recorded): the device side cannot be judged; profile with ProfilerActivity.CUDA")]
    return [_cpu(ctx, th)]
