"""DataLoader waits that come at each epoch's start are told from the rest.

A loop that makes a new DataLoader iterator each epoch starts the workers' prefetch from nothing:
the epoch's first batch is loaded by one worker while the step waits, so more workers, the usual
fix, do not shorten it (measured with `examples/train_ddp.py --epoch-steps 4 --num-workers 2
--slow-getitem-ms 1`: ~300 ms at each epoch start with 2 or 4 workers, persistent or not). Until
2026-12-07 the finding said "num_workers=4..8" and sized the wait on a window of five steps that
held two epoch starts of the run's seven. The probes now mark each training iterator's first
fetch (`first_batch_ms` in the step record); the dataloader check says when most of the wait is
there, gives the run's figures beside the window's and leads its fix with the epochs.

tests/fixtures/cpu_epoch_starts_2rank (README there): epochs of 4 steps, a new iterator each;
cpu_epoch_sampler_2rank: the same job with one iterator over every epoch (its fix)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from diagnose.analyzers.dataloader import EPOCH_LEADS, TITLE, TITLE_EPOCH
from diagnose.pipeline import diagnose_paths
from diagnose.probedata import load_probe_data

FIXTURES = Path(__file__).parent / "fixtures"
EPOCHS = FIXTURES / "cpu_epoch_starts_2rank"
SAMPLER = FIXTURES / "cpu_epoch_sampler_2rank"
EPOCH_STEPS = 4  # the recording's --epoch-steps


def _finding(d, check_id="dataloader_starvation"):
    return next(f for f in d.findings if f.id == check_id)


def test_waits_at_epoch_starts_are_named_with_the_runs_figures():
    d = diagnose_paths([EPOCHS])
    f = _finding(d)
    assert d.findings[0].id == "dataloader_starvation" and f.title == TITLE_EPOCH
    m = f.metrics
    p = load_probe_data([EPOCHS])[m["worst_rank"]].steps
    # the epoch starts the job made: steps 4, 8, ... of the record (step 0, the first epoch's, is
    # never in it), against the steps the probes marked
    assert p.loc[p["first_batch_ms"] > 0, "step"].tolist() == [s for s in p["step"] if s % EPOCH_STEPS == 0]
    assert m["epoch_starts"] == len(p) // EPOCH_STEPS == 7
    # the run's figures, from the record as written
    assert m["every_step_dataloader_ms"] == pytest.approx(p["dataloader_ms"].mean(), abs=1e-3)
    assert m["every_step_first_batch_ms"] == pytest.approx(p["first_batch_ms"].mean(), abs=1e-3)
    assert m["first_batch_share_of_wait"] >= EPOCH_LEADS
    # each start waits for a batch of 256 samples at 1 ms each, loaded by one worker
    assert m["first_batch_ms_each"] > 256 * 1.0
    # the window: the profiled steps the trace's clock places, and the starts among them
    lo, hi = d.extras["window"]["window_steps"]
    assert (m["window_steps"], m["window_epoch_starts"]) == \
        (hi - lo + 1, sum(1 for s in range(lo, hi + 1) if s % EPOCH_STEPS == 0))
    assert m["window_epoch_starts"] / m["window_steps"] > m["epoch_starts"] / 29  # the window over-samples them
    check = next(c for c in d.checks if c.id == "dataloader_starvation")
    assert f"at 7 epoch starts of {m['first_batch_ms_each']:.0f} ms each" in check.reason
    # the fix leads with the epochs, says why more workers do not help, and keeps the run's loader
    assert f.fix.startswith("Keep the DataLoader's prefetch running across epochs")
    assert "more workers do not shorten that wait" in f.fix and "persistent_workers=False here" in f.fix
    assert "This run: DataLoader(batch_size=256, num_workers=2" in f.fix


def test_one_iterator_over_every_epoch_has_no_epoch_starts():
    """The fix applied: the record marks no first batch past step 0, and the finding, if any, is
    the plain one (two workers still fall behind a little here)."""
    p = load_probe_data([SAMPLER])
    assert all((q.steps["first_batch_ms"] == 0).all() for q in p.values())
    d = diagnose_paths([SAMPLER])
    for f in d.findings:
        assert f.title != TITLE_EPOCH and "epoch_starts" not in f.metrics
    # and the run got shorter by more than the epoch starts' share of it, per the record
    before = load_probe_data([EPOCHS])
    for r in p:
        assert p[r].steps["dur_ms"].mean() < before[r].steps["dur_ms"].mean() - before[r].steps["first_batch_ms"].mean() / 2


def test_epoch_starts_that_hold_little_of_the_wait_leave_the_usual_finding():
    """No workers: each batch loads in the training process, an epoch's first no slower than the
    rest. The starts are marked, a quarter of the wait: the fix stays workers."""
    no_workers = FIXTURES / "cpu_epoch_no_workers_2rank"
    p = load_probe_data([no_workers])
    for q in p.values():
        s = q.steps
        assert s.loc[s["first_batch_ms"] > 0, "step"].tolist() == [x for x in s["step"] if x % EPOCH_STEPS == 0]
        assert s["first_batch_ms"].sum() / s["dataloader_ms"].sum() < EPOCH_LEADS
    f = _finding(diagnose_paths([no_workers]))
    assert f.title == TITLE and "epoch_starts" not in f.metrics
    assert f.fix.startswith("Feed the step faster: DataLoader(num_workers=")


@pytest.mark.parametrize("fixture", ["cpu_straggler_dataloader_2rank", "cpu_eval_in_loop_2rank"])
def test_records_from_before_the_marking_say_nothing_of_epochs(fixture):
    d = diagnose_paths([FIXTURES / fixture])
    f = _finding(d)
    assert f.title != TITLE_EPOCH and "epoch_starts" not in f.metrics
    assert not f.fix.startswith("Keep the DataLoader's prefetch")


torch = pytest.importorskip("torch")


def test_the_probe_marks_each_training_iterators_first_fetch_only(tmp_path):
    """In process: the hook `diagnose run` installs, a real DataLoader over three epochs, an
    evaluation loader (autograd off) in between whose first fetch is not a training epoch's."""
    from diagnose.probes import patches
    from diagnose.probes.core import Probe, Schedule
    from torch.utils.data import DataLoader

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            time.sleep(0.002)  # every fetch measurably long: a first fetch is never written as 0
            return i

    probe = Probe(tmp_path / "probe", rank=0, world_size=1, schedule=Schedule.parse("off"), strict_dir=False)
    undo = patches._dataloader(probe)
    try:
        train = DataLoader(Slow(), batch_size=2)
        val = DataLoader(Slow(), batch_size=3)
        for epoch in range(3):
            for batch in train:
                if epoch == 1 and int(batch[0]) == 2:
                    with torch.no_grad():
                        assert len(list(val)) == 2
                probe.on_step()
    finally:
        undo()
        probe.close()
    records = [json.loads(x) for f in sorted((tmp_path / "probe").rglob("rank0.steps.jsonl"))
               for x in f.read_text().splitlines()]
    marked = [r["step"] for r in records if r.get("first_batch_ms", 0) > 0]
    # three batches an epoch: each epoch's first at steps 0, 3, 6 (the evaluation ran in step 4);
    # the fetch that ends an epoch falls in the next epoch's first step and is not a first fetch
    assert marked == [0, 3, 6], records
    for r in records:
        if r["step"] in marked:
            assert 2.0 * 2 * 0.9 <= r["first_batch_ms"] <= r["dataloader_ms"]
