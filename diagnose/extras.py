"""What the report draws beside the verdict (`Diagnosis.extras`): each shown rank's lanes in
representative steps, its heaviest ops, communication by process group, the run over time,
torch.compile's share and the rank x collective lateness. Read from the context after the
checklist; nothing here decides a finding."""
from __future__ import annotations

import numpy as np
import pandas as pd

from diagnose.context import Context
from diagnose.model import Check, Finding, Grid
from diagnose.step.bandwidth import comm_table
from diagnose.step.changes import over_time
from diagnose.step.collectives import packed_key
from diagnose.step.graph import critical_segments
from diagnose.step.cover import DRAWN, MAX_DRAWN
from diagnose.step.idle import CLASSES
from diagnose.step.link import LinkSpec, group_ranks, judge
from diagnose.thresholds import Thresholds


def report_extras(ctx: Context, checks: list[Check], findings: list[Finding], th: Thresholds,
                  link: LinkSpec | None) -> dict:
    """Every extra but the replay's summary (the pipeline adds that after annotating)."""
    # the communication table first, before what the others keep: its build is the extras'
    # highest point (#20); the dict keeps the report's order
    comm = _comm_groups_extra(ctx, th, link)
    shown = shown_ranks(ctx, findings)
    return {"lateness": _lateness_extra(ctx), "timeline": _timeline_extra(ctx, shown),
            "top_ops": _top_ops_extra(ctx, shown), "comm_groups": comm,
            "compiled": _compiled_extra(ctx), "evaluation": _evaluation_extra(ctx),
            "over_time": _over_time_extra(ctx, checks)}


MAX_TIMELINE_RANKS = 16
MAX_LANE_INTERVALS = MAX_DRAWN  # critical-path segments drawn a step, as many as a lane's intervals
SINGLED_OUT = 4
"""Ranks taken from each finding that singles out a few, when the run has more than can be drawn."""


def shown_ranks(ctx: Context, findings: list[Finding]) -> list[int]:
    """The ranks the report draws one by one (the timeline's lanes, the heaviest ops), at most
    MAX_TIMELINE_RANKS: every rank when there are that few. Past that (#20: a 1,024-rank job),
    the ranks that matter first: those a flagged finding singles out (a straggler; up to
    SINGLED_OUT from each finding naming under half the ranks), the ranks the median step's
    critical path runs through, the slowest and the fastest rank by mean step; then the lowest
    ranks. Ranks 0-15 alone would leave out a straggler at rank 700."""
    ranks = ctx.run.ranks
    if len(ranks) <= MAX_TIMELINE_RANKS:
        return ranks
    pick: list[int] = []
    for f in findings:
        if len(f.ranks) < len(ranks) / 2:
            pick += list(f.ranks[:SINGLED_OUT])
    pick += _critical_ranks(ctx)
    mean = ctx.per_rank_mean("step_ms")
    if len(mean):
        pick += [int(mean.idxmax()), int(mean.idxmin())]
    pick += ranks
    out = list(dict.fromkeys(r for r in pick if r in ctx.run.timelines))[:MAX_TIMELINE_RANKS]
    return sorted(out)


def _critical_ranks(ctx: Context) -> list[int]:
    """The ranks the median step's critical path runs through, in the order it meets them."""
    m = ctx.model
    step = _median_step(ctx, ctx.run.ranks)
    if m is None or not m.trusted or step is None:
        return []
    try:
        return list(dict.fromkeys(r for _, _, r, _ in critical_segments(m.graph, m.base, step)))
    except Exception:  # noqa: BLE001 - which ranks to draw; the diagnosis stands without it
        return []


def _median_step(ctx: Context, ranks: list[int]) -> int | None:
    """The median step by duration on the lowest rank, among the steps every rank in `ranks` profiled."""
    order = _steps_by_duration(ctx, ranks)
    return order[len(order) // 2] if order else None


def _steps_by_duration(ctx: Context, ranks: list[int]) -> list[int]:
    run = ctx.run
    common = set.intersection(*(set(run.timelines[r].steps.step.tolist()) for r in ranks))
    if not common:
        return []
    first = run.timelines[ranks[0]].steps.frame()
    cand = first[first["step"].isin(common)].assign(d=lambda f: f["end"] - f["start"]).sort_values("d", kind="stable")
    return [int(x) for x in cand["step"]]


def _timeline_extra(ctx: Context, ranks: list[int]) -> dict:
    """Representative steps of the shown ranks as lanes of intervals (ms from the earliest rank's
    step start, clocks aligned), for the report's mini timeline. Among the steps every shown rank
    profiled, by their duration on the lowest rank: the median step (the top-level fields), and the
    slowest and fastest (under "other_steps", when they are other steps), for the page's step
    selector. `shown`: which ranks of how many, when not all."""
    run = ctx.run
    order = _steps_by_duration(ctx, ranks)
    if not order:
        return {}
    median = order[len(order) // 2]
    out = _step_lanes(ctx, ranks, median)
    others = {}
    for label, step in (("slowest", order[-1]), ("fastest", order[0])):
        if step != median and step not in [o["step"] for o in others.values()]:
            others[label] = _step_lanes(ctx, ranks, step)
    if others:
        out["other_steps"] = others
    if len(ranks) < len(run.ranks):
        out["shown"] = {"ranks": len(ranks), "of": len(run.ranks),
                        "why": "the ranks a finding singles out, those the median step's critical path runs "
                               "through, the slowest and the fastest by mean step, then the lowest"}
    return out


def _step_lanes(ctx: Context, ranks: list[int], step: int) -> dict:
    run = ctx.run
    rows = []
    for r in ranks:
        tl = run.timelines[r]
        off = run.clock_offsets_us.get(r, 0.0)
        i = int(np.flatnonzero(tl.steps.step == step)[0])
        lo, hi = float(tl.steps.start[i]), float(tl.steps.end[i])
        drawing = tl.cover.drawn()  # the longest intervals of each lane, kept where the trace was read
        lanes: dict[str, list] = {}
        for name in DRAWN:
            a, b = drawing.lane(name, i)
            lanes[name] = [[round(float(x + off) / 1000, 4), round(float(y - x) / 1000, 4)] for x, y in zip(a, b)]
        if "idle" in drawing.offsets:  # each idle gap with its cause
            a, b = drawing.lane("idle", i)
            lanes["idle"] = [[round(float(x + off) / 1000, 4), round(float(y - x) / 1000, 4), CLASSES[int(k)]]
                             for x, y, k in zip(a, b, drawing.idle_classes(i))]
        rows.append({"rank": r, "start_ms": round((lo + off) / 1000, 4), "dur_ms": round((hi - lo) / 1000, 4),
                     "lanes": lanes})
    t0 = min(x["start_ms"] for x in rows)
    for x in rows:  # relative to the earliest start, so lateness is visible across ranks
        x["start_ms"] = round(x["start_ms"] - t0, 4)
        for lane in x["lanes"].values():
            for iv in lane:  # [start, dur] or, for idle gaps, [start, dur, cause]
                iv[0] = round(iv[0] - t0, 4)
    out = {"step": step, "ranks": rows, "clock": "ms from the earliest rank's step start, clocks aligned"}
    m = ctx.model
    if m is not None and m.trusted:
        # the chain that set this step's end, as a strip over the lanes: [start, dur, rank, part];
        # drawn only when every rank it runs through is drawn too
        segs = critical_segments(m.graph, m.base, step)[:MAX_LANE_INTERVALS]
        if {r for _, _, r, _ in segs} <= set(ranks):
            out["critical_path"] = [[round(a / 1000 - t0, 4), round((b - a) / 1000, 4), r, what]
                                    for a, b, r, what in segs]
    return out


TOP_OPS_SHOWN = 10


def _top_ops_extra(ctx: Context, ranks: list[int]) -> dict:
    """Each rank's heaviest work, for the report's per-rank table: per name, ms per step (self
    time of host ops on CPU ranks, kernel time on GPU ranks: where the step's time is spent),
    calls per step, share of the rank's mean step. From the straggler check's per-rank summary
    (the same figures its op diff compares), so nothing is measured twice."""
    try:  # read one rank at a time, the ranks drawn kept (#20: every rank's held at once)
        wanted = set(ranks)
        facts = {r: f for r, f in ctx.facts_each("straggler") if r in wanted}
    except RuntimeError:
        return {}
    steps = ctx.per_rank_mean("step_ms")
    out = []
    for r in ranks:
        ops = getattr(facts.get(r), "ops", ())
        step = float(steps.get(r, 0.0))
        if not ops:
            continue
        out.append({"rank": r, "kind": "kernels" if ctx.run.timelines[r].is_gpu else "host ops (self time)",
                    "step_ms": round(step, 3),
                    "top": [{"name": n, "ms_per_step": round(ms, 4), "calls_per_step": round(calls, 2),
                             "share_of_step": round(ms / step, 4) if step > 0 else None}
                            for n, ms, calls in sorted(ops, key=lambda o: -o[1])[:TOP_OPS_SHOWN]]})
    return {"ranks": out} if out else {}


def _comm_groups_extra(ctx: Context, th: Thresholds, link: LinkSpec | None) -> dict:
    """Communication per process group and collective kind: exposed ms per step and, where sizes
    are recorded, size, transfer time and bandwidth (diagnose/step/bandwidth.py), each group judged
    against the link (diagnose/step/link.py)."""
    def r(x, nd):
        return round(x, nd) if x is not None else None

    try:
        rows = comm_table(ctx.run, ctx.matched)
    except Exception as exc:  # noqa: BLE001 - material for the report: the verdict stands without it
        return {"error": one_line(f"{type(exc).__name__}: {exc}")[:300]}
    if not rows:
        return {}
    pgs = [pg for t in ctx.run.traces.values() for pg in ((t.meta.get("distributedInfo") or {}).get("pg_config") or [])
           if isinstance(t.meta.get("distributedInfo"), dict)]
    hosts = {rk: str(p.meta["host"])[:100] for rk, p in ctx.probes.items() if p.meta.get("host")}
    world = ctx.run.world_size or len(ctx.run.ranks)
    out = []
    for g in rows:
        row = {"group": g.group, "kind": g.kind, "ranks": g.ranks, "count": g.count,
               "exposed_ms_per_step": round(g.exposed_ms_per_step, 4), "sized": g.sized,
               "median_bytes": int(g.median_bytes) if g.median_bytes is not None else None,
               "median_transfer_ms": r(g.median_transfer_ms, 4), "algbw_gbps": r(g.algbw_gbps, 3),
               "busbw_gbps": r(g.busbw_gbps, 3), "regime": g.regime, "transfer": g.transfer}
        if g.group:  # the row outside collectives moves nothing a link carries
            v = judge(g, group_ranks(pgs, g.group, ctx.run.ranks), hosts, world, link, th)
            row.update({"hosts": v.hosts, "link": v.link, "link_gbps": v.link_gbps, "link_share": r(v.share, 4),
                        "link_verdict": v.verdict, "link_text": v.text, "tp_spans_hosts": v.tp_spans_hosts})
        out.append(row)
    given = {"intra_gbps": link.intra_gbps, "inter_gbps": link.inter_gbps} if link is not None else None
    return {"groups": out, "link_given": given}


def _over_time_extra(ctx: Context, checks: list[Check]) -> dict:
    """Every step of the run from the probes' record, bucketed, for the report's whole-run chart,
    with the fail-slow check's change marked ({} without an every-step record)."""
    o = over_time({r: p for r, p in ctx.probes.items() if not p.steps.empty}, max_ranks=MAX_TIMELINE_RANKS)
    if o is None:
        return {}
    fs = next((c for c in checks if c.id == "fail_slow" and c.finding is not None), None)
    changes = [{"step": int(fs.finding.metrics["change_step"]), "text": fs.reason}] if fs else []
    return {"bucket_steps": o.bucket, "steps": list(o.steps), "job_ms": list(o.job_ms),
            "ranks": [{"rank": r, "step_ms": list(v)} for r, v in o.ranks.items()], "changes": changes,
            "heat": {"bucket_steps": o.heat_bucket, "steps": list(o.heat_steps),
                     "ranks": [{"rank": r, "own_ms": list(v)} for r, v in o.heat.items()]}}


def _compiled_extra(ctx: Context) -> dict:
    """How much of the host's work in the steps ran inside torch.compile'd code ({} if none)."""
    share = ctx.compiled_share()
    if share is None:
        return {}
    return {"host_share": round(share, 4),
            "definition": "median over ranks of the host's busy time in the steps inside `Torch-Compiled Region` "
                          "and `CompiledFunctionBackward` spans"}


def _evaluation_extra(ctx: Context) -> dict:
    """An evaluation loop inside the profiled steps, where the probes marked its fetches ({} if none)."""
    facts = ctx.facts("dataloader")
    per_rank = [f.evaluation_ms for f in facts.values() if f.evaluation_ms > 0]
    if not per_rank:
        return {}
    ms = float(np.median(per_rank))
    return {"ms_per_step": round(ms, 3), "share_of_step": round(ms / ctx.mean_step_ms, 4), "ranks": len(per_rank),
            "definition": "median over the ranks with one of the mean per step of the time from a step's first "
                          "fetch of an evaluation's DataLoader (probes/patches.EVAL_BATCH) to the end of its last "
                          "(the fetch that ends the loop included): the evaluation's loop, its batches' wait and "
                          "forward passes"}


MAX_LATENESS_COLUMNS = 200
"""The heatmap's collectives: the first ones in (step, group, order)."""


def _lateness_extra(ctx: Context) -> dict:
    """Rank x collective arrival lateness (ms) for the report's heatmap; capped in size. The
    matrix is one array until it is written (model.Grid; output._clean makes it lists): as lists of
    Python floats, held to the end, it was 0.28 MB more at 1,024 DLRM ranks than at 256
    (tracemalloc, #20). The matched table's columns are read a few at a time, each once its
    reader comes: all six at once, and the keys sorted as a table, were the extra's height at
    1,024 ranks (1.28 MB above its base; #20)."""
    key = ["step", "pg", "seq"]
    kf = ctx.matched.frame(key)
    if kf.empty:
        return {}
    at, first = _sorted_keys(kf)
    gid = np.cumsum(first) - 1  # each sorted row's collective, numbered in that order
    keep = gid < MAX_LATENESS_COLUMNS
    at, gid, first = at[keep], gid[keep], first[keep]
    # a column a reader can find in the trace: "step 4 · all_reduce #0", the group only when several;
    # made once per collective (at most 200), not per row: a string of every row, thrice, set the
    # client's peak at 1,024 ranks
    heads = at[first]
    several = pd.Series(kf["pg"].to_numpy()[at]).nunique() > 1
    kf = pd.DataFrame({k: kf[k].to_numpy()[heads] for k in key})
    name = ctx.matched.frame(["name"])["name"].to_numpy()
    kf["name"] = pd.Series(name[at]).groupby(gid, sort=False).first().to_numpy()
    del name
    label = "step " + kf["step"].astype(str) + " · " + kf["name"].astype(str).str.rsplit(":", n=1).str[-1] \
        + " #" + kf["seq"].astype(str)
    if several:
        label = label + " (group " + kf["pg"].astype(str) + ")"
    labels = label.to_numpy(dtype=object)
    del kf, label
    pr = ctx.matched.frame(["rank", "lateness"])
    ranks, lateness = pr["rank"].to_numpy()[at], pr["lateness"].to_numpy(dtype=float)[at]
    del pr
    ranks_out, cols, mat = _pivot_mean(ranks, gid, lateness)
    return {"ranks": [int(r) for r in ranks_out], "collectives": [str(labels[c]) for c in cols],
            "lateness_ms": Grid(np.round(mat / 1000, 3))}


def _sorted_keys(kf: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """The rows' order sorted by (step, pg, seq) as sort_values gives it (stable) and, in that
    order, each collective's first row (~duplicated()): by one packed integer a row where the
    groups are texts and the rest integers (the keys sorted as a table were a copy of each and
    pandas' hash table of every row, #20), else pandas' own."""
    step, pg, seq = (kf[k].to_numpy() for k in ("step", "pg", "seq"))
    texts = pg.tolist()
    ints = np.issubdtype(step.dtype, np.integer) and np.issubdtype(seq.dtype, np.integer)
    if ints and all(type(v) is str for v in texts):
        code = {v: i for i, v in enumerate(sorted(set(texts)))}
        g = np.fromiter((code[v] for v in texts), dtype=np.int64, count=len(texts))
        packed = packed_key([seq, g, step])  # step the most significant: sort_values' order
        if packed is not None:
            key = packed[0]
            at = np.argsort(key, kind="stable")
            key = key[at]
            return at, np.append(True, key[1:] != key[:-1])
    ks = kf[["step", "pg", "seq"]].reset_index(drop=True).sort_values(["step", "pg", "seq"])
    return ks.index.to_numpy(), ~ks.duplicated().to_numpy()


def _pivot_mean(rows: np.ndarray, cols: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """pandas' pivot_table(index=rows, columns=cols, values, sort=False): its rows, columns and
    cells. Where every (row, col) has one value, as matched collectives do, it is each value
    placed at its row's and column's first appearance, NaN elsewhere, made from the arrays: the
    pivot held a frame of every cell and its keys at once, the lateness extra's height at 1,024
    ranks (#20). Anything else (a missing value, a cell seen twice) is pandas' own, whose rules
    for what it leaves out and in which order it puts the rest are its own."""
    r_codes, r_uniq = pd.factorize(rows, sort=False)
    c_codes, c_uniq = pd.factorize(cols, sort=False)
    cell = r_codes.astype(np.int64) * max(len(c_uniq), 1) + c_codes
    if np.isnan(values).any() or len(np.unique(cell)) != len(cell):
        t = pd.DataFrame({"r": rows, "c": cols, "v": values}).pivot_table(index="r", columns="c", values="v",
                                                                         sort=False)
        return t.index.to_numpy(), t.columns.to_numpy(), t.to_numpy(dtype=float)
    out = np.full((len(r_uniq), len(c_uniq)), np.nan)
    out[r_codes, c_codes] = values
    return np.asarray(r_uniq), np.asarray(c_uniq), out
