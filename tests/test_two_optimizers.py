"""Steps without ProfilerStep#N: one step an iteration, however many optimizers it steps.

A trace recorded with a plain `profile()` (no schedule, no prof.step()) has no ProfilerStep#N;
its steps are taken between the ends of the Optimizer.step spans. A job that steps two optimizers
an iteration has two such spans an iteration: read as two steps, every ms per step was halved.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from diagnose.ingest.load import load_trace
from diagnose.pipeline import diagnose_paths
from diagnose.step.timeline import find_steps, iteration_ends

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURE = FIXTURES / "cpu_two_optimizers_2rank"
GAN = FIXTURES / "cpu_gan_2rank"
SLEEP_MS = 150.0
"""What rank 1 sleeps an iteration in both fixtures (their READMEs)."""


def _ends(spans, backward, names=None, inner=None):
    end = np.array([e for _, e in spans], dtype=float)  # spans as (start, end), sorted by start
    names = np.array(names or ["Optimizer.step#SGD.step"] * len(spans))
    return iteration_ends(end, np.array(sorted(backward), dtype=float), names, None if inner is None else np.array(inner))


def test_two_optimizers_back_to_back_end_one_iteration():
    # backward at 10, 110, 210; SGD then Adam after each
    ends, said = _ends([(50, 60), (61, 70), (150, 160), (161, 170), (250, 260), (261, 270)], [10, 110, 210],
                       ["Optimizer.step#SGD.step", "Optimizer.step#Adam.step"] * 3)
    assert ends.tolist() == [70, 170, 270]
    assert "2 optimizer steps an iteration" in said and "Adam.step" in said and "SGD.step" in said


def test_one_optimizer_each_span_ends_a_step():
    ends, said = _ends([(50, 60), (150, 160), (250, 260)], [10, 110, 210])
    assert ends.tolist() == [60, 160, 260] and said == ""


def test_a_wrapper_and_the_optimizer_it_steps_are_one_step():
    # an optimizer wrapper records its inner optimizer's step inside its own span
    ends, _ = _ends([(50, 80), (55, 75), (150, 180), (155, 175)], [10, 110])
    assert ends.tolist() == [80, 180]


def test_a_closure_holding_its_own_backward_stays_a_step_each():
    # optimizer.step(closure): forward and backward inside the span
    ends, said = _ends([(0, 90), (100, 190), (200, 290)], [40, 140, 240])
    assert ends.tolist() == [90, 190, 290] and said == ""


def test_accumulated_micro_batches_still_end_at_the_optimizer_step():
    ends, _ = _ends([(80, 90), (180, 190)], [10, 40, 70, 110, 140, 170])
    assert ends.tolist() == [90, 190]


def test_without_any_backward_op_each_span_ends_a_step():
    ends, said = _ends([(50, 60), (61, 70), (150, 160)], [])
    assert ends.tolist() == [60, 70, 160] and said == ""


@pytest.mark.parametrize("rank", [0, 1])
def test_the_recorded_job_has_one_step_an_iteration(rank):
    trace = load_trace(next(FIXTURE.glob(f"rank{rank}.*")))
    steps, source, warnings = find_steps(trace.events)
    assert source == "optimizer_step"
    assert len(steps) == 5  # six iterations recorded: five steps between their ends
    assert any("2 optimizer steps an iteration" in w for w in warnings)


def test_the_straggler_costs_its_sleep_per_step_not_half_of_it():
    d = diagnose_paths([FIXTURE])
    assert d.run.steps_analysed == 5 and d.run.step_source == "optimizer_step"
    top = d.findings[0]
    assert top.id == "straggler" and top.ranks == (1,)
    # the sleep is the floor of each step's cost; read as two steps an iteration it was 69 ms
    assert 0.8 * SLEEP_MS <= top.recoverable_ms <= 1.3 * SLEEP_MS
    assert min(d.run.mean_step_ms.values()) > SLEEP_MS


def test_two_optimizers_each_after_its_own_backward_are_one_iteration_a_cycle():
    # a GAN: D's backward and step (156 ops), then G's (208 ops), three iterations
    spans = [(50, 60), (150, 160), (250, 260), (350, 360), (450, 460), (550, 560)]
    ends, said = _ends(spans, [10, 110, 210, 310, 410, 510], ["Optimizer.step#Adam.step"] * 6,
                       [156, 208] * 3)
    assert ends.tolist() == [160, 360, 560]
    assert said.startswith("2 optimizer steps an iteration, each after its own backward")


def test_a_cycle_cut_by_the_window_is_dropped():
    spans = [(50, 60), (150, 160), (250, 260), (350, 360), (450, 460)]
    ends, _ = _ends(spans, [10, 110, 210, 310, 410], ["Optimizer.step#Adam.step"] * 5, [156, 208, 156, 208, 156])
    assert ends.tolist() == [160, 360]


def test_one_optimizer_between_alternating_tasks_keeps_a_step_each():
    # the same optimizer (the same ops each step) after two tasks' backwards in turn
    spans = [(50, 60), (150, 160), (250, 260), (350, 360)]
    ends, said = _ends(spans, [10, 110, 210, 310], inner=[40, 40, 40, 40])
    assert ends.tolist() == [60, 160, 260, 360] and said == ""


def test_steps_that_do_not_repeat_exactly_stay_steps():
    # an optimizer's first step makes its state (more ops), then steps as the others
    spans = [(50, 60), (150, 160), (250, 260), (350, 360)]
    ends, _ = _ends(spans, [10, 110, 210, 310], inner=[90, 40, 40, 41])
    assert ends.tolist() == [60, 160, 260, 360]


def test_the_recorded_gan_has_one_step_an_iteration():
    d = diagnose_paths([GAN])
    assert d.run.steps_analysed == 5 and d.run.step_source == "optimizer_step"
    assert any("each after its own backward" in w for w in d.warnings)
    top = d.findings[0]
    assert top.id == "straggler" and top.ranks == (1,)
    assert 0.8 * SLEEP_MS <= top.recoverable_ms <= 1.3 * SLEEP_MS
