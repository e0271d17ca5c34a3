"""Why a rank is late, for the straggler check's reason and evidence.

Its step breakdown against the median of the other ranks (compute, the DataLoader, host gaps or
device idle, its own communication: the largest excess is named; on GPU ranks late from device
idle, the idle class it has most more of; its placed garbage collections said apart, the gc_pause
check's), and its ops (CPU: self time per op name; GPU: kernels
per name) against the median rank's over the same steps: "aten::mm +111.0 ms/step (+8 calls)".
The op table is each rank's per-rank summary (`reduce`, run next to the trace: RankOps).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from diagnose.analyzers.common import host_self_times
from diagnose.context import Context
from diagnose.step.breakdown import CAUSE_COLUMNS, HAS_CAUSES
from diagnose.step.idle import CLASSES
from diagnose.ingest.load import KIND_KERNEL, RankTrace
from diagnose.probedata import run_wait_shares
from diagnose.step.timeline import RankTimeline

FACTS = "straggler"
DATALOADER_FACTS = "dataloader"
"""The DataLoader check's per-rank summary (dataloader.RankInput): each rank's evaluation loops."""
"""The per-rank summary's name (the straggler check's entry in the checklist)."""
TOP_OPS = 200  # per rank: enough to diff any op that matters, small enough to ship from a worker
SOURCES = {"compute_ms": "compute", "dataloader_ms": "the DataLoader", "other_ms": "host gaps or device idle",
           "exposed_comm_ms": "its own communication", "gc_ms": "Python garbage collections"}
CPU_OTHER = "host gaps"
"""A CPU rank's "other" time: outside any profiled op (it has no device to idle)."""
EVAL_ALONE = 0.5
"""A late rank's evaluation loops explain its lateness from this share of its excess over the median
rank (all components) up: the fix is where the evaluation runs, not what it is late from."""
ALSO_SHARE = 0.25
"""A second source of lateness is named beside the largest from this share of it up (a rank
waiting 149 ms for its DataLoader and sleeping 100 ms more is late from both)."""
OPS_EXPLAIN = 0.25
"""The op diff is given as the reason a rank is late when its ops' excess is at least this share of
the rank's excess (or the rank is late from compute); below, the reason says the time is elsewhere."""
IDLE_SOURCES = {"launch": "the device waiting for host launches", "sync": "host sync drains",
                "queued": "work queued behind other streams", "input": "blocking input copies",
                "unattributed": "unattributed device idle", "latency": "scheduling latency"}


@dataclass(frozen=True, slots=True, eq=False)
class RankOps:
    """One rank's work by op name over its profiled steps: each name's ms and calls per step, as
    arrays (#20: as a tuple of (name, ms, calls) tuples it was ~20 KB of the client's memory per
    rank, as arrays ~5 KB)."""

    names: tuple[str, ...] = ()
    ms: np.ndarray = field(default_factory=lambda: np.empty(0))
    calls: np.ndarray = field(default_factory=lambda: np.empty(0))
    rows: tuple[int, ...] = ()

    @classmethod
    def of(cls, ops) -> RankOps:
        """From (name, ms per step, calls per step) triples."""
        ops = list(ops)
        return cls(names=tuple(n for n, _, _ in ops), ms=np.array([m for _, m, _ in ops], dtype=float),
                   calls=np.array([k for _, _, k in ops], dtype=float))

    def __eq__(self, other: object) -> bool:  # arrays: compared by value, not by numpy's elementwise ==
        return (isinstance(other, RankOps) and self.names == other.names and self.rows == other.rows
                and np.array_equal(self.ms, other.ms) and np.array_equal(self.calls, other.calls))

    __hash__ = None  # mutable arrays inside: not a dict key

    @property
    def ops(self) -> tuple[tuple[str, float, float], ...]:
        return tuple(zip(self.names, self.ms.tolist(), self.calls.tolist()))

    def shared(self, texts: dict[str, str]) -> RankOps:
        """The same, its op names kept once across ranks (`texts`: the client's pool, ingest.assemble.Keep).
        Ranks run the same kernels, whose C++ names reach 2 KB: each rank's own copies were 42 KB
        of the client's memory per rank."""
        return RankOps(names=tuple(texts.setdefault(n, n) for n in self.names), ms=self.ms, calls=self.calls,
                       rows=self.rows)


def reduce(trace: RankTrace, tl: RankTimeline) -> RankOps:
    ev = trace.events
    lo, hi = tl.steps.start, tl.steps.end
    if tl.is_gpu:
        ops = ev[(ev["kind"] == KIND_KERNEL).to_numpy()]
        ops = ops.assign(self_us=ops["dur"].to_numpy(dtype=float))
    else:
        ops = host_self_times(ev, tl)
    k = np.searchsorted(lo, ops["ts"].to_numpy(), side="right") - 1
    ops = ops[(k >= 0) & (ops["ts"].to_numpy() < hi[np.clip(k, 0, None)])]
    if ops.empty:
        return RankOps()
    g = ops.groupby(ops["name"].astype(str))["self_us"].agg(["sum", "size"]).nlargest(TOP_OPS, "sum")
    n = max(len(lo), 1)
    return RankOps(names=tuple(str(name) for name in g.index), ms=g["sum"].to_numpy(dtype=float) / 1000 / n,
                   calls=g["size"].to_numpy(dtype=float) / n)


MIN_OP_EXCESS_MS = 0.05  # the healthy floor: below it an op's excess is timer noise


def _op_table(ctx: Context, rank: int) -> tuple[list[str], np.ndarray] | None:
    """Every rank's ms per step of each op name: names x ranks, a rank without an op reading as
    zero (a matrix filled in place: a long frame pivoted was 5 MB at its height at 512 ranks). The
    summaries are read one rank at a time, twice (the names, then the figures): all of them held
    at once set the client's peak at 1,024 ranks (#20). None when a rank has none, `rank` is not
    among them, fewer than two ranks have them or none names an op."""
    ranks = ctx.run.ranks  # facts_each gives every rank's, or raises
    if rank not in ranks or len(ranks) < 2:
        return None
    try:
        seen: set[str] = set()
        for _, f in ctx.facts_each(FACTS):
            seen.update(f.names)
    except RuntimeError:
        return None
    if not seen:
        return None
    names = sorted(seen)
    return names, _figure(ctx, names, "ms")


def _figure(ctx: Context, names: list[str], figure: str) -> np.ndarray:
    """names x the run's ranks: each rank's `figure` (ms or calls per step) of each
    name, zero where the rank has not got it; one more read of the summaries."""
    at = {n: i for i, n in enumerate(names)}
    out = np.zeros((len(names), len(ctx.run.ranks)))
    for j, (_, f) in enumerate(ctx.facts_each(FACTS)):
        mine = [(at[n], k) for k, n in enumerate(f.names) if n in at]
        if mine:
            rows, cols = map(list, zip(*mine))
            out[rows, j] = getattr(f, figure)[cols]
    return out


def _over_median(m: np.ndarray, me: int) -> np.ndarray:
    """Per row, column `me` minus the median of the other columns; a row at a time (the other
    columns taken at once were a copy of the matrix, and the median's partition another)."""
    return np.array([row[me] - np.median(np.delete(row, me)) for row in m]) if len(m) else np.zeros(0)


def _short(name: str) -> str:
    """A kernel's or op's name without its template arguments and signature, for one line."""
    n = name.removeprefix("void ").split("(")[0].split("<")[0].strip() or name
    return n[:80]


@dataclass(frozen=True, slots=True)
class WhyLate:
    """Why one rank is late, against the median other rank over the same steps."""

    source: str | None
    """The breakdown component it has most more of ("compute", "host gaps", ...); None: none more."""
    key: str | None
    """That component's column (a SOURCES key)."""
    excess: dict[str, float]
    """Its excess per breakdown component, ms per step."""
    ops: str
    """The ops (GPU: kernels) it spends more time in, from MIN_OP_EXCESS_MS per step up, largest first."""
    ops_ms: float
    """Its ops' excess in all (every op's positive difference), ms per step."""
    detail: str
    """GPU ranks late from device idle: the idle class it has most more of, as ", mostly ..."."""
    also: tuple[tuple[str, str, float], ...] = ()
    """Other components it has ALSO_SHARE of the largest excess or more: (key, label, ms per step)."""
    paused_ms: float = 0.0
    """Its excess in garbage collections the probes placed in the profiled steps (the breakdown's
    gc_ms), ms per step: not among the sources above (the gc_pause check's, set apart by the replay)."""
    cpu_wait_ms: float = 0.0
    """Its training thread's wait for a core (the probes' run_wait share over the run) above the
    median other rank's, as ms of its mean profiled step: time its ops and gaps stretched for want
    of a core, not more work (0 where the probes did not sample it)."""
    cpu_wait_share: float = 0.0
    """Its run_wait share over the run (0 where not sampled)."""
    cpu_wait_others: float = 0.0
    """The median other rank's."""
    evaluation_ms: float = 0.0
    """Its excess in evaluation loops inside the steps (dataloader.RankInput.evaluation_ms: a
    DataLoader iterated with autograd off, its batches and forward passes), ms per step: an
    evaluation it runs and the others do not (`if rank == 0: validate()`)."""

    @property
    def evaluates_alone(self) -> bool:
        """Most of its excess over the median rank is an evaluation of its own."""
        total = sum(v for v in self.excess.values() if v > 0)
        return total > 0 and self.evaluation_ms >= EVAL_ALONE * total

    @property
    def ops_explain(self) -> bool:
        """Whether the op diff accounts for the lateness, rather than a time outside the ops."""
        if not self.ops or self.key is None:
            return False
        return self.key == "compute_ms" or self.ops_ms >= OPS_EXPLAIN * self.excess[self.key]


def why_late(ctx: Context, rank: int) -> WhyLate:
    # gc: only where the probes placed a collection in the profiled steps (no zeros said elsewhere)
    cols = [c for c in SOURCES if c != "gc_ms" or ctx.table[c].any()]
    means = ctx.table.groupby("rank")[cols].mean()
    if rank not in means.index or len(means) < 2:
        return WhyLate(None, None, {}, "", 0.0, "")
    excess = (means.loc[rank] - means.drop(index=rank).median()).to_dict()
    # the collections are the gc_pause check's, which the replay sets apart: what the rank is late
    # from beyond them is the straggler's (its replayed figure, its fix)
    paused = max(float(excess.get("gc_ms", 0.0)), 0.0)
    top = max((k for k in excess if k != "gc_ms"), key=excess.get)
    def label(key: str) -> str:
        return CPU_OTHER if key == "other_ms" and not ctx.run.is_gpu else SOURCES[key]
    source = label(top) if excess[top] > 0 else None
    also = tuple((k, label(k), round(float(v), 3)) for k, v in sorted(excess.items(), key=lambda kv: -kv[1])
                 if k not in (top, "gc_ms") and source and v > 0 and v >= ALSO_SHARE * excess[top])
    detail = ""
    if top == "other_ms" and source and HAS_CAUSES in ctx.table:
        # GPU ranks: which kind of device idle the late rank has more of (the idle model's classes).
        # A rank whose idle model could not be built has no split: left out, not read as zero idle
        t = ctx.table[ctx.table[HAS_CAUSES]]
        by = pd.DataFrame(t[list(CAUSE_COLUMNS)].to_numpy(), index=t["rank"].to_numpy(),
                          columns=list(CLASSES)).dropna(how="all")
        if not by.empty and rank in by.index and by.index.nunique() >= 2:
            m = by.groupby(level=0).mean()
            cls = (m.loc[rank] - m.drop(index=rank).median()).sort_values(ascending=False)
            if len(cls) and cls.iloc[0] > 0 and cls.index[0] in IDLE_SOURCES:
                detail = f", mostly {IDLE_SOURCES[cls.index[0]]} (+{cls.iloc[0]:.1f} ms)"
    ops, ops_ms = "", 0.0
    table = _op_table(ctx, rank)
    if table is not None:
        names, ms = table
        me = ctx.run.ranks.index(rank)
        d_ms = pd.Series(_over_median(ms, me), index=names)
        del ms, table
        top_ops = d_ms[d_ms >= MIN_OP_EXCESS_MS].nlargest(3)
        # calls only of the ops named (none: no read): every op's was a second matrix as large
        named = list(top_ops.index)
        d_calls = pd.Series(_over_median(_figure(ctx, named, "calls"), me) if named else [], index=named, dtype=float)
        ops = ", ".join(f"{_short(n)} {v:+.2f} ms/step" + (f" ({d_calls[n]:+.0f} calls)" if abs(d_calls[n]) >= 0.5
                                                             else "") for n, v in top_ops.items())
        ops_ms = float(d_ms[d_ms > 0].sum())
    mine, others = _cpu_waits(ctx, rank)
    step = float(ctx.table.loc[ctx.table["rank"] == rank, "step_ms"].mean())
    return WhyLate(source, top if source else None, {k: round(float(v), 3) for k, v in excess.items()}, ops,
                   round(ops_ms, 3), detail, also, round(paused, 3), round(max(mine - others, 0.0) * step, 3),
                   round(mine, 4), round(others, 4), round(_evaluation_excess(ctx, rank), 3))


def _cpu_waits(ctx: Context, rank: int) -> tuple[float, float]:
    """The rank's training thread's run_wait share over the run and the median other rank's ((0, 0)
    where its probes, or fewer than half of the others', sampled none)."""
    shares = run_wait_shares(ctx.probes)
    others = [v for r, v in shares.items() if r != rank]
    if rank not in shares or len(others) < max(1, (len(ctx.run.ranks) - 1) // 2):
        return 0.0, 0.0
    return shares[rank], float(np.median(others))


def _evaluation_excess(ctx: Context, rank: int) -> float:
    """The rank's evaluation loops per profiled step above the median other rank's (0 where the
    DataLoader check's per-rank phase did not run)."""
    try:
        facts = ctx.facts(DATALOADER_FACTS)
    except RuntimeError:
        return 0.0
    others = [f.evaluation_ms for r, f in facts.items() if r != rank]
    if rank not in facts or not others:
        return 0.0
    return max(facts[rank].evaluation_ms - float(np.median(others)), 0.0)

