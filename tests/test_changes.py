"""When did the job get slow: change points over the whole run (diagnose/step/changes.py) and the
fail_slow finding, on recorded light-mode runs (tests/fixtures/light_failslow) checked against
their raw step records."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from diagnose.analyzers import fail_slow
from diagnose.cli import main
from diagnose.probedata import load_probe_data
from diagnose.step.changes import change_points, run_changes
from diagnose.thresholds import DEFAULT

FIX = Path(__file__).parent / "fixtures" / "light_failslow"
FAULT_STEP = 150  # --slow-from-step of the recordings (README)


def raw_steps(name: str, rank: int) -> list[dict]:
    rows = [json.loads(x) for x in (FIX / name / f"rank{rank}.steps.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] >= 1]  # step 0 is the warm-up: the probes' own rule


def events(name: str):
    return run_changes(load_probe_data([FIX / name]), DEFAULT.fail_slow_min_segment, DEFAULT.fail_slow_effect)


def test_a_steady_run_has_no_change():
    assert events("steady") == ()


def test_one_rank_computing_more_is_found_at_its_step():
    (e,) = events("rank")
    assert abs(e.step - FAULT_STEP) <= 3 and e.cause == "compute_ms" and e.ranks == (1,) and e.place == "rank 1"
    # independently, from the raw records: the job's step before and after, the median over ranks
    # of each rank's median step over the segment
    def job(keep):
        return statistics.median(statistics.median(s["dur_ms"] for s in raw_steps("rank", r) if keep(s["step"]))
                                 for r in (0, 1))
    before, after = job(lambda k: k < e.step), job(lambda k: k >= e.step)
    assert (e.step_before_ms, e.step_after_ms) == (pytest.approx(before), pytest.approx(after))
    # rank 1's compute (step - DataLoader - communication) moved by about the injected 20 ms
    comp = [s["dur_ms"] - s["dataloader_ms"] - s["comm_ms"] for s in raw_steps("rank", 1)]
    steps = [s["step"] for s in raw_steps("rank", 1)]
    delta = (statistics.median(c for c, k in zip(comp, steps) if k >= e.step)
             - statistics.median(c for c, k in zip(comp, steps) if k < e.step))
    assert e.cause_delta_ms == pytest.approx(delta, abs=0.5) and 15 < delta < 30
    # the waiting rank's communication grew with it: a consequence, not named as the cause
    assert any(c.rank == 0 and c.component == "comm_ms" and c.delta_ms > 10 for c in e.changes)


def test_a_slower_input_pipeline_on_every_rank_is_shared_infrastructure():
    (e,) = events("loader")
    assert abs(e.step - FAULT_STEP) <= 3 and e.cause == "dataloader_ms" and set(e.ranks) == {0, 1}
    assert e.place == "every rank" and "shared infrastructure" in fail_slow.describe(e)
    for r in (0, 1):
        rows = raw_steps("loader", r)
        late = statistics.median(s["dataloader_ms"] for s in rows if s["step"] >= e.step)
        early = statistics.median(s["dataloader_ms"] for s in rows if s["step"] < e.step)
        assert late - early > 15  # 64 samples x 0.3 ms: 19.2 ms of sleep, more with the host's timer slack


def test_the_fail_slow_finding_on_a_run_directory():
    from diagnose.analyzers.fail_slow import analyze
    from tests.conftest import fixture_run
    from diagnose.context import build_context

    run = fixture_run(Path(__file__).parent / "fixtures" / "cpu_checkpoint_2rank")  # any real 2-rank trace set
    for name, flagged in (("rank", True), ("loader", True), ("steady", False)):
        (c,) = analyze(build_context(run, load_probe_data([FIX / name])), DEFAULT)
        assert (c.status == "flagged") == flagged, (name, c.reason)
        if flagged:
            f = c.finding
            (e,) = events(name)
            assert f.recoverable_ms == pytest.approx(e.lost_ms, abs=1e-3) and f.ranks == e.ranks
            assert f.share_of_step == pytest.approx(e.lost_ms / e.step_after_ms, abs=1e-4)
            assert f.metrics["change_step"] == e.step and f.metrics["cause_component"] == e.cause
    (c,) = analyze(build_context(run, {}), DEFAULT)
    assert c.status == "not_measurable" and "diagnose run" in c.reason


def test_the_changes_command_reads_a_run_directory():
    res = CliRunner().invoke(main, ["changes", str(FIX / "rank")])
    assert res.exit_code == 0, res.output
    assert "rank 1, compute +" in res.output and "from step 1" in res.output
    res = CliRunner().invoke(main, ["changes", str(FIX / "steady")])
    assert "none: the job ran at one speed" in res.output


@pytest.mark.parametrize("seed", range(5))
def test_change_points_on_hand_made_levels(seed):
    """A level shift of 30% after noise is found where it is; a bump of 15 steps, isolated spikes
    (a checkpoint, a GC pause) and shifts under the minimum are not."""
    rng = np.random.default_rng(seed)
    x = np.r_[100 + rng.normal(0, 5, 200), 130 + rng.normal(0, 5, 150)]
    (cut,) = change_points(x, 20, 20.0)
    assert abs(cut - 200) <= 3
    y = 100 + rng.normal(0, 5, 400)
    y[100:115] += 40
    y[::60] += 500
    assert change_points(y, 20, 20.0) == []
    assert change_points(np.r_[100 + rng.normal(0, 2, 200), 115 + rng.normal(0, 2, 200)], 20, 20.0) == []
    two = np.r_[100 + rng.normal(0, 3, 150), 160 + rng.normal(0, 3, 150), 100 + rng.normal(0, 3, 150)]
    assert [abs(c - e) <= 3 for c, e in zip(change_points(two, 20, 20.0), (150, 300))] == [True, True]


def test_block_medians_are_the_medians_of_each_five_steps():
    """The min/max network against numpy's median, with ties and a trailing partial block."""
    from diagnose.step.changes import BLOCK, _block_medians

    rng = np.random.default_rng(7)
    for x in (rng.normal(0, 1, 503), rng.integers(0, 3, 1000).astype(float), np.arange(10.0)[::-1]):
        m = len(x) // BLOCK
        np.testing.assert_array_equal(_block_medians(x), np.median(x[:m * BLOCK].reshape(m, BLOCK), axis=1))


@pytest.mark.parametrize("at", [200, 201, 202, 203, 204])
def test_a_shift_is_placed_on_its_first_step_whatever_its_place_in_a_block(at):
    """The search runs on blocks of five steps; the split is then put on the first step at the
    new level, wherever it falls in its block."""
    rng = np.random.default_rng(at)
    x = np.r_[100 + rng.uniform(-1, 1, at), 140 + rng.uniform(-1, 1, 400 - at)]
    assert change_points(x, 20, 20.0) == [at]
    x[at - 1] = 140.5  # a lone slow step just before the shift: at most that one step earlier
    assert change_points(x, 20, 20.0) in ([at], [at - 1])


def test_events_from_a_source_read_one_rank_at_a_time():
    """find_events reads the ranks through a source it calls once, and a second time only when
    there are events; the result is the same as from the loaded records."""
    from diagnose.step.changes import find_events, rank_series

    probes = load_probe_data([FIX / "rank"])
    calls = []

    def source():
        calls.append(1)
        return rank_series(probes)

    got = find_events(source, DEFAULT.fail_slow_min_segment, DEFAULT.fail_slow_effect)
    assert got == events("rank") and len(got) == 1 and len(calls) == 2
    calls.clear()
    steady = load_probe_data([FIX / "steady"])
    assert find_events(lambda: calls.append(1) or rank_series(steady)) == () and len(calls) == 1


def test_the_whole_run_chart_is_the_raw_steps_bucketed():
    """What the report draws over the whole run (extras.over_time), against the raw records: per
    bucket of steps, each rank's median step and the job's (median over ranks at each step, then
    over the bucket)."""
    from diagnose.step.changes import over_time

    probes = load_probe_data([FIX / "rank"])
    raw = {r: {x["step"]: x["dur_ms"] for x in raw_steps("rank", r)} for r in (0, 1)}
    steps = sorted(set(raw[0]) & set(raw[1]))
    for points in (1000, 50):
        o = over_time(probes, max_points=points)
        n = steps[-1] - steps[0] + 1
        bucket = -(-n // points)
        assert o.bucket == bucket and o.steps[0] == steps[0] and len(o.steps) == -(-n // bucket)
        for i, first in enumerate(o.steps):
            inside = [s for s in steps if first <= s < first + bucket]
            for r in (0, 1):
                assert o.ranks[r][i] == pytest.approx(statistics.median(raw[r][s] for s in inside), abs=1e-3)
            job = statistics.median(statistics.median([raw[0][s], raw[1][s]]) for s in inside)
            assert o.job_ms[i] == pytest.approx(job, abs=1e-3)
    # at most max_ranks lines: the slowest ranks by median step are the ones kept
    slowest = max((0, 1), key=lambda r: statistics.median(raw[r].values()))
    assert list(over_time(probes, max_ranks=1).ranks) == [slowest]
    assert over_time({}) is None


def test_the_rank_by_time_heatmap_is_each_ranks_steps_bucketed_against_the_job():
    """The heatmap's data (extras.over_time.heat) against the raw records: at most HEAT_POINTS
    buckets, each cell a rank's median own time (step less its collectives) over its bucket; the
    chart colours each cell by its distance from the median rank's cell of that bucket, so rank 1,
    slowed from step 150 (its peer waits for it: their steps stay equal), reads hotter after the
    change than before."""
    from diagnose.reports.charts import over_time_heatmap
    from diagnose.step.changes import HEAT_POINTS, over_time

    probes = load_probe_data([FIX / "rank"])
    raw = {r: {x["step"]: x["dur_ms"] - (x["comm_ms"] or 0.0) for x in raw_steps("rank", r)} for r in (0, 1)}
    steps = sorted(set(raw[0]) & set(raw[1]))
    o = over_time(probes)
    n = steps[-1] - steps[0] + 1
    assert o.heat_bucket == -(-n // HEAT_POINTS) and len(o.heat_steps) <= HEAT_POINTS and sorted(o.heat) == [0, 1]
    for i, first in enumerate(o.heat_steps):
        inside = [s for s in steps if first <= s < first + o.heat_bucket]
        for r in (0, 1):
            assert o.heat[r][i] == pytest.approx(statistics.median(raw[r][s] for s in inside), abs=1e-3)
    extra = {"heat": {"bucket_steps": o.heat_bucket, "steps": list(o.heat_steps),
                      "ranks": [{"rank": r, "own_ms": list(v)} for r, v in o.heat.items()]}}
    fig = over_time_heatmap(extra)
    z = fig["data"][0]["z"]
    rank1 = fig["data"][0]["y"].index("rank 1")
    for i in (0, len(o.heat_steps) - 1):  # two ranks: the median is their mean
        mid = (o.heat[0][i] + o.heat[1][i]) / 2
        assert z[rank1][i] == pytest.approx((o.heat[1][i] / mid - 1) * 100, abs=1e-6)
    before = [v for x, v in zip(o.heat_steps, z[rank1]) if x + o.heat_bucket <= FAULT_STEP]
    after = [v for x, v in zip(o.heat_steps, z[rank1]) if x > FAULT_STEP + 10]
    assert statistics.median(after) > statistics.median(before) + 10  # 20 ms more per step, over 10%
    # nothing drawn from one rank, or from a malformed extra (text from a file is untrusted)
    assert over_time_heatmap({"heat": {"steps": [1, 2], "ranks": [{"rank": 0, "own_ms": [1.0, 2.0]}]}}) is None
    assert over_time_heatmap({"heat": "x"}) is None and over_time_heatmap({}) is None


def _fail_slow_check(probes):
    from diagnose.context import build_context
    from tests.conftest import fixture_run

    run = fixture_run(Path(__file__).parent / "fixtures" / "cpu_checkpoint_2rank")  # any real 2-rank trace set
    (c,) = fail_slow.analyze(build_context(run, probes), DEFAULT)
    return c


def test_the_fail_slow_finding_says_when_where_and_how_sure():
    """The finding's words, against the raw record: its title names the step and the two levels,
    the host comes from the sidecars, the confidence follows the steps on either side of the
    change, the method names how the change was found."""
    probes = load_probe_data([FIX / "rank"])
    c = _fail_slow_check(probes)
    f = c.finding
    (e,) = events("rank")
    assert f.title == (f"Fail-slow: the job got slower from step {e.step} ({fail_slow.when(e.wall_s)}), "
                       f"{e.step_before_ms:.1f} -> {e.step_after_ms:.1f} ms per step")
    hosts = {json.loads((FIX / "rank" / f"rank{r}.probe.json").read_text())["meta"]["host"] for r in e.ranks}
    assert f.metrics["hosts"] == ", ".join(sorted(hosts))
    steps = [s["step"] for s in raw_steps("rank", 0)]
    room = min(e.step - min(steps), max(steps) - e.step + 1)
    assert f.confidence == ("high" if room >= 3 * DEFAULT.fail_slow_min_segment else "medium")
    assert "binary segmentation" in f.method and "median over ranks" in f.method
    assert f.method.endswith("(binary segmentation of each rank's step components: diagnose/step/changes.py); "
                             "its share is of the step since the change.")
    assert c.id == f.id == "fail_slow"
    # the figures behind the title, each against the raw record's change
    assert f.metrics["cause_delta_ms"] == round(e.cause_delta_ms, 3) and f.metrics["slowdowns_found"] == 1
    assert f.metrics["steps_recorded"] == len(steps)
    # one rank leads it: not shared infrastructure
    assert e.place == "rank 1" and "shared infrastructure" not in fail_slow.describe(e)
    assert c.reason == fail_slow.describe(e)


def test_fail_slow_needs_the_minimum_steps_on_either_side():
    """Exactly twice the minimum segment of recorded steps is enough to judge; one fewer is not."""
    import dataclasses

    probes = load_probe_data([FIX / "steady"])
    need = 2 * DEFAULT.fail_slow_min_segment
    cut = {r: dataclasses.replace(p, steps=p.steps.iloc[:need]) for r, p in probes.items()}
    assert _fail_slow_check(cut).status == "passed"
    cut = {r: dataclasses.replace(p, steps=p.steps.iloc[:need - 1]) for r, p in probes.items()}
    c = _fail_slow_check(cut)
    assert c.status == "not_measurable" and f"{need - 1} steps recorded" in c.reason


def test_the_fail_slow_confidence_is_high_from_three_minimum_segments_on_either_side():
    """Confidence is high when the record holds at least 3 minimum segments on each side of the
    change; the record cut to exactly that after the change is high, one step fewer is medium."""
    import dataclasses

    probes = load_probe_data([FIX / "rank"])
    (e,) = events("rank")
    need = 3 * DEFAULT.fail_slow_min_segment
    assert e.step - min(s["step"] for s in raw_steps("rank", 0)) >= need  # room before the change

    def cut(last_step):
        return {r: dataclasses.replace(p, steps=p.steps[p.steps["step"] <= last_step]) for r, p in probes.items()}

    at = _fail_slow_check(cut(e.step + need - 1)).finding  # steps e.step .. e.step + need - 1: need of them
    assert at.metrics["change_step"] == e.step and at.confidence == "high"
    short = _fail_slow_check(cut(e.step + need - 2)).finding
    assert short.metrics["change_step"] == e.step and short.confidence == "medium"


def test_a_steady_run_passes_with_its_length_and_nothing_else_said():
    c = _fail_slow_check(load_probe_data([FIX / "steady"]))
    n = len(raw_steps("steady", 0))
    assert c.status == "passed" and c.reason == (
        f"steady over {n} steps on 2 rank(s): no slowdown of {DEFAULT.fail_slow_effect:.0%} of the step or more "
        f"lasting {DEFAULT.fail_slow_min_segment} steps")


def test_a_shared_slowdown_keeps_its_whole_line_and_gets_the_loader_fix():
    """Every rank's DataLoader slowed (the loader recording): the line says when and what before it
    says "shared infrastructure", and the fix is the DataLoader's, not the compute one."""
    probes = load_probe_data([FIX / "loader"])
    c = _fail_slow_check(probes)
    (e,) = [x for x in run_changes(probes, DEFAULT.fail_slow_min_segment, DEFAULT.fail_slow_effect) if x.lost_ms > 0]
    assert e.place == "every rank" and e.cause == "dataloader_ms"
    line = fail_slow.describe(e)
    assert line.startswith(f"from step {e.step} (") and line.endswith(
        "; no rank leads it: shared infrastructure (storage, network, the input pipeline)")
    assert c.finding.fix == fail_slow.FIX["dataloader_ms"]


def test_the_signals_that_moved_are_the_findings_metric():
    """The CPU-hog recording: the finding's signals_moved is the annotation's text, largest first."""
    probes = load_probe_data([FIX / "hog"])
    c = _fail_slow_check(probes)
    (e,) = [x for x in run_changes(probes, DEFAULT.fail_slow_min_segment, DEFAULT.fail_slow_effect) if x.lost_ms > 0]
    assert e.signals and c.finding.metrics["signals_moved"] == "; ".join(
        m.text for m in e.signals[:fail_slow.MAX_SIGNALS])
    assert "CPU busy" in c.finding.metrics["signals_moved"]


def test_a_slowdown_under_a_millisecond_of_the_jobs_step_is_still_one(tmp_path):
    """Any slower step counts as a slowdown however small (the effect floors decide what is a
    change): one rank's compute +1.5 ms on a 3 ms step while its peer's step stays, so the job's
    step (the median over the two ranks) moves by 0.75 ms."""
    for r, extra in ((0, 0.0), (1, 1.5)):
        rows = [{"step": s, "start": 1000.0 + s * 0.01, "dur_ms": 3.0 + (extra if s >= 150 else 0.0)
                 + 0.01 * (s % 3), "dataloader_ms": 0.1, "comm_ms": 0.2, "collectives": []} for s in range(1, 300)]
        (tmp_path / f"rank{r}.steps.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
        (tmp_path / f"rank{r}.probe.json").write_text(json.dumps({"meta": {"rank": r, "world_size": 2}}))
    probes = load_probe_data([tmp_path])
    (e,) = run_changes(probes, DEFAULT.fail_slow_min_segment, DEFAULT.fail_slow_effect)
    assert 0 < e.lost_ms < 1.0
    c = _fail_slow_check(probes)
    assert c.finding is not None and c.finding.recoverable_ms == round(e.lost_ms, 3)


def test_longer_collectives_on_some_ranks_name_the_rank_they_wait_for():
    """The hog_comm recording: a CPU hog on rank 1's core slowed its gloo transfers more than its
    compute. From the raw records: rank 0's communication grew by far the most, rank 1's compute by
    less than the floor. The event names rank 1 (waited for), rank 0 as the one waiting, and
    rank 1's CPU load, which moved with it."""
    rec = {r: [json.loads(x) for x in (FIX / "hog_comm" / f"rank{r}.steps.jsonl").read_text().splitlines()]
           for r in (0, 1)}

    def med(r, key, lo, hi):
        return statistics.median(key(x) for x in rec[r] if lo <= x["step"] < hi)

    comm = {r: med(r, lambda x: x["comm_ms"], 130, 240) - med(r, lambda x: x["comm_ms"], 20, 120) for r in (0, 1)}
    own1 = med(1, lambda x: x["dur_ms"] - x["comm_ms"], 130, 240) - med(1, lambda x: x["dur_ms"] - x["comm_ms"], 20, 120)
    step = med(1, lambda x: x["dur_ms"], 20, 120)
    assert comm[0] > 2 * comm[1] and comm[0] > DEFAULT.fail_slow_effect * step > own1
    (e,) = run_changes(load_probe_data([FIX / "hog_comm"]), DEFAULT.fail_slow_min_segment, DEFAULT.fail_slow_effect)
    assert abs(e.step - 120) <= 3 and e.cause == "comm_ms" and e.ranks == (1,) and e.waiting == (0,)
    assert e.place == "rank 1" and e.cause_delta_ms == pytest.approx(comm[0], rel=0.2)
    line = fail_slow.describe(e)
    assert "rank 1, the others wait for it at collectives (communication +" in line and "on rank(s) 0;" in line
    assert any(m.rank == 1 and m.signal == "cpu_busy" for m in e.signals) and "shared infrastructure" not in line
    f = _fail_slow_check(load_probe_data([FIX / "hog_comm"])).finding
    assert f.ranks == (1,) and f.fix == fail_slow.FIX_WAITED_FOR
