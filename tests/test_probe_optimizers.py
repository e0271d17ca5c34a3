"""Steps marked by optimizer.step() when a job steps several optimizers, or replaces one part way.

Until 2026-12-07 the first optimizer a job stepped marked every step for the rest of the run: a
job that switched to a new Adam at step 10 of 40 (a second stage) had 10 steps recorded, the
profiler's window stepped by nothing after the switch, and the memory check sized the old SGD's
state (none) for the job's Adam. In process, real models and optimizers, the hooks installed as
`diagnose run` installs them (patches._optimizer, patches._memory)."""
from __future__ import annotations

import gc
import json

import pytest
from diagnose.probes.optimizers import TAKEOVER, StepMarker


class Opt:
    """Any object stands for an optimizer here: the marker only tells them apart."""


def _marks(marker: StepMarker, order) -> list[bool]:
    return [marker.on_step(o)[0] for o in order]


def test_one_optimizer_marks_every_step():
    a = Opt()
    assert _marks(StepMarker(), [a] * 5) == [True] * 5


def test_a_gan_marks_each_iteration_once_whichever_steps_first():
    d, g = Opt(), Opt()
    assert _marks(StepMarker(), [d, g] * 6) == [True, False] * 6
    # three optimizers stepped once an iteration, in any fixed order: one mark an iteration
    a, b, c = Opt(), Opt(), Opt()
    assert sum(_marks(StepMarker(), [a, b, c] * 10)) == 10


def test_a_critic_stepped_five_times_a_generator_step_takes_the_mark_once_and_keeps_it():
    critic, gen = Opt(), Opt()
    got = _marks(StepMarker(), [gen] + ([critic] * 5 + [gen]) * 8)
    # the generator marks first; the critic's second step in a row takes the mark; from then on
    # every critic step ends a step and the generator's single steps never take it back
    assert got == [True] + [False, True, True, True, True, False] + ([True] * 5 + [False]) * 7


def test_a_replaced_optimizer_passes_the_mark_on_and_is_retired():
    old, new = Opt(), Opt()
    m = StepMarker()
    assert _marks(m, [old] * 3) == [True] * 3
    got = [m.on_step(new) for _ in range(4)]
    # kept alive (a scheduler holds it): the new one takes over at its TAKEOVER-th step
    assert [e for e, _ in got] == [False] * (TAKEOVER - 1) + [True] * (5 - TAKEOVER)
    assert got[TAKEOVER - 1][1] == m.number(old) == 0 and m.number(new) == 1
    # freed: the next optimizer to step marks at once
    m2, first = StepMarker(), Opt()
    m2.on_step(first)
    del first
    gc.collect()
    assert m2.on_step(Opt()) == (True, 0)


def test_numbers_are_not_reused_when_ids_are():
    m = StepMarker()
    seen = set()
    for _ in range(5):
        o = Opt()
        seen.add(m.number(o))
        del o
    assert seen == {0, 1, 2, 3, 4}


torch = pytest.importorskip("torch")

from diagnose.probes import patches
from diagnose.probes.core import Probe, Schedule

from diagnose.analyzers.memory import _rank_memory


@pytest.fixture
def probe(tmp_path):
    p = Probe(tmp_path / "probe", rank=0, world_size=1, schedule=Schedule.parse("off"), strict_dir=False)
    undo = [patches._optimizer(p), patches._memory(p)]
    yield p
    for u in undo:
        if u:
            u()


def _stage_switch(steps: int, at: int, keep: bool) -> None:
    from torch import nn

    model = nn.Linear(16, 16)
    opt, kept = torch.optim.SGD(model.parameters(), lr=0.01), []
    for i in range(steps):
        if i == at:  # a second stage: a new optimizer over the same parameters
            if keep:
                kept.append(opt)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("keep", [False, True])
def test_a_job_that_replaces_its_optimizer_records_every_step_after(probe, keep):
    _stage_switch(40, 10, keep)
    # freed at once (CPython's reference count): no step lost; kept alive: the switch's first
    # TAKEOVER - 1 steps run into one recorded step
    assert probe.step == (40 - (TAKEOVER - 1) if keep else 40)
    facts = {o["optimizer"]: o for o in probe.meta["optimizers"]}
    assert facts["SGD"]["retired_at_step"] == 10 and "retired_at_step" not in facts["Adam"]
    measured = {o["optimizer"]: o for o in probe.meta["memory_tensors"]}
    assert "retired_at_step" in measured["SGD"] and measured["Adam"]["state_bytes"] > 0
    # the memory check reads the job's Adam, not the SGD it left
    mem = _rank_memory(0, json.loads(json.dumps(probe.meta)))
    assert mem.optimizer == "Adam" and mem.state == measured["Adam"]["state_bytes"]
    assert mem.weights == measured["Adam"]["param_bytes"]


def test_a_gan_records_one_step_an_iteration(probe):
    from torch import nn

    gen, disc = nn.Linear(8, 8), nn.Linear(8, 1)
    og, od = torch.optim.Adam(gen.parameters()), torch.optim.Adam(disc.parameters())
    for _ in range(12):
        disc(gen(torch.randn(4, 8)).detach()).mean().backward()
        od.step()
        od.zero_grad()
        (-disc(gen(torch.randn(4, 8)))).mean().backward()
        og.step()
        og.zero_grad()
    assert probe.step == 12
    mem = _rank_memory(0, json.loads(json.dumps(probe.meta)))
    assert mem.params == sum(p.numel() for p in [*gen.parameters(), *disc.parameters()])
