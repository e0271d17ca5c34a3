"""3. Per-rank stragglers: who arrives late at collectives, and what it costs.

Step times cannot show a straggler (the collective re-synchronises the ranks), so
collectives are matched across ranks (diagnose.collectives) and each rank's arrival
compared. A rank is named when it is the last to arrive at a consistent share of
the collectives.

Estimation: the median, over the other ranks, of the per-step time they spend
waiting for the last rank alone (after the second-latest arrived): had the late
rank arrived with the rest, each collective, and so the step, would end that much
sooner.
"""
from __future__ import annotations

import numpy as np

from diagnose.analyzers.common import confidence_for, flag_or_pass, not_measurable
from diagnose.context import Context
from diagnose.model import Check, Finding
from diagnose.probedata import every_step_lateness
from diagnose.thresholds import Thresholds

ID = "straggler"
TITLE = "Straggler rank(s) arriving late at collectives"
FIX = ("Find what makes the named rank(s) late: compare their step breakdown with the others' "
       "(extra compute, DataLoader, host contention, thermal throttling, a slower node or NIC); "
       "balance the work per rank (uneven batches, sequence lengths, embedding shards); "
       "move the job off a noisy host.")


def analyze(ctx: Context, th: Thresholds) -> list[Check]:
    run = ctx.run
    if len(run.ranks) < 2:
        return [not_measurable(ID, TITLE, f"only rank {run.ranks[0]}'s trace: lateness needs at least two ranks")]
    pc = ctx.matched.per_collective
    if pc.empty:
        return [not_measurable(ID, TITLE, "no collectives could be matched across ranks")]
    n = len(pc)
    last_share = pc.groupby("last_rank").size() / n
    pr = ctx.matched.per_rank
    lateness_ms = pr.groupby("rank")["lateness"].mean() / 1000
    named = [int(r) for r in last_share[last_share >= th.straggler_consistency].index]
    if not named:
        top = int(last_share.idxmax())
        named = [top]
    wait = ctx.per_rank_mean("straggler_wait_ms")
    others = wait.drop(index=named, errors="ignore")
    ms = float(np.median(others.to_numpy())) if len(others) else 0.0
    share = ms / ctx.mean_step_ms
    consistent = float(last_share.reindex(named).fillna(0).max())
    mismatched = int((~pc["names_agree"].astype(bool)).sum())
    metrics: dict[str, float | int | str] = {
        "collectives_matched": n,
        "match_ratio": round(ctx.matched.match_ratio, 3),
        "wait_imposed_ms_per_step": round(ms, 3),
        "share_of_step": round(share, 4),
    }
    for r in sorted(last_share.index):
        metrics[f"rank{int(r)}_last_share"] = round(float(last_share[r]), 3)
    for r in lateness_ms.index:
        metrics[f"rank{int(r)}_mean_lateness_ms"] = round(float(lateness_ms[r]), 3)
    if mismatched:
        metrics["collectives_with_mismatched_names"] = mismatched
    base = "high" if consistent >= 0.8 else "medium" if consistent >= th.straggler_consistency else "low"
    every = every_step_lateness(ctx.probes)
    if not every.empty:
        last = every.loc[every.groupby(["step", "group", "seq"])["arrival"].idxmax(), "rank"]
        every_share = last.value_counts(normalize=True)
        metrics["every_step_collectives"] = int(len(last))
        for r in sorted(every_share.index):
            metrics[f"rank{int(r)}_every_step_last_share"] = round(float(every_share[r]), 3)
        agree = float(every_share.reindex(named).fillna(0).max())
        # hundreds of steps agreeing with the profiled window make the verdict firm
        if agree >= 0.8 and len(last) >= 10:
            base = "high"
    if ctx.matched.match_ratio < 0.9 or mismatched > 0.1 * n:
        base = "low"  # sampled or partial traces: matching by order is unreliable
    # evidence: the straggler's latest arrivals
    rows = pr[pr["rank"].isin(named)].nlargest(5, "lateness")
    refs = tuple(ctx.event_ref(int(r.rank), int(r.row), f"arrived {r.lateness / 1000:.2f} ms after the median rank")
                 for r in rows.itertuples())
    names = ", ".join(map(str, named))
    f = Finding(
        id=ID, title=TITLE, severity=th.severity(share), recoverable_ms=round(ms, 3), share_of_step=round(share, 4),
        ranks=tuple(named), metrics=metrics, events=refs, fix=FIX, confidence=confidence_for(ctx, base),
        method="Median over the other ranks of per-step time spent waiting, at each collective, for the "
               "last rank alone (after the second-latest arrived).")
    reason = (f"rank {names} is last to arrive at {consistent:.0%} of {n} collectives; the others wait "
              f"{ms:.1f} ms per step for it")
    return [flag_or_pass(f, th.straggler, th, reason)]
