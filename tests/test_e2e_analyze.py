"""Real 2-rank torchrun gloo jobs with an injected fault; the right cause must rank first."""
from __future__ import annotations

import pytest

from diagnose.pipeline import diagnose_paths
from tests.conftest import torchrun

pytestmark = pytest.mark.e2e


def test_straggler_rank1_is_named(tmp_path):
    res = torchrun(tmp_path, "--pathology", "straggler")
    assert res.returncode == 0, res.stderr[-2000:]
    d = diagnose_paths([tmp_path])
    assert d.findings[0].id == "straggler"
    assert d.findings[0].ranks == (1,)
    # the injected 150 ms sleep; CPU contention on a 2-core host moves it by tens of ms
    assert d.findings[0].recoverable_ms > 80


def test_uneven_work_whose_slowest_rank_changes_ranks_first(tmp_path):
    """Each step each rank computes a random 0-400 ms more (seeded: the same draws every run): no
    rank is late more than chance, yet each step the faster rank waits for the slower."""
    import statistics

    from examples.train_ddp import uneven_extra_ms

    res = torchrun(tmp_path, "--uneven-ms", "400", "--steps", "10")
    assert res.returncode == 0, res.stderr[-2000:]
    d = diagnose_paths([tmp_path])
    top = d.findings[0]
    assert top.id == "load_imbalance" and top.ranks == (0, 1)
    assert next(c for c in d.checks if c.id == "straggler").status == "passed"
    steps = sorted({s.step for s in d.breakdown})
    injected = statistics.fmean(abs(uneven_extra_ms(0, s, 0, 400) - uneven_extra_ms(1, s, 0, 400)) for s in steps) / 2
    # each rank's mean wait for the step's slowest; contention on two cores moves it by tens of ms
    assert 0.6 * injected < top.recoverable_ms < 1.5 * injected


def test_a_jobs_own_profiler_repeating_until_the_end_is_read_from_its_last_whole_window(tmp_path):
    """torch's default schedule repeats (repeat=0) and the default names are {host}_{pid}.{ns}:
    a trace a rank a window, the last cut by the run's end. Until 2026-12-07: "two traces for
    rank 0 ... mixed runs?". Now window 2 of 3 (the third holds one step of three). Windows of
    3 steps, not 2: with one all-reduce a step, 2 left the straggler's chance test near its
    threshold (the rerun test below, at 2-step windows, failed so 3 times in 25 here, 2026-12-07)."""
    res = torchrun(tmp_path, "--pathology", "straggler", "--steps", "13", "--trace-default-names",
                   "--profile-repeat", "0", "--profile-wait", "1", "--profile-warmup", "1", "--profile-active", "3")
    assert res.returncode == 0, res.stderr[-2000:]
    assert len(list(tmp_path.glob("*.pt.trace.json.gz"))) == 6
    d = diagnose_paths([tmp_path])
    assert d.run.steps_analysed == 3
    assert any("3 profiled windows a rank" in w and "(window 2) is analysed" in w for w in d.warnings), d.warnings
    assert d.findings[0].id == "straggler" and d.findings[0].ranks == (1,)


def test_a_job_rerun_into_its_own_profiler_directory_is_read_one_run_at_a_time(tmp_path):
    """tensorboard_trace_handler's default names, a schedule that repeats, the job run twice into
    one directory (the second time with the other rank late): refused as it is, and `--run K`
    reads each run alone, its windows chosen as before."""
    from diagnose.errors import DiagnoseError

    # windows of 3 steps: at 2 (one all-reduce a step) the straggler's chance test missed its
    # threshold in 3 of 25 tries here (one: p=0.019 against 0.0167, 155.7 ms of waiting read as
    # jitter); 0 of 13 at 3 (this test 3 times, a /tmp loop of its two jobs 10)
    common = ("--pathology", "straggler", "--steps", "11", "--trace-default-names", "--profile-repeat", "0",
              "--profile-wait", "1", "--profile-warmup", "1", "--profile-active", "3")
    for late in ("1", "0"):
        res = torchrun(tmp_path, *common, "--straggler-rank", late)
        assert res.returncode == 0, res.stderr[-2000:]
    with pytest.raises(DiagnoseError, match="two runs in one directory"):
        diagnose_paths([tmp_path])
    for k, late in ((1, 1), (-1, 0)):
        d = diagnose_paths([tmp_path], run_k=k)
        assert d.findings[0].id == "straggler" and d.findings[0].ranks == (late,)
        assert any(f"run {1 if k == 1 else 2} is analysed" in w for w in d.warnings), d.warnings


def test_slow_getitem_dataloader_ranks_first(tmp_path):
    res = torchrun(tmp_path, "--pathology", "dataloader")
    assert res.returncode == 0, res.stderr[-2000:]
    d = diagnose_paths([tmp_path])
    assert d.findings[0].id == "dataloader_starvation"
    assert d.findings[0].share_of_step > 0.5
