"""A 2-D parallel job (FSDP2 over `dp`, DTensor tensor parallel over `tp`) on gloo, recorded:
tests/fixtures/cpu_2d_straggler_4rank (rank 3 sleeps 150 ms before each backward) and its healthy
twin cpu_2d_4rank. What it takes: a rank blocked in `_c10d_functional::wait_tensor` (DTensor's
functional collectives) is waiting for a peer, not computing; and collectives of several process
groups, which gloo traces do not name, are said to be matched as one group's."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from diagnose.step.timeline import UNNAMED_GROUPS, _several_gloo_groups
from tests.conftest import fixture_diagnosis

FIXTURES = Path(__file__).resolve().parent / "fixtures"
STRAGGLER, HEALTHY = FIXTURES / "cpu_2d_straggler_4rank", FIXTURES / "cpu_2d_4rank"
SLEEP_MS = 150.0


def _raw_ms_per_step(path: Path, name: str) -> float:
    """The summed duration of the events called `name`, per ProfilerStep, from the file itself."""
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    steps = sum(1 for e in events if str(e.get("name", "")).startswith("ProfilerStep#"))
    return sum(e["dur"] for e in events if e.get("name") == name) / 1000.0 / steps


def test_the_rank_that_sleeps_is_named_with_what_it_costs():
    d = fixture_diagnosis(STRAGGLER)
    f = d.top
    assert f is not None and f.id == "straggler" and list(f.ranks) == [3], [(x.id, x.ranks) for x in d.findings]
    assert 0.8 * SLEEP_MS < f.recoverable_ms < 1.2 * SLEEP_MS, f.recoverable_ms


def test_a_wait_in_wait_tensor_is_communication_not_compute():
    """Ranks 0 and 2 spend ~160 ms a step blocked in `_c10d_functional::wait_tensor` (the raw
    events): in their breakdown that is communication; their compute is what is left, as small
    as the ranks that do not wait there (1 and 3)."""
    d = fixture_diagnosis(STRAGGLER)
    files = {r: STRAGGLER / Path(p).name for r, p in d.run.files.items()}
    for r in (0, 2):
        waited = _raw_ms_per_step(files[r], "_c10d_functional::wait_tensor")
        assert waited > 0.6 * SLEEP_MS, (r, waited)
        rows = [b for b in d.breakdown if b.rank == r]
        compute = float(np.mean([b.compute_ms for b in rows]))
        comm = float(np.mean([b.exposed_comm_ms + b.straggler_wait_ms for b in rows]))
        assert compute < 0.3 * waited and comm > 0.9 * waited, (r, compute, comm, waited)


def test_several_unnamed_groups_are_said_and_labelled_so():
    from diagnose.ingest.assemble import load_run

    assert load_run([STRAGGLER]).unnamed_groups == [0, 1, 2, 3]
    d = fixture_diagnosis(STRAGGLER)
    said = [w for w in d.warnings if "process groups, which gloo traces do not name" in w]
    assert len(said) == 1 and said[0].startswith("rank(s) 0-3 ran collectives on several process groups"), d.warnings
    groups = {g["group"] for g in d.extras["comm_groups"]["groups"] if g["group"]}
    assert groups == {UNNAMED_GROUPS}, groups


def test_a_one_group_gloo_job_is_matched_as_before():
    d = fixture_diagnosis(FIXTURES / "cpu_straggler_2rank")
    assert not any("process groups" in w for w in d.warnings)
    assert {g["group"] for g in d.extras["comm_groups"]["groups"] if g["group"]} == {"default"}


def test_the_healthy_twin_names_no_straggler():
    d = fixture_diagnosis(HEALTHY)
    assert "straggler" not in [f.id for f in d.findings]
    assert next(c for c in d.checks if c.id == "straggler").status == "passed"


@pytest.mark.parametrize("tids, several", [
    ([], False), (["11"], False), (["11", "12"], False), (["11", "40"], False),  # one group's threads at most
    (["11", "12", "40"], True), (["11", "12", "40", "41"], True)])
def test_more_runloop_threads_than_one_group_starts_are_several_groups(tids, several):
    assert _several_gloo_groups(np.array(tids, dtype=object)) is several


def test_a_rank_held_up_once_a_step_among_many_collectives_is_a_firm_straggler():
    """Last at a minority of the collectives (the backward's first, after its sleep) yet holding
    nearly all the time they waited for their last rank: high confidence (FSDP2, one group); on
    the 2-D job medium, its groups matched as one (their waits approximate)."""
    for name, confidence in (("cpu_fsdp2_straggler_2rank", "high"), ("cpu_2d_straggler_4rank", "medium")):
        f = fixture_diagnosis(FIXTURES / name).top
        m = f.metrics
        last = m[f"rank{f.ranks[0]}_last_share"]
        assert last < 0.8 and m["held_share_of_last_waits"] > 0.9, (name, last, m["held_share_of_last_waits"])
        assert f.confidence == confidence, (name, f.confidence)


def _groups_named(src: Path, out: Path) -> Path:
    """The recorded 2-D traces with each gloo collective's process group named in its args, as
    NCCL's record_param_comms names it: by the job's construction, a rank's runloop threads that
    ran an all-gather are its `mesh_dp` group's (FSDP2 all-gathers over dp), the others its
    `mesh_tp` group's (DTensor's all-reduces). Nothing else in the files changes."""
    out.mkdir()
    for f in src.glob("*.pt.trace.json.gz"):
        doc = json.loads(gzip.decompress(f.read_bytes()))
        pgs = {g["pg_desc"]: g["pg_name"] for g in doc["distributedInfo"]["pg_config"]}
        gloo = [e for e in doc["traceEvents"] if str(e.get("name", "")).startswith("gloo:")]
        dp_threads = {e["tid"] for e in gloo if e["name"] == "gloo:all_gather"}
        for e in gloo:
            e.setdefault("args", {})["Process Group Name"] = pgs["mesh_dp" if e["tid"] in dp_threads else "mesh_tp"]
        (out / f.name).write_bytes(gzip.compress(json.dumps(doc).encode()))
    return out


def test_with_its_groups_named_each_wait_is_for_its_own_peer(tmp_path):
    """What an NCCL trace of the same job would say (its groups named): two 2-rank groups of each
    kind, no warning, rank 3 named, and the others' wait for it the sleep's (~150 ms a step), not
    the few ms that matching every group as one leaves. Ranks 1 and 2, held up by rank 3 in one of
    their groups, come last in turn at their other group's collectives with rank 0, so rank 3
    holds ~60% of the waiting directly; the replay, which follows the chain, gives it nearly all
    of what bringing each rank to the median gives back: high confidence."""
    from diagnose.pipeline import diagnose_paths

    d = diagnose_paths([_groups_named(STRAGGLER, tmp_path / "named")])
    assert not any("process groups" in w for w in d.warnings)
    groups = {(g["group"], g["ranks"]) for g in d.extras["comm_groups"]["groups"] if g["group"]}
    assert groups == {("1", 2), ("2", 2), ("3", 2), ("4", 2)}, groups
    f = d.top
    assert f.id == "straggler" and list(f.ranks) == [3] and f.confidence == "high", (f.id, f.ranks, f.confidence)
    assert 0.5 < f.metrics["held_share_of_last_waits"] < 0.8 < f.metrics["effect_share_of_all_ranks"], f.metrics
    assert 0.8 * SLEEP_MS < f.recoverable_ms < 1.2 * SLEEP_MS
    assert f.metrics["wait_imposed_ms_per_step"] > 0.8 * SLEEP_MS, f.metrics["wait_imposed_ms_per_step"]


@pytest.mark.parametrize("name, says, not_says", [
    ("cpu_2d_4rank", ("FSDP's communication", "Tensor parallelism's all-reduces"), ("let DDP overlap it",)),
    ("cpu_fsdp2_straggler_2rank", ("FSDP's communication",), ("Tensor parallelism", "let DDP overlap it")),
    ("cpu_straggler_2rank", ("let DDP overlap it",), ("FSDP", "Tensor parallelism"))])
def test_the_communication_fix_is_the_stack_s_that_moves_it(name, says, not_says):
    """DDP's bucket advice beside an FSDP2 and tensor-parallel job's all-gathers reads as nonsense:
    the fix is the stack's (its flag threshold at 0 so that each job's finding is there to read)."""
    from tests.conftest import threshold_diagnosis

    d = threshold_diagnosis(FIXTURES / name, communication=0.0)
    fix = next(f.fix for f in d.findings if f.id == "exposed_communication")
    assert all(s in fix for s in says) and not any(s in fix for s in not_says), fix


@pytest.mark.parametrize("names, tp", [
    (("_c10d_functional::all_reduce", "_c10d_functional::wait_tensor", "Redistribute"), True),
    # compiled DDP's Python reducer issues functional collectives too: not tensor parallelism
    (("DistributedDataParallel.forward", "_c10d_functional::all_reduce", "_c10d_functional::wait_tensor"), False)])
def test_tensor_parallelism_is_dtensor_redistributing_by_functional_collectives(tmp_path, names, tp):
    from diagnose.analyzers.communication import reduce as stack_of
    from diagnose.ingest.load import load_trace
    from diagnose.step.timeline import build_timeline

    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0.0, "dur": 1000.0, "pid": 1,
               "tid": 1}] + [{"ph": "X", "cat": "cpu_op", "name": n, "ts": 10.0 + 10 * i, "dur": 5.0, "pid": 1, "tid": 1}
                             for i, n in enumerate(names)]
    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(json.dumps({"distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": events}))
    trace = load_trace(path)
    s = stack_of(trace, build_timeline(trace, 0))
    assert s.tensor_parallel is tp and s.ddp is ("DistributedDataParallel.forward" in names) and not s.fsdp
