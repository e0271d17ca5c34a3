"""Host CPU contention, from the probes' samples of the training thread's run-queue delay.

tests/fixtures/cpu_cores_contended_2rank: transforms that burn CPU in two workers per rank on a
2-core host (READMEs there): the DataLoader keeps up, every step stretches, and the tool said
"no significant cause found". cpu_cores_inline_loading_2rank: the same loading in the training
thread, where "more workers" was the fix and does not help."""
from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from diagnose.analyzers.cpu_contention import FIX_WORKERS, ID
from diagnose.analyzers.dataloader import FIX, FIX_NO_CORES
from diagnose.pipeline import diagnose_paths

FIXTURES = Path(__file__).parent / "fixtures"
CONTENDED = FIXTURES / "cpu_cores_contended_2rank"
INLINE = FIXTURES / "cpu_cores_inline_loading_2rank"


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_training_thread_waiting_for_a_core_is_named_with_what_it_costs():
    d = diagnose_paths([CONTENDED])
    f = d.findings[0]
    assert f.id == ID and f.over == "run" and f.confidence == "high" and set(f.ranks) == {0, 1}
    # the figure is the samples' mean wait times the recorded mean step, on the rank that loses most
    lost = {}
    for r in (0, 1):
        wait = np.mean([x["run_wait"] for x in _lines(CONTENDED / f"rank{r}.telemetry.jsonl")])
        steps = [x["dur_ms"] for x in _lines(CONTENDED / f"rank{r}.steps.jsonl") if x["step"] > 0]
        lost[r] = wait * np.mean(steps)
        assert wait > 0.4  # the host's cores shared by 2 ranks and 4 busy workers: far above noise
    worst = max(lost, key=lost.get)
    assert f.metrics["worst_rank"] == worst and f.recoverable_ms == pytest.approx(lost[worst], abs=1e-3)
    assert f.metrics["host_cpu_busy"] > 0.95
    busy = np.mean([x["cpu_busy"] for r in (worst,) for x in _lines(CONTENDED / f"rank{r}.telemetry.jsonl")])
    assert f.fix == FIX_WORKERS.format(ranks=2, workers=4, cores=2, fit=0, busy=f"{busy:.0%} busy over the run")
    # the DataLoader itself kept up: no starvation
    assert next(c for c in d.checks if c.id == "dataloader_starvation").status == "passed"


def test_loading_in_the_training_thread_on_a_full_host_is_not_told_to_add_workers():
    d = diagnose_paths([INLINE])
    f = d.findings[0]
    assert f.id == "dataloader_starvation" and f.metrics["no_spare_cores"] == 1
    assert f.fix.startswith(FIX_NO_CORES.split("{")[0]) and not f.fix.startswith(FIX)
    assert "This host has 2 core(s) for 2 rank(s), and the training thread ran on a core" in f.fix
    # nothing waited for a core: the work is the thread's own
    assert next(c for c in d.checks if c.id == ID).status == "passed"


@pytest.mark.parametrize("fixture", ["cpu_straggler_2rank", "cpu_gc_pauses_2rank"])
def test_probes_that_did_not_sample_the_run_queue_are_not_measured(fixture):
    c = next(c for c in diagnose_paths([FIXTURES / fixture]).checks if c.id == ID)
    assert c.status == "not_measurable" and "run_wait" in c.reason


@pytest.mark.skipif(not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"),
                    reason="no schedstat (not Linux)")
def test_the_sampler_reads_the_training_threads_time_on_and_waiting_for_a_core():
    from diagnose.probes.telemetry import Sampler

    lines = []
    s = Sampler(lines.append, lambda: 3, lambda exc: None, interval_s=0.2)
    s.sample()
    end = time.process_time() + 0.3
    while time.process_time() < end:  # this (main) thread busy: on a core most of the wall time
        pass
    line = s.sample()
    # a thread that never sleeps is on a core or waiting for one, however busy the machine
    assert line["thread_cpu"] > 0.05 and line["run_wait"] >= 0.0
    assert 0.7 <= line["thread_cpu"] + line["run_wait"] <= 1.1


@pytest.mark.skipif(not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"),
                    reason="no schedstat (not Linux)")
def test_the_probe_samples_the_thread_that_runs_the_loop_not_the_main_thread(tmp_path, monkeypatch):
    """A loop run from a worker thread (Ray Train, a trainer started in a thread) with the main
    thread asleep: sampling the main thread read 0 on a core, and a starved loop as no contention."""
    from diagnose.probes.core import Probe, Schedule

    monkeypatch.setenv("DIAGNOSE_TELEMETRY_S", "0.2")
    p = Probe(tmp_path, rank=0, world_size=1, schedule=Schedule(enabled=False))

    def loop() -> None:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:  # busy steps: this thread on a core or waiting for one
            t = time.process_time() + 0.01
            while time.process_time() < t:
                pass
            p.on_step()

    t = threading.Thread(target=loop)
    t.start()
    t.join()  # the main thread asleep in join() the whole time
    p.close()
    lines = _lines(tmp_path / "rank0.telemetry.jsonl")
    assert len(lines) >= 3
    busy = [x["thread_cpu"] + x["run_wait"] for x in lines[:-1]]  # the last may straddle the loop's end
    assert min(busy) > 0.7, busy


def test_turns_of_slowest_rank_on_a_contended_host_are_not_told_to_rebalance_batches():
    """The contended job's batches are equal random tensors, yet the ranks took turns being slowest
    (each the one whose cores the other's workers took): "Uneven work across ranks", fix "batch by
    tokens ... balance the routing", confidence high. Now the reason and the fix say the turns may
    be the contention's, and its confidence is low."""
    from diagnose.analyzers.imbalance import FIX, FIX_CONTENDED

    d = diagnose_paths([CONTENDED])
    assert [f.id for f in d.findings][0] == ID
    f = next(f for f in d.findings if f.id == "load_imbalance")
    assert f.fix == FIX_CONTENDED + FIX["compute_ms"] and f.confidence == "low"
    waits = [np.mean([x["run_wait"] for x in _lines(CONTENDED / f"rank{r}.telemetry.jsonl")]) for r in (0, 1)]
    assert f.metrics["run_wait_share"] == pytest.approx(max(waits), abs=1e-4)
    c = next(c for c in d.checks if c.id == "load_imbalance")
    assert "may be the contention's, not uneven batches" in c.reason and "more work in its batch" not in c.reason


def test_uneven_batches_on_a_host_with_cores_to_spare_keep_their_own_fix():
    """The twin: random extra work per rank and step, the training threads seldom waiting for a core."""
    from diagnose.analyzers.imbalance import FIX

    d = diagnose_paths([FIXTURES / "cpu_uneven_sampled_2rank"])
    assert [f.id for f in d.findings] == ["load_imbalance"]
    f = d.findings[0]
    assert f.fix == FIX["compute_ms"] and f.confidence == "high" and "run_wait_share" not in f.metrics
    assert next(c for c in d.checks if c.id == ID).status == "passed"


def test_a_straggler_slowed_by_a_busy_neighbour_on_its_core_is_told_so_not_to_balance_work():
    from diagnose.analyzers.straggler import FIX_CPU_WAIT

    fixture = FIXTURES / "cpu_hog_one_rank_2rank"
    d = diagnose_paths([fixture])
    assert [f.id for f in d.findings] == [ID, "straggler"]
    late = d.findings[1]
    assert late.ranks == (1,) and late.fix == FIX_CPU_WAIT.format(who="rank 1")
    m = late.metrics
    waits = {r: np.mean([x["run_wait"] for x in _lines(fixture / f"rank{r}.telemetry.jsonl")]) for r in (0, 1)}
    assert m["late_rank_cpu_wait_share"] == pytest.approx(waits[1], abs=1e-4)
    assert m["median_rank_cpu_wait_share"] == pytest.approx(waits[0], abs=1e-4)
    # what it is late from (its ops, the same calls) is about what the extra wait for a core stretched
    assert m["late_from"] == "compute"
    assert m["late_rank_extra_cpu_wait_ms"] == pytest.approx(m["late_rank_extra_compute_ms"], rel=0.25)
    assert "the same work done slower, not more work" in next(c for c in d.checks if c.id == "straggler").reason


def test_a_late_rank_not_short_of_cores_keeps_its_fix():
    """A sleeping rank waits for no core (its share barely above the other's): the straggler's fix
    stays the host gaps', with no claim about cores."""
    from diagnose.analyzers.straggler import FIX_BY_SOURCE
    from diagnose.probedata import load_probe_data, run_wait_shares

    fixture = FIXTURES / "cpu_straggler_sampled_2rank"
    shares = run_wait_shares(load_probe_data([fixture]))
    assert set(shares) == {0, 1} and shares[1] < 0.01  # read at every step, and next to nothing
    late = next(f for f in diagnose_paths([fixture]).findings if f.id == "straggler")
    assert late.ranks == (1,) and late.fix == FIX_BY_SOURCE["other_ms"].format(who="rank 1")
    assert "late_rank_cpu_wait_share" not in late.metrics


def test_a_run_too_short_for_the_telemetry_is_measured_from_its_steps():
    """The probes read the training thread's run-queue wait at every step end (run_wait_ms): a
    2.5 s run with one telemetry sample a rank was "not measurable"; its 9 recorded steps say 35%."""
    from diagnose.probedata import RUN_WAIT_SAMPLES, load_probe_data, run_wait_basis

    fixture = FIXTURES / "cpu_cores_contended_short_2rank"
    probes = load_probe_data([fixture])
    for r, p in probes.items():
        assert len(_lines(fixture / f"rank{r}.telemetry.jsonl")) < RUN_WAIT_SAMPLES
        raw = _lines(fixture / f"rank{r}.steps.jsonl")
        waits = [x["run_wait_ms"] for x in raw if "run_wait_ms" in x]
        assert len(waits) == len(raw) - 1  # every step but the first (no reading before it)
        assert all(0 <= x["run_wait_ms"] <= x["dur_ms"] for x in raw if "run_wait_ms" in x)
        share, over = run_wait_basis(p)
        timed = [x for x in raw if "run_wait_ms" in x and x["step"] > 0]
        assert share == pytest.approx(sum(x["run_wait_ms"] for x in timed) / sum(x["dur_ms"] for x in timed))
        assert over == f"{len(timed)} recorded steps"
    d = diagnose_paths([fixture])
    assert d.findings[0].id == ID
    c = next(c for c in d.checks if c.id == ID)
    assert "recorded steps" in c.reason


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="no schedstat (not Linux)")
def test_the_probe_records_each_steps_wait_for_a_core_from_the_loops_thread(tmp_path, monkeypatch):
    from diagnose.probes.core import Probe, Schedule

    monkeypatch.setenv("DIAGNOSE_TELEMETRY_S", "0")
    p = Probe(tmp_path, rank=0, world_size=1, schedule=Schedule(enabled=False))
    seen = {}

    def loop() -> None:
        seen["tid"] = threading.get_native_id()
        for _ in range(12):
            t = time.process_time() + 0.01
            while time.process_time() < t:  # busy: on a core, or ready and waiting for one
                pass
            p.on_step()
        seen["read"] = os.readlink(f"/proc/self/fd/{p._sched_fd}")

    t = threading.Thread(target=loop)
    t.start()
    t.join()  # the main thread asleep meanwhile
    p.close()
    # the counter read is the loop thread's, not the main thread's
    assert seen["read"] == f"/proc/{os.getpid()}/task/{seen['tid']}/schedstat"
    raw = _lines(tmp_path / "rank0.steps.jsonl")
    assert "run_wait_ms" not in raw[0] and all("run_wait_ms" in x for x in raw[1:])
    assert all(0 <= x["run_wait_ms"] <= x["dur_ms"] + 1 for x in raw[1:])


STEPS_CONTENDED = FIXTURES / "cpu_cores_contended_steps_2rank"
STEPS_UNEVEN = FIXTURES / "cpu_uneven_steps_2rank"


def _slowest_starved(fixture: Path) -> tuple[float, float]:
    """From the raw records: per step, the rank that held the collectives longest and its lead,
    and its wait for a core above the other rank's; means over the steps both ranks read."""
    raw = {r: {x["step"]: x for x in _lines(fixture / f"rank{r}.steps.jsonl")} for r in (0, 1)}
    starved, lead = [], []
    for step in sorted(set(raw[0]) & set(raw[1])):
        a, b = raw[0][step], raw[1][step]
        if "run_wait_ms" not in a or "run_wait_ms" not in b or not a["collectives"] or not b["collectives"]:
            continue
        gaps = [0.0, 0.0]
        for ca, cb in zip(a["collectives"], b["collectives"]):
            ta, tb = a["start"] + ca[1] / 1000, b["start"] + cb[1] / 1000
            gaps[0 if ta > tb else 1] += abs(ta - tb)
        slow = 0 if gaps[0] > gaps[1] else 1
        if gaps[slow] <= 0:
            continue
        mine, other = (a, b) if slow == 0 else (b, a)
        starved.append(mine["run_wait_ms"] - other["run_wait_ms"])
        lead.append(gaps[slow] * 1000)
    return float(np.mean(starved)), float(np.mean(lead))


def test_turns_that_follow_the_wait_for_a_core_step_by_step_are_the_contentions():
    """With the wait for a core read at every step end, the record tells, step by step, whether
    the rank slowest at a step is the one that waited for a core: here it is, and uneven work is
    not flagged beside the contention (it was, as "may be the contention's")."""
    d = diagnose_paths([STEPS_CONTENDED])
    assert [f.id for f in d.findings][:1] == [ID] and "load_imbalance" not in [f.id for f in d.findings]
    c = next(c for c in d.checks if c.id == "load_imbalance")
    assert c.status == "passed" and "the turns are the host's CPU contention's" in c.reason
    starved, lead = _slowest_starved(STEPS_CONTENDED)
    assert starved >= 0.5 * lead
    said = re.search(r"waited ([\d.]+) ms more for a core than the median other rank, against its ([\d.]+) ms lead",
                     c.reason)
    assert float(said[1]) == pytest.approx(starved, abs=0.1) and float(said[2]) == pytest.approx(lead, rel=0.01)


def test_turns_that_do_not_follow_the_wait_for_a_core_stay_uneven_work():
    """Uneven work on a host whose threads also wait for cores (--uneven-ms with CPU-heavy loading):
    the slowest rank of a step is not the one that waited: uneven work, said without "may be"."""
    from diagnose.analyzers.imbalance import FIX

    d = diagnose_paths([STEPS_UNEVEN])
    f = next(f for f in d.findings if f.id == "load_imbalance")
    assert f.fix == FIX["compute_ms"] and f.confidence != "low"
    starved, lead = _slowest_starved(STEPS_UNEVEN)
    assert starved < 0.5 * lead
    c = next(c for c in d.checks if c.id == "load_imbalance")
    assert "not the contention's" in c.reason and "may be" not in c.reason
