"""Branches of the checks that no shared trace or recording reaches with default thresholds, each
pinned on a real trace (a threshold moved, a sidecar section added in the probe's own format) or on
the plain function that decides it. Found by mutation testing (benchmarks/mutation.py): a change
here that no test noticed is a claim the tool could get wrong unseen."""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pandas as pd
import pytest

from diagnose.analyzers import checkpoint, dataloader, host_sync
from diagnose.context import build_context
from diagnose.probedata import ProbeData
from diagnose.thresholds import DEFAULT
from tests.conftest import FLOORS, fixture_run, shared, shared_run, threshold_diagnosis

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _check(d, cid: str):
    return next(c for c in d.checks if c.id == cid)


def test_checkpoint_ranges_below_the_threshold_pass_and_keep_their_figures(tmp_path):
    """The checkpointing job seen from its traces alone (8.5 ms per profiled step, 28% of it):
    with the threshold above that share it passes, and the finding behind the figure is kept."""
    for f in (FIXTURES / "cpu_checkpoint_2rank").glob("*.pt.trace.json.gz"):
        shutil.copy(f, tmp_path / f.name)
    from diagnose.pipeline import diagnose_paths

    flagged = _check(diagnose_paths([tmp_path]), "checkpoint_io")
    share = flagged.finding.share_of_step
    c = _check(diagnose_paths([tmp_path], dataclasses.replace(DEFAULT, checkpoint=share + 0.01)), "checkpoint_io")
    assert c.status == "passed" and c.finding is not None
    assert c.finding.recoverable_ms == flagged.finding.recoverable_ms and c.finding.ranks == (0,)
    assert c.finding.metrics["source"] == "trace (profiled steps only)"


def test_the_dataloader_fix_quotes_this_runs_loader_settings():
    """The probe's `dataloader` section (what it read off the DataLoader) on a real starved trace:
    the fix names the settings the run used, only those recorded, in a fixed order."""
    run = shared_run("kineto_resnet50_dataloader_v100/nw0")
    cfg = {"num_workers": 0, "batch_size": 32, "pin_memory": False, "unrelated": "x"}
    ctx = build_context(run, {0: ProbeData(rank=0, meta={"dataloader": cfg}, steps=pd.DataFrame(),
                                           collectives=pd.DataFrame())})
    c = next(c for c in dataloader.analyze(ctx, DEFAULT) if c.id == "dataloader_starvation")
    assert c.status == "flagged"
    assert c.finding.fix.endswith(" This run: DataLoader(batch_size=32, num_workers=0, pin_memory=False).")
    bare = next(c for c in dataloader.analyze(build_context(run, {}), DEFAULT) if c.id == "dataloader_starvation")
    assert "This run:" not in bare.finding.fix


def test_a_sync_call_on_a_thread_without_ops_reads_none_and_the_next_still_gets_its_op():
    ev = pd.DataFrame({"kind": pd.Categorical(["cpu_op", "cpu_op"]), "tid": ["1", "1"], "ts": [0.0, 2.0],
                       "dur": [100.0, 10.0], "name": ["aten::to", "aten::_local_scalar_dense"]})
    calls = pd.DataFrame({"tid": ["7", "1", "1"], "ts": [5.0, 3.0, 50.0], "dur": [1.0, 2.0, 5.0]})
    ev["kind"] = ev["kind"].astype(str).map({"cpu_op": host_sync.KIND_CPU_OP})
    assert host_sync._innermost_ops(ev, calls) == [None, "aten::_local_scalar_dense", "aten::to"]


def test_host_syncs_name_the_ranks_at_or_above_the_threshold():
    """On param_dlrm_8rank_v100 each rank's sync idle is 0.73-0.81 ms per step: with the threshold
    between them, the ranks named are exactly those whose own idle reaches it."""
    base = _check(threshold_diagnosis(shared("param_dlrm_8rank_v100"), host_sync=0.0), "host_sync").finding
    step = base.recoverable_ms / base.share_of_step
    per = {r: base.metrics[f"rank{r}_sync_idle_ms"] for r in range(8)}
    values = sorted(per.values())
    cut = (values[4] + values[5]) / 2  # the three largest reach it
    c = _check(threshold_diagnosis(shared("param_dlrm_8rank_v100"), host_sync=cut / step), "host_sync")
    want = tuple(sorted(r for r, v in per.items() if v / step >= cut / step))
    assert len(want) == 3 and c.finding is not None and c.finding.ranks == want


def test_a_lower_missing_launch_threshold_lowers_confidence_with_its_note():
    """edge_hta_ddp_world1_v100: 235 of 6330 launch calls in the steps have no device event (3.7%),
    under the default 20%: no note. At 1% the idle model says device work is missing, and the checks
    that read idle classes drop to low confidence."""
    path = shared("edge_hta_ddp_world1_v100")
    floors = {f: 0.0 for f in FLOORS}
    quiet = _check(threshold_diagnosis(path, **floors), "launch_overhead").finding
    assert "no device event" not in str(quiet.metrics.get("note", ""))
    loud = _check(threshold_diagnosis(path, **floors, unmatched_launch_share=0.01), "launch_overhead").finding
    assert "4% of the launch calls in the steps have no device event" in loud.metrics["note"]
    assert loud.confidence == "low"
    # device_wait keeps its own note (all of its sliver of queued idle is same-stream) and adds this one
    wait = _check(threshold_diagnosis(path, **floors, unmatched_launch_share=0.01), "device_wait").finding
    first, second = wait.metrics["note"].split("; ", 1)
    assert first.startswith("100% of the queued idle is same-stream") and wait.confidence == "low"
    assert second.startswith("rank 0: 4% of the launch calls in the steps have no device event")


def test_the_checkpoint_trace_marks_reduce_counts_every_write_and_cites_the_first():
    """What the checkpoint check reads off one rank's trace: every marked write counted, the first
    three cited, and the figure per profiled step."""
    marks = checkpoint._trace_marks(build_context(fixture_run(FIXTURES / "cpu_checkpoint_2rank"), {}))
    assert marks and all(m.count >= len(m.first_rows) for m in marks.values())
    assert all(0 < len(m.first_rows) <= 3 for m in marks.values())


def test_accumulation_is_judged_by_the_majority_of_its_steps():
    """tests/fixtures/cpu_accum_nosync_2rank, every profiled step reducing before its last
    micro-batch: a rank is judged to reduce early when more than half of its steps do. Exactly
    half (a run that switched to no_sync() halfway) passes; one step more flags."""
    from diagnose.analyzers import grad_sync

    run = fixture_run(FIXTURES / "cpu_accum_nosync_2rank")
    facts = {r: run.facts[r]["grad_sync"] for r in run.ranks}
    assert all(f.steps >= 2 and f.syncing_steps == f.steps for f in facts.values())

    def judged(steps: int, syncing: int) -> str:
        edited = dataclasses.replace(run, facts={r: {**run.facts[r], "grad_sync": dataclasses.replace(
            facts[r], steps=steps, syncing_steps=syncing)} for r in run.ranks})
        (c,) = grad_sync.analyze(build_context(edited), DEFAULT)
        return c.status

    assert [judged(6, k) for k in (2, 3, 4)] == ["passed", "passed", "flagged"]
    assert [judged(5, k) for k in (2, 3)] == ["passed", "flagged"]


def test_checkpoint_with_probes_and_no_save_passes_and_says_so():
    """A run the probes watched that wrote no checkpoint (tests/fixtures/light_failslow/steady: 299
    recorded steps, no torch.save): passed, naming how many steps were watched, not 'not measurable'."""
    from diagnose.analyzers import checkpoint
    from diagnose.probedata import load_probe_data

    probes = load_probe_data([FIXTURES / "light_failslow" / "steady"])
    n = max(len(p.steps) for p in probes.values())
    (c,) = checkpoint.analyze(build_context(fixture_run(FIXTURES / "cpu_straggler_2rank"), probes), DEFAULT)
    assert (c.id, c.status) == ("checkpoint_io", "passed")
    assert c.reason == (f"no checkpoint written during the {n} probed steps (torch.save, "
                        "torch.distributed.checkpoint)")
