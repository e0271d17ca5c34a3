"""Every registered analyzer on every shared trace set: no exception, invariants hold."""
from __future__ import annotations

import pytest

from diagnose.analyzers import CHECKLIST, reduce_rank
from diagnose.context import build_context
from diagnose.errors import DiagnoseError
from diagnose.ingest.assemble import load_run
from diagnose.thresholds import DEFAULT
from tests.conftest import SHARED

SETS = ["kineto_resnet50_dataloader_v100/nw0", "kineto_resnet50_dataloader_v100/nw4", "param_dlrm_8rank_v100",
        "hta_sampled_2rank_of128", "hta_nccl_data_rank0of2_a100", "edge_hta_ddp_world1_v100",
        "edge_hta_cpu_only_gloo_rank34of300", "edge_hta_no_distributedinfo", "edge_tracelens_b200_vllm_tp8_rank0"]


@pytest.mark.parametrize("name", SETS)
def test_invariants(name):
    path = SHARED / name
    if not path.exists():
        pytest.skip(f"{path} absent")
    try:
        run = load_run([path], reduce=reduce_rank)
    except DiagnoseError:
        return  # a clear error is an allowed outcome for edge sets; the CLI test checks its form
    ctx = build_context(run)
    t = ctx.table
    parts = t[["compute_ms", "exposed_comm_ms", "straggler_wait_ms", "dataloader_ms", "other_ms"]]
    assert (parts >= -1e-9).all().all()
    assert ((parts.sum(axis=1) - t["step_ms"]).abs() < 1e-6 * t["step_ms"].clip(lower=1) + 1e-6).all()
    for entry in CHECKLIST:
        for c in entry.analyze(ctx, DEFAULT):
            assert c.status in ("flagged", "passed", "not_measurable") and c.reason
            f = c.finding
            if c.status == "flagged":
                assert f is not None
                assert 0 <= f.recoverable_ms <= t["step_ms"].max() + 1e-6
                assert 0 <= f.share_of_step <= 1
                assert f.ranks and f.fix and f.method
