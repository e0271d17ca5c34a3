"""DDP bucket size read from the trace (diagnose/analyzers/communication.py): one all-reduce
carrying most of a step's gradients, too big for a default bucket, with nothing of the
communication overlapped (one_bucket); a bucket cap below the default splitting the gradients
into many all-reduces (small_buckets). The recorded jobs (tests/fixtures/cpu_huge_bucket_2rank,
cpu_tiny_buckets_2rank) are checked against their raw events; each branch of the rules on
hand-made figures."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from diagnose.analyzers.communication import DDP_DEFAULT_CAP_BYTES, FIX, one_bucket, small_buckets
from tests.conftest import fixture_diagnosis

ROOT = Path(__file__).parent / "fixtures" / "cpu_huge_bucket_2rank"
MB = 1e6


def _raw_per_step(path: Path) -> list[list[int]]:
    """Each profiled step's gloo all-reduces' bytes (Input Dims x 4, fp32), from the raw events."""
    evs = [e for e in json.load(gzip.open(path, "rt"))["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in evs if str(e["name"]).startswith("ProfilerStep#"))
    out = []
    for lo, hi in steps:
        ops = [e for e in evs if e["name"] == "gloo:all_reduce" and lo <= e["ts"] < hi]
        out.append([sum(4 * d[0] for d in e["args"]["Input Dims"]) for e in ops if e["args"]["Input type"][0] == "float"])
    return out


def test_one_bucket_on_the_recorded_job_is_named_with_its_bytes_and_cap():
    raw = [sum(b) for p in sorted(ROOT.glob("rank*.pt.trace.json.gz")) for b in _raw_per_step(p)]
    model = json.loads((ROOT / "rank0.probe.json").read_text())["meta"]["model"]
    assert set(raw) == {model["param_bytes"]} == {64_032_772} and model["ddp_bucket_cap_mb"] == 1000.0
    d = fixture_diagnosis(ROOT)
    (c,) = [c for c in d.checks if c.id == "exposed_communication"]
    m = c.finding.metrics
    assert c.status == "flagged" and m["largest_all_reduce_bytes"] == m["all_reduce_bytes_per_step"] == 64_032_772
    assert m["ddp_bucket_cap_mb"] == 1000.0 and m["overlapped_share"] < 0.05
    assert "one all-reduce carries 64.0 of the 64.0 MB reduced per step, after the backward" in c.reason
    # a CPU-only job: the cores the transfers would share are the backward's; no bucket fix
    assert "CPU-only" in c.reason and c.finding.fix == FIX


def test_jobs_whose_gradients_fit_a_default_bucket_get_no_note():
    """cpu_straggler_2rank: one 2.6 MB bucket a step (all of its gradients, under the default cap)."""
    (c,) = [c for c in fixture_diagnosis(Path(__file__).parent / "fixtures" / "cpu_straggler_2rank").checks
            if c.id == "exposed_communication"]
    assert "one all-reduce carries" not in c.reason


BIG = 3 * DDP_DEFAULT_CAP_BYTES  # 78.6 MB


@pytest.mark.parametrize("largest, reduced, overlapped", [
    (2 * DDP_DEFAULT_CAP_BYTES, 2 * DDP_DEFAULT_CAP_BYTES, 0.0),  # the default would make two buckets only at over twice
    (BIG, BIG / 0.74, 0.0),  # the largest carries under three quarters of the bytes
    (BIG, BIG, 0.25),  # a quarter of the communication overlaps already
])
def test_no_note_outside_the_rule(largest, reduced, overlapped):
    assert one_bucket(largest, reduced, overlapped, 1000.0, True) is None


def test_each_branch_says_what_the_record_can_tell():
    note, fix = one_bucket(BIG, BIG, 0.0, 100.0, True)  # GPU, the cap let one bucket hold it all
    assert f"{BIG / MB:.1f} of the {BIG / MB:.1f} MB" in note and "bucket_cap_mb=100)" in note
    assert fix.startswith(f"One DDP bucket carries {BIG / MB:.0f} MB") and "bucket_cap_mb=100" in fix
    note, fix = one_bucket(BIG, BIG, 0.0, 25.0, True)  # one parameter larger than the cap: no cap splits it
    assert "one parameter larger than bucket_cap_mb=25" in note and fix is None
    note, fix = one_bucket(BIG, BIG, 0.0, None, True)  # traces alone
    assert "would tell" in note and fix is None
    note, fix = one_bucket(BIG, BIG, 0.0, 100.0, False)  # CPU-only
    assert "CPU-only" in note and fix is None


TINY = Path(__file__).parent / "fixtures" / "cpu_tiny_buckets_2rank"


def test_a_bucket_cap_below_the_default_is_named_with_the_count_it_makes():
    per_step = [b for p in sorted(TINY.glob("rank*.pt.trace.json.gz")) for b in _raw_per_step(p)]
    assert {len(b) for b in per_step} == {6} and {sum(b) for b in per_step} == {5_781_508}
    assert max(max(b) for b in per_step) < DDP_DEFAULT_CAP_BYTES
    assert json.loads((TINY / "rank0.probe.json").read_text())["meta"]["model"]["ddp_bucket_cap_mb"] == 0.01
    (c,) = [c for c in fixture_diagnosis(TINY).checks if c.id == "exposed_communication"]
    m = c.finding.metrics
    assert (m["all_reduces_per_step"], m["all_reduce_bytes_per_step"], m["ddp_bucket_cap_mb"]) == (6, 5_781_508, 0.01)
    assert "6 all-reduces a step carry its 5.8 MB of gradients (bucket_cap_mb=0.01)" in c.reason
    assert "default 25 MB buckets would take 1" in c.reason
    assert c.finding.fix.startswith("DDP splits this step's 5.8 MB of gradients into 6 buckets")


def test_small_buckets_needs_the_recorded_cap_below_the_default_and_a_real_split():
    mb = 1024**2
    assert small_buckets(6, 5.8 * mb, None) is None  # traces alone: accumulation without no_sync() looks alike
    assert small_buckets(6, 5.8 * mb, 25.0) is None  # the default cap
    assert small_buckets(3, 5.8 * mb, 1.0) is None  # under MIN_SPLIT
    assert small_buckets(5, 60 * mb, 10.0) is None  # 60 MB takes 3 default buckets: 5 is under twice that
    note, fix = small_buckets(6, 60 * mb, 10.0)
    assert "would take 3" in note and "into 6 buckets (bucket_cap_mb=10)" in fix


def test_many_small_collectives_the_loop_issues_itself_are_told_to_use_ddp():
    """No DDP in the trace (cpu_manual_sync_2rank: one blocking all-reduce per parameter after the
    backward): the fix is DDP itself, not a DDP setting the job does not have."""
    from diagnose.analyzers.communication import FIX_TINY, FIX_TINY_LOOP, MANY_COLLECTIVES

    root = Path(__file__).parent / "fixtures" / "cpu_manual_sync_2rank"
    per_step = [b for p in sorted(root.glob("rank*.pt.trace.json.gz")) for b in _raw_per_step(p)]
    assert {len(b) for b in per_step} == {54} and 54 >= MANY_COLLECTIVES
    evs = [e for e in json.load(gzip.open(next(root.glob("rank0.*.pt.trace.json.gz")), "rt"))["traceEvents"]
           if e.get("ph") == "X"]
    assert not any("DistributedDataParallel" in str(e.get("name")) for e in evs)
    d = fixture_diagnosis(root)
    f = d.findings[0]
    assert f.id == "exposed_communication" and f.fix == FIX_TINY_LOOP
    assert "issued by the training loop itself" in next(c for c in d.checks if c.id == f.id).reason
    # a DDP job is never said to issue its collectives itself
    (c,) = [c for c in fixture_diagnosis(TINY).checks if c.id == "exposed_communication"]
    assert c.finding.fix != FIX_TINY_LOOP and "issued_by" not in c.finding.metrics
    assert FIX_TINY.startswith("Collectives are many and small: raise DDP bucket_cap_mb")
