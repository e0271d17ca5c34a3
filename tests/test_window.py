"""The profiled window set against the run (diagnose/step/window.py).

Every figure of the checks is a mean over the few profiled steps. A window that caught the run's
one evaluation (tests/fixtures/cpu_window_unlike_run_2rank: steps 47-51, the evaluation after step
50) describes that evaluation, and until 2026-12-07 nothing said so: the verdict read as the run's.
The probes time every step, so the analysis now sets the window against the rest of the run and
says so beside the verdict; here that comparison is recomputed from the raw files."""
from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

import pytest

from diagnose.output import diagnosis_dict, terminal_summary
from diagnose.pipeline import diagnose_paths
from diagnose.step.window import WINDOW_UNLIKE_RUN
from reports.html import render

FIXTURES = Path(__file__).parent / "fixtures"
UNLIKE = FIXTURES / "cpu_window_unlike_run_2rank"


def _raw(d: Path, rank: int) -> tuple[list[int], float, float]:
    """(step numbers inside the trace, their mean step, the other steps' mean), from the files alone."""
    with gzip.open(next(d.glob(f"rank{rank}.*.pt.trace.json.gz"))) as f:
        body = json.load(f)
    base_us = body["baseTimeNanoseconds"] / 1000
    ev = [e for e in body["traceEvents"] if e.get("ph") == "X"]
    lo, hi = min(e["ts"] for e in ev) + base_us, max(e["ts"] + e["dur"] for e in ev) + base_us
    steps = [json.loads(line) for line in (d / f"rank{rank}.steps.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["step"] > 0]  # step 0 is the start-up, never in the record
    inside = [s for s in steps if lo - 1000 <= s["start"] * 1e6 and s["start"] * 1e6 + s["dur_ms"] * 1e3 <= hi + 1000]
    others = [s for s in steps if s not in inside]
    mean = lambda xs: sum(s["dur_ms"] for s in xs) / len(xs)
    return [s["step"] for s in inside], mean(inside), mean(others)


def _raw_medians(d: Path, rank: int) -> tuple[float, float]:
    inside, _, _ = _raw(d, rank)
    steps = [json.loads(line) for line in (d / f"rank{rank}.steps.jsonl").read_text().splitlines()]
    w = [s["dur_ms"] for s in steps if s["step"] in inside]
    o = [s["dur_ms"] for s in steps if s["step"] > 0 and s["step"] not in inside]
    return statistics.median(w), statistics.median(o)


def test_a_window_that_caught_the_runs_evaluation_says_so_beside_the_verdict():
    d = diagnose_paths([UNLIKE])
    w = d.extras["window"]
    raw = [_raw(UNLIKE, r) for r in (0, 1)]
    assert [s for s, _, _ in raw] == [list(range(47, 52))] * 2 and w["window_steps"] == [47, 51]
    # two ranks: the median of two is their mean
    window = sum(m for _, m, _ in raw) / 2
    run = sum(o for _, _, o in raw) / 2
    assert w["window_step_ms"] == pytest.approx(window, abs=1e-3) and w["run_step_ms"] == pytest.approx(run, abs=1e-3)
    assert w["ratio"] == pytest.approx(window / run, abs=1e-3) and w["unlike"] is True and w["ratio"] > 3
    # the evaluation's step, named; and the profiler's own cost on these 12 ms steps: the window's
    # median step is itself 1.7x the run's (its four other steps 11-24 ms against 11.6)
    assert "outliers" in w["kinds"] and w["slowest_step"] == 50 and w["slowest_ms"] > 300
    med = [_raw_medians(UNLIKE, r) for r in (0, 1)]
    assert w["window_median_ms"] == pytest.approx(sum(m for m, _ in med) / 2, abs=1e-3)
    assert w["run_median_ms"] == pytest.approx(sum(o for _, o in med) / 2, abs=1e-3)
    assert "shifted" in w["kinds"] and 1.25 < w["median_ratio"] < w["ratio"]
    summary = terminal_summary(d)
    verdict_block = summary.split("\n\n")[0]
    assert "caution: the profiled steps 47-51 ran at a median" in verdict_block, summary
    assert "; step 50 at " in verdict_block and "profile at a typical time" in verdict_block, summary
    assert any(x.startswith("the profiled steps 47-51 ran at a median") for x in d.warnings)
    page = render(diagnosis_dict(d))
    assert "Caution: the profiled steps 47-51 ran at a median" in page


@pytest.mark.parametrize("fixture", ["cpu_eval_in_loop_2rank", "cpu_tiny_buckets_2rank"])
def test_a_run_of_few_more_steps_than_its_window_is_not_compared(fixture):
    """12 steps, 5 profiled: 6 others are too few to stand for the run."""
    d = diagnose_paths([FIXTURES / fixture])
    assert "window" not in d.extras and "caution" not in terminal_summary(d)


def test_a_typical_window_is_compared_and_not_flagged():
    d = diagnose_paths([FIXTURES / "gpu_h200" / "none_long_timed"])
    w = d.extras["window"]
    assert w["window_steps"] == [252, 256] and abs(w["ratio"] - 1) < WINDOW_UNLIKE_RUN and w["unlike"] is False
    assert "caution" not in terminal_summary(d) and "Caution:" not in render(diagnosis_dict(d))


def test_host_timed_steps_of_a_gpu_job_are_not_compared():
    """none_long: the probes timed only the host, which ran ahead of its device (2.6 ms host steps
    in the window, 10.4 ms over the run as the launch queue filled, a 12.7 ms job throughout)."""
    assert "window" not in diagnose_paths([FIXTURES / "gpu_h200" / "none_long"]).extras


def test_no_cause_found_from_an_unusual_window_says_so_too():
    """"Nothing found" is the verdict an unusual window misleads most with (the steps before a
    slowdown): the caution sits beside it as beside a cause."""
    from dataclasses import replace

    d = replace(diagnose_paths([UNLIKE]), findings=())
    summary = terminal_summary(d)
    assert summary.startswith("VERDICT: no significant cause found")
    assert "\n  caution: the profiled steps 47-51 ran at a median" in summary.split("\n\n")[0], summary
    assert "Caution: the profiled steps 47-51" in render(diagnosis_dict(d))
