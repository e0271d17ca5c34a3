"""A job torchelastic restarts (`torchrun --max-restarts N`): each attempt's files in their own
directory (probes/core.py), the last one with data read by every reader (diagnose/rundir.py).

The attempts here are two recorded runs with different verdicts laid out as a restarted run's
traces/ would be; tests/test_e2e_probes.py restarts a real job."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from diagnose.probes.core import Probe, Schedule, elastic_attempt

from diagnose.errors import DiagnoseError
from diagnose.ingest.discover import discover_traces
from diagnose.oncall import probe_dir
from diagnose.pipeline import diagnose_paths
from diagnose.probedata import load_probe_data
from diagnose.rundir import run_of
from tests.conftest import ROOT

FIXTURES = ROOT / "tests" / "fixtures"
FIRST, LAST = "cpu_huge_bucket_2rank", "cpu_checkpoint_2rank"  # their top findings differ


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    for n, src in ((0, FIRST), (1, LAST)):
        dst = run / "traces" / f"attempt{n}"
        dst.mkdir(parents=True)
        for f in (FIXTURES / src).iterdir():
            if f.name.startswith("rank"):
                shutil.copy(f, dst / f.name)
    return run


@pytest.fixture(scope="module")
def last_alone():
    return diagnose_paths([FIXTURES / LAST])


@pytest.mark.parametrize("given", ["run", "traces"])
def test_the_analysis_reads_the_last_attempt_and_names_the_others(restarted, last_alone, given):
    d = diagnose_paths([restarted if given == "run" else restarted / "traces"])
    assert d.findings[0].id == last_alone.findings[0].id
    assert d.findings[0].id != diagnose_paths([FIXTURES / FIRST]).findings[0].id
    assert all("/attempt1/" in f for f in d.run.files.values())
    # the probes' records come from the same attempt (its model: the first attempt's had 1,000 MB buckets)
    assert d.run.metadata["model"] == last_alone.run.metadata["model"]
    assert d.run.metadata["model"]["ddp_bucket_cap_mb"] == 25.0
    note = [w for w in d.warnings if "torchelastic" in w]
    assert len(note) == 1 and "(2 attempts)" in note[0] and str(restarted / "traces" / "attempt0") in note[0]


def test_an_earlier_attempt_is_analysed_when_named(restarted):
    d = diagnose_paths([restarted / "traces" / "attempt0"])
    assert d.findings[0].id == diagnose_paths([FIXTURES / FIRST]).findings[0].id
    assert not [w for w in d.warnings if "torchelastic" in w]


def test_the_attempts_records_are_never_merged(restarted):
    assert load_probe_data([restarted / "traces"]) == {}  # a directory of attempts holds no rank's records
    assert set(load_probe_data([restarted / "traces" / "attempt1"])) == {0, 1}


def test_the_last_attempt_is_by_number_and_must_hold_data(tmp_path, restarted):
    traces = tmp_path / "traces"
    shutil.copytree(restarted / "traces" / "attempt0", traces / "attempt2")
    shutil.copytree(restarted / "traces" / "attempt1", traces / "attempt10")
    (traces / "attempt11").mkdir()  # an attempt that died before writing anything
    d = diagnose_paths([traces])
    assert all("/attempt10/" in f for f in d.run.files.values())
    assert any("(3 attempts)" in w and "attempt10" in w for w in d.warnings)


def test_a_reader_that_cannot_pick_says_which_to_pass(restarted):
    """discover_traces alone (a cluster worker's listing): refused, naming the last attempt."""
    with pytest.raises(DiagnoseError, match=r"2 attempts of a job torchelastic restarted .*the last: .*attempt1"):
        discover_traces([restarted / "traces"])


def test_the_on_call_commands_find_the_current_attempt(restarted):
    assert probe_dir(restarted) == restarted / "traces" / "attempt1"
    assert run_of(restarted / "traces" / "attempt1") == restarted
    assert run_of(restarted / "traces") == restarted


def test_probes_option_reads_the_last_attempts_records(restarted, tmp_path):
    """`diagnose analyze THEIR_TRACES --probes RUN`: the records of the attempt that ran last."""
    cmd = [sys.executable, "-m", "diagnose.cli", "analyze", str(FIXTURES / "cpu_straggler_2rank"),
           "--probes", str(restarted), "--out", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "restarted by torchelastic (2 attempts)" in res.stderr
    model = json.loads((tmp_path / "diagnosis.json").read_text())["run"]["metadata"]["model"]
    assert model["ddp_bucket_cap_mb"] == 25.0  # attempt1's (the first attempt's: 1,000)


@pytest.mark.parametrize("env, expected", [
    ({"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "2"}, 2),
    ({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "0"}, 0),
    ({"TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RESTART_COUNT": "0"}, None),  # cannot restart: flat
    ({}, None),  # not under torchelastic
    ({"TORCHELASTIC_MAX_RESTARTS": "x", "TORCHELASTIC_RESTART_COUNT": "1"}, None),
])
def test_the_probe_writes_each_attempt_into_its_own_directory(tmp_path, monkeypatch, env, expected):
    for k in ("TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert elastic_attempt() == expected
    probe = Probe(tmp_path, rank=0, world_size=1, schedule=Schedule(enabled=False))
    probe.on_step()
    probe.on_step()
    probe.close()
    where = tmp_path if expected is None else tmp_path / f"attempt{expected}"
    assert (where / "rank0.steps.jsonl").is_file() and (where / "rank0.probe.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith(".")) == \
        ([] if expected is None else [f"attempt{expected}"])


def test_a_parent_of_runs_names_a_restarted_run(tmp_path, restarted):
    """`diagnose analyze PARENT` (`--out`): a run whose traces are in attempts is still a run."""
    shutil.copytree(restarted, tmp_path / "20261207-010000")
    with pytest.raises(DiagnoseError, match="holds 1 run directory"):
        discover_traces([tmp_path])
