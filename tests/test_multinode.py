"""One multi-node job's run directories found beside each other (diagnose/multinode.py).

tests/fixtures/two_nodes_records: the probes' sidecars and step records of a real 2-node job, one
`diagnose run` a node on this host (`torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d`,
rank 1 sleeping 100 ms a step; recorded 2026-12-07): node_a holds rank 0, node_b rank 1. Laid out
here as the two launchers left them, side by side in one --out; the directories that must not be
joined are those copies with one fact of another job (another port, another time, the same rank).
The combined analysis of the real job: tests/test_e2e_probes.py."""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

from diagnose.multinode import (
    CLAIM,
    TOGETHER,
    _claim,
    find_together,
    node_run,
    siblings,
)
from diagnose.rundir import RunLock

RECORDS = Path(__file__).parent / "fixtures" / "two_nodes_records"


def _run(out: Path, name: str, node: str, edit=None) -> Path:
    d = out / name
    (d / "traces").mkdir(parents=True)
    for f in (RECORDS / node).iterdir():
        shutil.copy(f, d / "traces" / f.name)
    if edit:
        edit(d / "traces")
    return d


def _env(key: str, value: str):
    def edit(traces: Path) -> None:
        for f in traces.glob("rank*.probe.json"):
            body = json.loads(f.read_text())
            body["meta"]["env"][key] = value
            f.write_text(json.dumps(body))
    return edit


def _a_day_earlier(traces: Path) -> None:
    for f in traces.glob("rank*.steps.jsonl"):
        lines = [json.loads(x) for x in f.read_text().splitlines()]
        f.write_text("".join(json.dumps({**x, "start": x["start"] - 86400}) + "\n" for x in lines))


def test_the_other_node_of_the_job_is_found_and_no_other_run(tmp_path):
    out = tmp_path
    a = _run(out, "20261207-044615", "node_a")
    b = _run(out, "20261207-044615-2", "node_b")
    _run(out, "20261207-044616", "node_b", _env("MASTER_PORT", "29500"))  # another rendezvous
    _run(out, "20261206-044615", "node_b", _a_day_earlier)  # the same port, a day before
    ours = node_run(a)
    assert ours.ranks == {0} and ours.identity[:3] == ("localhost", "37423", "2")
    assert [n.run_dir for n in siblings(ours)] == [b]
    assert [n.run_dir for n in siblings(node_run(b))] == [a]
    _run(out, "20261207-044617", "node_a")  # a directory holding our own rank 0: not another node
    assert [n.run_dir for n in siblings(ours)] == [b]
    if os.geteuid() == 0:  # another user's copy of node b's run, newer than b: never joined
        os.chown(_run(out, "20261207-044618", "node_b"), os.getuid() + 4242, -1)
        assert [n.run_dir for n in siblings(ours)] == [b]


def test_a_run_without_the_rendezvous_facts_joins_nothing(tmp_path):
    a = _run(tmp_path, "20261207-044615", "node_a", _env("MASTER_PORT", None))
    _run(tmp_path, "20261207-044615-2", "node_b")
    assert node_run(a) is None and find_together(a, print) is None


def test_one_launcher_claims_the_jobs_analysis_and_the_other_is_told_where(tmp_path):
    a, b = _run(tmp_path, "20261207-044615", "node_a"), _run(tmp_path, "20261207-044615-2", "node_b")
    na, nb = node_run(a), node_run(b)
    # b claims first: the claim sits in the first directory by name, and names b's analysis
    assert _claim([na, nb], nb) is None
    assert (a / CLAIM).read_text() == str(b / TOGETHER)
    assert _claim([na, nb], na) == b / TOGETHER


def test_a_node_whose_launcher_still_runs_is_waited_for(tmp_path):
    a, b = _run(tmp_path, "20261207-044615", "node_a"), _run(tmp_path, "20261207-044615-2", "node_b")
    said = []
    with RunLock.acquire(b):  # b's launcher: its job or its own analysis still running
        found = find_together(a, said.append, wait_s=0.5)
    assert found.still_running == (b,) and found.elsewhere is None and "waiting for" in said[0]
    # released while a waits: a goes on, and the analysis is a's to make
    lock = RunLock.acquire(b)
    threading.Timer(0.6, lock.release).start()
    t = time.monotonic()
    found = find_together(a, said.append, wait_s=30)
    assert 0.5 < time.monotonic() - t < 10
    assert not found.still_running and found.elsewhere is None
    assert [n.run_dir for n in found.members] == [a, b]
