"""The scaling arithmetic on hand-built points (the e2e tests run real jobs)."""
from __future__ import annotations

from pathlib import Path

import pytest

from diagnose.scaling import ScalePoint, account


def point(n, step, causes, compute, batch=32, replayed=None):
    return ScalePoint(nproc=n, step_ms=step, step_source="probe steps", per_rank_batch=batch,
                      throughput=n * batch / step * 1000, speedup=1.0, efficiency=1.0, run_dir=f"n{n}",
                      trace_step_ms=step, causes_ms=causes, compute_ms=compute, replayed_step_ms=replayed,
                      causes_from="replay" if replayed else "checks")


def test_weak_scaling_straggler_accounts_for_the_whole_loss():
    base = point(1, 100.0, {"dataloader_starvation": 10.0, "straggler": 0.0}, 90.0)
    top = point(2, 150.0, {"dataloader_starvation": 10.0, "straggler": 50.0}, 90.0)
    s = account({1: base, 2: top})
    assert s.ideal_speedup == 2 and s.observed_speedup == pytest.approx(100 / 150 * 2, abs=1e-3)
    bars = {b.id: b.lost_speedup for b in s.waterfall}
    assert s.waterfall[0].id == "straggler"
    assert bars["straggler"] == pytest.approx(2 * 50 / 150, abs=1e-3)
    # an equally slow loader at both sizes costs no speedup under weak scaling
    assert bars["dataloader_starvation"] == pytest.approx(0.0, abs=1e-9)
    assert bars["unexplained"] == pytest.approx(0.0, abs=1e-3)
    assert sum(bars.values()) == pytest.approx(s.ideal_speedup - s.observed_speedup, abs=1e-3)
    w = {x.id: x for x in s.what_if}
    assert w["straggler"].step_ms == pytest.approx(100.0) and w["straggler"].speedup == pytest.approx(2.0, abs=1e-3)


def test_strong_scaling_moves_fixed_costs_into_the_waterfall():
    # per-op overhead of 10 ms does not shrink when the per-rank batch halves
    base = point(1, 100.0, {"launch_overhead": 10.0}, 90.0, batch=64)
    top = point(2, 55.0, {"launch_overhead": 10.0}, 45.0, batch=32)
    s = account({1: base, 2: top}, mode="strong")
    bars = {b.id: b.lost_speedup for b in s.waterfall}
    assert bars["launch_overhead"] == pytest.approx(2 * (10 - 5) / 55, abs=1e-3)
    assert bars["compute_inflation"] == pytest.approx(0.0, abs=1e-9)


def test_unexplained_is_always_reported():
    s = account({1: point(1, 100.0, {}, 100.0), 2: point(2, 130.0, {}, 100.0)})
    ids = [b.id for b in s.waterfall]
    assert "unexplained" in ids and "compute_inflation" in ids
    assert dict((b.id, b.lost_speedup) for b in s.waterfall)["unexplained"] == pytest.approx(2 - 2 * 100 / 130, abs=1e-3)


def test_replayed_costs_the_verdict_and_what_ifs_that_stay_positive():
    """Replayed costs overlap (straggler 60 + DataLoader 40 > the 80 ms the two cost together):
    the waterfall still sums to the lost speedup through unexplained; a what-if takes what the
    replay gives back off the probed step; the verdict names the straggler's rank."""
    base = point(1, 100.0, {"straggler": 0.0, "dataloader_starvation": 0.0}, 100.0, replayed=100.0)
    top = point(2, 180.0, {"straggler": 60.0, "dataloader_starvation": 40.0}, 100.0, replayed=180.0)
    s = account({1: base, 2: top}, ranks_by_cause={"straggler": (1,)})
    bars = {b.id: b for b in s.waterfall}
    assert sum(b.lost_speedup for b in s.waterfall) == pytest.approx(s.ideal_speedup - s.observed_speedup, abs=1e-3)
    assert bars["unexplained"].delta_ms == pytest.approx(-20.0, abs=1e-6)  # the overlap, shown
    assert all(b.delta_ms <= top.step_ms for b in s.waterfall)
    w = {x.id: x for x in s.what_if}
    assert w["straggler"].step_ms == pytest.approx(120.0) and w["every_cause"].step_ms == pytest.approx(100.0)
    assert all(x.step_ms > 0 for x in s.what_if)
    assert s.verdict.startswith("1.11x of an ideal 2.00x at N=2: the largest loss is waiting for a straggler on rank 1")
    assert "without it a step would take 120.0 ms" in s.verdict


def test_the_wait_for_a_changing_slowest_rank_is_called_uneven_work():
    """With no straggler named at the largest N, the straggler's replayed cost is every rank brought
    to the median; where that run's finding is uneven work, the verdict says so, not "a straggler"."""
    base = point(1, 100.0, {"straggler": 0.0}, 100.0, replayed=100.0)
    top = point(2, 160.0, {"straggler": 60.0}, 100.0, replayed=160.0)
    s = account({1: base, 2: top}, ranks_by_cause={"load_imbalance": (0, 1)})
    assert s.verdict.startswith("1.25x of an ideal 2.00x at N=2: the largest loss is uneven work across ranks "
                                "(waiting for each step's slowest rank) (0.75x"), s.verdict
    named = account({1: base, 2: top}, ranks_by_cause={"straggler": (1,)})
    assert "the largest loss is waiting for a straggler on rank 1" in named.verdict


def test_a_wait_comes_off_the_probed_step_as_it_is_and_host_op_time_is_scaled():
    """The profiled steps (509 ms replayed) are longer than the probed ones (490 ms) by the
    profiler's per-op overhead: a 410 ms DataLoader wait lasts as long in both, so the step
    without it is 490 - 410 = 80 ms (the ratio 490 x 99/509 kept 16 ms of the wait: 96 ms).
    Launch overhead is the host's own op time, which the overhead lengthens: scaled. A wait
    longer than the probed step (the profiled window unlike the rest): scaled, never negative."""
    top = ScalePoint(nproc=2, step_ms=490.0, step_source="probe steps", per_rank_batch=32, throughput=None,
                     speedup=1.0, efficiency=1.0, run_dir="n2", trace_step_ms=509.0,
                     causes_ms={"dataloader_starvation": 410.0, "launch_overhead": 50.9, "straggler": 495.0},
                     compute_ms=90.0, replayed_step_ms=509.0, causes_from="replay")
    w = {x.id: x.step_ms for x in account({1: point(1, 100.0, {}, 100.0, replayed=100.0), 2: top}).what_if}
    assert w["dataloader_starvation"] == pytest.approx(80.0)
    assert w["launch_overhead"] == pytest.approx(490.0 * (509.0 - 50.9) / 509.0, abs=1e-3)
    assert w["straggler"] == pytest.approx(490.0 * 14.0 / 509.0, abs=1e-3)
    assert w["every_cause"] == pytest.approx(490.0 - (509.0 - 90.0))


def test_an_estimate_as_long_as_the_step_gets_no_what_if():
    # a check's own estimate (no replay) can reach the step: no zero or negative what-if step
    s = account({1: point(1, 100.0, {}, 100.0), 2: point(2, 120.0, {"straggler": 130.0}, 100.0)})
    assert [x.id for x in s.what_if] == []


FIXTURES = Path(__file__).parent / "fixtures"


def test_more_ranks_on_the_same_cores_lose_speedup_to_cpu_contention_not_compute_inflation():
    """tests/fixtures/cpu_scale_contended_n1 / _n2 (READMEs there): one job at 1 and 2 ranks whose
    samples burn CPU in two DataLoader workers a rank, on this 2-core host. The step doubles (121 ->
    250 ms); the waterfall called it compute inflation, the growth of the step with every cause
    removed. The probes sample each training thread's wait for a core: that wait is the loss."""
    from diagnose.probedata import load_probe_data, run_wait_shares
    from diagnose.scaling import analyze_scaling

    n1, n2 = FIXTURES / "cpu_scale_contended_n1", FIXTURES / "cpu_scale_contended_n2"
    s, _ = analyze_scaling({1: n1, 2: n2})
    assert s.waterfall[0].id == "cpu_contention", s.waterfall
    assert "the largest loss is CPU contention" in s.verdict
    bars = {b.id: b for b in s.waterfall}
    # compute inflation no longer carries the wait (it read +60 ms and more before)
    assert bars["compute_inflation"].delta_ms < 0.5 * bars["cpu_contention"].delta_ms
    # each size's figure: the largest share of wall time a rank's training thread waited for a core,
    # of the traced step, taken out of compute (which held it)
    for n, d in ((1, n1), (2, n2)):
        p = next(x for x in s.points if x.nproc == n)
        share = max(run_wait_shares(load_probe_data([d])).values())
        assert p.causes_ms["cpu_contention"] == pytest.approx(share * p.trace_step_ms, rel=1e-6)
    assert sum(b.lost_speedup for b in s.waterfall) == pytest.approx(s.ideal_speedup - s.observed_speedup, abs=1e-3)
    # slow at one rank already (1 rank and 2 workers on 2 cores), but most of the loss comes with the second rank
    assert [f["id"] for f in s.baseline] == ["cpu_contention"]
    assert bars["cpu_contention"].delta_ms > 4 * s.points[0].causes_ms["cpu_contention"]
    assert not [w for w in s.warnings if "not read" in w]


def test_a_size_whose_wait_for_a_core_was_not_sampled_is_said(tmp_path):
    """A run of a few seconds has too few telemetry samples: its contention counts as none, and the
    scaling warns, rather than leaving a bar that silently carries the other size's."""
    import shutil

    from diagnose.scaling import analyze_scaling

    n1 = tmp_path / "n1"
    shutil.copytree(FIXTURES / "cpu_scale_contended_n1", n1, ignore=shutil.ignore_patterns("*.telemetry.jsonl"))
    s, _ = analyze_scaling({1: n1, 2: FIXTURES / "cpu_scale_contended_n2"})
    assert "cpu_contention" not in s.points[0].causes_ms
    assert any(w.startswith("N=1: the training threads' wait for a core was not read") for w in s.warnings)
