"""3. Per-rank stragglers: who arrives late at collectives, and what it costs.

Step times cannot show a straggler (the collective re-synchronises the ranks), so
collectives are matched across ranks (diagnose.step.collectives) and each rank's arrival
compared. A rank is named when it is the last to arrive at a consistent share of
the collectives.

Being last is evidence only beyond chance: with n ranks, jitter alone makes each rank last
at about 1/n of the collectives and late by nothing on average. The named rank is a
straggler when one of the one-sided tests below finds its record unlikely under jitter, in
the profiled steps or in the probes' every-step record; each test at Thresholds.straggler_alpha
divided by the number of tests run (Bonferroni: one to five tests, together at most alpha, so a
healthy job is called a straggler in at most 1 of 20 runs by jitter alone):
- last more often than 1/n (binomial): strong with many ranks or many collectives;
- its arrival minus the latest other rank's is positive on average (Student's t):
  strong with few collectives when the lateness is steady (4 of 4 collectives late by
  50 ms each is no coin toss, though 4 heads in a row can be);
- the same summed per step, positive on average over the steps (Student's t): strong when a
  step mixes collectives the rank is late for with ones it is not (Lightning's per-step
  broadcast, where another rank comes last by 0.1 ms, beside the all-reduce the rank holds up
  by 150 ms: per collective that is a coin toss, per step it is not).
Otherwise the waiting is no single rank's, and the check passes saying so and how much: arrival
jitter, or uneven work whose slowest rank changes from step to step, which imbalance.py judges.

Named and sized by effect, where the step graph's replay reproduces the steps
(diagnose/whatif.py): each rank's effect is what the replay gives back when that rank's work
between collectives is brought to the median rank's. The ranks whose effect reaches the
threshold are named (largest first), then each next-latest rank while adding it gives back the
threshold's share more (rank A 6 ms late, rank B 3 ms: A's own effect is 3 ms, B's nothing, both
together 6). With no rank's effect that large, the ranks late together that the context found
(context.late_peers: a slow host's ranks, each of whose own effect is nothing while its peers are
as late; past MAX_EFFECT_RANKS also a single late rank) are named; else the rank most often last
is tested as before. The chance tests guard the named ranks against jitter, they do not decide
alone. The size flagged is the named ranks' effect together.
The check's own estimate, kept as the metric `wait_imposed_ms_per_step` (and the finding's
figure where there is no faithful replay): the median, over the other ranks, of the per-step
time they spend waiting for the last rank alone (after the second-latest arrived), or for all
the named ranks when several are named.

Confidence: high where the named ranks came last at 80% of the collectives, held 80% of the time
the collectives waited for their last rank (LateRank.held: a rank held up once a step among many
collectives, FSDP2's or tensor parallelism's, is last at a minority of them and holds most of the
waiting) or make 80% of what the replay gives back rank by rank (`effect_share_of_all_ranks`: a
wait passed along, a peer held up in one group coming last in its other, is its cause's), medium
from straggler_consistency; where the probes kept an every-step record of 10 collectives or more,
it decides (the same 80%: high, else medium at most); low on partial or sampled traces matched by
order; medium at most where several gloo process groups were matched as one (Run.unnamed_groups).

Why the rank is late (its breakdown and its ops against the median rank's): why_late.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from diagnose.analyzers import imbalance
from diagnose.analyzers.chance import binom_sf, mean_positive_p
from diagnose.analyzers.common import confidence_for, flag_or_pass, not_measurable, paused_peers
from diagnose.analyzers.why_late import ALSO_SHARE, reduce, why_late  # noqa: F401 - reduce: the checklist entry's
from diagnose.context import Context
from diagnose.errors import one_line
from diagnose.model import Check, Finding
from diagnose.probedata import every_step_last, every_step_lateness
from diagnose.step.collectives import group_wait_ms
from diagnose.thresholds import Thresholds
from diagnose.whatif import StepModel
from diagnose.units import rank_ranges

ID = "straggler"
TITLE = "Straggler rank(s) arriving late at collectives"
FIX = ("Find what makes the named rank(s) late: compare their step breakdown with the others' "
       "(extra compute, DataLoader, host contention, thermal throttling, a slower node or NIC); "
       "balance the work per rank (uneven batches, sequence lengths, embedding shards); "
       "move the job off a noisy host.")


def _one_host(ctx: Context, ranks: list[int]) -> str | None:
    """The host the probes put exactly these ranks on (every rank of it, no other), else None."""
    hosts = {r: p.meta.get("host") for r, p in ctx.probes.items()}
    mine = {hosts.get(r) for r in ranks}
    if len(mine) == 1 and None not in mine:
        h = next(iter(mine))
        if {r for r, x in hosts.items() if x == h} == set(ranks):
            return str(h)[:100]
    return None


def _together(ctx: Context, groups: tuple[tuple[int, ...], ...]) -> str:
    """How the context's late ranks are said: one group together (a host's ranks by their host),
    or groups peeled one after another, late by different amounts (the latest first), which
    "late together" would overstate."""
    if sum(map(len, groups)) < 2:
        return ""

    def on_host(g: tuple[int, ...]) -> str | None:
        host = _one_host(ctx, list(g)) if len(g) > 1 else None
        return f"every rank of host {host}" if host else None
    if len(groups) == 1:
        return f" (late together: {on_host(groups[0]) or f'{len(groups[0])} ranks'})"
    said = [on_host(g) or (f"rank {g[0]}" if len(g) == 1 else f"ranks {rank_ranges(g)}") for g in groups]
    return f" (late by different amounts: {said[0]} most, then {', then '.join(said[1:])})"


FIX_BY_SOURCE = {
    "compute_ms": ("Balance the work or find the slow device on {who}: more compute per step than the others "
                   "(uneven batches, sequence lengths or embedding shards; on GPU a throttled or degraded device: "
                   "compare nvidia-smi -q on its host with a healthy one)."),
    "dataloader_ms": ("Feed {who} faster: longer waits for the next batch than the others (more DataLoader "
                      "workers, pin_memory, a slow disk or network mount on the host, a heavier data shard)."),
    "other_ms": ("Look for work outside the profiled ops on {who}: a sleep, logging, checkpointing or other "
                 "Python work there only, or CPU contention on the host (py-spy dump --pid shows where it is)."),
    "exposed_comm_ms": ("Check the network on {who}'s host: slower transfers there (NIC, link errors, a shared "
                        "switch port) and the transport NCCL chose (NCCL_DEBUG=INFO)."),
    "gc_ms": ("Keep Python's full garbage collections out of {who}'s steps: it collects while the others wait "
              "(more long-lived Python objects there: metric histories, caches); gc.freeze() after setup, or "
              "gc.disable() with gc.collect() every N steps at the same step on every rank (the gc_pause check)."),
}
"""The fix, by what the (latest) named rank is late from (why_late): more to act on than FIX."""
FIX_EVAL_ALONE = ("{who} runs an evaluation inside the training steps that the other ranks do not (`if rank == 0: "
                  "validate()`), and they wait for it at the next collective: evaluate on every rank, each on its "
                  "shard of the validation set with the results all-reduced, or less often, or outside the training "
                  "loop (a separate process or job on a saved checkpoint).")
HOST_FIX = "They share a host: look at that node first (its clocks and thermals, neighbours, storage, network). "
FIX_CPU_WAIT = ("Give {who} its cores back: its training thread waits for a core far more than the others' (the "
                "cpu_contention check), so its ops run slower with the same work; find what else runs there (top -H, "
                "pidstat -t 2: another job, a busy process, too many DataLoader workers on its host), keep it off, "
                "and pin each rank to cores of its own (numactl --physcpubind or taskset per rank).")
CPU_WAIT_EXPLAINS = 0.5
"""A late rank's extra wait for a core (ms of its step) from this share of what it is late from
(compute or host gaps) up: the fix is its cores, not its work."""


MAX_NAMED_IN_ORDER = 8
"""Named ranks listed one by one, largest effect first, up to this many; beyond, as ranges."""
def _excess(arrivals: pd.DataFrame, key: list[str], rank: int, per_step: bool = False) -> np.ndarray:
    """Per collective (per_step: summed over each step's): the rank's arrival minus the latest other
    rank's (> 0 when it came last)."""
    mine = arrivals[arrivals["rank"] == rank].groupby(key)["arrival"].max()
    others = arrivals[arrivals["rank"] != rank].groupby(key)["arrival"].max()
    both = pd.concat([mine.rename("me"), others.rename("other")], axis=1, join="inner")
    d = both["me"] - both["other"]
    if per_step:
        d = d.groupby(level="step").sum()
    return d.to_numpy(dtype=float)


@dataclass(frozen=True, slots=True)
class LateRank:
    """Who comes last at the collectives, and whether that is beyond chance."""

    named: tuple[int, ...]
    last_share: dict[int, float]
    consistent: float
    """The share of collectives at which a named rank came last."""
    held: float
    """The share of the time collectives waited for their last rank alone (latest minus
    second-latest arrival, summed) that a named rank was that last rank. A rank held up once a
    step among many collectives (a sleep before an FSDP2 or tensor-parallel backward: last at the
    backward's first collectives only) is last at a minority of them and holds most of the waiting;
    a rank last by a hair at many does the opposite."""
    chance: float
    p_value: float
    """The smallest of the tests' p-values (profiled steps and every-step record)."""
    units: int
    """Collectives the tests could use (the larger of the two records)."""
    metrics: dict[str, float | int]
    every_agree: float | None
    """Share of the every-step collectives at which a named rank came last, or of the time they
    waited for their last rank that it held, the larger (None: no record)."""
    tests: int = 2
    """How many tests p_value is the smallest of."""

    def too_few(self, th: Thresholds) -> int | None:
        """Where the named ranks came last at every collective and the tests still could not tell
        (no every-step record to add more): how many all-late collectives the binomial test needs
        (2 ranks at alpha 0.05 over 3 tests: 6); None otherwise. Such a window cannot say jitter
        either: a rank last at both collectives of a 2-step window, 155.7 ms of waiting a step (63%
        of it), was called "arrival jitter" (examples/train_ddp.py --pathology straggler profiled
        2 steps a window: 3 of 25 tries here)."""
        limit = th.straggler_alpha / max(self.tests, 1)
        p0 = min(1.0, self.chance * len(self.named))  # by chance, a named rank last at one collective
        if self.units < 2 or self.consistent < 1.0 or self.every_agree is not None or not 0.0 < p0 < 1.0 \
                or p0 ** self.units <= limit:  # the binomial test's p-value, every collective's last named
            return None
        return math.ceil(math.log(limit) / math.log(p0))

    def beyond_chance(self, th: Thresholds) -> bool:
        """A straggler, not jitter. With under 2 collectives neither test can tell: still named
        (at low confidence), since one step's late arrival is all the evidence there is."""
        return self.units < 2 or self.p_value <= th.straggler_alpha / max(self.tests, 1)


MAX_EFFECT_RANKS = 64  # one replay per rank: beyond this, ranks are named by how often they are last


def effects(ctx: Context) -> dict[int, float] | None:
    """Per rank, ms per step the replay gives back with that rank brought to the median rank
    (None: no faithful step model, or too many ranks to replay one by one)."""
    m = ctx.model
    if m is None or not m.trusted or len(ctx.run.ranks) > MAX_EFFECT_RANKS:
        return None
    return {r: m.saving(ID, (r,)) or 0.0 for r in ctx.run.ranks}


MAX_NEXT = 8
"""Ranks added after the named ones at most, each by one replay (_next_latest)."""


def _next_latest(named: list[int], lateness_ms: pd.Series, m: StepModel, th: Thresholds,
                 step_ms: float) -> tuple[list[int], list[tuple[int, float]]]:
    """The named ranks, then each next-latest rank while adding it gives back the threshold's share
    of the step more (one replay each): with rank A 6 ms late and rank B 3 ms late, bringing A to the
    median gives back 3 ms, B then comes last, and B alone gives back nothing, so the per-rank
    effects name A at half the cost. Returns the ranks and, per added rank, what the set gave back
    before it."""
    out, added = list(named), []
    limit = (len(lateness_ms) - 1) // 2
    floor = th.straggler_floor_ms(step_ms)
    before = m.saving(ID, tuple(out)) or 0.0
    for r in lateness_ms.sort_values(ascending=False, kind="stable").index:
        if len(out) >= limit or len(added) >= MAX_NEXT:
            break
        if int(r) in out:
            continue
        with_it = m.saving(ID, tuple(out) + (int(r),)) or 0.0
        if with_it - before < floor or with_it <= before:
            break
        added.append((int(r), before))
        out.append(int(r))
        before = with_it
    return out, added


def _name(ctx: Context, th: Thresholds, effect: dict[int, float] | None, lateness_ms: pd.Series,
          step_ms: float) -> tuple[list[int] | None, list[int], list[tuple[int, float]]]:
    """(the ranks named, None to fall back on who is most often last; the ranks late together among
    them, [] if none; the ranks _next_latest added, with what the set gave back before each).
    By effect where per-rank replays exist: the ranks whose own effect reaches the threshold (fewer
    than half, largest first), then the next-latest ones, then the context's late group behind them
    when all of it adds the threshold's share. Otherwise the context's late group (past
    MAX_EFFECT_RANKS a single late rank comes this way too)."""
    m, found = ctx.model, list(ctx.late_together)
    floor = th.straggler_floor_ms(step_ms)
    limit = (len(ctx.run.ranks) - 1) // 2
    named = None
    if effect is not None:
        big = [r for r, v in sorted(effect.items(), key=lambda kv: -kv[1]) if v >= floor]
        named = big[:max(1, limit)] or None
    if named is None:
        return (found, found, []) if found and (effect is None or len(found) > 1) else (None, [], [])
    if m is None:
        return named, [], []
    named, then = _next_latest(named, lateness_ms, m, th, step_ms)
    more = [r for r in found if r not in named]
    if len(found) > 1 and more and m.trusted and len(named) + len(more) <= limit:
        # one at a time none of the group adds anything (its peers are as late), all of it may (8 ranks
        # on 2 cores, 5-7 asleep: rank 7 was named alone at 59 ms)
        if (m.saving(ID, tuple(named + more)) or 0.0) - (m.saving(ID, tuple(named)) or 0.0) >= floor:
            return named + more, found, []
    return named, [], then


def late_rank(ctx: Context, th: Thresholds, by_effect: list[int] | None, every: pd.DataFrame) -> LateRank | None:
    """The ranks named (by_effect, else the rank most often last at the matched collectives) and
    the chance tests on them (None: nothing to match). every: the probes' every_step_lateness."""
    pc = ctx.matched.per_collective
    if len(ctx.run.ranks) < 2 or pc.empty:
        return None
    n = len(pc)
    last_share = pc.groupby("last_rank").size() / n
    often = [int(r) for r in last_share[last_share >= th.straggler_consistency].index]
    if len(often) >= pc["n_ranks"].max():
        often = []  # every rank "consistently" last (two ranks at half each): none is
    named = by_effect or often or [int(last_share.idxmax())]
    chance = 1.0 / max(float(pc["n_ranks"].median()), 2.0)
    p_last = binom_sf(int(pc["last_rank"].isin(named).sum()), n, min(1.0, chance * len(named)))
    single = len(named) == 1
    key = ["step", "pg", "seq"]
    pr = ctx.matched.frame(key + ["rank", "arrival"]) if single else None
    p_late = mean_positive_p(_excess(pr, key, named[0])) if single else 1.0
    p_step = mean_positive_p(_excess(pr, key, named[0], per_step=True)) if single else 1.0
    p_value, units, agree = min(p_last, p_late, p_step), n, None
    tests = 1 + 2 * single  # binomial; t-tests on a single rank's lateness per collective and per step
    metrics: dict[str, float | int] = {"chance_last_share": round(chance, 3),
                                       "p_last_more_than_chance": round(p_last, 4),
                                       "p_late_on_average": round(p_late, 4),
                                       "p_late_per_step": round(p_step, 4)}
    if not every.empty:
        key = ["step", "group", "seq"]
        per = every_step_last(every)
        last, gap = per["rank"], per["gap"]
        every_share = last.value_counts(normalize=True)
        metrics["every_step_collectives"] = int(len(last))
        for r in sorted(every_share.index):
            metrics[f"rank{int(r)}_every_step_last_share"] = round(float(every_share[r]), 3)
        # as in the profiled steps, by how often a named rank came last or by how much waiting it held
        held_every = float(gap[last.isin(named)].sum() / gap.sum()) if gap.sum() > 0 else 0.0
        metrics["every_step_held_share"] = round(held_every, 4)
        agree = max(float(every_share.reindex(named).fillna(0).max()), held_every)
        every_ranks = int(every.groupby(key)["rank"].nunique().median())
        p_every = binom_sf(int(last.isin(named).sum()), len(last), min(1.0, len(named) / max(every_ranks, 2)))
        if len(named) == 1:
            p_every = min(p_every, mean_positive_p(_excess(every, key, named[0])))
        metrics["every_step_p_value"] = round(p_every, 4)
        p_value, units = min(p_value, p_every), max(units, len(last))
        tests += 1 + single
    gap = np.nan_to_num(pc["gap"].to_numpy(dtype=float))  # a collective without a second arrival holds nothing
    held = float(gap[pc["last_rank"].isin(named).to_numpy()].sum() / gap.sum()) if gap.sum() > 0 else 0.0
    return LateRank(named=tuple(named), last_share={int(r): float(v) for r, v in last_share.items()},
                    consistent=float(pc["last_rank"].isin(named).mean()), held=held, chance=chance,
                    p_value=p_value, units=units, metrics=metrics, every_agree=agree, tests=tests)


def analyze(ctx: Context, th: Thresholds) -> list[Check]:
    """The straggler check, then uneven work across ranks (imbalance.py), which reads whom it flagged."""
    every = every_step_lateness(ctx.probes)  # both read it: one concat of every rank's collectives
    c = _straggler(ctx, th, every)
    named = tuple(c.finding.ranks) if c.status == "flagged" and c.finding is not None else ()
    try:
        u = imbalance.analyze(ctx, th, named, every)
    except Exception as exc:  # noqa: BLE001 - its bug must not cost the straggler's verdict (one entry, two checks)
        u = not_measurable(imbalance.ID, imbalance.TITLE, one_line(f"failed on this input ({type(exc).__name__}: "
                                                                    f"{exc})")[:300])
    return [c, u]


def _straggler(ctx: Context, th: Thresholds, every: pd.DataFrame) -> Check:
    run = ctx.run
    if len(run.ranks) < 2:
        return not_measurable(ID, TITLE, f"only rank {run.ranks[0]}'s trace: lateness needs at least two ranks")
    effect = effects(ctx)
    step_ms = ctx.mean_step_ms
    pc, pr = ctx.matched.per_collective, ctx.matched.frame(["rank", "lateness", "row"])
    lateness_ms = pr.groupby("rank")["lateness"].mean() / 1000 if not pr.empty else pd.Series(dtype=float)
    by_effect, group, then = _name(ctx, th, effect, lateness_ms, step_ms)
    late = late_rank(ctx, th, by_effect, every)
    if late is None:
        return not_measurable(ID, TITLE, "no collectives could be matched across ranks")
    n, named, consistent = len(pc), list(late.named), late.consistent
    if set(named) != set(ctx.late_together) and (len(named) > 1 or len(ctx.late_together) > 1):
        # not the breakdown's split (which is by the ranks late together): what the others wait for these
        ms = group_wait_ms(ctx.matched, tuple(named))
    else:
        # what the others wait for the last rank alone, or for the ranks late together (the
        # breakdown's split: context.late_peers)
        wait = ctx.per_rank_mean("straggler_wait_ms")
        others = wait.drop(index=named, errors="ignore")
        ms = float(np.median(others.to_numpy())) if len(others) else 0.0
    share = ms / ctx.mean_step_ms
    mismatched = int((~pc["names_agree"].astype(bool)).sum())
    metrics: dict[str, float | int | str] = {
        "collectives_matched": n,
        "match_ratio": round(ctx.matched.match_ratio, 3),
        "wait_imposed_ms_per_step": round(ms, 3),
        "share_of_step": round(share, 4),
    }
    for r in sorted(late.last_share):
        metrics[f"rank{r}_last_share"] = round(late.last_share[r], 3)
    for r in lateness_ms.index:
        metrics[f"rank{int(r)}_mean_lateness_ms"] = round(float(lateness_ms[r]), 3)
    if mismatched:
        metrics["collectives_with_mismatched_names"] = mismatched
    if effect is not None:
        for r in sorted(effect):
            metrics[f"rank{r}_effect_ms"] = round(effect[r], 3)
    if group:
        metrics["late_together"] = len(group)
    metrics.update(late.metrics)
    metrics["p_threshold_per_test"] = round(th.straggler_alpha / max(late.tests, 1), 4)
    # consistent by how often it came last, by how much of the waiting it held (LateRank.held), or by
    # its share of what the replay gives back rank by rank (the chain a wait passes along included: on
    # a 2-D mesh rank 3's sleep makes its dp peer come last at that peer's tp collectives)
    steady = max(consistent, late.held)
    metrics["held_share_of_last_waits"] = round(late.held, 4)
    if effect and (total := sum(max(v, 0.0) for v in effect.values())) > 0:
        metrics["effect_share_of_all_ranks"] = round(sum(max(effect.get(r, 0.0), 0.0) for r in named) / total, 4)
        steady = max(steady, metrics["effect_share_of_all_ranks"])
    base = "high" if steady >= 0.8 else "medium" if steady >= th.straggler_consistency else "low"
    # hundreds of steps agreeing with the profiled window make the verdict firm; not agreeing, not
    if late.every_agree is not None and metrics.get("every_step_collectives", 0) >= 10:
        base = "high" if late.every_agree >= 0.8 else min(base, "medium", key=("low", "medium", "high").index)
    if ctx.matched.match_ratio < 0.9 or mismatched > 0.1 * n:
        base = "low"  # sampled or partial traces: matching by order is unreliable
    if late.units < 2:
        base = "low"
        metrics["note"] = "one collective only: too few to tell a straggler from jitter"
    if base == "high" and run.unnamed_groups:
        base = "medium"  # several process groups matched as one (timeline.UNNAMED_GROUPS): its waits approximate
    # evidence: the straggler's latest arrivals
    rows = pr[pr["rank"].isin(named)].nlargest(5, "lateness")
    refs = tuple(ctx.event_ref(int(r.rank), int(r.row), f"arrived {r.lateness / 1000:.2f} ms after the median rank")
                 for r in rows.itertuples())
    # the named ranks as ordered (largest effect first) while few; as ranges when many or late together
    names = ", ".join(map(str, named)) if len(named) <= MAX_NAMED_IN_ORDER and not group else rank_ranges(named)
    who = f"rank {names} is" if len(named) == 1 else f"ranks {names} are"
    m = ctx.model
    size = ((m.saving(ID, tuple(named)) or 0.0) if (effect is not None or group) and m is not None and m.trusted
            else None)
    host = _one_host(ctx, group) if len(group) > 1 else None
    note = _together(ctx, ctx.late_groups) if group else ""
    for r, before in then:  # why more than the per-rank effects named
        ahead = named[:named.index(r)]
        note += (f"; bringing {'rank' if len(ahead) == 1 else 'ranks'} {rank_ranges(ahead)} to the median rank alone "
                 f"gives back {before:.1f} ms per step: rank {r} then comes last")
    # how much of the waiting it held, where that says more than how often it came last
    held = (f", holding {late.held:.0%} of the time they waited for their last rank"
            if late.held >= consistent + 0.1 else "")
    reason = (f"{who} last to arrive at {consistent:.0%} of {n} collectives{held}{note}; "
              f"the others wait {ms:.1f} ms per step for {'it' if len(named) == 1 else 'them'}")
    if size is not None:
        reason += (f", and bringing {'it' if len(named) == 1 else 'them'} to the median rank gives back {size:.1f} "
                   "ms per step (replayed)")
    if late.every_agree is not None and late.every_agree < 0.8 and (k := metrics.get("every_step_collectives", 0)) >= 10:
        # the window says one rank, the whole run does not: say so beside the verdict, not in the confidence alone
        last = max(float(metrics.get(f"rank{r}_every_step_last_share", 0.0)) for r in named)
        reason += (f"; but over the probes' every-step record ({k} collectives) {'it' if len(named) == 1 else 'they'} "
                   f"came last at {last:.0%} of them, holding {metrics.get('every_step_held_share', 0.0):.0%} of their "
                   "waiting: the profiled steps may have caught a turn of uneven work (a slowest rank that changes "
                   "from step to step)")
    fix = FIX
    if len(named) == 1 or group or then:
        # several: explained by the latest (named[0]) against the median other rank
        w = why_late(ctx, named[0])
        if w.key is not None:
            keys = [w.key] + [k for k, _, _ in w.also]
        else:  # late from nothing but its collections: theirs is the fix
            keys = ["gc_ms"] if w.paused_ms > 0 else []
        if keys and keys[0] in FIX_BY_SOURCE:
            ranks_text = f"rank {names}" if len(named) == 1 else f"ranks {names}"
            fix = " Then: ".join(FIX_BY_SOURCE[k].format(who=ranks_text) for k in keys if k in FIX_BY_SOURCE)
        starved = (w.key in ("compute_ms", "other_ms") and w.cpu_wait_ms > 0
                   and w.cpu_wait_ms >= CPU_WAIT_EXPLAINS * w.excess[w.key])
        if starved:  # the same ops run slower for want of a core (a busy neighbour on its core)
            fix = FIX_CPU_WAIT.format(who=f"rank {names}" if len(named) == 1 else f"ranks {names}")
        if w.evaluates_alone:  # what it is late from is the evaluation's: where that runs is the fix
            fix = FIX_EVAL_ALONE.format(who=f"Rank {named[0]}")
        if host:
            fix = HOST_FIX + fix
        subject = "it is" if len(named) == 1 else f"rank {named[0]}, the latest of them, is"
        if w.source and w.key:
            metrics["late_from"] = w.source + w.detail
            reason += (f"; {subject} late from {w.source} (+{w.excess[w.key]:.1f} ms per step against the median "
                       f"rank){w.detail}")
        gc = (f"Python garbage collections (+{w.paused_ms:.1f} ms per step: the gc_pause check's, which the replay "
              "sets apart)")
        if w.paused_ms > 0 and w.source and w.key and w.paused_ms >= ALSO_SHARE * w.excess[w.key]:
            reason += f", and from {gc}"
        elif w.paused_ms > 0 and not w.source:
            reason += f"; {subject} late from {gc} alone"
        for k, v in w.excess.items():
            metrics[f"late_rank_extra_{k}"] = v
        if w.ops:
            metrics["late_rank_extra_ops"] = w.ops
        if w.ops_explain:
            reason += f": {w.ops}"
        elif w.key == "other_ms":
            # its ops are not why: say so, lest a +0.4 ms op read as the cause of a 150 ms wait
            where = ("the device idles between them" if ctx.run.is_gpu else
                     "the time is outside them (a sleep, Python work, I/O, a wait the profiler does not record)")
            reason += (f"; its {'kernels' if ctx.run.is_gpu else 'ops'} take about as long as the median rank's "
                       f"({w.ops_ms:+.1f} ms per step in all): {where}")
        if starved:
            metrics["late_rank_cpu_wait_share"] = w.cpu_wait_share
            metrics["median_rank_cpu_wait_share"] = w.cpu_wait_others
            metrics["late_rank_extra_cpu_wait_ms"] = w.cpu_wait_ms
            reason += (f"; its training thread waited for a core {w.cpu_wait_share:.0%} of the time over the run, the "
                       f"median rank's {w.cpu_wait_others:.0%} (+{w.cpu_wait_ms:.1f} ms of its step; the cpu_contention "
                       "check): the same work done slower, not more work")
        if w.also:  # after the op diff, which speaks of the largest source only
            reason += "; also from " + " and ".join(f"{label} (+{ms:.1f} ms per step)" for _, label, ms in w.also)
        if w.evaluates_alone:
            metrics["late_rank_extra_evaluation_ms"] = w.evaluation_ms
            reason += (f"; {w.evaluation_ms:.1f} ms per step of it is an evaluation rank {named[0]} runs and the "
                       "others do not (a DataLoader iterated with autograd off, its batches and forward passes)")
    f = Finding(
        id=ID, title=TITLE, severity=th.severity(share), recoverable_ms=round(ms, 3), share_of_step=round(share, 4),
        ranks=tuple(named), metrics=metrics, events=refs, fix=fix, confidence=confidence_for(ctx, base),
        method=("Median over the other ranks of per-step time spent waiting, at each collective, for the "
                "named ranks (after the last of the others arrived)." if len(named) > 1 else
                "Median over the other ranks of per-step time spent waiting, at each collective, for the "
                "last rank alone (after the second-latest arrived)."))
    if not late.beyond_chance(th):
        # measured 0: the waiting is the communication check's, counted there once
        tested = f"p={late.p_value:.3f}, above {th.straggler_alpha / max(late.tests, 1):.4g} for each of {late.tests} tests"
        need = late.too_few(th)
        said = (f"cannot tell a straggler from jitter here: {who} last at all {n} collectives, too few for the "
                f"chance test (it needs {need} all late; {tested}): the {ms:.1f} ms per step of waiting for "
                f"{'it' if len(named) == 1 else 'them'} may be either; profile more steps to tell" if need is not None
                else f"no rank is late more than chance: {who} last at {consistent:.0%} of {n} collectives against "
                     f"{late.chance:.0%} by chance ({tested}); the {ms:.1f} ms per step of waiting is no single "
                     "rank's to fix (" + (paused_peers(ctx, ms) or "arrival jitter, or uneven work: the "
                                          "load_imbalance check judges which") + ")")
        return Check(id=ID, title=TITLE, status="passed", measured_ms=0.0,
                     reason=said + ", and not booked as exposed communication either")
    if size is None:
        return flag_or_pass(f, th.straggler, th, reason)
    # decided by its effect; the finding keeps its own estimate, which the replay then replaces
    c = flag_or_pass(replace(f, recoverable_ms=round(size, 3), share_of_step=round(size / step_ms, 4)),
                     th.straggler, th, reason)
    if c.finding is None:  # below the threshold: still say who is late, by how much, and why
        return replace(c, reason=f"{reason}: {c.reason}")
    return replace(c, finding=f)
