"""A run missing some of its ranks (another node's run directory, a rank that died): what the
checks cannot see there is said beside the verdict, and the time its peers spent waiting for a
missing rank is not sold as communication with confidence.

The ranks are the recorded tests/fixtures/cpu_straggler_2rank job (rank 1 sleeps 150 ms before
each backward), read without rank 1's file: as the first node's `diagnose run` of a 2-node job
saw it (measured on two launchers here: 137.7 ms of "exposed communication" on rank 0, confidence
medium, for rank 1's 100 ms sleep)."""
from __future__ import annotations

import pytest

from diagnose.launch import nodes_of
from diagnose.output import terminal_summary
from diagnose.pipeline import diagnose_paths
from tests.conftest import ROOT

RUN = ROOT / "tests" / "fixtures" / "cpu_straggler_2rank"


@pytest.fixture(scope="module")
def rank0_alone():
    return diagnose_paths(sorted(RUN.glob("rank0.*.pt.trace.json.gz")))


def test_waiting_for_a_missing_rank_is_not_communication_with_confidence(rank0_alone):
    d = rank0_alone
    assert d.run.ranks_found == (0,) and d.run.ranks_missing == (1,)
    comm = next(c for c in d.checks if c.id == "exposed_communication")
    assert comm.status == "flagged"  # the time is spent in the collectives, and it is said where it may come from
    assert comm.finding.confidence == "low"
    assert comm.finding.metrics["includes_waits_for_missing_ranks"] == "1"
    assert "wait for the missing rank(s) 1" in comm.reason
    # with every rank, the same job reads as rank 1's straggling, at high confidence, and the
    # communication check carries no such caveat
    whole = diagnose_paths([RUN])
    assert whole.top.id == "straggler" and whole.top.ranks == (1,)
    comm = next(c for c in whole.checks if c.id == "exposed_communication")
    assert "missing" not in comm.reason
    assert comm.finding is None or "includes_waits_for_missing_ranks" not in comm.finding.metrics


def test_the_summary_says_beside_the_verdict_what_it_cannot_see(rank0_alone):
    lines = terminal_summary(rank0_alone).splitlines()
    caution = [i for i, line in enumerate(lines) if line.startswith("  caution: 1 of 2 ranks here (rank(s) 1 missing)")]
    assert caution and caution[0] < lines.index("")  # in the verdict's block, before the run line
    assert not [line for line in terminal_summary(diagnose_paths([RUN])).splitlines() if "caution:" in line]


@pytest.mark.parametrize("command, env, nodes", [
    (["torchrun", "--nnodes", "2", "--nproc-per-node", "8", "train.py"], {}, 2),
    (["torchrun", "--nnodes=1:4", "train.py"], {}, 4),
    (["python", "-m", "torch.distributed.run", "--nnodes=2", "train.py", "--nnodes", "9"], {}, 2),
    (["torchrun", "--nproc-per-node", "2", "train.py", "--nnodes", "9"], {}, None),  # the script's own flag
    (["torchrun", "--nnodes=1", "train.py"], {"SLURM_JOB_NUM_NODES": "4"}, None),  # torchrun says one node
    (["python", "train.py"], {"SLURM_JOB_NUM_NODES": "3"}, 3),  # srun starts one per task
    (["python", "train.py"], {"SLURM_JOB_NUM_NODES": "1"}, None),
    (["torchrun", "--nnodes", "x", "train.py"], {}, None),
])
def test_the_launcher_knows_a_job_over_several_nodes(command, env, nodes):
    assert nodes_of(command, env) == nodes


@pytest.mark.parametrize("ran, schedule, says", [
    (3, "2,2,5", (": the job ran 3 step(s), and the profiler's window (--schedule 2,2,5) records from step 5; "
                  "rerun with more steps or an earlier window (--schedule 0,1,2)")),
    (1, "2,2,5", (": the job ran 1 step(s), and the profiler's window (--schedule 2,2,5) records from step 5; "
                  "rerun with more steps")),
    (6, "2,2,5", ""),  # it reached the window: no trace for another reason, not guessed
    (3, "off", " (--schedule off: timings only, in the run directory's step logs: `diagnose changes RUN` reads them)"),
])
def test_a_run_that_ended_before_the_window_says_so(tmp_path, ran, schedule, says):
    """`diagnose run` of a short smoke test used to end in "the job wrote no traces; nothing to
    analyse" alone. The step logs are the probes' own, written by a real Probe."""
    from diagnose.probes.core import Probe, Schedule

    from diagnose.launch import _before_the_window

    for rank in (0, 1):
        probe = Probe(tmp_path, rank=rank, world_size=2, schedule=Schedule(enabled=False))
        for _ in range(ran):  # the first call opens step 0, each later one ends a step; close() the last
            probe.on_step()
        probe.close()
    assert len((tmp_path / "rank0.steps.jsonl").read_text().splitlines()) == ran
    assert _before_the_window(tmp_path, schedule) == says.replace("RUN", str(tmp_path.parent))
