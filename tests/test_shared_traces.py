"""Behaviour on the real traces in ../shared/traces (see its README for what is known)."""
from __future__ import annotations

import pytest

from diagnose.errors import DiagnoseError
from tests.conftest import shared, shared_diagnosis


def ids(d):
    return [f.id for f in d.findings]


def check(d, cid):
    return next(c for c in d.checks if c.id == cid)


def test_resnet_nw0_dataloader_starvation_ranks_first():
    d = shared_diagnosis("kineto_resnet50_dataloader_v100/nw0")
    top = d.findings[0]
    assert top.id == "dataloader_starvation"
    # blocked in the DataLoader about a third of each step ...
    assert top.metrics["blocked_share_of_step"] >= 0.25
    # ... of which the part the GPU also idles is what fixing it gives back
    assert top.share_of_step >= 0.15


def test_resnet_nw4_dataloader_not_flagged():
    d = shared_diagnosis("kineto_resnet50_dataloader_v100/nw4")
    assert check(d, "dataloader_starvation").status == "passed"


def test_resnet_prediction_matches_the_fix():
    """nw0 -> nw4 is the fix, by construction: the predicted saving should match the measured one."""
    before = shared_diagnosis("kineto_resnet50_dataloader_v100/nw0")
    after = shared_diagnosis("kineto_resnet50_dataloader_v100/nw4")
    measured = before.run.mean_step_ms[0] - after.run.mean_step_ms[0]
    predicted = before.findings[0].recoverable_ms
    assert abs(predicted - measured) / measured < 0.25


def test_dlrm_all_ranks_communication_and_rank7_late():
    d = shared_diagnosis("param_dlrm_8rank_v100")
    assert d.run.ranks_found == tuple(range(8)) and d.run.ranks_missing == ()
    comm = check(d, "exposed_communication")
    assert comm.status == "flagged"
    # NCCL dominates the device time of every rank
    lo = int(comm.finding.metrics["comm_share_of_device_time"].split("-")[0].rstrip("%"))
    assert lo >= 50
    strag = check(d, "straggler")
    assert strag.finding is not None and strag.finding.ranks == (7,)


def test_sampled_two_of_128_loads_and_flags_communication():
    d = shared_diagnosis("hta_sampled_2rank_of128")
    assert d.run.ranks_found == (0, 1) and d.run.world_size == 128
    assert "exposed_communication" in ids(d)
    assert any("2 of 128 ranks" in w for w in d.warnings)


def test_nccl_data_host_bound_ranks_high():
    d = shared_diagnosis("hta_nccl_data_rank0of2_a100")
    assert ids(d)[0] == "launch_overhead"
    assert d.findings[0].share_of_step > 0.3


def test_ddp_world1_is_healthy():
    d = shared_diagnosis("edge_hta_ddp_world1_v100")
    assert d.findings == ()
    assert check(d, "exposed_communication").status == "passed"


@pytest.mark.parametrize("name", ["edge_hta_cpu_only_gloo_rank34of300", "edge_hta_no_distributedinfo",
                                  "edge_tracelens_b200_vllm_tp8_rank0"])
def test_edge_sets_give_a_result_or_one_clear_error(name):
    try:
        d = shared_diagnosis(name)
    except DiagnoseError as exc:
        msg = str(exc)
        assert "\n" not in msg and len(msg) < 400
        assert shared(name).name in msg or ".json" in msg
    else:
        assert d.run.steps_analysed >= 1
        assert all(c.status in ("flagged", "passed", "not_measurable") for c in d.checks)
