"""4. Micro-batch too small / launch (host) overhead.

GPU traces. Estimation: the host-launch class of the idle model (diagnose/step/idle.py): per
step, the device idle ended by work whose launch call returned after the idle began (the
device waited for the host), outside DataLoader waits and synchronising calls; split into
short gaps (launch rate) and long gaps (host-op stalls, with the host ops behind them).
Work that was launched before the idle began (queued) is device_wait's, syncs host_sync's.
Job-level: median rank.

CPU-only traces. Estimation: per-op overhead = for every op in the step, its self
time up to that op's fixed cost, taken as the self time of its fastest instance on
the rank (where the work is smallest), at most FIXED_MOST typical ops' (dense math:
one typical op's): the cost each op pays whatever its size, which a larger
micro-batch amortises.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from itertools import islice

import numpy as np
import pandas as pd

from diagnose.analyzers.common import (confidence_for, flag_or_pass, host_self_times, idle_completeness,
                                       not_measurable)
from diagnose.context import Context
from diagnose.ingest.load import KIND_COMM_KERNEL, KIND_KERNEL, RankTrace
from diagnose.model import Check, Finding
from diagnose.step import idle
from diagnose.step.intervals import covered
from diagnose.step.timeline import RankTimeline, _names_matching
from diagnose.thresholds import Thresholds

ID = "launch_overhead"
TITLE = "Micro-batch too small / launch overhead (device waits for the host)"
FIX_GPU = ("Give the device bigger, fewer kernels: raise the micro-batch (keep the global batch with gradient "
           "accumulation), torch.compile the model (fuses ops), or capture the step with CUDA graphs; "
           "move Python work out of the step.")
FIX_STALL = ("The device waits on long host-side stalls between launches: profile the host ops named in the "
             "evidence (py-spy or torch.profiler with_stack=True), move Python work (logging, metric "
             "bookkeeping, data reshuffles) out of the step, and avoid allocator-heavy or CPU-side ops in the loop; "
             "CUDA graphs or torch.compile remove the per-op host time altogether.")
FIX_CPU = ("Per-op overhead dominates: raise the micro-batch (with gradient accumulation to keep the global "
           "batch), fuse ops with torch.compile, and keep Python work out of the step.")
FIX_CPU_COMPILED = ("Per-op overhead dominates although most of the step already runs compiled: raise the "
                    "micro-batch (with gradient accumulation to keep the global batch), compile what still runs "
                    "eagerly (look for graph breaks: TORCH_LOGS=graph_breaks), and keep Python work out of the step.")
FIXED_MOST = 10.0
"""CPU traces: no op's fixed cost is taken above this many times the typical op's (the floor: the
median, over the step's ops, of each name's fastest instance; mostly views and metadata ops, pure
dispatch). An op that runs at one size only (dropout's bernoulli_ and GELU's tanh on a fixed-size
activation, the optimizer's foreach ops on the parameters) has a fastest instance that is all
work, which counted whole grew the "overhead" with the batch: a GPT-2 on CPU at 8 x 128 tokens
gave 71.6 ms a step, at 32 x 128 258.1 ms. Measured on real jobs (2026-12-07): in a tiny-batch job,
whose ops all run at their fixed cost, 0.2% of ops' fastest instances exceed 10 floors; in that
GPT-2 4% do, carrying 93% of what the old rule called fixed cost. With the bound: 6.6 and 7.4 ms."""
COMPILED_MOST = 0.5
"""Share of the host's busy time inside compiled code above which "use torch.compile" is no fix."""
DENSE = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|conv|_convolution|mkldnn_convolution|"
                   r"cudnn_convolution|_scaled_dot_product|scaled_dot_product|einsum)")


@dataclass(frozen=True, slots=True)
class HostBound:
    """GPU rank: the host-launch class of the idle model (diagnose/step/idle.py) and the figures behind it."""

    ms: float
    """Mean per-step device idle waiting for a launch issued after the gap began."""
    long_ms: float
    """Its part in gaps over th.launch_gap_long_us (host-op stalls, not launch rate)."""
    queued_ms: float
    """The queued class (reported by device_wait, never here), for the cross-check."""
    idle_us: float
    launch_us: float
    kernels_per_step: float
    median_kernel_us: float | None
    median_launch_delay_us: float | None
    linked: int
    """Device events inside the steps linked to their launch (correlation ids)."""
    kernels: int
    """Device events inside the steps."""
    host_ops: tuple[tuple[str, float], ...]
    """Innermost host ops during the long launch gaps: (name, ms per step)."""
    clock_bound_us: float | None
    """min(device start - its launch call's start): below 0, the host clock runs at least that far ahead
    of the device's (a kernel cannot start before it is launched), which shifts every gap's class."""
    evidence: tuple[tuple[int, str], ...]
    """(row, note): the kernels that end the longest launch gaps."""


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


def reduce(trace: RankTrace, tl: RankTimeline, idle_gaps: idle.IdleModel | None = None) -> RankLaunch:
    """idle_gaps: the rank's idle model when the caller built it already (reduce_rank does, once)."""
    if tl.is_gpu:
        return RankLaunch(gpu=_host_bound(trace, tl, idle_gaps or idle.idle_model(trace, tl)), cpu=None)
    return RankLaunch(gpu=None, cpu=_op_overhead(trace.events, tl))


def _host_bound(trace: RankTrace, tl: RankTimeline, m: idle.IdleModel) -> HostBound:
    ev = trace.events
    lo, hi = tl.steps.start, tl.steps.end
    k = ev[ev["kind"].isin([KIND_KERNEL, KIND_COMM_KERNEL]).to_numpy()]
    k_in = k[(k["ts"] >= lo.min()) & (k["ts"] < hi.max())]
    launch = (m.cls == idle.LAUNCH) & (m.end_row >= 0)
    evidence = []
    for i in np.flatnonzero(launch)[np.argsort(-m.in_steps_us[launch])[:2]]:
        evidence.append((int(m.end_row[i]), f"device idle {(m.end[i] - m.start[i]) / 1000:.2f} ms before this "
                         "kernel; its launch call ended after the idle began (the device waited for the host)"))
        evidence.append((int(m.launch_row[i]), "the launch call of that kernel"))
    return HostBound(ms=m.class_ms("launch"), long_ms=float(m.launch_long_us.mean()) / 1000,
                     queued_ms=m.class_ms("queued"), idle_us=float(m.step_idle_us.sum()),
                     launch_us=float(m.by_class_us[:, idle.LAUNCH].sum()),
                     kernels_per_step=len(k_in) / max(len(lo), 1),
                     median_kernel_us=float(np.median(k_in["dur"])) if len(k_in) else None,
                     median_launch_delay_us=m.median_launch_delay_us, linked=m.linked, kernels=m.device_events,
                     host_ops=tuple((n, us / 1000) for n, us in m.long_gap_ops),
                     clock_bound_us=m.clock_bound_us, evidence=tuple(evidence))


def _gpu(ctx: Context, th: Thresholds) -> Check:
    run = ctx.run
    # the ranks' summaries one at a time, each folded into its figures (#20: all of them held at
    # once were 3.5 MB at 1,024 ranks, the checklist's height)
    per_rank: dict[int, float] = {}
    refs: list = []
    figures: dict[str, list] = {k: [] for k in ("long_ms", "queued_ms", "kernels_per_step", "clock_bound_us")}
    kernel_us, delay_us = [], []
    host_ops: dict[str, list[float]] = {}  # host ops behind the long gaps: each rank's ms per step
    idle_total = launch_total = 0.0
    linked = n_dev = 0
    for r, x in ctx.facts_each("launch_overhead"):
        f = x.gpu
        if f is None:
            continue
        per_rank[r] = f.ms
        for row, note in f.evidence:
            if len(refs) < 6:  # the finding cites the first 6: build no more (every rank's would be thousands)
                refs.append(ctx.event_ref(r, row, note))
        idle_total += f.idle_us
        launch_total += f.launch_us
        linked += f.linked
        n_dev += f.kernels
        for k, v in figures.items():
            v.append(getattr(f, k))
        # medians over ranks of each rank's median: a rank reports its median, not its every kernel
        if f.median_kernel_us is not None:
            kernel_us.append(f.median_kernel_us)
        if f.median_launch_delay_us is not None:
            delay_us.append(f.median_launch_delay_us)
        for name, v in f.host_ops:
            host_ops.setdefault(name, []).append(v)
    ops = {name: sum(v / len(per_rank) for v in vs) for name, vs in host_ops.items()}  # mean over the ranks
    ms = float(np.median(list(per_rank.values())))
    long_ms = float(np.median(figures["long_ms"]))
    queued_ms = float(np.median(figures["queued_ms"]))
    share = ms / ctx.mean_step_ms
    delay = float(np.median(delay_us)) if delay_us else None
    metrics: dict[str, float | int | str] = {
        "device_idle_host_launch_ms_per_step": round(ms, 3),
        "short_gaps_ms_per_step": round(ms - long_ms, 3),
        "long_gaps_ms_per_step": round(long_ms, 3),
        "share_of_step": round(share, 4),
        "device_idle_share": round(float((ctx.table["other_ms"] + ctx.table["dataloader_ms"]).sum()
                                         / ctx.table["step_ms"].sum()), 4),
        # the share of idle time blamed on the host (what HTA calls host wait)
        "host_busy_share_of_idle": round(launch_total / idle_total, 4) if idle_total else 0.0,
        "queued_idle_ms_per_step": round(queued_ms, 3),
        "kernels_per_step": round(float(np.median(figures["kernels_per_step"])), 1),
        "median_kernel_us": round(float(np.median(kernel_us)), 2) if kernel_us else 0.0,
        "median_launch_delay_us": round(delay, 2) if delay is not None else "not linked",
        # causality bound on the host-device clock offset (the worst rank); negative: the class
        # boundaries between "queued" and "launch" are uncertain by that much
        "clock_bound_us": (round(min(b), 2) if (b := [x for x in figures["clock_bound_us"] if x is not None])
                           else "not linked"),
    }
    if ops:
        metrics["long_gap_host_ops_ms_per_step"] = ", ".join(
            f"{n} {v:.1f}" for n, v in sorted(ops.items(), key=lambda kv: -kv[1])[:5])
    base = "high" if kernel_us and np.median(kernel_us) < 50 else "medium"
    linked_share = linked / n_dev if n_dev else 0.0
    metrics["kernels_linked_to_launch"] = round(linked_share, 3)
    notes = []
    if linked_share < th.min_linked_share or not any(run.traces[r].flows for r in run.ranks):
        # sampled or filtered trace (no launch->kernel flows): missing events look like idle time
        base = "low"
        notes.append("trace looks sampled or filtered (no flow events): idle time may be overstated")
    host_ahead = delay is not None and delay >= th.host_ahead_delay_us and ms < queued_ms
    if host_ahead:
        base = "low"
        notes.append(f"median launch delay {delay / 1000:.1f} ms: the host runs ahead of the device, so launch "
                     "overhead is not what the device mostly waits for")
    gaps = idle_completeness(ctx, th)
    if gaps:
        base = "low"
        notes += gaps
    if notes:
        metrics["note"] = "; ".join(notes)
    ranks = tuple(r for r, v in per_rank.items() if v / ctx.mean_step_ms >= th.launch_overhead) or tuple(run.ranks)
    split = (f"{ms - long_ms:.1f} ms in short gaps between kernels (launch rate), {long_ms:.1f} ms in gaps over "
             f"{th.launch_gap_long_us:.0f} us (host-op stalls)")
    top_ops = [n for n, _ in sorted(ops.items(), key=lambda kv: -kv[1])[:3]]
    f = Finding(
        id=ID, title=TITLE, severity=th.severity(share), recoverable_ms=round(ms, 3), share_of_step=round(share, 4),
        ranks=ranks, metrics=metrics, events=tuple(refs[:6]), fix=FIX_GPU if ms - long_ms >= long_ms else FIX_STALL,
        confidence=confidence_for(ctx, base),
        method="Median over ranks of per-step device idle ended by work whose launch call returned after the "
               "idle began (the device waited for the host), outside DataLoader waits and synchronising calls; "
               "each idle gap is linked to its launch by correlation id (diagnose/step/idle.py).")
    reason = f"the device waits {ms:.1f} ms per step ({share:.0%}) for the host to launch work: {split}"
    if long_ms > 0 and top_ops:
        reason += f"; host ops behind the long gaps: {', '.join(top_ops)}"
    check = flag_or_pass(f, th.launch_overhead, th, reason, ctx)
    if host_ahead and check.status == "flagged":
        check = replace(check, reason=check.reason + f"; but the host runs ahead (median launch delay "
                        f"{delay / 1000:.1f} ms) and queued idle is larger ({queued_ms:.1f} ms): see device_wait")
    return check


def _op_overhead(ev: pd.DataFrame, tl: RankTimeline) -> OpOverhead:
    ops = host_self_times(ev, tl)
    # ops inside a DataLoader fetch are input work, counted by the dataloader check
    if len(tl.dataloader):
        inside = covered(tl.dataloader, ops["ts"], ops["ts"] + ops["dur"]) > 0
        ops = ops[~inside]
    lo, hi = tl.steps.start, tl.steps.end
    if ops.empty:
        return OpOverhead(ms=0.0, ops_per_step=None, fixed_cost_us=None, dense_share=None, typical_rows=())
    # an op's fixed cost is at most its fastest instance's self time: at that size
    # the work is smallest, so what remains is dispatch and bookkeeping; and at most FIXED_MOST
    # typical ops' (an op seen at one size only has a fastest instance that is all work)
    fixed_cost = ops.groupby("name", observed=True)["self_us"].transform("min").to_numpy()
    floor = float(np.median(fixed_cost))
    # dense math the more so: its fastest instance still multiplies matrices (a pipeline stage's
    # equal-sized matmuls would count whole as overhead); its fixed cost is taken as a typical op's
    dense_rows = _names_matching(ops, DENSE)
    fixed_cost = np.where(dense_rows, np.minimum(fixed_cost, floor), np.minimum(fixed_cost, FIXED_MOST * floor))
    idx = np.searchsorted(lo, ops["ts"].to_numpy(), side="right") - 1
    ok = (idx >= 0) & (ops["ts"].to_numpy() < hi[np.clip(idx, 0, None)])
    fixed = np.bincount(idx[ok], weights=np.minimum(ops["self_us"].to_numpy(), fixed_cost)[ok], minlength=len(lo))
    n_ops = np.bincount(idx[ok], minlength=len(lo))
    dense = ops[dense_rows]
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
    refs = list(islice((ctx.event_ref(r, i, "a typical op: fixed cost dominates") for r, f in facts.items()
                        for i in f.typical_rows), 4))  # the finding cites the first 4
    ms = float(np.median(list(per_rank.values())))
    share = ms / ctx.mean_step_ms
    metrics: dict[str, float | int | str] = {
        "op_overhead_ms_per_step": round(ms, 3),
        "share_of_step": round(share, 4),
        "ops_per_step": round(float(np.median(ops_per_step)), 1) if ops_per_step else 0,
        "median_fixed_cost_per_op_us": round(float(np.median(floors)), 2) if floors else 0.0,
        "dense_math_share_of_compute": round(float(np.median(dense_shares)), 4) if dense_shares else 0.0,
    }
    compiled = ctx.compiled_share()
    if compiled is not None:
        metrics["compiled_share_of_host_time"] = round(compiled, 4)
    ranks = tuple(r for r, v in per_rank.items() if v / ctx.mean_step_ms >= th.cpu_op_overhead) or tuple(run.ranks)
    f = Finding(
        id=ID, title=TITLE, severity=th.severity(share), recoverable_ms=round(ms, 3), share_of_step=round(share, 4),
        ranks=ranks, metrics=metrics, events=tuple(refs[:4]),
        fix=FIX_CPU_COMPILED if (compiled or 0.0) >= COMPILED_MOST else FIX_CPU, confidence=confidence_for(ctx, "medium"),
        method="Median over ranks of the per-step sum, over ops, of each op's self time up to that op's fixed "
               "cost (its fastest instance's self time): the cost a larger micro-batch amortises.")
    return flag_or_pass(f, th.cpu_op_overhead, th, f"per-op overhead is {ms:.1f} ms per step ({share:.0%}) over "
                        f"{metrics['ops_per_step']:.0f} ops: the micro-batch is too small to amortise it")


def analyze(ctx: Context, th: Thresholds) -> list[Check]:
    if ctx.run.is_gpu:
        return [_gpu(ctx, th)]
    gpus = [p for t in ctx.run.traces.values() for p in t.meta.get("deviceProperties") or []]
    if gpus:
        return [not_measurable(ID, TITLE, "the trace lists GPUs but holds no GPU events (CUDA activity not "
                               "recorded): the device side cannot be judged; profile with ProfilerActivity.CUDA")]
    return [_cpu(ctx, th)]
