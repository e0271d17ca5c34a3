"""Garbage collections placed in their steps: the step model's own part, not another cause's.

A full pass that falls inside the profiled steps stops its rank for hundreds of ms; the trace
shows that time as whatever the process was doing when it began. Before the probes placed each
pass in its step, the window's figures carried it so: `cpu_gc_in_window_2rank` (recorded then)
ranked "uneven work across ranks" first, and its re-recording with placing probes,
`cpu_gc_placed_2rank`, did the same on the old code (62.6 ms per step, confidence low). Now the
step graph carries each pass as its part "gc" (diagnose/step/pauses.py), which the median edit
leaves where it is and the DataLoader's part gives up where the pass began inside a fetch
(`cpu_gc_placed_loader_2rank`). READMEs in the fixtures say how each was recorded.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from diagnose.context import build_context
from diagnose.ingest.assemble import load_run
from diagnose.pipeline import diagnose_paths
from diagnose.probedata import load_probe_data, probe_from_rows
from diagnose.step import graph as sg
from diagnose.step.window import window_mask

FIXTURES = Path(__file__).parent / "fixtures"
PLACED = FIXTURES / "cpu_gc_placed_2rank"
IN_FETCH = FIXTURES / "cpu_gc_placed_loader_2rank"


def _window_passes(fixture: Path) -> dict[int, list[tuple[int, float, bool]]]:
    """Each rank's full passes inside its profiled steps, as the step logs hold them: (step, ms, in fetch)."""
    run = load_run([fixture])
    out = {}
    for r, p in load_probe_data([fixture]).items():
        inside = window_mask(run.traces[r], p.steps)
        window = set(p.steps["step"][inside].tolist())
        raw = [json.loads(x) for x in (fixture / f"rank{r}.steps.jsonl").read_text().splitlines()]
        out[r] = [(x["step"], g[1], g[3] == 1) for x in raw if x["step"] in window
                  for g in x.get("gc_passes", []) if g[2] == 2]
    return out


def _part_ms(ctx, part: str) -> dict[int, float]:
    """The graph's part summed over each rank's lane edges, ms."""
    g = ctx.model.graph
    col = g.lane_parts.column(sg.PARTS.index(part))
    rank = g.rank
    return {int(r): float(col[rank == r].sum()) / 1000 for r in np.unique(rank)}


def test_passes_outside_fetches_are_their_own_cause_not_uneven_work():
    passes = _window_passes(PLACED)
    # as the README says: one pass on each rank, at different steps, outside any fetch, hundreds of ms
    assert {r: [(s, f) for s, _, f in v] for r, v in passes.items()} == {0: [(12, False)], 1: [(11, False)]}
    assert min(ms for v in passes.values() for _, ms, _ in v) > 250
    d = diagnose_paths([PLACED])
    assert [f.id for f in d.findings] == ["gc_pause"]
    assert d.findings[0].confidence == "high" and d.findings[0].over == "run"
    imbalance = next(c for c in d.checks if c.id == "load_imbalance")
    assert imbalance.status == "passed" and "the waits were for peers stopped in garbage collections" in imbalance.reason
    # the straggler check, finding no rank late beyond chance, says whose the waits were too
    straggler = next(c for c in d.checks if c.id == "straggler")
    assert straggler.status == "passed" and "no rank is late more than chance" in straggler.reason
    assert "the waits were for peers stopped in garbage collections" in straggler.reason
    # removing the passes from the replay gives back what they stopped: one rank at a time, the other waiting
    steps = d.extras["replay"]["critical_path"]["steps"]
    stopped = sum(ms for v in passes.values() for _, ms, _ in v) / steps
    assert d.extras["replay"]["by_cause_ms"]["gc_pause"] == pytest.approx(stopped, rel=0.05)
    assert d.findings[0].metrics["replay_recoverable_ms"] == d.extras["replay"]["by_cause_ms"]["gc_pause"]
    # every rank brought to the median rank: next to nothing once the passes are set apart
    assert d.extras["replay"]["by_cause_ms"]["straggler"] < 0.05 * stopped
    w = d.extras["window"]
    assert "collections" in w["kinds"] and w["collections_placed"] is True
    assert "the probes placed each in its step" in " ".join(d.warnings)
    # the report's replay table says whose figure is which, and draws the part on the critical path
    from diagnose.output import diagnosis_dict
    from diagnose.reports.html import render

    page = render(diagnosis_dict(d))
    assert "(its figure: over the run; the replay: the profiled steps)" in page
    assert '"name":"Python garbage collection"' in page  # the critical path's part, labelled


def test_the_graph_carries_each_placed_pass_once():
    run = load_run([PLACED])
    probes = load_probe_data([PLACED])
    ctx = build_context(run, probes)
    passes = _window_passes(PLACED)
    got = _part_ms(ctx, "gc")
    for r, v in passes.items():
        assert got[r] == pytest.approx(sum(ms for _, ms, _ in v), abs=1.0)  # a pass is lane time, whole
        assert ctx.pauses[r].ms == pytest.approx(got[r], abs=1.0)
    # the critical path of the window is its steps, not more: chains of consecutive steps no longer
    # overlap where one rank is out of step with the other
    # composed, the collections go after the median edit, whichever is asked first: it sets them apart
    m = ctx.model
    both = m.without({"gc_pause": (), "straggler": ()})
    assert both == m.without({"straggler": (), "gc_pause": ()})
    assert m.base.mean_step_ms - both == pytest.approx(m.saving("gc_pause") + m.saving("straggler"), abs=1.0)
    cp = sg.critical_path(ctx.model.graph, ctx.model.base)
    assert sum(cp.by_part_ms.values()) == pytest.approx(ctx.model.base.mean_step_ms, rel=0.01)
    assert cp.by_part_ms["gc"] == pytest.approx(sum(got.values()) / cp.steps, rel=0.05)


def test_passes_inside_fetches_leave_the_dataloaders_part():
    passes = _window_passes(IN_FETCH)
    assert {r: [(s, f) for s, _, f in v] for r, v in passes.items()} == {0: [(11, True)], 1: [(11, True)]}
    run = load_run([IN_FETCH])
    ctx = build_context(run, load_probe_data([IN_FETCH]))
    dl, gc = _part_ms(ctx, "dataloader"), _part_ms(ctx, "gc")
    for r, v in passes.items():
        waited = float(run.timelines[r].cover.per_step[:, 2].sum()) / 1000  # the trace's DataLoader spans
        assert gc[r] == pytest.approx(sum(ms for _, ms, _ in v), abs=1.0)
        assert dl[r] == pytest.approx(waited - gc[r], abs=1.0)
    d = diagnose_paths([IN_FETCH])
    assert d.findings[0].id == "gc_pause"
    f = next(x for x in d.findings if x.id == "dataloader_starvation")
    m = f.metrics
    # the window's wait was mostly the collection; what is left is the Dataset's own work, and the
    # replay and the check's own figure agree on it
    # the wait it cites is the trace's (the breakdown's DataLoader part plus the passes it gave up)
    waits = {r: float(run.timelines[r].cover.per_step[:, 2].mean()) / 1000 for r in passes}
    assert m["dataloader_ms_per_step"] == pytest.approx(max(waits.values()), abs=0.01)
    assert m["gc_in_wait_ms"] > 0.5 * m["dataloader_ms_per_step"]
    assert m["gc_in_wait_unplaced_ms"] < 0.05 * m["gc_in_wait_ms"]  # middle generations under 1 ms only
    assert f.recoverable_ms == pytest.approx(m["own_estimate_ms"], abs=0.5)
    assert f.recoverable_ms < 0.25 * m["gc_in_wait_ms"]
    assert f.confidence != "low"


@pytest.mark.parametrize("fixture", [PLACED, IN_FETCH])
def test_the_breakdown_books_the_collections_the_graph_carries(fixture):
    """One model of the step: the per-rank breakdown (the report's bars, why_late's sources) books
    each placed pass as its part gc_ms, the same time the graph's part "gc" holds, out of the
    DataLoader wait where it began in a fetch and out of the host time otherwise."""
    from diagnose.step.breakdown import GC_IN_FETCH, MS_FIELDS

    passes = _window_passes(fixture)
    run = load_run([fixture])
    ctx = build_context(run, load_probe_data([fixture]))
    t = ctx.table
    parts = [f for f in MS_FIELDS if f != "step_ms"]
    assert np.allclose(t[parts].sum(axis=1), t["step_ms"], atol=1e-6)  # still disjoint, still the step
    graph_gc = _part_ms(ctx, "gc")
    for r, v in passes.items():
        mine = t[t["rank"] == r].set_index("step")
        assert mine["gc_ms"].sum() == pytest.approx(graph_gc[r], abs=1.0)
        for step, ms, in_fetch in v:
            assert mine.at[step, "gc_ms"] == pytest.approx(ms, abs=1.0)
            if in_fetch:  # out of the wait: what the trace showed is the wait plus it
                assert mine.at[step, GC_IN_FETCH] == pytest.approx(ms, abs=1.0)
                waited = float(run.timelines[r].cover.per_step[:, 2].sum()) / 1000
                assert (mine["dataloader_ms"] + mine[GC_IN_FETCH]).sum() == pytest.approx(waited, abs=0.01)
            else:  # out of the host time between ops: no step keeps a pass's worth of it
                assert mine.at[step, GC_IN_FETCH] == 0.0
                assert mine["other_ms"].max() < 0.25 * ms
        quiet = mine.drop(index=[s for s, _, _ in v])
        assert (quiet["gc_ms"] == 0.0).all()


def test_the_report_draws_the_collections_only_where_a_rank_has_some():
    from diagnose.output import diagnosis_dict
    from diagnose.reports.html import render

    assert '"name":"garbage collection"' in render(diagnosis_dict(diagnose_paths([PLACED])))
    assert '"name":"garbage collection"' not in render(diagnosis_dict(diagnose_paths([FIXTURES / "cpu_straggler_2rank"])))


def test_collections_older_probes_did_not_place_stay_out_of_the_graph():
    """Older probes (cpu_gc_in_window_2rank) sum the collections only: nothing placed, the window's
    caution and low confidence as before."""
    old = FIXTURES / "cpu_gc_in_window_2rank"
    run = load_run([old])
    ctx = build_context(run, load_probe_data([old]))
    assert ctx.pauses == {} and "gc" not in sg.critical_path(ctx.model.graph, ctx.model.base).by_part_ms
    d = diagnose_paths([old])
    assert d.extras["window"]["collections_placed"] is False
    assert "carry them as whatever the process was doing" in " ".join(d.warnings)


def test_malformed_passes_in_a_step_record_are_skipped():
    good = [10.0, 300.0, 2, 1]
    rows = [{"step": 1, "start": 100.0, "dur_ms": 400.0, "dataloader_ms": 0, "comm_ms": 0, "collectives": [],
             "gc_passes": [good, [1, 2, 3], "x", [1.0, -5.0, 2, 0], [1.0, 5.0, 7, 0], [float("nan"), 5.0, 2, 0],
                           [2.0, 5.0, True, 0], {"a": 1}]}]
    p = probe_from_rows(0, {"gc": {"timed": True, "placed": True}}, rows)
    assert p.gc_passes.to_dict("records") == [{"step": 1, "start": 100.01, "dur_ms": 300.0, "generation": 2,
                                               "in_fetch": True}]


def test_a_rank_that_collects_alone_is_first_the_collections_then_a_smaller_straggler():
    fixture = FIXTURES / "cpu_gc_one_rank_2rank"
    passes = _window_passes(fixture)
    assert {r: [s for s, _, _ in v] for r, v in passes.items()} == {0: [10, 16], 1: []}
    d = diagnose_paths([fixture])
    assert [f.id for f in d.findings] == ["gc_pause", "straggler"]
    gc, late = d.findings
    assert gc.ranks == (0,) and late.ranks == (0,)
    steps = d.extras["replay"]["critical_path"]["steps"]
    stopped = sum(ms for _, ms, _ in passes[0]) / steps
    m = late.metrics
    # the breakdown books the collections as their own part (gc_ms), not as the rank's host gaps:
    # the reason names both, and the replay (the named rank to the median, the collections kept)
    # gives back about the host gaps' excess, not the wait
    assert m["late_rank_extra_gc_ms"] == pytest.approx(stopped, abs=1.0)
    reason = next(c for c in d.checks if c.id == "straggler").reason
    assert "late from host gaps" in reason and "and from Python garbage collections (+" in reason
    excess = m["late_rank_extra_other_ms"]
    assert excess < 0.5 * stopped
    assert late.recoverable_ms == pytest.approx(excess, abs=0.25 * excess)
    assert late.recoverable_ms < 0.5 * m["own_estimate_ms"]
    # its fix is the host gaps' (the collections' is gc_pause's, first)
    assert late.fix.startswith("Look for work outside the profiled ops on rank 0")
    rank0 = [b for b in d.breakdown if b.rank == 0]
    assert sum(b.gc_ms for b in rank0) / len(rank0) == pytest.approx(stopped, rel=0.05)


@pytest.mark.parametrize("fixture", [IN_FETCH, FIXTURES / "cpu_uneven_2rank"])
def test_waits_the_collections_do_not_explain_are_not_put_on_them(fixture):
    """Passes inside fetches (the DataLoader's, not a peer's wait) and uneven work without passes:
    the straggler's passing reason stays jitter or uneven work."""
    d = diagnose_paths([fixture])
    for c in d.checks:
        assert "stopped in garbage collections" not in c.reason, (c.id, c.reason)
    straggler = next(c for c in d.checks if c.id == "straggler")
    assert "uneven work: the load_imbalance check judges which" in straggler.reason
