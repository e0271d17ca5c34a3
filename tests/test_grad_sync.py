"""The grad_sync check (gradient accumulation without no_sync()) on two recorded jobs: the same
DDP job accumulating 4 micro-batches per optimizer step, once all-reducing after every micro-batch
(tests/fixtures/cpu_accum_nosync_2rank) and once with no_sync() on the first three
(tests/fixtures/cpu_accum_2rank). Each figure is checked against a count written here from the raw
trace events."""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from tests.conftest import fixture_diagnosis

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NOSYNC = FIXTURES / "cpu_accum_nosync_2rank"
SYNCED = FIXTURES / "cpu_accum_2rank"


def raw_counts(path: Path, rank: int) -> list[tuple[int, int, int]]:
    """Per profiled step: (DDP forwards, all-reduces enqueued before the last forward starts, all
    all-reduces), from the raw events of the rank's training thread."""
    f = next(path.glob(f"rank{rank}.*.pt.trace.json.gz"))
    ev = [e for e in json.loads(gzip.decompress(f.read_bytes()))["traceEvents"] if e.get("ph") == "X"]
    out = []
    for s in (e for e in ev if re.fullmatch(r"ProfilerStep#\d+", str(e.get("name")))):
        lo, hi = s["ts"], s["ts"] + s["dur"]
        inside = [e for e in ev if e.get("tid") == s["tid"] and lo <= e["ts"] < hi]
        fw = sorted(e["ts"] for e in inside if e["name"] == "DistributedDataParallel.forward")
        ar = [e["ts"] for e in inside if e["name"] == "c10d::allreduce_"]
        out.append((len(fw), sum(t < fw[-1] for t in ar) if fw else 0, len(ar)))
    return out


def check(d, cid: str):
    return next(c for c in d.checks if c.id == cid)


def test_all_reduces_before_the_last_micro_batch_are_found():
    d = fixture_diagnosis(NOSYNC)
    c = check(d, "grad_sync")
    assert c.status == "flagged", c.reason
    m = c.finding.metrics
    raw = raw_counts(NOSYNC, 0)
    assert {fw for fw, _, _ in raw} == {4}  # 4 micro-batches in every profiled step
    early = [e for _, e, _ in raw]
    total = [t for _, _, t in raw]
    assert m["micro_batches_per_step"] == 4
    assert m["allreduces_before_last_micro_batch"] == pytest.approx(sum(early) / len(early))
    assert m["allreduces_per_step"] == pytest.approx(sum(total) / len(total))
    assert m["allreduces_before_last_micro_batch"] == pytest.approx(0.75 * m["allreduces_per_step"])
    assert c.finding.ranks == (0, 1) and "no_sync()" in c.finding.fix
    # it ranks first: the reductions no_sync() removes cost more than what stays exposed
    assert d.findings[0].id == "grad_sync" and d.findings[0].share_of_step > 0.1


def test_the_same_accumulation_with_no_sync_passes():
    d = fixture_diagnosis(SYNCED)
    c = check(d, "grad_sync")
    raw = raw_counts(SYNCED, 0)
    assert {fw for fw, _, _ in raw} == {4} and {e for _, e, _ in raw} == {0}
    assert c.status == "passed" and "no all-reduce before the last one" in c.reason, c.reason


def test_no_accumulation_passes_and_says_so():
    c = check(fixture_diagnosis(FIXTURES / "cpu_straggler_2rank"), "grad_sync")
    assert c.status == "passed" and "no gradient accumulation" in c.reason
