"""3b. Uneven work across ranks: the slowest rank changes from step to step.

A straggler is one rank (or one host's ranks) late step after step; the straggler check names it.
Where every rank takes its turn at being slowest (sequence lengths that vary by batch, uneven
token routing in a mixture of experts, batches unequal to load), no rank is late more than chance
and the straggler check passes, yet each step runs at its slowest rank's pace while the others
wait for it at the collectives. That time was called arrival jitter and booked nowhere: a job
whose ranks waited 18% of every step read "no significant cause found".

Sized on the one model of the step (diagnose/whatif.py): what the replay gives back with every
rank's work between collectives brought to the median rank's (the straggler's edit with every rank
listed): the same work spread evenly. The check's own estimate, where there is no faithful replay:
the mean over ranks of the per-step wait at collectives for a late peer; each rank waits for the
slowest rank's excess over its own work, so the mean wait is the slowest rank's excess over the
mean rank, what even work gives back.

Flagged where
- the straggler check flagged no rank (with one, the waiting is first the straggler's; what
  bringing every rank to the median gives back beyond it is said in the passed reason);
- the slowest rank changes: the rank slowest most often is so in fewer than
  Thresholds.imbalance_same_rank of the steps, judged on the probes' every-step record where it
  holds MIN_EVERY_STEPS steps with collectives, else on the profiled steps (MIN_STEPS at least:
  with fewer a slow rank and a changing one cannot be told apart);
- and it costs Thresholds.load_imbalance of the step or more.
Which part of each step's slowest rank is longer than the other ranks' (its ops, its DataLoader
waits, the time outside both) says what is uneven, and the fix follows it.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from diagnose.analyzers.common import confidence_for, flag_or_pass, not_measurable
from diagnose.context import Context
from diagnose.model import Check, Finding
from diagnose.probedata import every_step_last, run_wait_shares
from diagnose.thresholds import Thresholds
from diagnose.units import rank_ranges

ID = "load_imbalance"
TITLE = "Uneven work across ranks (the slowest rank changes from step to step)"
MIN_STEPS = 3
MIN_EVERY_STEPS = 10
# the breakdown's parts of a rank's own time (not its waits for others), and what each says is uneven
SOURCES = {
    "compute_ms": "its ops (more work in its batch)",
    "dataloader_ms": "its DataLoader waits (batches unequal to load)",
    "other_ms": "time outside ops and waits (host contention, Python work, a wait the profiler does not record)",
    "gc_ms": "Python garbage collections (each rank collecting at its own steps)",
}
FIX = {
    "compute_ms": ("Even out the work each rank gets per step: batch by tokens rather than by samples (a "
                   "length-grouped or bucketing sampler that puts sequences of similar length together, or "
                   "pack sequences to a fixed length), cap the tokens per rank, and for a mixture of experts "
                   "balance the routing (a load-balancing loss, a capacity factor)."),
    "dataloader_ms": ("Keep slow batches out of the step: more DataLoader workers and a deeper prefetch "
                      "(prefetch_factor) so a batch that is slow to load is ready in time, and even out the "
                      "per-sample cost (pre-process or cache the expensive samples)."),
    "other_ms": ("Find what runs outside the ops on each step's slowest rank (py-spy or torch.profiler "
                 "with_stack=True on every rank); keep other processes off the ranks' cores (pin each rank "
                 "to its own cores) and Python work such as logging out of the step."),
    "gc_ms": ("Collect on every rank at the same step: gc.disable() in the training loop and gc.collect() every "
              "N steps (torchtitan's gc_freq), after gc.freeze() once the model and data are built (the gc_pause "
              "check)."),
}


FIX_CONTENDED = ("First give the training threads their cores back (the cpu_contention check's fix): ranks that "
                 "wait for a core take turns being the slowest with the same work, whichever rank the host's other "
                 "work (DataLoader workers, other ranks, other jobs) took the cores from. If the turns remain once "
                 "no rank waits for a core: ")
"""The fix where the host's training threads waited for cores (cpu_contention) and the slowest rank
is longer in its ops or between them: both are what a thread short of cores shows."""
SLOWED_BY = {"compute_ms": "its ops", "other_ms": "time outside ops and waits"}
"""The parts a thread short of cores stretches, as said without naming a cause."""


def _contended(ctx: Context, th: Thresholds) -> float | None:
    """The largest share of wall time a rank's training thread waited for a core over the run (the
    probes' samples), from the cpu_contention check's threshold up; else None."""
    worst = max(run_wait_shares(ctx.probes).values(), default=None)
    return worst if worst is not None and worst >= th.cpu_contention else None


def _slowest_by_profiled_step(table: pd.DataFrame) -> pd.Series:
    """Per profiled step, the rank that worked longest (its step less its waits for late peers)."""
    t = table[["step", "rank"]].assign(own=table["step_ms"] - table["straggler_wait_ms"])
    t = t[t.groupby("step")["rank"].transform("size") >= 2]
    return t.loc[t.groupby("step")["own"].idxmax()].set_index("step")["rank"].astype(int)


def _held_by_every_step(every: pd.DataFrame) -> pd.DataFrame:
    """Per step of the probes' every-step record, the rank that held the collectives longest and
    for how long (`rank`, `gap` s): the sum over the step's collectives of its arrival minus the
    next-latest one's, where last."""
    per = every_step_last(every)
    if per.empty:
        return pd.DataFrame({"rank": pd.Series(dtype=int), "gap": pd.Series(dtype=float)})
    held = pd.DataFrame({"step": per.index.get_level_values("step"), "rank": per["rank"].to_numpy(),
                         "gap": per["gap"].to_numpy()}).groupby(["step", "rank"])["gap"].sum()
    held = held[held > 0].reset_index()
    top = held.loc[held.groupby("step")["gap"].idxmax()].set_index("step")
    return top.assign(rank=top["rank"].astype(int))


def _slowest_by_every_step(every: pd.DataFrame) -> pd.Series:
    """Per step of the probes' every-step record, the rank that held the collectives longest."""
    return _held_by_every_step(every)["rank"]


STARVED_EXPLAINS = 0.5
"""Each step's slowest rank waiting for a core this share of its lead at the collectives or more
(over the every-step record): its turns are the contention's, not uneven work."""


def _starved(ctx: Context, held: pd.DataFrame) -> tuple[float, float, int] | None:
    """Over the record's steps where every rank's wait for a core was read (run_wait_ms): the mean
    of the step's slowest rank's wait above the median other rank's (ms), the mean lead it held the
    collectives by (ms), and how many steps; None with fewer than MIN_EVERY_STEPS such steps."""
    waits = {r: p.steps.set_index("step")["run_wait_ms"] for r, p in ctx.probes.items()
             if not p.steps.empty and "run_wait_ms" in p.steps and p.steps["run_wait_ms"].notna().any()}
    if len(waits) < 2 or held.empty:
        return None
    grid = pd.DataFrame({r: w[~w.index.duplicated(keep="last")] for r, w in waits.items()})
    grid = grid.reindex(held.index).dropna()  # steps every rank's probes read
    if len(grid) < MIN_EVERY_STEPS:
        return None
    slow = held.loc[grid.index, "rank"].to_numpy()
    cols = {r: i for i, r in enumerate(grid.columns)}
    w = grid.to_numpy(dtype=float)
    at = np.array([cols.get(int(r), -1) for r in slow])
    ok = at >= 0
    if ok.sum() < MIN_EVERY_STEPS:
        return None
    mine = w[ok, at[ok]]
    others = np.array([np.median(np.delete(row, i)) for row, i in zip(w[ok], at[ok])])
    lead = held.loc[grid.index[ok], "gap"].to_numpy(dtype=float) * 1000
    return float(np.mean(mine - others)), float(np.mean(lead)), int(ok.sum())


def _source(table: pd.DataFrame, slowest: pd.Series) -> dict[str, float]:
    """Per part of the breakdown, how much longer each step's slowest rank spent in it than the
    step's other ranks on average (ms, mean over the steps)."""
    cols = [c for c in SOURCES if c in table.columns and (c != "gc_ms" or table[c].any())]
    t = table[table["step"].isin(slowest.index)]
    is_slow = t["rank"].to_numpy() == slowest.reindex(t["step"]).to_numpy()
    slow = t[is_slow].groupby("step")[cols].mean()
    rest = t[~is_slow].groupby("step")[cols].mean()
    return {c: round(float((slow[c] - rest[c]).mean()), 3) for c in cols} if len(slow) else {}


def _late_rows(ctx: Context, n: int = 4) -> tuple:
    """Evidence: each of the latest ranks' latest arrival (a rank each, so that the turns show)."""
    pr = ctx.matched.frame(["rank", "lateness", "row", "step"])
    if pr.empty:
        return ()
    top = pr.loc[pr.groupby("rank")["lateness"].idxmax()].nlargest(n, "lateness")
    return tuple(ctx.event_ref(int(r.rank), int(r.row), f"arrived {r.lateness / 1000:.2f} ms after the median rank "
                               f"(step {int(r.step)})") for r in top.itertuples())


def analyze(ctx: Context, th: Thresholds, straggler_ranks: tuple[int, ...], every: pd.DataFrame) -> Check:
    """straggler_ranks: the ranks the straggler check flagged (none: it flagged nothing); every:
    the probes' every_step_lateness (probedata), which the straggler check reads too."""
    run = ctx.run
    if len(run.ranks) < 2:
        return not_measurable(ID, TITLE, f"only rank {run.ranks[0]}'s trace: uneven work needs at least two ranks")
    if ctx.matched.per_collective.empty:
        return not_measurable(ID, TITLE, "no collectives could be matched across ranks")
    ranks = tuple(int(r) for r in run.ranks)
    wait = ctx.per_rank_mean("straggler_wait_ms")
    own = float(wait.mean()) if len(wait) else 0.0
    m = ctx.model
    trusted = m is not None and m.trusted
    balanced = m.saving(ID, ranks) if trusted else None
    if straggler_ranks:
        beyond = (max(balanced - (m.saving("straggler", straggler_ranks) or 0.0), 0.0)
                  if balanced is not None else None)
        more = (f"; bringing every rank to the median rank gives back {beyond:.1f} ms per step more than "
                "bringing those alone (replayed)" if beyond is not None else "")
        who = f"rank {rank_ranges(straggler_ranks)}" if len(straggler_ranks) == 1 else \
            f"ranks {rank_ranges(straggler_ranks)}"
        return Check(id=ID, title=TITLE, status="passed", measured_ms=round(beyond, 3) if beyond is not None else None,
                     reason=f"the waiting at collectives is first the straggler check's ({who})" + more)
    held = _held_by_every_step(every)
    by_every = held["rank"]
    profiled = _slowest_by_profiled_step(ctx.table) if not ctx.table.empty else pd.Series(dtype=int)
    use_every = len(by_every) >= MIN_EVERY_STEPS
    slowest = by_every if use_every else profiled
    cost = balanced if balanced is not None else own
    if len(slowest) < MIN_STEPS:
        return Check(id=ID, title=TITLE, status="passed", measured_ms=round(cost, 3),
                     reason=f"{len(profiled)} profiled step(s): whether the slowest rank changes from step to step "
                            f"needs {MIN_STEPS}; the ranks wait {own:.1f} ms per step for late peers")
    turns = slowest.value_counts(normalize=True)
    top_rank, top_share = int(turns.index[0]), float(turns.iloc[0])
    where = "(the probes' every-step record)" if use_every else "(the profiled steps)"
    metrics: dict[str, float | int | str] = {
        "wait_ms_per_step": round(own, 3),
        "share_of_step": round(cost / ctx.mean_step_ms, 4) if ctx.mean_step_ms > 0 else 0.0,
        "steps_judged": int(len(slowest)),
        "judged_on": "every_step_record" if use_every else "profiled_steps",
        "slowest_rank_most_often": top_rank,
        "its_share_of_steps": round(top_share, 3),
    }
    for r in sorted(turns.index):
        metrics[f"rank{int(r)}_slowest_share"] = round(float(turns[r]), 3)
    if top_share >= th.imbalance_same_rank:
        return Check(id=ID, title=TITLE, status="passed", measured_ms=round(cost, 3),
                     reason=f"the slowest rank does not change: rank {top_rank} is slowest at {top_share:.0%} of "
                            f"{len(slowest)} steps {where}, a straggler's pattern (the straggler check judges it)")
    extra = _source(ctx.table, profiled) if len(profiled) else {}
    for k, v in extra.items():
        metrics[f"slowest_extra_{k}"] = v
    key = max(extra, key=extra.get) if extra and max(extra.values()) > 0 else None
    if key is not None:
        metrics["uneven_in"] = key
    base = "high" if use_every else "medium"
    if ctx.matched.match_ratio < 0.9:
        base = "low"  # sampled or partial traces: matching by order is unreliable
    if base == "high" and run.unnamed_groups:
        base = "medium"  # several process groups matched as one: the waits approximate
    n_turns = int((turns > 0).sum())
    reason = (f"the slowest rank changes from step to step: {n_turns} of {len(ranks)} ranks take turns, rank "
              f"{top_rank} the most often at {top_share:.0%} of {len(slowest)} steps {where}; the ranks wait "
              f"{own:.1f} ms per step on average for each step's slowest")
    if balanced is not None:
        reason += f"; bringing every rank to the median rank gives back {balanced:.1f} ms per step (replayed)"
    contended = _contended(ctx, th) if (key or "compute_ms") in SLOWED_BY else None
    starved = _starved(ctx, held) if contended is not None and use_every else None
    if starved is not None:
        # each step's slowest rank against the others at that step: the record says whether the
        # turns follow the wait for a core, where the run's share alone could only say "may be"
        metrics.update(slowest_extra_cpu_wait_ms=round(starved[0], 3), slowest_lead_ms=round(starved[1], 3),
                       cpu_wait_steps=starved[2])
        if starved[1] > 0 and starved[0] >= STARVED_EXPLAINS * starved[1]:
            return Check(id=ID, title=TITLE, status="passed", measured_ms=round(cost, 3),
                         reason=f"{reason}; but at each of {starved[2]} steps of the record the slowest rank waited "
                                f"{starved[0]:.1f} ms more for a core than the median other rank, against its "
                                f"{starved[1]:.1f} ms lead at the collectives: the turns are the host's CPU "
                                "contention's (the cpu_contention check), not uneven work")
        contended = None  # the turns do not follow the wait for a core: uneven work, said plainly
        reason += (f"; the training threads waited for a core, but each step's slowest rank only "
                   f"{starved[0]:.1f} ms more than the median other rank against its {starved[1]:.1f} ms lead "
                   f"({starved[2]} steps of the record): not the contention's")
    if key is not None:
        said = SOURCES[key] if contended is None else SLOWED_BY[key]  # not "more work" where it may be slower work
        reason += f"; each step's slowest rank is longer in {said}: +{extra[key]:.1f} ms per step against the other ranks"
    fix = FIX.get(key or "compute_ms")
    if contended is not None:
        # the same batches on every rank read as uneven work where the ranks share too few cores
        # (tests/fixtures/cpu_cores_contended_2rank: "batch by tokens" for equal random batches)
        metrics["run_wait_share"] = round(contended, 4)
        reason += (f"; but the training threads waited for a core {contended:.0%} of the time over the run (the "
                   "cpu_contention check): a rank short of cores is slower with the same work, so the turns may be "
                   "the contention's, not uneven batches")
        fix = FIX_CONTENDED + fix
        base = "low"
    share = own / ctx.mean_step_ms if ctx.mean_step_ms > 0 else 0.0
    f = Finding(
        id=ID, title=TITLE, severity=th.severity(share), recoverable_ms=round(own, 3), share_of_step=round(share, 4),
        ranks=ranks, metrics=metrics, events=_late_rows(ctx), fix=fix,
        confidence=confidence_for(ctx, base),
        method="Mean over ranks of the per-step time spent waiting at collectives for a late peer: each rank "
               "waits for the step's slowest rank, so this is the slowest rank's excess over the mean rank, "
               "what spreading the same work evenly gives back.")
    return flag_or_pass(f, th.load_imbalance, th, reason, ctx)
