"""Why the device idles: every GPU idle gap attributed to one cause from its launch link.

Contract. `idle_model(trace, timeline, th)` is a pure function of one GPU rank's events.
- Busy = the union of kernels (communication kernels included), memcpy and memset on
  every stream of the rank. An idle gap is the time between two busy intervals; it keeps
  its true start (the end of the last device activity, even in an earlier step) and is
  counted only where it lies inside a step window.
- Each gap is classified by the device event that ends it (the earliest one to start),
  linked to the runtime call that launched it by the correlation id (`cudaLaunchKernel`,
  `cudaMemcpyAsync`, `cudaGraphLaunch`, `hip*`, the legacy `Runtime` category: any runtime
  event with the same correlation). Rules, first match wins:
  1. latency: the gap is at most `th.sched_latency_us` (the device's own scheduling time).
  2. queued: the launch call returned before the gap began, or the correlation is below the
     first recorded runtime call's (launched before the profiler started). The device had
     the work and waited for something else. Sub-tag: graph (a `*GraphLaunch`), collective
     (a communication kernel), other_stream (the device's last activity before the gap was
     on another stream, or the launching thread's previous runtime call was a
     `cudaStreamWaitEvent`), same_stream (none of these: in a complete trace a stream runs
     queued work at once, so long ones mean events are missing).
  3. sync: the launching thread was inside a synchronising call when the device went idle
     (`host_sync.SYNC_CALL`, or a `cudaMemcpyAsync` whose copy names a `Pageable` side).
  4. input: the ending event is a host-to-device copy whose call began before the device went
     idle (the host was in a blocking copy); else the part of the gap under a DataLoader
     `__next__` span. A copy called after the gap began is a late launch (rule 5).
  5. launch: the rest of a linked gap: the device waited for a launch issued after the gap
     began. `long` marks gaps over `th.launch_gap_long_us` (host-op stalls, not launch rate).
  6. unattributed: no device event ends the gap, or its launch is not in the trace.
Every idle microsecond inside a step lands in exactly one class: per step the classes sum
to the step time minus the busy time.

Columnar throughout (numpy over whole arrays); Python loops run over gaps' distinct
threads or names, never over events.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from diagnose.ingest.load import (KIND_ANNOTATION, KIND_COMM_KERNEL, KIND_CPU_OP, KIND_KERNEL, KIND_MEMCPY,
                                  KIND_MEMSET, KIND_RUNTIME, RankTrace)
from diagnose.step.intervals import Intervals, covered, intersect, union
from diagnose.thresholds import DEFAULT, Thresholds
from diagnose.step.timeline import H2D, PROFILER_STEP, RankTimeline, _names_matching, launch_positions

CLASSES = ("latency", "queued", "sync", "input", "launch", "unattributed")
LATENCY, QUEUED, SYNC, INPUT, LAUNCH, UNATTRIBUTED = range(len(CLASSES))
SUBTAGS = ("none", "graph", "collective", "other_stream", "same_stream")
NO_SUB, GRAPH, COLLECTIVE, OTHER_STREAM, SAME_STREAM = range(len(SUBTAGS))

SYNC_CALL = re.compile(
    r"^(cuda|hip)(StreamSynchronize|DeviceSynchronize|EventSynchronize|Memcpy|Memcpy2D|Memcpy3D|MemcpyDtoH|"
    r"MemcpyHtoD|MemcpyFromSymbol|MemcpyToSymbol)$|^cu(StreamSynchronize|CtxSynchronize|EventSynchronize|"
    r"MemcpyDtoH|MemcpyHtoD)(_v2)?$")
PAGEABLE = re.compile(r"Pageable")
GRAPH_LAUNCH = re.compile(r"GraphLaunch")
STREAM_WAIT = re.compile(r"StreamWaitEvent")
# runtime calls that put work on the device (each should have a device event with its correlation)
LAUNCH_CALL = re.compile(r"^(cuda|hip|hipExt|cu)\w*(LaunchKernel|Memcpy\w*Async|Memset\w*Async|GraphLaunch)")
DATALOADER_OP = re.compile(r"^enumerate\(DataLoader\)#")
NO_OP = "(no op open: Python between ops)"
TOP_OPS = 8


EVIDENCE_GAP_COLUMNS = ("in_steps_us", "sub", "end_row", "launch_row", "sync_row", "prev_row", "queued_us")
"""Gap columns only the checks' per-rank reductions read (evidence and sub-causes): empty in the
parent's copy (IdleModel.for_parent)."""


@dataclass(frozen=True, slots=True)
class IdleModel:
    """One GPU rank's idle gaps and their causes. Gap columns are parallel arrays, empty in the
    parent after the reductions (for_parent)."""

    steps: int
    step_idle_us: np.ndarray
    """(steps,) device idle inside each step: step time minus busy time."""
    by_class_us: np.ndarray
    """(steps, len(CLASSES)): idle per step and class; rows sum to step_idle_us."""
    outside_dataloader_us: np.ndarray
    """(steps, len(CLASSES)): the same, outside DataLoader spans: the split of the breakdown's
    `other_ms` (idle under a DataLoader span is the breakdown's `dataloader_ms`)."""
    queued_by_sub_us: np.ndarray
    """(steps, len(SUBTAGS)): the queued class per step by sub-tag."""
    launch_long_us: np.ndarray
    """(steps,): the part of the launch class in gaps longer than th.launch_gap_long_us."""
    start: np.ndarray
    """Gap start (end of the last device activity; -inf before the first one)."""
    end: np.ndarray
    """Gap end (start of the ending device event)."""
    in_steps_us: np.ndarray
    """Each gap's time inside step windows (what it counts for)."""
    cls: np.ndarray
    """Class of the gap (input gaps may count partly as launch outside DataLoader spans)."""
    sub: np.ndarray
    end_row: np.ndarray
    """Row label of the ending device event (-1: none)."""
    launch_row: np.ndarray
    """Row label of its launch call (-1: none)."""
    sync_row: np.ndarray
    """Row label of the synchronising call (sync class; else -1)."""
    prev_row: np.ndarray
    """Row label of the event before the ending one on its stream (-1: none)."""
    queued_us: np.ndarray
    """Time from the launch call's end to the ending event's start (NaN when pre-trace or unlinked)."""
    long_gap_ops: tuple[tuple[str, float], ...]
    """Innermost host ops on the launching thread during long launch gaps: (name, us per step)."""
    device_events: int
    linked: int
    """Device events inside the steps linked to their launch call."""
    median_launch_delay_us: float | None
    """Median over linked kernels of start minus launch-call end."""
    clock_bound_us: float | None
    """min(device start - launch-call start): below 0, the host clock runs at least that far ahead."""
    launch_calls: int = 0
    """Runtime calls inside the steps that put work on the device (kernels, async copies, graphs)."""
    launches_without_device: int = 0
    """Of those, the ones no recorded device event links to (their work is missing from the trace)."""
    graph_launches: int = 0
    graph_launches_empty: int = 0
    """CUDA graph launches with no recorded kernel: the graph's work is not in the trace."""

    def for_parent(self) -> IdleModel:
        """The model as the parent keeps it once the checks' per-rank reductions have read it: the
        per-step sums and counts. The gaps themselves (one per kernel boundary) are emptied: the
        step graph and the mini timeline read them from the rank's cover (step/cover.py), built
        before (#20: the gaps grow with the trace, ~20 bytes a kernel)."""
        return replace(self, long_gap_ops=(), **{c: np.empty(0, dtype=getattr(self, c).dtype)
                                                  for c in ("start", "end", "cls") + EVIDENCE_GAP_COLUMNS})

    def class_ms(self, name: str) -> float:
        """Mean per-step ms of one class."""
        if not self.steps:
            return 0.0
        return float(self.by_class_us[:, CLASSES.index(name)].mean()) / 1000


def _prev_same_stream(pid: np.ndarray, tid: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """For each device event, the position of the previous event on its stream (-1: first)."""
    order = np.lexsort((ts, tid, pid))
    prev = np.full(ts.size, -1, dtype=np.int64)
    if ts.size > 1:
        same = (pid[order][1:] == pid[order][:-1]) & (tid[order][1:] == tid[order][:-1])
        prev[order[1:][same]] = order[:-1][same]
    return prev


def _inside(t: np.ndarray, tid: np.ndarray, calls_ts: np.ndarray, calls_end: np.ndarray, calls_tid: np.ndarray,
            slack: float) -> np.ndarray:
    """For each (time, thread): position of a call on that thread open at that time (-1: none).

    Calls on one thread do not nest (runtime calls are leaves), so the last one to start at
    or before t is the only candidate."""
    out = np.full(t.size, -1, dtype=np.int64)
    if calls_ts.size == 0 or t.size == 0:
        return out
    order = np.lexsort((calls_ts, calls_tid))
    ct, cs, ce = calls_tid[order], calls_ts[order], calls_end[order]
    # one sorted key per (thread, time): thread codes are small non-negative ints, times taken
    # from a base so the key keeps microsecond precision
    fin = np.isfinite(t)
    base = min(float(cs.min()), float(t[fin].min())) if fin.any() else float(cs.min())
    span = max(float(cs.max()), float(t[fin].max()) if fin.any() else 0.0) - base + slack + 1.0
    key_c = ct * span + (cs - base)
    key_q = tid[fin] * span + (t[fin] - base)
    i = np.searchsorted(key_c, key_q, side="right") - 1
    ok = i >= 0
    j = np.where(ok, i, 0)
    ok &= (ct[j] == tid[fin]) & (ce[j] + slack >= t[fin])
    res = np.full(fin.sum(), -1, dtype=np.int64)
    res[ok] = order[j[ok]]
    out[fin] = res
    return out


def _innermost_segments(ts: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split one thread's (nested) ops into segments labelled by the innermost open op.

    Returns (seg_start, seg_end, op position or -1). Depth is
    the running count of opens minus closes; for nested spans the innermost op open in a
    segment at depth d is the last op whose start brought the depth to d."""
    n = ts.size
    times = np.concatenate([ts, end])
    delta = np.concatenate([np.ones(n, dtype=np.int64), -np.ones(n, dtype=np.int64)])
    op = np.concatenate([np.arange(n), np.arange(n)])
    order = np.lexsort((-end[op] * (delta > 0), delta, times))  # closes first; outer ops open first
    times, delta, op = times[order], delta[order], op[order]
    depth = np.cumsum(delta)
    m = times.size
    open_pos = np.flatnonzero(delta > 0)
    key = depth[open_pos] * (m + 1) + open_pos
    srt = np.argsort(key, kind="stable")
    key, open_pos = key[srt], open_pos[srt]
    seg_d = depth[:-1]
    q = seg_d * (m + 1) + np.arange(m - 1)
    i = np.searchsorted(key, q, side="right") - 1
    ok = (i >= 0) & (seg_d > 0)
    j = np.where(ok, i, 0)
    ok &= (key[j] // (m + 1)) == seg_d
    label = np.full(m - 1, -1, dtype=np.int64)
    label[ok] = op[open_pos[j[ok]]]
    return times[:-1], times[1:], label


def _outermost(ts: np.ndarray, end: np.ndarray, at: np.ndarray) -> np.ndarray:
    """For each time in `at`, the position of the outermost span (of one thread's nested spans)
    open then, or -1. Outermost spans are those no earlier span still covers when they start."""
    if not ts.size:
        return np.full(at.size, -1, dtype=np.int64)
    order = np.argsort(ts, kind="stable")
    s, e = ts[order], end[order]
    covered_until = np.concatenate([[-np.inf], np.maximum.accumulate(e)[:-1]])
    top = np.flatnonzero(s >= covered_until)
    i = np.searchsorted(s[top], at, side="right") - 1
    ok = (i >= 0) & (at < e[top[np.clip(i, 0, None)]])
    return np.where(ok, order[top[np.clip(i, 0, None)]], -1)


def _long_gap_ops(ev: pd.DataFrame, gaps_by_tid: dict[int, Intervals], n_steps: int
                  ) -> tuple[tuple[str, float], ...]:
    """What each launching thread was doing during its long gaps: the innermost host op open at
    each instant, inside the outermost user annotation (`record_function`) open then when there
    is one ("log_metrics > aten::mm": the innermost op alone rarely says where in the user's code
    the host was), summed per label: (label, us per step), longest first."""
    if not gaps_by_tid:
        return ()
    host = ev[ev["kind"].isin([KIND_CPU_OP, KIND_ANNOTATION]).to_numpy() & ~_names_matching(ev, PROFILER_STEP)]
    h_tid = host["tid"].cat.codes.to_numpy()
    h_ts_all = host["ts"].to_numpy(dtype=float)
    h_end_all = h_ts_all + host["dur"].to_numpy(dtype=float)
    h_ann = (host["kind"] == KIND_ANNOTATION).to_numpy()
    codes = host["name"].cat.codes.to_numpy()
    cats = host["name"].cat.categories
    totals: dict[str, float] = {}
    for t, gaps in gaps_by_tid.items():
        sel = h_tid == t
        ts, end, nm = h_ts_all[sel], h_end_all[sel], codes[sel]
        rest = gaps.total
        if ts.size:
            s0, s1, lab = _innermost_segments(ts, end)
            seg = lab >= 0
            # each labelled segment's overlap with the gaps, then summed per label
            cut = intersect(Intervals(s0[seg], s1[seg]), gaps)
            k = np.searchsorted(s0[seg], cut.starts, side="right") - 1
            w = cut.ends - cut.starts
            inner = nm[lab[seg][k]]
            ann = np.flatnonzero(h_ann[sel])
            outer = np.full(w.size, -1, dtype=np.int64)
            if ann.size:
                pos = _outermost(ts[ann], end[ann], (cut.starts + cut.ends) / 2)
                outer[pos >= 0] = nm[ann][pos[pos >= 0]]
            for (o, c), us in pd.Series(w).groupby([outer, inner]).sum().items():
                name = str(cats[c]) if o < 0 or o == c else f"{cats[o]} > {cats[c]}"
                totals[name] = totals.get(name, 0.0) + float(us)
            rest -= float(w.sum())
        if rest > 0:
            totals[NO_OP] = totals.get(NO_OP, 0.0) + rest
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:TOP_OPS]
    return tuple((n, us / max(n_steps, 1)) for n, us in top if us > 0)


def sync_calls(ev: pd.DataFrame) -> np.ndarray:
    """Mask over `ev` of the runtime calls that block the host until the device drains: the
    synchronising calls by name, and any call that launched a copy with a pageable side (a
    `cudaMemcpyAsync` to or from pageable memory blocks like `cudaMemcpy`). One rule for the idle
    model and host_sync."""
    runtime = (ev["kind"] == KIND_RUNTIME).to_numpy()
    pageable = ev["corr"][(ev["kind"] == KIND_MEMCPY).to_numpy() & _names_matching(ev, PAGEABLE)]
    return runtime & (_names_matching(ev, SYNC_CALL) | ev["corr"].isin(pageable[pageable >= 0]).to_numpy())


def idle_model(trace: RankTrace, tl: RankTimeline, th: Thresholds = DEFAULT) -> IdleModel:
    ev = trace.events
    lo, hi = tl.steps.start, tl.steps.end
    n_steps = lo.size
    kind = ev["kind"]
    dev_mask = kind.isin([KIND_KERNEL, KIND_COMM_KERNEL, KIND_MEMCPY, KIND_MEMSET]).to_numpy()
    dev = ev[dev_mask]
    rt = ev[(kind == KIND_RUNTIME).to_numpy()]
    d_ts = dev["ts"].to_numpy(dtype=float)
    d_end = d_ts + dev["dur"].to_numpy(dtype=float)
    d_rows = dev.index.to_numpy()
    d_corr = dev["corr"].to_numpy()
    d_kind = dev["kind"].to_numpy()
    d_pid = dev["pid"].cat.codes.to_numpy() if hasattr(dev["pid"], "cat") else np.zeros(len(dev), np.int64)
    d_tid = dev["tid"].cat.codes.to_numpy() if hasattr(dev["tid"], "cat") else np.zeros(len(dev), np.int64)
    d_h2d = _names_matching(dev, H2D) & (d_kind == KIND_MEMCPY)

    r_ts = rt["ts"].to_numpy(dtype=float)
    r_end = r_ts + rt["dur"].to_numpy(dtype=float)
    r_rows = rt.index.to_numpy()
    r_tid = rt["tid"].cat.codes.to_numpy() if hasattr(rt["tid"], "cat") else np.zeros(len(rt), np.int64)
    r_corr = rt["corr"].to_numpy()
    link = launch_positions(d_corr, rt)
    first_corr = int(r_corr[r_corr >= 0].min()) if (r_corr >= 0).any() else None
    pre_trace = (link < 0) & (d_corr >= 0) & (first_corr is not None) & (d_corr < (first_corr or 0))

    # busy intervals, each with the position of the event that starts it
    order = np.lexsort((link < 0, d_ts))  # at equal starts, a linked event ends the gap
    s, e = d_ts[order], d_end[order]
    run_max = np.maximum.accumulate(e) if e.size else e
    new = np.ones(s.size, dtype=bool)
    new[1:] = s[1:] > run_max[:-1]
    starter = order[new]
    b_start = s[new]
    b_end = np.maximum.reduceat(e, np.flatnonzero(new)) if s.size else e
    # the event whose end is the busy interval's end: the device's last activity before a gap
    last_pos = np.zeros(b_end.size, dtype=np.int64)
    if s.size:
        grp = np.cumsum(new) - 1
        is_last = e == b_end[grp]
        # last matching event of each group
        idx = np.flatnonzero(is_last)
        last_pos[grp[idx]] = order[idx]

    # gaps: before each busy interval (from the previous one's end), plus the tail after the last
    g_start = np.concatenate([[-np.inf], b_end])
    g_end = np.concatenate([b_start, [np.inf]])
    g_end_pos = np.concatenate([starter, [-1]])
    g_prev_pos = np.concatenate([[-1], last_pos])
    if n_steps:
        w_lo, w_hi = float(lo.min()), float(hi.max())
        keep = (g_end > w_lo) & (g_start < w_hi) & (g_end > g_start)
    else:
        keep = np.zeros(g_start.size, dtype=bool)
    g_start, g_end, g_end_pos, g_prev_pos = g_start[keep], g_end[keep], g_end_pos[keep], g_prev_pos[keep]
    n = g_start.size
    has_end = g_end_pos >= 0
    ep = np.where(has_end, g_end_pos, 0)
    lk = np.where(has_end, link[ep] if link.size else -1, -1)
    lp = np.where(lk >= 0, lk, 0)
    launch_end = np.where(lk >= 0, r_end[lp] if r_end.size else np.nan, np.nan)
    launch_tid = np.where(lk >= 0, r_tid[lp] if r_tid.size else -1, -1)
    is_pre = has_end & (pre_trace[ep] if pre_trace.size else False)
    length = g_end - g_start

    cls = np.full(n, UNATTRIBUTED, dtype=np.int8)
    sub = np.zeros(n, dtype=np.int8)
    sync_row = np.full(n, -1, dtype=np.int64)
    todo = np.ones(n, dtype=bool)

    lat = length <= th.sched_latency_us
    cls[lat] = LATENCY
    todo &= ~lat

    queued = todo & ((lk >= 0) & (launch_end <= g_start) | is_pre)
    cls[queued] = QUEUED
    todo &= ~queued
    if queued.any():
        graph = np.zeros(n, dtype=bool)
        if len(rt):
            g_hit = _names_matching(rt, GRAPH_LAUNCH)
            graph = (lk >= 0) & g_hit[lp]
        comm = has_end & (d_kind[ep] == KIND_COMM_KERNEL) if d_kind.size else np.zeros(n, bool)
        pp = np.where(g_prev_pos >= 0, g_prev_pos, 0)
        other = has_end & (g_prev_pos >= 0) & ((d_tid[pp] != d_tid[ep]) | (d_pid[pp] != d_pid[ep]))
        # the launching thread's previous runtime call was a cross-stream wait
        if len(rt):
            w_hit = _names_matching(rt, STREAM_WAIT)
            prev_rt = _prev_call_same_thread(r_tid, r_ts)
            pr = prev_rt[lp]
            other |= (lk >= 0) & (pr >= 0) & w_hit[np.where(pr >= 0, pr, 0)]
        sub[queued] = np.select([graph[queued], comm[queued], other[queued]], [GRAPH, COLLECTIVE, OTHER_STREAM],
                                SAME_STREAM)

    # sync: the launching thread inside a synchronising call when the device went idle
    linked_todo = todo & (lk >= 0)
    if linked_todo.any() and len(rt):
        c_pos = np.flatnonzero(sync_calls(ev)[(kind == KIND_RUNTIME).to_numpy()])
        q = np.flatnonzero(linked_todo)
        hit = _inside(g_start[q], launch_tid[q], r_ts[c_pos], r_end[c_pos], r_tid[c_pos],
                      slack=th.sched_latency_us)
        # the call must have begun before the device went idle (it waited for the drain)
        got = hit >= 0
        got[got] = r_ts[c_pos[hit[got]]] <= g_start[q[got]]
        cls[q[got]] = SYNC
        sync_row[q[got]] = r_rows[c_pos[hit[got]]]
        todo[q[got]] = False

    # a copy whose call began before the device went idle: the host was inside it (a blocking
    # copy); one called later is a late launch like any other (recorded on an H200: a 25 ms host
    # op before the next batch's async copy read as 15.5 ms of input stall per step)
    launch_start = np.where(lk >= 0, r_ts[lp] if r_ts.size else np.nan, np.nan)
    h2d_end = todo & (lk >= 0) & has_end & (d_h2d[ep] if d_h2d.size else False) & (launch_start <= g_start)
    cls[h2d_end] = INPUT
    todo &= ~h2d_end
    cls[todo & (lk >= 0)] = LAUNCH  # split against DataLoader spans below
    todo &= ~(lk >= 0)
    # what remains: no ending event, or an unlinked one: unattributed

    # pieces: gaps cut at step bounds and DataLoader span bounds, each with one class
    dl = tl.dataloader
    pts = np.unique(np.concatenate([g_start[np.isfinite(g_start)], g_end[np.isfinite(g_end)], lo, hi,
                                    dl.starts, dl.ends]))
    by_class = np.zeros((n_steps, len(CLASSES)))
    outside_dl = np.zeros((n_steps, len(CLASSES)))
    by_sub = np.zeros((n_steps, len(SUBTAGS)))
    launch_long = np.zeros(n_steps)
    in_steps = np.zeros(n)
    long_gap = length > th.launch_gap_long_us
    long_w = np.zeros(n)
    if pts.size >= 2 and n and n_steps:
        mids = (pts[:-1] + pts[1:]) / 2
        plen = pts[1:] - pts[:-1]
        gi = np.searchsorted(g_start, mids, side="right") - 1
        in_gap = (gi >= 0) & (mids < g_end[np.clip(gi, 0, None)])
        si = np.searchsorted(lo, mids, side="right") - 1
        in_step = (si >= 0) & (mids < hi[np.clip(si, 0, None)])
        di = np.searchsorted(dl.starts, mids, side="right") - 1
        in_dl = (di >= 0) & (mids < dl.ends[np.clip(di, 0, None)]) if len(dl) else np.zeros(mids.size, bool)
        use = in_gap & in_step
        gi, si, plen, in_dl = gi[use], si[use], plen[use], in_dl[use]
        pc = cls[gi].astype(np.int64)
        pc = np.where((pc == LAUNCH) & in_dl, INPUT, pc)
        np.add.at(by_class, (si, pc), plen)
        np.add.at(outside_dl, (si[~in_dl], pc[~in_dl]), plen[~in_dl])
        q = pc == QUEUED
        np.add.at(by_sub, (si[q], sub[gi[q]].astype(np.int64)), plen[q])
        ll = (pc == LAUNCH) & long_gap[gi]
        np.add.at(launch_long, si[ll], plen[ll])
        in_steps = np.bincount(gi, weights=plen, minlength=n)
        long_w = np.bincount(gi[ll], weights=plen[ll], minlength=n)
    step_idle = (hi - lo) - covered(Intervals(b_start, b_end), lo, hi) if n_steps else np.zeros(0)

    lg = long_w > 0
    windows = union(lo, hi)
    ops = _long_gap_ops(ev, {int(t): intersect(union(np.maximum(g_start[lg & (launch_tid == t)], lo.min()),
                                                     g_end[lg & (launch_tid == t)]), windows)
                             for t in np.unique(launch_tid[lg])}, n_steps) if n_steps else ()

    # per-gap row labels for evidence
    end_row = np.where(has_end, d_rows[ep] if d_rows.size else -1, -1)
    launch_row = np.where(lk >= 0, r_rows[lp] if r_rows.size else -1, -1)
    prev_same = _prev_same_stream(d_pid, d_tid, d_ts)
    pv = np.where(has_end, prev_same[ep] if prev_same.size else -1, -1)
    prev_row = np.where(pv >= 0, d_rows[np.where(pv >= 0, pv, 0)] if d_rows.size else -1, -1)
    queued_us = np.where(lk >= 0, g_end - launch_end, np.nan)

    # linkage and timing over the device events inside the steps
    in_win = np.zeros(d_ts.size, dtype=bool)
    if n_steps:
        k = np.searchsorted(lo, d_ts, side="right") - 1
        in_win = (k >= 0) & (d_ts < hi[np.clip(k, 0, None)])
    linked = int(((link >= 0) & in_win).sum())
    kern = (link >= 0) & np.isin(d_kind, [KIND_KERNEL, KIND_COMM_KERNEL])
    delay = d_ts[kern] - r_end[link[kern]] if kern.any() else np.zeros(0)
    bound = d_ts[link >= 0] - r_ts[link[link >= 0]] if (link >= 0).any() else np.zeros(0)
    # completeness: launch calls inside the steps whose device work the trace does not hold
    r_in = np.zeros(r_ts.size, dtype=bool)
    if n_steps and r_ts.size:
        k = np.searchsorted(lo, r_ts, side="right") - 1
        r_in = (k >= 0) & (r_ts < hi[np.clip(k, 0, None)])
    launching = r_in & _names_matching(rt, LAUNCH_CALL) if len(rt) else r_in
    no_dev = launching & (r_corr >= 0) & ~np.isin(r_corr, d_corr)
    graphs = launching & _names_matching(rt, GRAPH_LAUNCH) if len(rt) else r_in
    return IdleModel(
        steps=n_steps, step_idle_us=step_idle, by_class_us=by_class, outside_dataloader_us=outside_dl,
        queued_by_sub_us=by_sub,
        launch_long_us=launch_long, start=g_start, end=g_end, in_steps_us=in_steps, cls=cls, sub=sub,
        end_row=end_row.astype(np.int64), launch_row=launch_row.astype(np.int64), sync_row=sync_row,
        prev_row=prev_row.astype(np.int64), queued_us=queued_us, long_gap_ops=ops,
        device_events=int(in_win.sum()), linked=linked,
        median_launch_delay_us=float(np.median(delay)) if delay.size else None,
        clock_bound_us=float(bound.min()) if bound.size else None,
        launch_calls=int(launching.sum()), launches_without_device=int(no_dev.sum()),
        graph_launches=int(graphs.sum()), graph_launches_empty=int((graphs & no_dev).sum()))


def completeness(m: IdleModel, th: Thresholds = DEFAULT) -> tuple[str, ...]:
    """What makes this rank's idle classes uncertain: missing device work, CUDA graphs whose
    kernels were not traced, host and device clocks that disagree. Empty when none applies."""
    notes = []
    if m.graph_launches and m.graph_launches_empty > th.empty_graph_share * m.graph_launches:
        notes.append(f"{m.graph_launches_empty} of {m.graph_launches} CUDA graph launches have no recorded "
                     "kernel: the device looks idle while the graphs run")
    if m.launch_calls and m.launches_without_device > th.unmatched_launch_share * m.launch_calls:
        notes.append(f"{m.launches_without_device / m.launch_calls:.0%} of the launch calls in the steps have no "
                     "device event: device work is missing, idle time is overstated")
    if m.clock_bound_us is not None and m.clock_bound_us < -th.clock_skew_us:
        notes.append(f"a device event starts {-m.clock_bound_us:.0f} us before its launch call: host and device "
                     "clocks disagree by at least that much, so gaps near that size may be misfiled between "
                     "queued and host launch")
    return tuple(notes)


def _prev_call_same_thread(tid: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """Position of each runtime call's predecessor on its thread (-1: first)."""
    order = np.lexsort((ts, tid))
    prev = np.full(ts.size, -1, dtype=np.int64)
    if ts.size > 1:
        same = tid[order][1:] == tid[order][:-1]
        prev[order[1:][same]] = order[:-1][same]
    return prev
