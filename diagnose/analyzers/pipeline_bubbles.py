"""6. Pipeline-parallel bubbles: stage ranks idle while the pipeline fills and drains.

Detection: point-to-point transfers between ranks inside the steps (`c10d::send` /
`c10d::recv_` on any backend, gloo's `gloo:send` / `gloo:recv`, `record_param_comms` named
send/recv), or micro-batch ranges as torch.distributed.pipelining labels them
(`Forward {i}` / `Backward {i}`, `PP:{stage}{F|B|I|W}{i}`). NCCL SendRecv kernels alone are
not evidence: NCCL runs all-to-all on them too.

Estimation, per stage rank and step: idle = step time minus the time the stage computes
(GPU: non-communication kernels, copies and memsets; CPU: CPU ops on the training threads
other than communication ops and DataLoader waits; annotations such as the micro-batch
ranges are not compute, since they also cover the receive waits inside them, nor is
Python time between ops). Job-level: the mean over stage ranks of idle / step, compared
with the fill-drain bound (p - 1) / (v m + p - 1) for p stages, m micro-batches and v
stages per rank (1 unless the PP: labels show an interleaved schedule). recoverable_ms is
the mean stage idle per step: what a bubble-free, balanced schedule would give back (an
upper bound; more micro-batches approach it). p: stage indices in PP: labels, else the
ranks holding point-to-point transfers; m: micro-batch indices in the labels, else the
receives per step on an end stage (the first and last stages receive m each).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from diagnose.analyzers.common import confidence_for, flag_or_pass, passed
from diagnose.context import Context
from diagnose.ingest.load import KIND_ANNOTATION, KIND_CPU_OP, RankTrace
from diagnose.step.intervals import covered, subtract, union
from diagnose.model import Check, Finding
from diagnose.thresholds import Thresholds
from diagnose.step.timeline import RankTimeline, _names_matching

ID = "pipeline_bubble"
TITLE = "Pipeline bubbles (stages idle while the pipeline fills and drains)"
P2P = re.compile(r"^(c10d::(send|recv_|recv_any_source_)|gloo:(send|recv)|nccl:(send|recv))$")
RECV = re.compile(r"^(c10d::recv_|c10d::recv_any_source_|nccl:recv)$")
RECV_TRANSFER = re.compile(r"^(gloo:recv|nccl:recv)$")
MICROBATCH = re.compile(r"^(?:(Forward|Backward) (\d+)|PP:(\d+)([FBIW])(\d+))$")
COMM_OP = re.compile(r"^(c10d::|gloo:|nccl:|record_param_comms$)")


@dataclass(frozen=True, slots=True)
class Stage:
    """One rank's summary: how much of its steps it computes, and its point-to-point traffic."""

    step_ms: float
    busy_ms: float
    idle_fraction: float
    p2p_per_step: float
    recvs_per_step: float
    microbatches: int | None
    stage_ids: frozenset[int]
    wait_rows: tuple[int, ...]
    """The longest receive transfers (waiting for the neighbour stage included): evidence."""

    @property
    def rows(self) -> tuple[int, ...]:
        return self.wait_rows


def _per_step_count(ts: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> float:
    if not len(lo):
        return 0.0
    return float(np.median([int(((ts >= s) & (ts < e)).sum()) for s, e in zip(lo, hi)]))


def reduce(trace: RankTrace, tl: RankTimeline) -> Stage:
    ev = trace.events
    lo, hi = tl.steps.start, tl.steps.end
    if tl.is_gpu:
        busy = tl.compute
    else:
        ops = ev[(ev["kind"] == KIND_CPU_OP).to_numpy() & ~_names_matching(ev, COMM_OP)]
        busy = subtract(union(ops["ts"], ops["ts"] + ops["dur"]), tl.dataloader)
    host = ev["kind"].isin([KIND_CPU_OP, KIND_ANNOTATION]).to_numpy()
    p2p_ts = ev[host & _names_matching(ev, P2P)]["ts"].to_numpy()
    recv = ev[host & _names_matching(ev, RECV)]
    if recv.empty:
        recv = ev[host & _names_matching(ev, RECV_TRANSFER)]
    rpc = ev[host & (ev["name"] == "record_param_comms").to_numpy()]
    if len(rpc) and len(trace.comm_args) and "Collective name" in trace.comm_args:
        names = trace.comm_args["Collective name"].reindex(rpc.index).astype(str)
        p2p_ts = np.concatenate([p2p_ts, rpc["ts"].to_numpy()[names.str.contains("send|recv").to_numpy()]])
        if recv.empty:
            recv = rpc[names.str.contains("recv").to_numpy()]
    mb = ev[host & _names_matching(ev, MICROBATCH)]
    micro, stage_ids = None, set()
    if len(mb):
        parts = mb["name"].astype(str).str.extract(MICROBATCH.pattern)
        idx = pd.to_numeric(parts[1].fillna(parts[4]), errors="coerce")
        stage_ids = {int(s) for s in pd.to_numeric(parts[2], errors="coerce").dropna()}
        fwd = (parts[0] == "Forward") | (parts[3] == "F")
        steps_mb = [int(idx[fwd.to_numpy() & (mb["ts"] >= s).to_numpy() & (mb["ts"] < e).to_numpy()].nunique())
                    for s, e in zip(lo, hi)]
        steps_mb = [n for n in steps_mb if n]  # distinct indices: an interleaved rank's stages share them
        micro = int(np.median(steps_mb)) if steps_mb else None
    step_us = hi - lo
    busy_us = covered(busy, lo, hi)
    waits = ev[host & _names_matching(ev, RECV_TRANSFER)]
    if waits.empty:
        waits = recv
    in_steps = waits[(waits["ts"] >= lo.min()) & (waits["ts"] < hi.max())] if len(lo) else waits.iloc[:0]
    return Stage(step_ms=float(np.mean(step_us)) / 1000, busy_ms=float(np.mean(busy_us)) / 1000,
                 idle_fraction=float(np.mean(1 - busy_us / step_us)),
                 p2p_per_step=_per_step_count(p2p_ts, lo, hi),
                 recvs_per_step=_per_step_count(recv["ts"].to_numpy(), lo, hi), microbatches=micro,
                 stage_ids=frozenset(stage_ids), wait_rows=tuple(int(i) for i in in_steps.nlargest(2, "dur").index))


def bubble_bound(p: int, m: int, v: int = 1) -> float:
    """Fill-drain idle share of a step: (p - 1) / (v m + p - 1)."""
    return (p - 1) / (v * m + p - 1)


def analyze(ctx: Context, th: Thresholds) -> list[Check]:
    run = ctx.run
    stages = ctx.facts("pipeline_bubble")
    pipe = {r: s for r, s in stages.items() if s.p2p_per_step > 0 or s.microbatches}
    if not pipe or not any(s.p2p_per_step > 0 for s in pipe.values()):
        return [passed(ID, TITLE, "no point-to-point send/recv between ranks in the profiled steps: "
                       "not a pipeline-parallel schedule")]
    ids = set().union(*(s.stage_ids for s in pipe.values()))
    all_traced = not run.world_size or len(run.ranks) == run.world_size
    if ids:
        p = max(ids) + 1
        v = max(1, p // max(len(pipe), 1)) if all_traced else 1
        p_source = "stage indices in the PP: labels"
    else:
        p = len(pipe) if all_traced else (run.world_size or len(pipe))
        v = 1
        p_source = "ranks with point-to-point transfers" if all_traced else "world size (not every rank traced)"
    p_ranks = max(1, p // v)
    labelled = [s.microbatches for s in pipe.values() if s.microbatches]
    if labelled:
        m, m_source = int(max(labelled)), "micro-batch labels"
    else:
        recvs = sorted(s.recvs_per_step for s in pipe.values() if s.recvs_per_step > 0)
        m, m_source = (int(recvs[0]), "receives per step on an end stage") if recvs else (None, "unknown")
    step_ms = float(np.mean([s.step_ms for s in pipe.values()]))
    idle = float(np.mean([s.idle_fraction for s in pipe.values()]))
    busy = {r: s.busy_ms for r, s in pipe.items()}
    mean_busy = float(np.mean(list(busy.values())))
    slowest = max(busy, key=busy.get)
    imbalance = busy[slowest] / mean_busy - 1 if mean_busy > 0 else 0.0
    ms = max(step_ms - mean_busy, 0.0)
    share = ms / step_ms if step_ms else 0.0
    bound = bubble_bound(p_ranks, m, v) if m else None
    metrics: dict[str, float | int | str] = {
        "stages": p_ranks,
        "stages_source": p_source,
        "microbatches": m if m else "unknown",
        "microbatches_source": m_source,
        "idle_fraction": round(idle, 4),
        "bound_fraction": round(bound, 4) if bound is not None else "unknown",
        "excess_over_bound": round(idle - bound, 4) if bound is not None else "unknown",
        "idle_ms_per_step": round(ms, 3),
        "share_of_step": round(share, 4),
        "stage_imbalance": round(imbalance, 4),
        "slowest_stage_rank": slowest,
    }
    if v > 1:
        metrics["virtual_stages_per_rank"] = v
    if bound is not None:
        metrics["bound_ms_per_step"] = round(bound * step_ms, 3)
    for r, s in sorted(pipe.items()):
        metrics[f"rank{r}_idle_fraction"] = round(s.idle_fraction, 4)
        metrics[f"rank{r}_busy_ms"] = round(s.busy_ms, 3)
    refs = []
    for r, s in sorted(pipe.items(), key=lambda kv: -kv[1].idle_fraction)[:4]:
        refs += [ctx.event_ref(r, row, "receive: waiting for the neighbouring stage") for row in s.wait_rows]
    fix = []
    if m:
        m_target = 9 * (p_ranks - 1) // v + (1 if (9 * (p_ranks - 1)) % v else 0)
        fix.append(f"1. More micro-batches: m={m} gives a bound of {bound:.0%}; m>={max(m_target, m + 1)} brings it "
                   f"under 10% (m={2 * m}: {bubble_bound(p_ranks, 2 * m, v):.0%}); keep the micro-batch size "
                   "or shrink it and let the global batch be m x micro-batch.")
    else:
        fix.append("1. More micro-batches per step: the fill-drain bound is (p - 1) / (m + p - 1).")
    if v > 1 and m:  # already interleaved: the advice is more of it, not to start
        fix.append(f"2. The schedule is already interleaved (v={v} stages per rank); v={2 * v} would bring the "
                   f"bound to {bubble_bound(p_ranks, m, 2 * v):.0%}, at one more point-to-point transfer per "
                   "micro-batch and stage.")
    else:
        fix.append("2. An interleaved schedule (torch.distributed.pipelining ScheduleInterleaved1F1B or "
                   "ScheduleInterleavedZeroBubble, v stages per rank) divides the bubble by about v; 1F1B also "
                   "keeps at most p micro-batches of activations alive instead of m.")
    if imbalance >= th.pipeline_imbalance:
        fix.append(f"3. Rebalance layers: stage rank {slowest} computes {busy[slowest]:.1f} ms per step against a "
                   f"mean of {mean_busy:.1f} ms ({imbalance:.0%} more); every micro-batch waits for it.")
    if bound is not None and idle - bound > th.pipeline_bubble:
        fix.append(f"{len(fix) + 1}. Stages idle {idle - bound:.0%} of the step beyond the schedule's bound: "
                   "point-to-point latency or host jitter; post receives early (irecv) and overlap sends with "
                   "compute.")
    has_labels = bool(labelled)
    f = Finding(
        id=ID, title=TITLE, severity=th.severity(share), recoverable_ms=round(ms, 3), share_of_step=round(share, 4),
        ranks=tuple(sorted(pipe)), metrics=metrics, events=tuple(refs[:6]), fix=" ".join(fix),
        confidence=confidence_for(ctx, "high" if has_labels and all_traced else "medium"),
        method="Mean over stage ranks of per-step time not spent computing (communication ops, annotations "
               "and host gaps are idle), compared with the fill-drain bound (p - 1) / (v m + p - 1).")
    vs = f" vs the bound {bound:.0%} for p={p_ranks}, m={m}" if bound is not None else ""
    reason = f"stages idle {idle:.0%} of the step ({ms:.1f} ms){vs}"
    if imbalance >= th.pipeline_imbalance:
        reason += f"; stage rank {slowest} computes {imbalance:.0%} more than the mean"
    check = flag_or_pass(f, th.pipeline_bubble, th, reason)
    if check.status != "flagged":
        check = replace(check, reason=f"{check.reason}; {reason}", finding=f)
    return [check]
