"""Every claim the tool prints on the real traces, pinned.

For each real trace set (../shared/traces) and each recorded job (tests/fixtures): the verdict,
every finding (figure, share, ranks, severity, confidence, metrics, cited events, fix, method),
every check's status, reason and measured figure, and the warnings, compared with a reviewed copy
in tests/golden/. A changed number, word or event fails here with the path of the first
difference; the other tests say whether a number is *right* (computed independently from the raw
events), this one says that nothing moved unseen while the core is rebuilt.

After a deliberate change, regenerate and review the diff:

    DIAGNOSE_GOLDEN=update python -m pytest tests/test_golden.py

Floats are compared at 4 significant digits (timestamps to the nanosecond): the figures are
deterministic on one input, and the rounding keeps a last-bit difference between numpy builds from
failing the test.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import SHARED, shared_diagnosis

GOLDEN = Path(__file__).resolve().parent / "golden"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
SETS = ["kineto_resnet50_dataloader_v100/nw0", "kineto_resnet50_dataloader_v100/nw4", "param_dlrm_8rank_v100",
        "hta_sampled_2rank_of128", "hta_nccl_data_rank0of2_a100", "edge_hta_ddp_world1_v100",
        "edge_hta_cpu_only_gloo_rank34of300", "edge_hta_no_distributedinfo"]
RECORDED = ["cpu_straggler_2rank", "cpu_straggler_dataloader_2rank", "cpu_checkpoint_2rank", "cpu_pipeline_2rank",
            "cpu_pipelining_2rank", "cpu_lightning_straggler_2rank", "cpu_fsdp2_straggler_2rank",
            "cpu_accum_nosync_2rank", "cpu_accum_2rank", "cpu_interleaved_2rank", "cpu_reduce_fp32_2rank",
            "cpu_reduce_bf16_2rank", "cpu_huge_bucket_2rank", "cpu_tiny_buckets_2rank", "cpu_eval_in_loop_2rank",
            "cpu_window_unlike_run_2rank", "cpu_two_optimizers_2rank", "cpu_gan_2rank", "cpu_2d_straggler_4rank",
            "cpu_2d_4rank", "cpu_late_group_8rank", "cpu_uneven_2rank",
            "cpu_hf_lengths_2rank", "cpu_hf_grouped_2rank", "cpu_epoch_starts_2rank",
            "cpu_epoch_sampler_2rank", "cpu_epoch_no_workers_2rank", "cpu_gc_pauses_2rank",
            "cpu_gc_every_2rank", "cpu_gc_in_window_2rank",
            "cpu_gc_in_loader_2rank", "cpu_gc_placed_2rank", "cpu_gc_placed_loader_2rank",
            "cpu_gc_one_rank_2rank", "cpu_manual_sync_2rank", "cpu_eval_one_rank_2rank",
            "cpu_cores_contended_2rank", "cpu_cores_inline_loading_2rank", "cpu_uneven_sampled_2rank",
            "cpu_scale_contended_n2", "cpu_hog_one_rank_2rank", "cpu_cores_contended_short_2rank",
            "cpu_cores_contended_steps_2rank", "cpu_uneven_steps_2rank", "cpu_straggler_sampled_2rank"] + [f"gpu_h200/{d.name}" for d in sorted((FIXTURES / "gpu_h200").iterdir()) if d.is_dir()]


def _round(x):
    if isinstance(x, float):
        return float(f"{x:.4g}")
    if isinstance(x, dict):  # a timestamp keeps its microseconds: "find it in Perfetto" needs them all
        return {str(k): round(v, 3) if k == "ts_us" and isinstance(v, float) else _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x


def claims(d) -> dict:
    """What a user reads: the verdict, findings, checks and warnings (no timeline or breakdown)."""
    from diagnose.output import diagnosis_dict

    body = json.loads(json.dumps(diagnosis_dict(d), default=float))
    return _round({"verdict": body.get("verdict"), "findings": body["findings"], "checks": body["checks"],
                   "warnings": body["warnings"], "steps_analysed": body["run"]["steps_analysed"],
                   "replay": {k: v for k, v in (body["extras"].get("replay") or {}).items()
                              if k != "critical_path"},
                   # the profiled window against the run (diagnose/step/window.py), where the probes timed both
                   **({"window": w} if (w := body["extras"].get("window")) else {})})


def first_difference(a, b, path="$") -> str | None:
    if type(a) is not type(b):
        return f"{path}: {a!r} != {b!r}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}.{k}: only in {'golden' if k in a else 'now'}"
            diff = first_difference(a[k], b[k], f"{path}.{k}")
            if diff:
                return diff
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items in golden, {len(b)} now"
        for i, (x, y) in enumerate(zip(a, b)):
            diff = first_difference(x, y, f"{path}[{i}]")
            if diff:
                return diff
        return None
    return None if a == b else f"{path}: golden {a!r}, now {b!r}"


def check_golden(name: str, d) -> None:
    path = GOLDEN / (name.replace("/", "__") + ".json")
    now = claims(d)
    if os.environ.get("DIAGNOSE_GOLDEN") == "update":
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(json.dumps(now, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    assert path.exists(), f"no golden file {path.name}: run with DIAGNOSE_GOLDEN=update and review it"
    golden = json.loads(path.read_text(encoding="utf-8"))
    diff = first_difference(golden, now)
    assert diff is None, f"{name}: {diff} (deliberate? DIAGNOSE_GOLDEN=update, then review the diff)"


@pytest.mark.parametrize("name", [s for s in SETS if (SHARED / s).exists()] or
                         [pytest.param("shared", marks=pytest.mark.skip("../shared/traces not found"))])
def test_claims_on_the_real_traces_are_unchanged(name):
    check_golden(name, shared_diagnosis(name))


@pytest.mark.parametrize("name", [s for s in SETS if (SHARED / s).exists()] or
                         [pytest.param("shared", marks=pytest.mark.skip("../shared/traces not found"))])
def test_findings_just_past_their_floors_are_unchanged(name):
    """Every floor at zero (tests/conftest.py FLOORS): each check that measures its cause on this
    trace flags, so the finding it prints once its cause crosses the threshold (ranks, cited
    events, confidence, notes, fix) is pinned on every trace, not only where it fires today."""
    from tests.conftest import floor_diagnosis

    check_golden("floor__" + name, floor_diagnosis(name))


@pytest.mark.parametrize("name", RECORDED)
def test_claims_on_the_recorded_jobs_are_unchanged(name):
    from tests.conftest import fixture_diagnosis

    check_golden(name, fixture_diagnosis(FIXTURES / name))


def test_claims_on_a_checkpointing_job_seen_from_its_traces_alone(tmp_path):
    """The same recorded job without its probes' files: what the traces alone can say (the
    checkpoint writes the probe marked in the trace, only inside the profiled steps)."""
    import shutil

    from diagnose.pipeline import diagnose_paths

    for f in (FIXTURES / "cpu_checkpoint_2rank").glob("*.pt.trace.json.gz"):
        shutil.copy(f, tmp_path / f.name)
    d = diagnose_paths([tmp_path])
    ckpt = next(c for c in d.checks if c.id == "checkpoint_io")
    assert ckpt.finding is not None and ckpt.finding.metrics["source"] == "trace (profiled steps only)"
    check_golden("cpu_checkpoint_2rank_traces_only", d)
