"""Python garbage collection pauses, from the probes' every-step record.

A rank whose collector makes a full pass over a large heap stops for hundreds of ms at steps of
its own, while the others wait for it at the next collective; a profiled window of five steps
rarely holds one. Until 2026-12-07 such a job read "no significant cause found". The probes time
every collection (gc.callbacks); the gc_pause check sizes the full passes over the run.

tests/fixtures/cpu_gc_pauses_2rank and its fixed twin cpu_gc_every_2rank (READMEs there)."""
from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from diagnose.analyzers.gc_pause import ID, TITLE
from diagnose.pipeline import diagnose_paths

FIXTURES = Path(__file__).parent / "fixtures"
PAUSES = FIXTURES / "cpu_gc_pauses_2rank"
EVERY = FIXTURES / "cpu_gc_every_2rank"


def _raw(fixture: Path) -> dict[int, dict[int, dict]]:
    """Each rank's step records as written, by step (the warm-up step 0 left out, as the loader does)."""
    out = {}
    for path in fixture.glob("rank*.steps.jsonl"):
        rank = int(path.name[4:].split(".")[0])
        out[rank] = {r["step"]: r for r in map(json.loads, path.read_text().splitlines()) if r["step"] > 0}
    return out


def _check(d):
    return next(c for c in d.checks if c.id == ID)


def test_full_passes_that_stop_one_rank_at_a_time_rank_first():
    d = diagnose_paths([PAUSES])
    f = d.findings[0]
    assert f.id == ID and f.title == TITLE and f.confidence == "high" and set(f.ranks) == {0, 1}
    raw = _raw(PAUSES)
    steps = sorted(set(raw[0]) | set(raw[1]))
    longest = [max(raw[r].get(s, {}).get("gc_full_ms", 0.0) for r in raw) for s in steps]
    m = f.metrics
    assert f.recoverable_ms == pytest.approx(sum(longest) / len(steps), abs=1e-3)
    passes = {r: [s for s, x in raw[r].items() if x.get("gc_full")] for r in raw}
    assert passes == {0: [12, 27], 1: [11, 27]}  # as the README says the record holds
    assert m["full_passes"] == 4 and m["steps_with_a_full_pass"] == 3 and m["steps_one_rank_alone"] == 2
    assert m["longest_pause_ms"] == pytest.approx(max(longest), abs=1e-3)
    # each is a walk of the million-record heap, far above a busy machine's noise
    assert min(raw[r][s]["gc_full_ms"] for r in raw for s in passes[r]) > 250
    # the record's own step times agree: the run's mean step above its median by about as much
    assert abs(m["mean_beyond_median_step_ms"] - f.recoverable_ms) < 0.25 * f.recoverable_ms
    # none of it in the profiled window: the trace's checks see a healthy job
    assert not any(x.id in ("straggler", "load_imbalance") for x in d.findings)
    assert "one rank collected alone while the others waited" in _check(d).reason
    assert f.fix.startswith("Keep the collector's full passes out of the steps: call gc.freeze()")
    assert "0 objects frozen" in f.fix


def test_the_report_draws_each_ranks_full_passes():
    from diagnose.reports.charts import finding_charts

    d = diagnose_paths([PAUSES])
    f = d.findings[0]
    figs = finding_charts({"id": f.id, "ranks": list(f.ranks), "metrics": f.metrics}, [], {})
    bars = figs[0]
    assert "Full garbage collections per step" in str(bars["layout"]["title"])
    drawn = {x: y for t in bars["data"] for x, y in zip(t["x"], t["y"])}
    assert drawn == {f"rank {r} (flagged)": f.metrics[f"rank{r}_full_pass_ms_per_step"] for r in (0, 1)}


def test_the_fixed_twin_collects_on_every_rank_at_once_and_says_so():
    d = diagnose_paths([EVERY])
    c = _check(d)
    raw = _raw(EVERY)
    for r in raw:
        assert [s for s, x in raw[r].items() if x.get("gc_full")] == [10, 20, 30]
    # what is left, 7.8 ms a step (7%): collecting the recent cycles every ten steps
    assert c.status == "flagged" and c.finding.metrics["steps_one_rank_alone"] == 0
    assert "every rank collected at the same 3 step(s)" in c.reason
    assert c.measured_ms < _check(diagnose_paths([PAUSES])).measured_ms / 2
    assert "already collect at the same steps" in c.finding.fix and "the collector disabled" in c.finding.fix


def test_full_passes_inside_the_profiled_steps_are_named_beside_the_verdict():
    """The window's figures carry a collection as whatever the process was doing when it began:
    the caution says which ran there (the fixture's README: the checks still carry them)."""
    from diagnose.output import terminal_summary
    from diagnose.probedata import load_probe_data
    from diagnose.ingest.assemble import load_run
    from diagnose.step.window import window_mask

    fixture = FIXTURES / "cpu_gc_in_window_2rank"
    d = diagnose_paths([fixture])
    w = d.extras["window"]
    assert "collections" in w["kinds"] and w["unlike"]
    # against the record and the traces' own clock: the full passes whose steps lie in each trace
    run = load_run([fixture])
    inside = []
    for r, p in load_probe_data([fixture]).items():
        s = p.steps
        mask = window_mask(run.traces[r], s) & (s["gc_full_ms"] > 0).to_numpy()
        inside += [[r, int(st), round(float(ms), 3)] for st, ms in zip(s["step"][mask], s["gc_full_ms"][mask])]
    assert sorted(w["collections"]) == sorted(inside) == [[0, 12, 295.951], [1, 11, 292.428]]
    assert "full garbage collections ran inside the profiled steps (rank 0 at step 12: 296 ms; rank 1 at step " \
           "11: 292 ms)" in terminal_summary(d)
    assert any(f.id == ID for f in d.findings)
    # a window without any says nothing of them
    assert "collections" not in diagnose_paths([PAUSES]).extras["window"]["kinds"]


def test_window_figures_that_carry_collections_have_low_confidence():
    d = diagnose_paths([FIXTURES / "cpu_gc_in_window_2rank"])
    assert {f.id: f.confidence for f in d.findings} == {
        "dataloader_starvation": "low", "load_imbalance": "low", "exposed_communication": "low", ID: "high"}


def test_collections_inside_fetches_are_not_the_dataloaders_wait():
    """The probes time the collections that ran inside each fetch: the DataLoader's figure, its own
    and the replay's, is the wait less them (whatif.finding_saving)."""
    from diagnose.probedata import load_probe_data
    from diagnose.step.window import window_mask
    from diagnose.ingest.assemble import load_run

    fixture = FIXTURES / "cpu_gc_in_loader_2rank"
    d = diagnose_paths([fixture])
    assert d.findings[0].id == ID
    f = next(x for x in d.findings if x.id == "dataloader_starvation")
    m = f.metrics
    worst = m["worst_rank"]
    s = load_probe_data([fixture])[worst].steps
    inside = window_mask(load_run([fixture]).traces[worst], s)
    assert m["gc_in_wait_ms"] == pytest.approx(s["dataloader_gc_ms"][inside].mean(), abs=1e-3)
    assert m["gc_in_wait_ms"] > 0.5 * m["dataloader_ms_per_step"]  # one 300 ms pass in five steps
    replayed = d.extras["replay"]["by_cause_ms"]["dataloader_starvation"]  # the DataLoader part whole
    assert m["gc_in_wait_unplaced_ms"] == m["gc_in_wait_ms"]  # recorded before the probes placed passes
    assert f.recoverable_ms == pytest.approx(max(replayed - m["gc_in_wait_unplaced_ms"], 0.0), abs=2e-3)
    assert f.confidence == "low" and "garbage collection inside the fetches" in \
        next(c for c in d.checks if c.id == "dataloader_starvation").reason


def test_a_fix_sized_over_the_run_is_checked_against_every_recorded_step():
    """`diagnose diff` of the pauses and their fix (collections every N steps on every rank): the
    profiled steps held none of the pauses on either side (115.5 -> 113.0 ms), so the prediction is
    set against both runs' every recorded step, where the pauses are (diff.py _prediction)."""
    from diagnose.diff import diff_diagnoses, diff_summary

    before, after = diagnose_paths([PAUSES]), diagnose_paths([EVERY])
    diff = diff_diagnoses(before, after)
    pr, every = diff["prediction"], diff["every_step_ms"]
    assert pr["causes"] == [ID] and pr["measured_over"] == "every recorded step"
    assert pr["measured_saving_ms"] == pytest.approx(every["before"] - every["after"], abs=1e-3)
    assert pr["measured_saving_ms"] > 5 * abs(diff["step_ms"]["change_ms"])  # the window's change, next to nothing
    assert "shorter over every recorded step" in diff_summary(diff)


@pytest.mark.parametrize("fixture", ["cpu_straggler_2rank", "cpu_epoch_starts_2rank"])
def test_records_from_probes_that_timed_no_collections_are_not_measured(fixture):
    c = _check(diagnose_paths([FIXTURES / fixture]))
    assert c.status == "not_measurable" and "timed" in c.reason


def test_traces_without_probes_are_not_measured():
    from tests.conftest import SHARED

    d = diagnose_paths([SHARED / "param_dlrm_8rank_v100"])  # a user's traces, no probes
    assert _check(d).status == "not_measurable"


torch = pytest.importorskip("torch")


def test_the_probe_times_each_collection_and_counts_full_passes(tmp_path):
    """In process: the hook `diagnose run` installs, real collections."""
    from diagnose.probes import patches
    from diagnose.probes.core import Probe, Schedule

    probe = Probe(tmp_path / "probe", rank=0, world_size=1, schedule=Schedule.parse("off"), strict_dir=False)
    undo = patches._gc(probe)
    assert patches._gc(probe) is None  # installed once
    try:
        probe.on_step()  # step 0
        junk = []
        for i in range(50_000):
            a = [i]
            a.append(a)  # a cycle: only the collector frees it
            junk.append(a)
        del junk
        gc.collect()  # one full pass, timed
        gc.collect(0)
        probe.on_step()  # step 1
        gc.collect(1)  # a middle generation's collection: timed, not a full pass
        probe.on_step()  # step 2
    finally:
        undo()
        probe.close()
    assert not any(getattr(cb, "__name__", "") == "timed" for cb in gc.callbacks)
    records = {r["step"]: r for f in (tmp_path / "probe").rglob("rank0.steps.jsonl")
               for r in map(json.loads, f.read_text().splitlines())}
    one = records[1]
    assert one["gc_full"] >= 1 and 0 < one["gc_full_ms"] <= one["gc_ms"]
    assert records[2]["gc_ms"] > 0 and records[2].get("gc_full", 0) == 0
    assert probe.meta["gc"]["timed"] is True and probe.meta["gc"]["threshold"] == list(gc.get_threshold())
    assert "dataloader_gc_ms" not in one  # no fetch in these steps


def test_the_probe_times_collections_inside_fetches(tmp_path):
    from diagnose.probes import patches
    from diagnose.probes.core import Probe, Schedule
    from torch.utils.data import DataLoader

    class Collecting(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            if i == 2:
                gc.collect()  # a full pass that comes due inside a fetch
            return i

    probe = Probe(tmp_path / "probe", rank=0, world_size=1, schedule=Schedule.parse("off"), strict_dir=False)
    undo = [patches._gc(probe), patches._dataloader(probe)]
    try:
        for _ in DataLoader(Collecting(), batch_size=2):
            probe.on_step()
        gc.collect()  # outside any fetch
        probe.on_step()
    finally:
        for u in undo:
            u()
        probe.close()
    records = {r["step"]: r for f in (tmp_path / "probe").rglob("rank0.steps.jsonl")
               for r in map(json.loads, f.read_text().splitlines())}
    assert "dataloader_gc_ms" not in records[0]
    assert 0 < records[1]["dataloader_gc_ms"] <= records[1]["gc_full_ms"] <= records[1]["dataloader_ms"]
    assert records[2]["gc_full"] >= 1 and "dataloader_gc_ms" not in records[2]
    # each full pass placed in its step, marked where it began inside a fetch
    (inside,) = [g for g in records[1]["gc_passes"] if g[2] == 2]
    assert inside[3] == 1 and 0 <= inside[0] <= inside[0] + inside[1] <= records[1]["dur_ms"] + 1e-3
    assert inside[1] == pytest.approx(records[1]["gc_full_ms"], abs=1e-3)
    (outside,) = [g for g in records[2]["gc_passes"] if g[2] == 2]
    assert outside[3] == 0 and 0 <= outside[0] <= records[2]["dur_ms"]
    assert probe.meta["gc"]["placed"] is True and probe.fetching == 0
