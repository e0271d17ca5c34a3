"""An evaluation inside the training loop: its DataLoader's wait is told from the training batches'.

A script that validates every N steps iterates a second DataLoader under torch.no_grad() inside
the training steps. Until 2026-12-07 that wait read as the training loader's starvation, with the
training loader's settings in the fix (and whichever loader was iterated last recorded as "the"
DataLoader). The probes now mark each fetch made with autograd off (patches.EVAL_BATCH; the fixture
holds its first name, NO_GRAD_BATCH) or by a Hugging Face Trainer's evaluation loop, and
record that loader's settings apart; the dataloader check says what share of the wait is the
evaluation's and names its loader.

tests/fixtures/cpu_eval_in_loop_2rank (README there): the evaluation's loader sleeps 1 ms a sample,
the training loader none."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from diagnose.probes.patches import EVAL_BATCH, NO_GRAD_BATCH

from diagnose.analyzers.dataloader import TITLE, TITLE_EVAL
from diagnose.output import terminal_summary
from diagnose.pipeline import diagnose_paths

FIXTURES = Path(__file__).parent / "fixtures"
EVAL = FIXTURES / "cpu_eval_in_loop_2rank"
DATALOADER = "enumerate(DataLoader)#"


def _finding(d, check_id="dataloader_starvation"):
    return next(f for f in d.findings if f.id == check_id)


def _raw_per_step(trace: Path, mark: str = NO_GRAD_BATCH) -> list[tuple[float, float]]:
    """(all DataLoader wait, the part inside the probes' autograd-off marks) per ProfilerStep, ms,
    from the raw events: every fetch of this single-threaded loader is one span on the main thread."""
    with gzip.open(trace) as f:
        ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e["name"].startswith("ProfilerStep#"))
    marks = [(e["ts"], e["ts"] + e["dur"]) for e in ev if e["name"] == mark]
    fetches = [(e["ts"], e["ts"] + e["dur"]) for e in ev if e["name"].startswith(DATALOADER)]
    out = []
    for s0, s1 in steps:
        mine = [(a, b) for a, b in fetches if s0 <= a and b <= s1]
        inside = [(a, b) for a, b in mine if any(m0 <= a and b <= m1 for m0, m1 in marks)]
        out.append((sum(b - a for a, b in mine) / 1000, sum(b - a for a, b in inside) / 1000))
    return out


def test_the_evaluations_wait_is_named_with_its_loader():
    d = diagnose_paths([EVAL])
    f = _finding(d)
    assert d.findings[0].id == "dataloader_starvation" and f.title == TITLE_EVAL
    m = f.metrics
    worst = m["worst_rank"]
    per_step = _raw_per_step(next(EVAL.glob(f"rank{worst}.*.pt.trace.json.gz")))
    # the share against the raw events, over the steps the analysis kept (a window of them)
    n = d.run.steps_analysed
    windows = [per_step[i:i + n] for i in range(len(per_step) - n + 1)]
    shares = [sum(x for _, x in w) / sum(t for t, _ in w) for w in windows]
    assert any(abs(s - m["no_grad_share_of_wait"]) < 5e-4 for s in shares), (shares, m)  # rounded to 4 places
    assert m["no_grad_dataloader_ms"] == pytest.approx(m["dataloader_ms_per_step"] * m["no_grad_share_of_wait"],
                                                       rel=1e-3)
    # 4 batches of 32 samples at 1 ms each, every other step: at least 51 ms a step on any window
    assert m["no_grad_dataloader_ms"] > 4 * 32 * 1.0 * 2 / 5
    # the fix leads with the evaluation and names its loader (not drop_last: the training one's is True)
    assert f.fix.startswith("Of the wait, ") and "this run's evaluation loader: DataLoader(batch_size=32" in f.fix
    assert "This run: DataLoader(" not in f.fix
    check = next(c for c in d.checks if c.id == "dataloader_starvation")
    assert "an evaluation's batches" in check.reason


@pytest.mark.parametrize("fixture", ["cpu_straggler_dataloader_2rank", "gpu_h200/dataloader"])
def test_a_training_loader_that_starves_the_step_is_not_called_an_evaluation(fixture):
    d = diagnose_paths([FIXTURES / fixture])
    f = _finding(d)
    assert f.title == TITLE and "no_grad_share_of_wait" not in f.metrics and "evaluation" not in f.fix
    if d.run.metadata.get("dataloader"):  # recorded under the probes: the training loader's settings
        assert "This run: DataLoader(" in f.fix


def _raw_evaluation_per_step(trace: Path) -> list[float]:
    """Per ProfilerStep, ms from its first autograd-off mark to the end of its last (0 without)."""
    with gzip.open(trace) as f:
        ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e["name"].startswith("ProfilerStep#"))
    marks = [(e["ts"], e["ts"] + e["dur"]) for e in ev if e["name"] == NO_GRAD_BATCH]
    out = []
    for s0, s1 in steps:
        mine = [(a, b) for a, b in marks if s0 <= a and b <= s1]
        out.append((max(b for _, b in mine) - min(a for a, _ in mine)) / 1000 if mine else 0.0)
    return out


def test_the_evaluations_whole_loop_is_a_fact_of_the_run():
    """Its batches and its forward passes: from the first marked fetch of a step to the end of the
    fetch that ended its loop."""
    d = diagnose_paths([EVAL])
    e = d.extras["evaluation"]
    n = d.run.steps_analysed
    per_rank = []
    for r in (0, 1):
        per_step = _raw_evaluation_per_step(next(EVAL.glob(f"rank{r}.*.pt.trace.json.gz")))
        assert len(per_step) == n  # every profiled step analysed: no window to choose
        per_rank.append(sum(per_step) / n)
    assert e["ranks"] == 2 and e["ms_per_step"] == pytest.approx(sum(per_rank) / 2, abs=1e-3)
    # more than its batches' wait: the forward passes are in it
    assert e["ms_per_step"] > _finding(d).metrics["no_grad_dataloader_ms"]
    assert f"evaluation: {e['ms_per_step']:.1f} ms per step" in terminal_summary(d)
    assert diagnose_paths([FIXTURES / "cpu_tiny_buckets_2rank"]).extras["evaluation"] == {}
    # its DDP forwards are no micro-batches: read as 11 forwards a step ("gradient accumulation")
    # until 2026-12-07
    grad_sync = next(c for c in d.checks if c.id == "grad_sync")
    assert grad_sync.reason.startswith("one forward per optimizer step"), grad_sync.reason


def test_the_run_facts_keep_each_loader_apart():
    d = diagnose_paths([EVAL])
    meta = d.run.metadata
    assert meta["dataloader"]["drop_last"] is True and meta["dataloader_no_grad"]["drop_last"] is False


torch = pytest.importorskip("torch")


def test_the_probe_marks_fetches_made_with_autograd_off(tmp_path):
    """In process: the hook `diagnose run` installs, a real profiler, two real loaders."""
    from diagnose.probes import patches
    from diagnose.probes.core import Probe, Schedule
    from torch.utils.data import DataLoader

    probe = Probe(tmp_path / "probe", rank=0, world_size=1, schedule=Schedule.parse("off"), strict_dir=False)
    undo = patches._dataloader(probe)
    try:
        train = DataLoader(list(range(8)), batch_size=4, drop_last=True)
        val = DataLoader(list(range(6)), batch_size=3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            assert len(list(train)) == 2
            with torch.no_grad():
                assert len(list(val)) == 2
    finally:
        undo()
    names = [e.name for e in prof.events()]
    assert names.count(EVAL_BATCH) == 3  # two batches and the fetch that ends the loop
    assert probe.meta["dataloader_no_grad"]


def test_a_hugging_face_trainers_evaluation_is_an_evaluation(tmp_path):
    """Hugging Face fetches its evaluation batches with autograd on (its no_grad is inside
    prediction_step): a real Trainer in process, trained and evaluated, the hook `diagnose run`
    installs. Its training loader stays the training one; its evaluation loader's fetches are marked."""
    transformers = pytest.importorskip("transformers")
    from diagnose.probes import patches
    from diagnose.probes.core import Probe, Schedule
    from torch import nn
    from torch.utils.data import Dataset

    class Data(Dataset):
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return {"x": torch.randn(8), "labels": torch.randn(1)}

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 1)

        def forward(self, x, labels=None):
            out = self.lin(x)
            return {"loss": nn.functional.mse_loss(out, labels), "logits": out}

    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4,
                                          per_device_eval_batch_size=3, max_steps=2, report_to=[],
                                          save_strategy="no", use_cpu=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=Model(), args=args, train_dataset=Data(16), eval_dataset=Data(6))
    probe = Probe(tmp_path / "probe", rank=0, world_size=1, schedule=Schedule.parse("off"), strict_dir=False)
    undo = patches._dataloader(probe)
    try:
        trainer.train()
        # accelerate's loaders batch through a batch sampler (batch_size None): told apart by when
        assert "dataloader_no_grad" not in probe.meta and probe.meta["dataloader"]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            trainer.evaluate()
    finally:
        undo()
    assert probe.meta["dataloader_no_grad"]
    assert [e.name for e in prof.events()].count(EVAL_BATCH) >= 2  # its two batches (and the loop's end)


def test_an_evaluation_one_rank_runs_alone_is_the_stragglers_fix():
    """cpu_eval_one_rank_2rank: rank 0 evaluates every third step, rank 1 waits for it. The rank is
    late "from the DataLoader", which is the evaluation's: the fix is where the evaluation runs."""
    from diagnose.analyzers.straggler import FIX_EVAL_ALONE

    fixture = FIXTURES / "cpu_eval_one_rank_2rank"
    per_rank = {int(p.name[4]): _raw_per_step(p, EVAL_BATCH) for p in fixture.glob("rank*.pt.trace.json.gz")}
    assert all(marked == 0 for _, marked in per_rank[1])  # rank 1 never evaluates
    assert sum(marked for _, marked in per_rank[0]) > 100  # rank 0 does, inside the profiled steps
    d = diagnose_paths([fixture])
    f = d.findings[0]
    assert f.id == "straggler" and f.ranks == (0,)
    assert f.fix == FIX_EVAL_ALONE.format(who="Rank 0")
    extra = f.metrics["late_rank_extra_evaluation_ms"]
    assert extra == pytest.approx(d.extras["evaluation"]["ms_per_step"], rel=0.05)  # rank 1 has none
    assert "an evaluation rank 0 runs and the others do not" in next(c for c in d.checks if c.id == "straggler").reason
    # where every rank evaluates (cpu_eval_in_loop_2rank) no rank is said to evaluate alone
    assert all("late_rank_extra_evaluation_ms" not in x.metrics for x in diagnose_paths([EVAL]).findings)
