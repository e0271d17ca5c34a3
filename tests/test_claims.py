"""Claims the tool prints, pinned by fast deterministic tests (issue 21).

Each test names the claim and the mutation of the code it catches. Independent figures are
computed here from the raw files (gzip + json, not the tool's loader), never by calling the
code under test for the number being checked.
"""
from __future__ import annotations

import gzip
import json
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from diagnose.analyzers.common import flag_or_pass
from diagnose.model import Finding
from diagnose.pipeline import diagnose_paths
from diagnose.thresholds import DEFAULT, Thresholds
from tests.conftest import floor_diagnosis, shared, shared_diagnosis

SETS = ["kineto_resnet50_dataloader_v100/nw0", "kineto_resnet50_dataloader_v100/nw4", "param_dlrm_8rank_v100",
        "hta_sampled_2rank_of128", "hta_nccl_data_rank0of2_a100", "edge_hta_ddp_world1_v100",
        "edge_hta_cpu_only_gloo_rank34of300"]


def diagnosis(name: str):
    return shared_diagnosis(name)


@lru_cache(maxsize=None)
def raw_events(path: Path) -> dict[tuple[float, float], list[str]]:
    """Complete ('X') events of a raw trace file by (ts, dur): read with gzip + json only."""
    opener = gzip.open if path.read_bytes()[:2] == b"\x1f\x8b" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    out: dict[tuple[float, float], list[str]] = {}
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e:
            key = (round(float(e["ts"]), 3), round(float(e.get("dur", 0)), 3))
            out.setdefault(key, []).append(str(e.get("name", "")))
    return out


def check(d, cid):
    return next(c for c in d.checks if c.id == cid)


# ---- thresholds and severities at their boundaries ---------------------------------------------
def test_severity_levels_change_exactly_at_their_thresholds():
    """Catches: severity_high or severity_medium moved (e.g. 0.20 -> 0.50)."""
    th = DEFAULT
    assert th.severity_high == 0.20 and th.severity_medium == 0.10
    assert th.severity(0.1999) == "medium" and th.severity(0.20) == "high"
    assert th.severity(0.0999) == "low" and th.severity(0.10) == "medium"


FLAG_LEVELS = ("input_bound", "input_stall", "communication", "straggler", "launch_overhead", "host_sync",
               "pipeline_bubble", "checkpoint", "device_wait")


@pytest.mark.parametrize("field", FLAG_LEVELS)
def test_a_finding_is_flagged_from_its_threshold_and_not_below(field):
    """Catches: the comparison in flag_or_pass (the one place every time check decides) turned
    strict or inverted; a floor moved off the documented 5% / 10%. Which floor each check passes
    to it: test_each_check_decides_at_its_own_threshold."""
    th = Thresholds()
    level = getattr(th, field)
    assert level in (0.05, 0.10), f"{field}={level}: the documented floors are 5% or 10% of the step"
    step_ms = 100.0

    def finding(share: float) -> Finding:
        return Finding(id="x", title="x", severity=th.severity(share), recoverable_ms=share * step_ms,
                       share_of_step=share, ranks=(0,), metrics={}, events=(), fix="", confidence="high", method="")

    assert flag_or_pass(finding(level - 1e-4), level, th, "x").status == "passed"
    assert flag_or_pass(finding(level), level, th, "x").status == "flagged"
    # under the healthy floor nothing is flagged, whatever the share (a 0.04 ms "cause" on a 0.1 ms step)
    tiny = Finding(id="x", title="x", severity="high", recoverable_ms=th.healthy_floor_ms / 2, share_of_step=0.5,
                   ranks=(0,), metrics={}, events=(), fix="", confidence="high", method="")
    assert flag_or_pass(tiny, level, th, "x").status == "passed"


# ---- confidence rules and not_measurable reasons ---------------------------------------------------
def test_a_subset_of_ranks_lowers_confidence():
    """Catches: confidence no longer lowered when under half of the ranks are loaded."""
    root = shared("param_dlrm_8rank_v100")
    files = sorted(root.glob("worker*.json.gz"))
    th = replace(DEFAULT, communication=0.0)  # flagged whatever its size: the confidence rule is the subject
    full = diagnose_paths([root], th)
    part = diagnose_paths([str(p) for p in files[:3]], th)
    levels = ["low", "medium", "high"]
    c_full = check(full, "exposed_communication").finding.confidence
    c_part = check(part, "exposed_communication").finding.confidence
    assert levels.index(c_part) == levels.index(c_full) - 1, (c_full, c_part)


def test_one_profiled_step_lowers_confidence():
    """DLRM holds one step per rank: a check whose base is high says medium."""
    d = diagnose_paths([shared("param_dlrm_8rank_v100")], replace(DEFAULT, communication=0.0))
    assert check(d, "exposed_communication").finding.confidence == "medium"
    assert d.run.steps_analysed == 1


@pytest.mark.parametrize("name", ["kineto_resnet50_dataloader_v100/nw0", "hta_nccl_data_rank0of2_a100",
                                  "edge_hta_ddp_world1_v100"])
def test_a_single_rank_cannot_show_a_straggler(name):
    """Catches: a single-rank trace's straggler check reported passed instead of not_measurable."""
    c = check(diagnosis(name), "straggler")
    assert c.status == "not_measurable" and "two ranks" in c.reason


def test_cpu_only_traces_say_gpu_checks_cannot_be_measured():
    d = diagnosis("edge_hta_cpu_only_gloo_rank34of300")
    for cid in ("input_stall", "host_sync"):
        assert check(d, cid).status == "not_measurable", cid


# ---- evidence is where the report says it is -------------------------------------------------------
@pytest.mark.parametrize("floors", [False, True], ids=["default", "floors"])
@pytest.mark.parametrize("name", SETS)
def test_every_cited_event_exists_in_the_raw_file_exactly_as_cited(name, floors):
    """Catches: evidence ts_us/dur_us shifted (aligned clock, a row off by one), names mangled.
    With every floor at zero, each check that measures its cause flags: its evidence is checked too."""
    d = floor_diagnosis(name) if floors else diagnosis(name)
    root = shared(name)
    cited = [(f.id, e) for f in d.findings for e in f.events]
    for fid, e in cited:
        path = next(root.rglob(e.file))
        names = raw_events(path).get((round(e.ts_us, 3), round(e.dur_us, 3)))
        assert names, f"{fid}: no event at ts={e.ts_us} dur={e.dur_us} in {e.file}"
        assert any(n[:300] == e.name for n in names), f"{fid}: {e.name!r} not among {names[:3]}"


# ---- the straggler's wait: what the others spend waiting for it alone ------------------------------
def _nccl_kernels(path: Path) -> list[tuple[float, float]]:
    doc = json.load(gzip.open(path, "rt"))
    ks = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in doc["traceEvents"]
          if e.get("ph") == "X" and e.get("cat") == "kernel" and str(e.get("name", "")).startswith("ncclKernel")]
    return sorted(ks)


def test_straggler_wait_is_the_others_wait_for_the_last_rank_alone():
    """Catches: the straggler's own (zero) wait counted in the median; a wait measured to the
    second-latest instead of the latest arrival. Independent: NCCL kernels from the raw files,
    matched by order (every rank issues the same collectives in one group on this job), each
    rank's tail wait = min(last arrival, its kernel end) - max(its arrival, second-latest)."""
    root = shared("param_dlrm_8rank_v100")
    kernels = {int(p.name[6]): _nccl_kernels(p) for p in sorted(root.glob("worker*.json.gz"))}
    n = min(len(k) for k in kernels.values())
    assert n >= 4 and all(len(k) == n for k in kernels.values())
    tail = {r: 0.0 for r in kernels}
    last_count = {r: 0 for r in kernels}
    for i in range(n):
        arr = {r: k[i][0] for r, k in kernels.items()}
        order = sorted(arr, key=arr.get)
        latest, second = arr[order[-1]], arr[order[-2]]
        last_count[order[-1]] += 1
        for r, (s, e) in ((r, k[i]) for r, k in kernels.items()):
            tail[r] += max(0.0, min(latest, e) - max(s, second))
    late = max(last_count, key=last_count.get)
    expected_ms = float(np.median([v for r, v in tail.items() if r != late])) / 1000
    # by its effect (the replay with rank 7 brought to the median rank: 0.77 ms, 4.8% of the step)
    # rank 7 stays under the 5% threshold; the wait it imposes is read with a lower threshold
    c = check(diagnosis("param_dlrm_8rank_v100"), "straggler")
    assert c.status == "passed" and c.reason.startswith("rank 7 is last to arrive"), c.reason
    assert "gives back 0.8 ms per step (replayed)" in c.reason and "below the 5% threshold" in c.reason
    f = check(diagnose_paths([shared("param_dlrm_8rank_v100")], replace(DEFAULT, straggler=0.03)), "straggler").finding
    assert f.ranks == (late,) == (7,)
    # the check's own estimate counts only the part of the wait not hidden under compute: never
    # more than this
    own = f.metrics["wait_imposed_ms_per_step"]
    assert own == f.metrics["own_estimate_ms"]
    assert own <= expected_ms * 1.02 + 0.01
    assert own >= 0.8 * expected_ms, (own, expected_ms)
    # the replay gives back less: rank 7 brought to the median rank still leaves the others'
    # spread, so the step shrinks by less than the others waited for it
    assert f.recoverable_ms == f.metrics["replay_recoverable_ms"]
    assert 0 < f.recoverable_ms < own


def test_two_rank_straggler_wait_excludes_the_late_ranks_own(tmp_path):
    """Catches: the median taken over all ranks, the straggler's own (zero) wait included: with
    two ranks that halves the figure. Rank 1 arrives 2 ms late at every step; rank 0 waits
    exactly those 2 ms inside the transfer (hand-built gloo pair)."""
    from tests.test_straggler import write_pair

    write_pair(tmp_path, [1] * 6, late_us=2_000.0)
    f = check(diagnose_paths([tmp_path]), "straggler").finding
    assert f.ranks == (1,) and f.recoverable_ms == pytest.approx(2.0, abs=0.01)


# ---- input stall: host-to-device copies while no kernel runs ---------------------------------------
def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for s, e in a:
        cur = s
        for bs, be in b:
            if be <= cur or bs >= e:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
        if cur < e:
            out.append((cur, e))
    return out


def _overlap(a: list[tuple[float, float]], s: float, e: float) -> float:
    return sum(max(0.0, min(e, be) - max(s, bs)) for bs, be in a)


def _exposed_h2d_ms_per_step(path: Path) -> float:
    doc = json.load(gzip.open(path, "rt"))
    ev = [e for e in doc["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    span = lambda e: (float(e["ts"]), float(e["ts"]) + float(e["dur"]))  # noqa: E731
    kernels = _union([span(e) for e in ev if e.get("cat") in ("kernel", "Kernel")])
    h2d = _union([span(e) for e in ev if e.get("cat") in ("gpu_memcpy", "Memcpy") and "HtoD" in e["name"]])
    steps = [span(e) for e in ev if str(e["name"]).startswith("ProfilerStep#")]
    exposed = _minus(h2d, kernels)
    return float(np.mean([_overlap(exposed, s, e) for s, e in steps])) / 1000


@pytest.mark.parametrize("name", ["kineto_resnet50_dataloader_v100/nw0", "kineto_resnet50_dataloader_v100/nw4"])
def test_input_stall_figure_matches_the_raw_copies(name):
    """The measured (not flagged) input-stall figure: copies with no kernel alongside, per step."""
    c = check(diagnosis(name), "input_stall")
    expected = _exposed_h2d_ms_per_step(next(shared(name).glob("*.json.gz")))
    assert expected > 1.0 and c.measured_ms == pytest.approx(expected, rel=0.01, abs=0.01)


def _gpu_trace_with_blocking_copies(path: Path, copy_us: float, steps: int = 4, step_us: float = 10_000.0) -> None:
    """One GPU rank, hand-built: each step a kernel, then a host-to-device copy with nothing else on
    the device, then a kernel; launches linked by correlation ids as Kineto writes them."""
    ev, corr = [], 1
    for s in range(steps):
        t0 = 1_000_000.0 + s * step_us
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "ts": t0, "dur": step_us,
                   "pid": 10, "tid": 10})
        k1_end = t0 + 0.5 * step_us
        for cat, name, ts, dur in (("kernel", "gemm_kernel", t0 + 100, k1_end - t0 - 100),
                                   ("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", k1_end, copy_us),
                                   ("kernel", "gemm_kernel", k1_end + copy_us, t0 + step_us - 100 - k1_end - copy_us)):
            launch = "cudaMemcpyAsync" if cat == "gpu_memcpy" else "cudaLaunchKernel"
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": launch, "ts": ts - 50, "dur": 10, "pid": 10,
                       "tid": 10, "args": {"correlation": corr}})
            ev.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7,
                       "args": {"correlation": corr, "device": 0, "stream": 7}})
            corr += 1
    doc = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "GPU"}], "traceEvents": ev}
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("copy_us,flagged", [(450.0, False), (2_000.0, True)])
def test_input_stall_flags_blocking_copies_from_its_threshold(tmp_path, copy_us, flagged):
    """Catches: input_stall never flagging; its threshold moved. 0.45 ms of a 10 ms step is 4.5%
    (under the 5% floor), 2 ms is 20%."""
    _gpu_trace_with_blocking_copies(tmp_path / "rank0.pt.trace.json", copy_us)
    c = check(diagnose_paths([tmp_path]), "input_stall")
    assert c.measured_ms == pytest.approx(copy_us / 1000, abs=0.01)
    assert (c.status == "flagged") is flagged, c.reason


# ---- pipeline bubbles: m read from torch.distributed.pipelining's own labels -----------------------
def test_microbatches_and_bound_of_a_scheduled_pipeline_come_from_its_labels():
    """tests/fixtures/cpu_pipelining_2rank (ScheduleGPipe, 2 stages): m is the number of distinct
    'Forward i' ranges in a profiled step, counted here from the raw file, and the bound is GPipe's
    (p - 1) / (m + p - 1). Catches: m from the transfer count instead, a stage count off by one."""
    from tests.conftest import fixture_diagnosis

    root = Path(__file__).resolve().parent / "fixtures" / "cpu_pipelining_2rank"
    per_step = []
    for path in sorted(root.glob("*.pt.trace.json.gz")):
        evs = [e for e in json.load(gzip.open(path, "rt"))["traceEvents"] if e.get("ph") == "X"]
        for s in (e for e in evs if str(e["name"]).startswith("ProfilerStep#")):
            lo, hi = s["ts"], s["ts"] + s["dur"]
            per_step.append(len({e["name"] for e in evs if str(e["name"]).startswith("Forward ")
                                 and lo <= e["ts"] < hi}))
    m = int(np.median(per_step))
    c = check(fixture_diagnosis(root), "pipeline_bubble")
    metrics = c.finding.metrics
    assert (metrics["microbatches"], metrics["microbatches_source"], metrics["stages"]) == (m, "micro-batch labels", 2)
    assert metrics["bound_fraction"] == pytest.approx((2 - 1) / (m + 2 - 1), abs=1e-4)


# ---- each check decides at its own threshold ------------------------------------------------------
FIELD = {"dataloader_starvation": "input_bound", "input_stall": "input_stall", "exposed_communication": "communication",
         "device_wait": "device_wait", "pipeline_bubble": "pipeline_bubble", "checkpoint_io": "checkpoint",
         "host_sync": "host_sync", "grad_sync": "grad_sync"}
"""Check -> the Thresholds field it flags from (launch_overhead: per device, below). The straggler's
floor also chooses which ranks it names, so it has its own boundary tests (tests/test_straggler.py)."""
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.mark.parametrize("where", ["kineto_resnet50_dataloader_v100/nw0", "param_dlrm_8rank_v100",
                                   "hta_sampled_2rank_of128", "cpu_pipeline_2rank", "cpu_checkpoint_2rank",
                                   "cpu_accum_nosync_2rank"])
def test_each_check_decides_at_its_own_threshold(where):
    """With every floor at zero each check that measures a cause flags, with the share it decides
    on (the replay's where the step model is faithful); set that check's own threshold 0.3% of the
    step above that share and it passes, 0.3% below and it flags. Catches: a check reading another
    check's threshold, comparing a different figure from the one it reports, or a threshold moved."""
    from tests.conftest import FLOORS, threshold_diagnosis

    path = FIXTURES / where if where.startswith("cpu_") else shared(where)
    floors = threshold_diagnosis(path, **dict.fromkeys(FLOORS, 0.0))
    cpu = floors.run.device == "cpu"
    tried = []
    for f in floors.findings:
        field = FIELD.get(f.id) or ({"launch_overhead": "cpu_op_overhead" if cpu else "launch_overhead"}.get(f.id))
        if field is None or f.kind != "time" or f.share_of_step < 0.01 or f.recoverable_ms < 0.5:
            continue
        above = check(threshold_diagnosis(path, **{field: f.share_of_step + 0.003}), f.id)
        below = check(threshold_diagnosis(path, **{field: f.share_of_step - 0.003}), f.id)
        assert (above.status, below.status) == ("passed", "flagged"), (f.id, field, f.share_of_step)
        tried.append(f.id)
    assert tried, "no check measured a cause here"
