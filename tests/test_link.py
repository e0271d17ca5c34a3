"""Each group's bus bandwidth against the link the user names (diagnose/step/link.py)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from diagnose.cli import main
from diagnose.output import terminal_summary
from diagnose.pipeline import diagnose_run
from diagnose.probedata import ProbeData
from diagnose.step.bandwidth import GroupComm
from diagnose.step.link import DECIDE, LinkSpec, group_ranks, judge
from diagnose.thresholds import DEFAULT
from tests.conftest import fixture_run

ACCUM = Path(__file__).parent / "fixtures" / "cpu_accum_nosync_2rank"


def _group(busbw: float | None, regime: str = "bandwidth-bound", ranks: int = 8, sized: int = 10) -> GroupComm:
    return GroupComm(group="0", kind="all_reduce", ranks=ranks, count=10, exposed_ms_per_step=1.0, sized=sized,
                     median_bytes=64e6, median_transfer_ms=1.0, algbw_gbps=None if busbw is None else busbw / 1.75,
                     busbw_gbps=busbw, regime=regime, transfer="matched across ranks")


ONE_HOST = {r: "node-a" for r in range(16)}
TWO_HOSTS = {r: "node-a" if r < 8 else "node-b" for r in range(16)}


@pytest.mark.parametrize("text, intra, inter", [("200", 200.0, None), ("200,25", 200.0, 25.0), (",25", None, 25.0),
                                                (" 150 , 12.5 ", 150.0, 12.5), ("200,", 200.0, None)])
def test_the_link_reads_as_a_person_writes_it(text, intra, inter):
    assert LinkSpec.parse(text) == LinkSpec(intra, inter)


@pytest.mark.parametrize("text", ["", ",", "fast", "1,2,3", "-5", "0", "nan", "inf", "200,-1"])
def test_a_link_that_is_no_bandwidth_is_refused(text):
    with pytest.raises(ValueError):
        LinkSpec.parse(text)


@pytest.mark.parametrize("busbw, verdict", [
    (140.0, "near peak"),  # 70% of 200: the boundary is near the peak
    (139.0, "below peak"),
    (60.0, "below peak"),  # 30%: the boundary is not far below
    (59.0, "far below"),
])
def test_a_group_within_one_host_is_judged_against_the_intra_host_link(busbw, verdict):
    v = judge(_group(busbw), list(range(8)), ONE_HOST, 8, LinkSpec(200.0, 25.0), DEFAULT)
    assert (v.verdict, v.link, v.link_gbps, v.hosts) == (verdict, "intra-host", 200.0, 1)
    assert v.share == pytest.approx(busbw / 200.0)
    assert f"{busbw / 200:.0%} of the intra-host link's 200 GB/s" in v.text


def test_a_group_over_two_hosts_is_judged_against_the_inter_host_link():
    v = judge(_group(20.0, ranks=16), list(range(16)), TWO_HOSTS, 16, LinkSpec(200.0, 25.0), DEFAULT)
    assert (v.verdict, v.link, v.hosts, v.tp_spans_hosts) == ("near peak", "inter-host", 2, False)
    assert "fewer bytes is the only lever" in v.text
    # one figure stands for the link whatever the hosts
    v = judge(_group(20.0, ranks=16), list(range(16)), TWO_HOSTS, 16, LinkSpec(200.0), DEFAULT)
    assert (v.verdict, v.link, v.share) == ("far below", "given", pytest.approx(0.1))
    assert "NCCL_DEBUG=INFO" in v.text


def test_no_verdict_without_a_link_and_what_would_decide_it():
    v = judge(_group(20.0), list(range(8)), ONE_HOST, 8, None, DEFAULT)
    assert (v.verdict, v.share, v.link_gbps) == ("link unknown", None, None)
    assert "20.00 GB/s bus on one host" in v.text and DECIDE in v.text
    # two figures and no host names: which applies is what is unknown
    v = judge(_group(20.0), list(range(8)), {}, 8, LinkSpec(200.0, 25.0), DEFAULT)
    assert (v.verdict, v.hosts) == ("link unknown", None) and "which of the two links applies" in v.text
    # one figure and no host names: it stands for the link
    v = judge(_group(150.0), list(range(8)), {}, 8, LinkSpec(200.0), DEFAULT)
    assert (v.verdict, v.link, v.hosts) == ("near peak", "given", None) and "on unknown hosts" in v.text
    # an inter-host figure alone says nothing of a group within one host
    v = judge(_group(150.0), list(range(8)), ONE_HOST, 8, LinkSpec(None, 25.0), DEFAULT)
    assert v.verdict == "link unknown" and "no intra-host figure" in v.text


def test_a_transfer_holding_waits_for_peers_is_never_far_below():
    """One rank loaded: its transfers run from its own arrival, waits for peers included."""
    own = GroupComm(**{**{f: getattr(_group(20.0), f) for f in GroupComm.__slots__},
                       "transfer": "own arrival (includes waits)"})
    v = judge(own, list(range(8)), ONE_HOST, 8, LinkSpec(200.0), DEFAULT)
    assert (v.verdict, v.share) == ("lower bound", pytest.approx(0.1)) and "at least" in v.text
    fast = GroupComm(**{**{f: getattr(own, f) for f in GroupComm.__slots__}, "busbw_gbps": 150.0})
    assert judge(fast, list(range(8)), ONE_HOST, 8, LinkSpec(200.0), DEFAULT).verdict == "near peak"


def test_small_messages_and_unknown_sizes_get_no_verdict_on_the_link():
    v = judge(_group(0.5, regime="latency-bound"), list(range(8)), ONE_HOST, 8, LinkSpec(200.0), DEFAULT)
    assert (v.verdict, v.share) == ("latency-bound", None) and "per-call latency" in v.text
    v = judge(_group(None, sized=0), list(range(8)), ONE_HOST, 8, LinkSpec(200.0), DEFAULT)
    assert (v.verdict, v.share) == ("no bandwidth", None)


def test_a_tensor_parallel_sized_group_over_hosts_is_named():
    members = [6, 7, 8, 9]  # four ranks, two on each host
    v = judge(_group(150.0, ranks=4), members, TWO_HOSTS, 16, LinkSpec(200.0, 25.0), DEFAULT)
    assert v.tp_spans_hosts and v.hosts == 2 and "tensor-parallel-sized group (4 ranks) spans 2 hosts" in v.text
    # the same group within one host, or a world-sized group over two, is no such mistake
    assert not judge(_group(150.0, ranks=4), [0, 1, 2, 3], TWO_HOSTS, 16, None, DEFAULT).tp_spans_hosts
    assert not judge(_group(20.0, ranks=8), list(range(4, 12)), TWO_HOSTS, 8, None, DEFAULT).tp_spans_hosts
    # some ranks' hosts unknown, two hosts seen among the rest: it spans all the same
    assert judge(_group(150.0, ranks=4), members, {6: "node-a", 9: "node-b"}, 16, None, DEFAULT).hosts == 2


def test_a_group_is_its_pg_config_ranks():
    pgs = [{"pg_name": "0", "ranks": [0, 1, 2, 3]}, {"pg_name": "5", "ranks": [2, 6]}, {"pg_name": "7", "ranks": []}]
    assert group_ranks(pgs, "5", [0, 1]) == [2, 6]
    assert group_ranks(pgs, "7", [0, 1]) == [0, 1]  # no members listed: the ranks loaded
    assert group_ranks(pgs, "9", [0, 1]) == [0, 1]


def _probes(hosts: dict[int, str]) -> dict[int, ProbeData]:
    return {r: ProbeData(rank=r, meta={"host": h}, steps=pd.DataFrame(), collectives=pd.DataFrame())
            for r, h in hosts.items()}


def test_a_recorded_job_judged_against_the_link():
    """tests/fixtures/cpu_accum_nosync_2rank: 13.6 MB buckets over gloo (bandwidth-bound). With the
    link given, each row's share is its bus bandwidth over it; the terminal says so. Without it, no
    verdict, and the terminal says what would decide it."""
    run = fixture_run(ACCUM)
    d = diagnose_run(run, probes=_probes({0: "node-a", 1: "node-a"}), link=LinkSpec(10.0, 1.0))
    rows = [g for g in d.extras["comm_groups"]["groups"] if g["group"]]
    bw = [g for g in rows if g["regime"] == "bandwidth-bound"]
    assert bw, rows
    for g in bw:
        assert g["hosts"] == 1 and g["link"] == "intra-host" and g["link_gbps"] == 10.0
        assert g["link_share"] == pytest.approx(g["busbw_gbps"] / 10.0, abs=1e-3)
        expect = "near peak" if g["busbw_gbps"] >= 7 else "far below" if g["busbw_gbps"] < 3 else "below peak"
        assert g["link_verdict"] == expect
    assert d.extras["comm_groups"]["link_given"] == {"intra_gbps": 10.0, "inter_gbps": 1.0}
    assert f"{bw[0]['link_verdict']}: {bw[0]['link_share']:.0%} of 10 GB/s (intra-host link)" in terminal_summary(d)
    bare = diagnose_run(run)
    assert all(g["link_verdict"] == "link unknown" and g["hosts"] is None
               for g in bare.extras["comm_groups"]["groups"] if g["group"] and g["regime"] == "bandwidth-bound")
    assert "against the link: no verdict; pass --link-gbps" in terminal_summary(bare)


def test_the_cli_refuses_a_bad_link_in_one_line(tmp_path):
    from click.testing import CliRunner

    res = CliRunner().invoke(main, ["analyze", str(ACCUM), "--out", str(tmp_path), "--link-gbps", "fast"])
    assert res.exit_code == 2, res.output
    assert res.output.count("\n") == 1 and "--link-gbps" in res.output, res.output


def test_run_takes_the_link_and_refuses_a_bad_one_before_starting_anything(tmp_path):
    from click.testing import CliRunner

    marker = tmp_path / "started"
    res = CliRunner().invoke(main, ["run", "--out", str(tmp_path / "runs"), "--link-gbps", "-3", "--",
                                    "python", "-c", f"open({str(marker)!r}, 'w')"])
    assert res.exit_code == 2 and "--link-gbps" in res.output, res.output
    assert not marker.exists() and not (tmp_path / "runs").exists()
