"""A job that runs its own torch.profiler under the probes: the probe's profiler stands aside.

torch records one profiler at a time. Until 2026-12-06 `diagnose run` of a script with its own
profiler killed the job ("Profiler is already enabled on this thread", raised into the script's
`prof.step()`), and a profiler the job had started put its ProfilerStep#N markers into the
probe's trace. In process, real profilers, a real model and optimizer; the hooks installed as
`diagnose run` installs them (patches._job_profiler, patches._optimizer)."""
from __future__ import annotations

import gzip
import json
import logging
import os

import pytest

torch = pytest.importorskip("torch")

from diagnose.probes import patches
from diagnose.probes.core import Probe, Schedule


@pytest.fixture
def hooked(tmp_path):
    """A probe with the job-profiler and optimizer-step hooks of `diagnose run`, removed after."""
    made = []

    def make(schedule: str) -> Probe:
        probe = Probe(tmp_path / "probe", rank=0, world_size=1, schedule=Schedule.parse(schedule), strict_dir=False)
        made.append([patches._job_profiler(probe), patches._optimizer(probe)])
        return probe

    yield make
    for undo in made:
        for u in undo:
            u()


def _train(steps: int, on_step=lambda i: None) -> None:
    from torch import nn

    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(steps):
        model(torch.randn(16, 32)).sum().backward()
        opt.step()  # the probe's step hook: starts and steps its profiler
        opt.zero_grad()
        on_step(i)


def _names(trace_file) -> list[str]:
    opener = gzip.open if str(trace_file).endswith(".gz") else open
    with opener(trace_file, "rt") as f:
        return [e.get("name", "") for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _job_profiler(tmp_path, active: int, wait: int = 0):
    """The job's own profiler, as a script writes it: a schedule, a trace file per window."""
    out = tmp_path / "job"
    out.mkdir(exist_ok=True)
    written = []

    def ready(p):
        path = out / f"job{len(written)}.json"
        p.export_chrome_trace(str(path))
        written.append(path)

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  schedule=torch.profiler.schedule(wait=wait, warmup=0, active=active, repeat=1),
                                  on_trace_ready=ready)
    return prof, written


def test_a_profiler_the_job_starts_mid_window_runs_and_the_probes_stops(tmp_path, hooked, caplog):
    probe = hooked("0,0,8")
    job, written = _job_profiler(tmp_path, active=3)

    def on_step(i):
        if i == 2:
            assert probe._profiler is not None  # the probe's window is recording
            job.start()  # before the fix: the probe's and the job's profilers fought over one slot
        elif i > 2:
            job.step()

    with caplog.at_level(logging.WARNING, logger="diagnose.probes"):
        _train(8, on_step)
    job.stop()
    probe.close()
    assert probe.job_profiler and probe.meta.get("job_profiler") is True
    assert probe._profiler is None and not probe._failed, probe._failed
    assert sum("the job runs its own torch.profiler" in r.getMessage() for r in caplog.records) == 1
    # the job's window recorded its three steps and what ran in them
    assert len(written) == 1
    names = _names(written[0])
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#0", "ProfilerStep#1",
                                                                          "ProfilerStep#2"]
    assert names.count("aten::addmm") >= 3 * 2  # two Linear layers a step
    # the probe's cut window was written as recorded: its own steps (three hooks and the step cut
    # short), none of the job's markers (the same names: they would come twice)
    assert probe._traces_written == 1
    (trace,) = (tmp_path / "probe").glob("rank0.*.pt.trace.json.gz")
    probe_steps = sorted(n for n in _names(trace) if n.startswith("ProfilerStep#"))
    assert probe_steps == [f"ProfilerStep#{i}" for i in range(4)]


def test_a_profiler_the_job_started_before_training_keeps_the_probes_off(tmp_path, hooked, monkeypatch):
    """Started before the first step, waiting on its schedule: its ProfilerStep#N markers would go
    into the probe's window, the probe's into its own. The probe starts no profiler at all."""
    started = []
    start = torch.profiler.profile.start  # the hooked one: counts what reaches torch
    probe = hooked("1,1,2")
    job, written = _job_profiler(tmp_path, active=2, wait=3)
    job.start()
    monkeypatch.setattr(torch.profiler.profile, "start", lambda self: (started.append(self), start(self))[1])
    _train(8, lambda i: job.step())
    job.stop()
    probe.close()
    assert started == [] and probe._traces_written == 0
    assert not list((tmp_path / "probe").glob("*.pt.trace.json*"))
    assert probe.job_profiler and probe.meta.get("job_profiler") is True
    assert len(written) == 1
    # where the job wrote it, for `diagnose run` to analyse (diagnose/launch.py _job_profiler)
    assert probe.meta["job_traces"] == [os.path.abspath(written[0])]
    assert sorted(n for n in _names(written[0]) if n.startswith("ProfilerStep#")) == ["ProfilerStep#3",
                                                                                      "ProfilerStep#4"]


def test_a_profiler_already_on_when_the_probe_comes_is_left_alone(tmp_path, hooked):
    """`with torch.autograd.profiler.profile()` entered before the probe's hooks were installed."""
    with torch.autograd.profiler.profile() as legacy:
        probe = hooked("0,0,3")
        _train(4)
    probe.close()
    assert probe._traces_written == 0 and probe.job_profiler and not probe._failed
    assert sum(e.name == "aten::addmm" for e in legacy.function_events) >= 8


def test_the_probes_own_windows_do_not_count_as_the_jobs(tmp_path, hooked):
    probe = hooked("0,1,2,2")
    _train(10)
    probe.close()
    assert not probe.job_profiler and "job_profiler" not in probe.meta
    assert probe._traces_written == 2 and not probe._failed
    assert "job_traces" not in probe.meta  # its own exports are not the job's


def test_with_the_probes_schedule_off_nothing_is_said_but_captures_are_refused(tmp_path, hooked, caplog):
    probe = hooked("off")
    job, _ = _job_profiler(tmp_path, active=1)
    with caplog.at_level(logging.WARNING, logger="diagnose.probes"):
        job.start()
        _train(2, lambda i: job.step())
        job.stop()
    assert probe.job_profiler  # what the on-demand capture checks before it starts a profiler
    assert "job_profiler" not in probe.meta and not caplog.records


class _SlowWork:
    """A CPU collective's work handle whose backend thread finishes after a few polls."""

    def __init__(self, polls: int) -> None:
        self.polls = 0
        self._after = polls

    def is_completed(self) -> bool:
        self.polls += 1
        return self.polls > self._after


def test_the_jobs_profiler_stops_only_after_its_cpu_collectives_have_finished(tmp_path, hooked):
    """gloo ends a collective's profiler event after waking the training thread (inflight.py): the
    job's profiler, like the probe's, is stopped once that end is done."""
    probe = hooked("off")
    work = _SlowWork(polls=5)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        probe.on_async_work(work)  # what the probe's collective wrappers hand it
        assert len(probe._inflight._works) == 1
    assert work.polls == 6 and len(probe._inflight._works) == 0
    probe.on_async_work(_SlowWork(polls=0))  # no profiler on: nothing kept
    assert len(probe._inflight._works) == 0


def test_the_jobs_last_traces_are_kept_however_many_windows(tmp_path, hooked):
    """A schedule that repeats to the end (torch's default repeat=0) exports a trace every few
    steps: the sidecar names the last JOB_TRACES_KEPT, in order, never a growing list."""
    from diagnose.probes.core import JOB_TRACES_KEPT

    probe = hooked("off")
    out = tmp_path / "job"
    out.mkdir()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  schedule=torch.profiler.schedule(wait=0, warmup=0, active=1),
                                  on_trace_ready=torch.profiler.tensorboard_trace_handler(str(out), "w"))
    with prof:
        _train(JOB_TRACES_KEPT + 4, lambda i: prof.step())
    written = sorted(out.iterdir(), key=lambda f: int(f.name.split(".")[1]))
    assert len(written) >= JOB_TRACES_KEPT + 4
    assert probe.meta["job_traces"] == [str(f) for f in written[-JOB_TRACES_KEPT:]]


def test_the_hooks_come_off_whole(tmp_path):
    from torch.autograd import profiler as ap

    before = (torch.profiler.profile.start, torch.profiler.profile.export_chrome_trace, ap.profile._prepare_trace,
              ap.profile.__exit__, ap._run_on_profiler_start)
    probe = Probe(tmp_path, rank=0, world_size=1, schedule=Schedule.parse("off"), strict_dir=False)
    undo = patches._job_profiler(probe)
    assert patches._job_profiler(probe) is None  # installed once
    undo()
    assert (torch.profiler.profile.start, torch.profiler.profile.export_chrome_trace, ap.profile._prepare_trace,
            ap.profile.__exit__, ap._run_on_profiler_start) == before


def test_the_analysis_names_the_ranks_where_the_probes_stood_aside(tmp_path):
    """A rank whose job profiled itself (here rank 1 alone) wrote a cut window or none: said."""
    import shutil

    from diagnose.pipeline import diagnose_paths
    from tests.conftest import ROOT

    run = tmp_path / "run"
    shutil.copytree(ROOT / "tests" / "fixtures" / "cpu_checkpoint_2rank", run)
    said = "the job ran its own torch.profiler there"
    assert not any(said in w for w in diagnose_paths([run]).warnings)
    sidecar = run / "rank1.probe.json"
    body = json.loads(sidecar.read_text())
    body["meta"]["job_profiler"] = True
    sidecar.write_text(json.dumps(body))
    (w,) = [w for w in diagnose_paths([run]).warnings if said in w]
    assert w.startswith("rank(s) 1:")
