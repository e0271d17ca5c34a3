"""8. Host-device synchronisation inside the step (.item(), .cpu(), synchronize()).

A synchronising runtime call (cudaStreamSynchronize, cudaDeviceSynchronize,
cudaEventSynchronize, a synchronous cudaMemcpy; hip* alike) blocks the host until the
device has drained its queue. The device then sits idle until the host has launched new
work: the cost of the sync is that idle, not the call's own duration (while the host
waits, the device is still busy with work queued earlier).

Estimation: the sync class of the idle model (diagnose/step/idle.py): per rank, every device
idle gap whose ending work was launched by a thread that was inside a synchronising call
(or a cudaMemcpyAsync with a pageable side, which blocks the same way) when the device went
idle; the whole gap, from the end of the device's last activity to the start of its next
activity, counts here and nowhere else; mean over steps; job-level: the median rank. Each call is attributed
to the innermost CPU op around it on the same thread (aten::_local_scalar_dense = .item(),
aten::_to_copy / copy_ = .cpu() / .to(), aten::nonzero = data-dependent shapes; none =
an explicit synchronize()).

No other check counts these gaps (launch_overhead takes only the host-launch class).
CPU-only traces have no device queue: .item() and .cpu() cost nothing extra there, and the
check says it cannot be measured.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from diagnose.analyzers.common import confidence_for, flag_or_pass, idle_completeness, not_measurable, passed
from diagnose.context import Context
from diagnose.ingest.load import KIND_CPU_OP, KIND_RUNTIME, RankTrace
from diagnose.model import Check, Finding
from diagnose.step import idle
from diagnose.step.timeline import RankTimeline, _names_matching
from diagnose.thresholds import Thresholds

ID = "host_sync"
TITLE = "Host-device synchronisation stalls the device (.item(), .cpu(), synchronize())"
FIX = ("Keep the step free of host-device syncs: leave losses and metrics on the device and read them once "
       "per logging interval (one .item() every N steps), avoid .cpu()/.tolist()/print() of device tensors "
       "in the loop, replace data-dependent ops (nonzero, boolean-mask indexing) with fixed-shape ones "
       "(torch.where), copy with non_blocking=True into pinned memory, and drop torch.cuda.synchronize() "
       "outside benchmarks. torch.cuda.set_sync_debug_mode('warn') names every sync with its stack.")
SYNC_CALL = idle.SYNC_CALL
ITEM = re.compile(r"^aten::(_local_scalar_dense|item)$")
_CAUSES = (
    (ITEM, ".item() (a Python number from a device tensor)"),
    (re.compile(r"^aten::(_to_copy|copy_|to|cpu|_copy_from|_copy_from_and_resize|tolist)$"),
     ".cpu() / .to() / copy_ (a blocking device-host copy)"),
    (re.compile(r"^aten::(nonzero|masked_select|unique|_unique2|index|repeat_interleave|bincount|histc)"),
     "a data-dependent output shape (nonzero, masked_select, boolean indexing)"),
)
MAX_LABELLED = 2000  # attributing a call to its op is a scan per call: the longest ones are enough
TOP = 6  # evidence events per rank (and in all)


def _cause(op: str | None) -> str:
    if op is None:
        return "an explicit synchronize() (no op around the call)"
    for pattern, label in _CAUSES:
        if pattern.search(op):
            return label
    return f"inside {op}"


def _innermost_ops(ev: pd.DataFrame, calls: pd.DataFrame) -> list[str | None]:
    """Name of the shortest CPU op enclosing each call on the same thread (None if none)."""
    ops = ev[(ev["kind"] == KIND_CPU_OP).to_numpy()]
    out: list[str | None] = []
    by_tid = {tid: g for tid, g in ops.groupby("tid", observed=True)}
    for tid, ts, end in zip(calls["tid"], calls["ts"], calls["ts"] + calls["dur"]):
        g = by_tid.get(tid)
        if g is None:
            out.append(None)
            continue
        mask = (g["ts"].to_numpy() <= ts) & ((g["ts"] + g["dur"]).to_numpy() >= end)
        if not mask.any():
            out.append(None)
            continue
        sub = g[mask]
        out.append(str(sub["name"].iloc[int(np.argmin(sub["dur"].to_numpy()))]))
    return out


@dataclass(frozen=True, slots=True)
class RankSyncs:
    """One rank's synchronising calls inside its steps and the device idle they caused."""

    has_runtime: bool
    """Any CUDA/HIP runtime event at all (none: sampled or filtered trace)."""
    item_calls: int
    """aten::item events anywhere in the trace (said on CPU, where they cost nothing)."""
    ms: float = 0.0
    steps: int = 0
    calls: int = 0
    blocked_ms: float = 0.0
    items_per_step: float = 0.0
    by_name: tuple[tuple[str, int], ...] = ()
    by_cause: tuple[tuple[str, int], ...] = ()
    top: tuple[tuple[int, float, float, str], ...] = ()
    """(row, idle caused us, call dur us, cause): the calls that caused most idle."""

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(t[0] for t in self.top)


def reduce(trace: RankTrace, tl: RankTimeline, idle_gaps: idle.IdleModel | None = None) -> RankSyncs:
    ev = trace.events
    has_runtime = bool((ev["kind"] == KIND_RUNTIME).any())
    item_calls = int((ev["name"] == "aten::item").sum())
    if not tl.is_gpu or not has_runtime:
        return RankSyncs(has_runtime=has_runtime, item_calls=item_calls)
    lo, hi = tl.steps.start, tl.steps.end
    m = idle_gaps or idle.idle_model(trace, tl)
    calls = ev[idle.sync_calls(ev)]
    in_step = np.zeros(len(calls), dtype=bool)
    ts = calls["ts"].to_numpy()
    for s, e in zip(lo, hi):
        in_step |= (ts >= s) & (ts < e)
    calls = calls[in_step]
    # the idle each call caused: the sync-class gaps the idle model attributes to it (time inside steps)
    own = m.cls == idle.SYNC
    caused_by_row = pd.Series(m.in_steps_us[own]).groupby(m.sync_row[own]).sum()
    caused = caused_by_row.reindex(calls.index, fill_value=0.0).to_numpy()
    per_step_ms = m.by_class_us[:, idle.SYNC] / 1000
    calls = calls.assign(caused=np.asarray(caused, dtype=float))
    labelled = calls.nlargest(MAX_LABELLED, ["caused", "dur"])
    causes = pd.Series(_innermost_ops(ev, labelled), index=labelled.index, dtype=object)
    by_cause: dict[str, int] = {}
    for op in causes:
        label = _cause(op)
        by_cause[label] = by_cause.get(label, 0) + 1
    items = ev[(ev["kind"] == KIND_CPU_OP).to_numpy() & _names_matching(ev, re.compile(r"^aten::item$"))]
    n_items = int(sum(((items["ts"] >= s) & (items["ts"] < e)).sum() for s, e in zip(lo, hi)))
    top = calls.sort_values(["caused", "dur"], ascending=False).head(TOP)
    return RankSyncs(
        has_runtime=True, item_calls=item_calls, ms=float(np.mean(per_step_ms)) if len(per_step_ms) else 0.0,
        steps=len(lo), calls=len(calls), blocked_ms=float(calls["dur"].sum()) / 1000 / max(len(lo), 1),
        items_per_step=n_items / max(len(lo), 1),
        by_name=tuple(calls["name"].astype(str).value_counts().items()), by_cause=tuple(by_cause.items()),
        top=tuple((int(row), float(c["caused"]), float(c["dur"]), _cause(causes.get(row)))
                  for row, c in top.iterrows()))


def analyze(ctx: Context, th: Thresholds) -> list[Check]:
    run = ctx.run
    # the ranks' summaries one at a time, each folded in (#20: all of them held at once were 2.9
    # MB at 1,024 ranks)
    n_items = 0
    has_runtime = False
    n_calls: dict[int, float] = {}
    calls: dict[int, int] = {}
    ms_by_rank: dict[int, float] = {}
    blocked, items = [], []
    by_name: dict[str, int] = {}
    by_cause: dict[str, int] = {}
    top: list = []
    for r, p in ctx.facts_each("host_sync"):
        n_items += p.item_calls
        has_runtime = has_runtime or p.has_runtime
        n_calls[r] = p.calls / max(p.steps, 1)
        calls[r] = p.calls
        ms_by_rank[r] = p.ms
        blocked.append(p.blocked_ms)
        items.append(p.items_per_step)
        for k, v in p.by_name:
            by_name[k] = by_name.get(k, 0) + v
        for k, v in p.by_cause:
            by_cause[k] = by_cause.get(k, 0) + v
        # the calls that caused most idle over all ranks, kept as they come (a stable sort: ties
        # stay in rank order, as one sort of every rank's would leave them)
        top = sorted(top + [(r, t) for t in p.top], key=lambda rt: (-rt[1][1], -rt[1][2]))[:TOP]
    if not run.is_gpu:
        gpus = any(run.traces[r].meta.get("deviceProperties") for r in run.ranks)
        why = ("the trace lists GPUs but holds no GPU events (CUDA activity not recorded): syncs cannot be "
               "timed; profile with ProfilerActivity.CUDA" if gpus else
               "not measurable on CPU: a CPU-only run has no device queue to drain, so .item()/.cpu() stall "
               f"nothing ({n_items} aten::item call(s) seen in the trace)")
        return [not_measurable(ID, TITLE, why)]
    if not has_runtime:
        return [not_measurable(ID, TITLE, "no CUDA/HIP runtime events in the trace (sampled or filtered): "
                               "synchronising calls cannot be seen")]
    if not any(calls.values()):
        return [passed(ID, TITLE, "no synchronising runtime calls (cudaStreamSynchronize, cudaDeviceSynchronize, "
                       "cudaEventSynchronize, synchronous cudaMemcpy) inside the profiled steps")]
    ms = float(np.median(list(ms_by_rank.values())))
    share = ms / ctx.mean_step_ms
    metrics: dict[str, float | int | str] = {
        "device_idle_after_sync_ms_per_step": round(ms, 3),
        "share_of_step": round(share, 4),
        "sync_calls_per_step": round(float(np.median(list(n_calls.values()))), 1),
        "host_blocked_in_sync_ms_per_step": round(float(np.median(blocked)), 3),
        "aten_item_calls_per_step": round(float(np.median(items)), 1),
        "calls_by_name_all_ranks": ", ".join(f"{n} x{c}" for n, c in
                                             sorted(by_name.items(), key=lambda kv: -kv[1])),
        "calls_by_cause_all_ranks": "; ".join(f"{k} x{v}" for k, v in
                                              sorted(by_cause.items(), key=lambda kv: -kv[1])),
    }
    for r in sorted(ms_by_rank):
        metrics[f"rank{r}_sync_idle_ms"] = round(ms_by_rank[r], 3)
    refs = [ctx.event_ref(r, row, f"host blocked {dur / 1000:.3f} ms, device then idle {caused / 1000:.3f} ms; "
                          f"{cause}") for r, (row, caused, dur, cause) in top]
    ranks = tuple(r for r, v in ms_by_rank.items() if v / ctx.mean_step_ms >= th.host_sync) or tuple(
        r for r in run.ranks if calls[r])
    linked = any(run.traces[r].flows for r in run.ranks)
    gaps = idle_completeness(ctx, th)
    if gaps:
        metrics["note"] = "; ".join(gaps)
    f = Finding(
        id=ID, title=TITLE, severity=th.severity(share), recoverable_ms=round(ms, 3), share_of_step=round(share, 4),
        ranks=ranks, metrics=metrics, events=tuple(refs), fix=FIX,
        confidence=confidence_for(ctx, "low" if gaps else "high" if linked else "medium"),
        method="Median over ranks of per-step device idle that follows a synchronising call which drained the "
               "device queue: from the device's last activity before the call returned to its next activity.")
    reason = (f"{metrics['sync_calls_per_step']:g} synchronising call(s) per step leave the device idle "
              f"{ms:.2f} ms per step ({share:.1%}); main cause: {max(by_cause, key=by_cause.get)}")
    check = flag_or_pass(f, th.host_sync, th, reason, ctx)
    if check.status != "flagged":
        check = replace(check, reason=f"{check.reason}; {metrics['sync_calls_per_step']:g} sync call(s) per step, "
                        f"main cause {max(by_cause, key=by_cause.get)}", finding=f)
    return [check]
