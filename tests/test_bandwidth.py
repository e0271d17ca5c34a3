"""Communication by process group and collective kind (diagnose/step/bandwidth.py): exposed time,
size, transfer time and bandwidth, checked against figures computed here from the raw trace files
(gzip + json) or the breakdown, not by the code under test."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from diagnose.step.bandwidth import bus_factor, collective_kind
from tests.conftest import fixture_diagnosis, shared, shared_diagnosis

FIXTURES = Path(__file__).resolve().parent / "fixtures"
DTYPE_BYTES = {"float": 4, "float32": 4, "half": 2, "bfloat16": 2, "int64": 8, "long": 8, "byte": 1, "int8": 1}


@pytest.mark.parametrize("name, kind", [
    ("ncclKernel_AllReduce_RING_LL_Sum_float", "all_reduce"),
    ("ncclDevKernel_AllGather_RING_LL", "all_gather"),
    ("ncclKernel_ReduceScatter_RING_SIMPLE_Sum_bf16", "reduce_scatter"),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t", "send_recv"),
    ("ncclKernel_Broadcast_RING_LL_Sum_int8_t", "broadcast"),
    ("gloo:all_reduce", "all_reduce"), ("gloo:all_to_all", "all_to_all"), ("gloo:broadcast", "broadcast"),
    ("c10d::_reduce_scatter_base_", "reduce_scatter"), ("c10d::reduce_", "reduce"), ("gloo:barrier", "barrier"),
    ("ncclKernel_Something_new", "unknown"),
])
def test_the_kind_of_a_collective_from_its_name(name, kind):
    assert collective_kind(name) == kind


def test_bus_bandwidth_factors_are_nccl_tests_ones():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(kind, 8) == pytest.approx(7 / 8)
    for kind in ("broadcast", "reduce", "send_recv"):
        assert bus_factor(kind, 8) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0  # one rank moves nothing
    assert bus_factor("barrier", 8) is None and bus_factor("unknown", 8) is None


def _events(path: Path) -> list[dict]:
    return [e for e in json.load(gzip.open(path, "rt"))["traceEvents"] if e.get("ph") == "X"]


def _steps(evs: list[dict]) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in evs if str(e["name"]).startswith("ProfilerStep#"))


def test_gloo_all_reduce_bandwidth_from_the_last_arrival_on_the_recorded_job():
    """tests/fixtures/cpu_straggler_2rank: each step's gloo all-reduce of one 657,409-float bucket.
    A rank arrives when its training thread enqueues the op (c10d::allreduce_) or the runloop
    starts it, whichever is first; the transfer runs from the later rank's arrival to each rank's
    end (the clocks of this job need no offset). Catches: the wait for the late rank counted as
    transfer, the size or the factor wrong."""
    root = FIXTURES / "cpu_straggler_2rank"
    per_rank = {}
    for r, path in enumerate(sorted(root.glob("rank*.pt.trace.json.gz"))):
        evs = _events(path)
        steps = _steps(evs)
        ops = sorted((e for e in evs if e["name"] == "gloo:all_reduce"), key=lambda e: e["ts"])
        enq = sorted((e for e in evs if e["name"] == "c10d::allreduce_"), key=lambda e: e["ts"])
        rows = {}
        for op, q in zip(ops, enq):
            step = next((i for i, (lo, hi) in enumerate(steps) if lo <= min(op["ts"], q["ts"]) < hi), None)
            if step is not None:
                (n,) = op["args"]["Input Dims"][0]
                rows[step] = (min(op["ts"], q["ts"]), op["ts"] + op["dur"], n * DTYPE_BYTES[op["args"]["Input type"][0]])
        per_rank[r] = rows
    common = sorted(set(per_rank[0]) & set(per_rank[1]))
    alg = []
    for s in common:
        latest = max(per_rank[r][s][0] for r in per_rank)
        alg += [per_rank[r][s][2] / (per_rank[r][s][1] - latest) / 1e3 for r in per_rank]
    g = next(g for g in fixture_diagnosis(root).extras["comm_groups"]["groups"] if g["kind"] == "all_reduce")
    assert (g["ranks"], g["sized"], g["transfer"]) == (2, 2 * len(common), "matched across ranks")
    assert g["median_bytes"] == 657_409 * 4 and g["regime"] == "bandwidth-bound"
    assert g["algbw_gbps"] == pytest.approx(float(np.median(alg)), rel=1e-3)
    assert g["busbw_gbps"] == pytest.approx(g["algbw_gbps"] * 2 * (2 - 1) / 2, rel=1e-3)


def test_nccl_bandwidth_on_one_rank_of_two_includes_its_waits_and_says_so():
    """hta_nccl_data_rank0of2_a100: rank 0 of a 2-rank group (pg_config); sizes from the
    record_param_comms op that launched each NCCL kernel (same External id). With one rank loaded
    the transfer is the kernel's whole duration, waits included, and the table says so."""
    evs = _events(shared("hta_nccl_data_rank0of2_a100") / "nccl_data.json.gz")
    steps = _steps(evs)
    rpc = {e["args"]["External id"]: e["args"] for e in evs
           if e["name"] == "record_param_comms" and "External id" in e.get("args", {})}
    alg = []
    for k in (e for e in evs if e.get("cat") == "kernel" and str(e["name"]).startswith("ncclKernel_AllReduce")):
        a = rpc.get(k.get("args", {}).get("External id"), {})
        if any(lo <= k["ts"] < hi for lo, hi in steps) and a.get("In msg nelems"):
            alg.append(a["In msg nelems"] * DTYPE_BYTES[str(a["dtype"]).lower()] / k["dur"] / 1e3)
    groups = {g["kind"]: g for g in shared_diagnosis("hta_nccl_data_rank0of2_a100").extras["comm_groups"]["groups"]}
    g = groups["all_reduce"]
    assert (g["ranks"], g["sized"], g["transfer"]) == (2, len(alg), "own arrival (includes waits)")
    assert g["algbw_gbps"] == pytest.approx(float(np.median(alg)), rel=1e-3)
    assert groups["broadcast"]["regime"] == "latency-bound"  # 106 kB median


def test_no_sizes_no_bandwidth_made_up():
    """DLRM's 2021 trace records no message sizes: its groups get their exposed time, no bandwidth."""
    groups = shared_diagnosis("param_dlrm_8rank_v100").extras["comm_groups"]["groups"]
    assert [(g["kind"], g["ranks"], g["sized"], g["busbw_gbps"]) for g in groups] == [
        ("send_recv", 8, 0, None), ("all_reduce", 8, 0, None)]


@pytest.mark.parametrize("where", ["param_dlrm_8rank_v100", "hta_sampled_2rank_of128", "hta_nccl_data_rank0of2_a100",
                                   "cpu_straggler_2rank", "cpu_pipelining_2rank"])
def test_exposed_time_by_group_sums_to_the_breakdown_on_each_rank(where):
    """Each rank's rows (the collectives, and what no collective covers) sum to its exposed_comm_ms
    in the breakdown; the table gives the median rank per row. Catches: an overlap counted twice,
    exposure left out of the split."""
    from diagnose.step.bandwidth import exposed_per_rank
    from diagnose.step.breakdown import compute_breakdown
    from diagnose.step.collectives import match_collectives
    from tests.conftest import fixture_run, shared_run

    run = fixture_run(FIXTURES / where) if where.startswith("cpu_") else shared_run(where)
    matched = match_collectives(run)
    total = {}
    for b in compute_breakdown(run, matched):
        total.setdefault(b.rank, []).append(b.exposed_comm_ms)
    split = exposed_per_rank(run, matched)
    for r, steps in total.items():
        assert sum(split.get(r, {}).values()) == pytest.approx(float(np.mean(steps)), abs=1e-6), r


def test_the_terminal_summary_lists_each_group():
    from diagnose.output import terminal_summary

    text = terminal_summary(shared_diagnosis("hta_nccl_data_rank0of2_a100"))
    assert "communication by group (exposed ms per step on the median rank;" in text
    assert ("  group 0 (2 ranks) all_reduce x15: 13.03 ms exposed; 26.26 MB in 2.52 ms, 5.75 GB/s bus "
            "[bandwidth-bound; includes waits: one rank loaded]") in text
    assert "  group default (8 ranks) send_recv x40: 3.63 ms exposed\n" in terminal_summary(
        shared_diagnosis("param_dlrm_8rank_v100"))
    assert "communication by group" not in terminal_summary(shared_diagnosis("kineto_resnet50_dataloader_v100/nw0"))


def test_the_report_shows_the_table():
    from diagnose.output import diagnosis_dict
    from diagnose.reports.html import render

    page = render(diagnosis_dict(shared_diagnosis("hta_nccl_data_rank0of2_a100")))
    assert '<h3 id="comm-groups">Communication by process group</h3>' in page
    assert ("<td>0</td><td>all_reduce</td><td class=num>2</td><td class=num>15</td><td class=num>13.03 ms</td>"
            "<td class=num>26.26 MB</td><td class=num>2.521 ms</td><td class=num>5.755</td><td class=num>5.755</td>"
            "<td>bandwidth-bound</td><td>own arrival (includes waits)</td>") in page
    assert "<td class=muted colspan=6>sizes not recorded</td>" in render(
        diagnosis_dict(shared_diagnosis("param_dlrm_8rank_v100")))
    assert 'id="comm-groups"' not in render(diagnosis_dict(shared_diagnosis("kineto_resnet50_dataloader_v100/nw0")))


@pytest.mark.parametrize("seed", range(6))
def test_matched_transfers_join_as_a_merge_does(seed):
    """The communication table joins each collective row to its matched transfer by one packed
    integer a (step, group, order, rank), not by a pandas merge (#20: the merge set the table's
    height at 1,024 ranks). On random tables with repeated keys, groups the other table lacks,
    transfers not positive, keys that are not integers and keys too wide to pack, each row gets
    what a merge of the two gives, assigned in its order (the last match wins)."""
    import pandas as pd

    from diagnose.step.bandwidth import _Transfers
    from diagnose.step.collectives import Matched

    rng = np.random.default_rng(seed)

    def table(n, pgs):
        return pd.DataFrame({"step": rng.integers(0, 2, n), "pg": rng.choice(pgs, n).astype(object),
                             "seq": rng.integers(0, 3, n), "rank": rng.integers(0, 2, n)})

    pr = table(60, ["0", "1", "tp"])
    pr["end"] = rng.normal(10, 3, len(pr))
    pr["latest"] = rng.normal(9, 3, len(pr))
    allc = table(80, ["0", "1", "dp"])
    if seed == 4:
        pr["step"] = pr["step"].astype(float)  # not integers: pandas' join
    if seed == 5:
        pr.loc[0, "seq"] = allc.loc[0, "seq"] = 2**40  # too wide to pack: pandas' join

    t = (pr["end"] - pr["latest"]).to_numpy()
    want = np.full(len(allc), np.nan)
    m = allc.reset_index().merge(pr[t > 0].assign(tx=t[t > 0]), on=["step", "pg", "seq", "rank"], how="inner")
    want[m["index"].to_numpy()] = m["tx"].to_numpy()
    got = _Transfers(Matched(pr, pd.DataFrame(), 1.0)).of(allc)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])
    assert (~np.isnan(want)).sum() >= 5  # rows that match, some of them more than once
    assert m["index"].duplicated().any() or seed >= 4
    empty = _Transfers(Matched(pr.iloc[:0], pd.DataFrame(), 1.0)).of(allc)
    assert np.isnan(empty).all()


def test_packed_key_sorts_as_its_columns_and_refuses_what_does_not_fit():
    """collectives.packed_key, the one packer of the heatmap's sort and the communication table's
    join: its order is np.lexsort's of the columns (the first the least significant), equal keys
    are equal rows, a row outside another table's ranges is -1, and spans too wide give None."""
    from diagnose.step.collectives import PACK_LIMIT, packed_key

    rng = np.random.default_rng(3)
    cols = [rng.integers(-5, 5, 400), rng.integers(0, 3, 400), rng.integers(100, 104, 400)]
    for c, v in zip(cols, (0, 1, 101)):
        c[0] = v
    key, bounds = packed_key(cols)
    assert np.array_equal(np.argsort(key, kind="stable"), np.lexsort(cols))
    rows = np.stack(cols, axis=1)
    same = key[:, None] == key[None, :]
    assert np.array_equal(same, (rows[:, None, :] == rows[None, :, :]).all(axis=2))
    other, _ = packed_key([np.array([0, 9, 0]), np.array([1, 1, 7]), np.array([101, 101, 101])], bounds)
    assert other[0] == key[0] and list(other[1:]) == [-1, -1]  # 9 and 7 lie outside the fitted ranges
    assert packed_key([np.array([0, PACK_LIMIT // 2]), np.array([0, 3])]) is None
