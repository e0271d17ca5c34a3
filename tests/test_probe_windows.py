"""The probe's profiler windows: as many as scheduled, no profiler after them, and each ends only
after gloo's thread has finished the collectives it recorded (probes/inflight.py says why: a late
end of a `gloo:*` event writes into the stopped profiler's freed memory). In process, on a real
gloo group of one rank."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from diagnose.probes import inflight, patches
from diagnose.probes.core import Probe, Schedule


def _train_ddp(probe: Probe, parts, module, width: int, steps: int, each=lambda: None) -> None:
    """`steps` optimizer steps of a DDP-wrapped `module` (inputs `width` wide) with the probe's hooks `parts` installed
    (as `diagnose run` installs them), then the probe closed and the hooks removed."""
    undo = [part(probe) for part in parts]
    try:
        model = torch.nn.parallel.DistributedDataParallel(module)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(steps):
            model(torch.randn(8, width)).sum().backward()
            opt.step()
            opt.zero_grad()
            each()
        probe.close()
    finally:
        for u in undo:
            if u:
                u()


def test_the_window_ends_after_the_ddp_all_reduces_it_recorded_have_finished(tmp_path, gloo_world_of_one):
    from torch import nn

    probe = Probe(tmp_path, rank=0, world_size=1, schedule=Schedule.parse("1,0,2,1"), strict_dir=False)
    # what each settle found to wait for, and whether the profiler was still recording then
    seen: list[tuple[int, bool]] = []
    settle = probe._inflight.settle

    def spy(*a, **k):
        seen.append((len(probe._inflight._works), torch.autograd.profiler._is_profiler_enabled))
        return settle(*a, **k)

    probe._inflight.settle = spy
    _train_ddp(probe, (patches._optimizer, patches._collectives, patches._ddp),
               nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4)), 64, steps=6)
    assert not probe._failed, probe._failed
    assert probe._traces_written == 1
    # at the window's end, with the profiler still on: the recorded steps' bucket all-reduces;
    # then once more as the probe lets its profiler go (nothing recorded since)
    assert len(seen) == 2, seen
    n, enabled = seen[0]
    assert enabled
    assert n >= 2, seen  # two steps recorded, a bucket each at least
    # after the window nothing is kept: the light mode holds no work handle
    assert len(probe._inflight._works) == 0
    assert probe._inflight.unsettled == 0 and "unsettled_windows" not in probe.meta


@pytest.mark.parametrize("schedule, windows", [("1,1,2", 1), ("0,1,1,3", 3)])
def test_after_its_windows_the_probe_never_profiles_again(tmp_path, gloo_world_of_one, monkeypatch, schedule,
                                                        windows):
    """Each step hook asks for a profiler; until 2026-12-06 a new one was started after the last
    window, at every step to the job's end (16 profilers in 20 steps of schedule 1,1,2)."""
    from torch import nn

    started = []
    start = torch.profiler.profile.start
    monkeypatch.setattr(torch.profiler.profile, "start", lambda self: (started.append(self), start(self))[1])
    probe = Probe(tmp_path, rank=0, world_size=1, schedule=Schedule.parse(schedule), strict_dir=False)
    busy = []
    _train_ddp(probe, (patches._optimizer, patches._ddp), nn.Linear(16, 4), 16, steps=20,
               each=lambda: busy.append(probe.profiler_busy()))
    assert not probe._failed, probe._failed
    assert probe._traces_written == windows
    assert len(started) == 1
    last = max(i for i, b in enumerate(busy) if b)
    assert busy[:last + 1] == [True] * (last + 1) and not any(busy[last + 1:]), busy
    assert last < 12, busy


def test_only_cpu_works_issued_while_recording_are_kept(tmp_path, gloo_world_of_one):
    import torch.distributed as dist

    probe = Probe(tmp_path, rank=0, world_size=1, schedule=Schedule.parse("0,0,1,1"), strict_dir=False)
    undo = patches._collectives(probe)
    try:
        dist.all_reduce(torch.ones(4), async_op=True).wait()  # no profiler yet: not kept
        assert len(probe._inflight._works) == 0
        probe.start_profiler()
        work = dist.all_reduce(torch.ones(4), async_op=True)
        dist.all_reduce(torch.ones(4))  # synchronous: wait() returned after gloo's finish()
        assert list(probe._inflight._works) == [work]
        probe.close()
    finally:
        undo()
    assert len(probe._inflight._works) == 0


class _Running:
    """A work still in flight when the window ends (a collective no peer has joined)."""

    def is_completed(self) -> bool:
        return False


class _Done:
    def __init__(self) -> None:
        self.asked = 0

    def is_completed(self) -> bool:
        self.asked += 1
        return True


def test_a_work_still_running_delays_the_window_end_a_bounded_time_only():
    f = inflight.InFlight()
    done = _Done()
    f.add(done)
    f.add(_Running())
    assert f.settle(timeout_s=0.05) is False
    assert f.unsettled == 1
    assert done.asked == 1
    assert f.settle(timeout_s=0.05) is True  # forgotten: the next window starts clean


def test_finished_works_are_dropped_as_more_arrive():
    f = inflight.InFlight(limit=100)
    for _ in range(500):
        f.add(_Done())
    assert len(f._works) <= 64
    running = [_Running() for _ in range(150)]
    for w in running:
        f.add(w)
    assert len(f._works) == 100  # bounded even when none has finished
