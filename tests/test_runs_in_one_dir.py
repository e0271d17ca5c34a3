"""A job rerun into one directory: its runs refused together, and `--run K` analyses one of them."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from diagnose.errors import DiagnoseError
from diagnose.ingest.runs import choose_run, split_runs
from diagnose.pipeline import diagnose_paths

FIXTURES = Path(__file__).resolve().parent / "fixtures"
OLDER, NEWER = "cpu_straggler_2rank", "cpu_huge_bucket_2rank"
"""Two real 2-rank recordings (2026-12-01 and 2026-12-04), named rank{R}.{stamp}.pt.trace.json.gz
both, as a rerun into one tensorboard directory leaves them."""


@pytest.fixture()
def reran(tmp_path) -> Path:
    d = tmp_path / "tb"
    d.mkdir()
    for name in (OLDER, NEWER):
        for f in (FIXTURES / name).glob("*.pt.trace.json.gz"):
            shutil.copy(f, d / f.name)
    return d


def _claims(d) -> tuple:
    return (d.run.ranks_found, d.run.steps_analysed, d.run.mean_step_ms,
            [(f.id, f.ranks, f.recoverable_ms) for f in d.findings])


def test_two_runs_are_refused_and_the_error_says_how_to_pick_one(reran):
    with pytest.raises(DiagnoseError) as e:
        diagnose_paths([reran])
    assert "two runs in one directory" in str(e.value) and "analyze --run K" in str(e.value)


@pytest.mark.parametrize("k, name", [(1, OLDER), (-1, NEWER), (2, NEWER), (-2, OLDER)])
def test_run_k_is_that_run_alone(reran, k, name):
    d = diagnose_paths([reran], run_k=k)
    assert _claims(d) == _claims(diagnose_paths([FIXTURES / name]))
    assert all(Path(f).parent == reran and (FIXTURES / name / Path(f).name).exists() for f in d.run.files.values())
    assert any("2 runs written into one place" in w and f"run {1 if name == OLDER else 2} is analysed" in w
               for w in d.warnings)


def test_a_run_that_is_not_there_is_one_line(reran):
    with pytest.raises(DiagnoseError, match="2 runs here"):
        choose_run([reran], 3)


def test_one_run_is_not_several(tmp_path):
    with pytest.raises(DiagnoseError, match="not several runs"):
        choose_run([FIXTURES / OLDER], -1)


def _trace(d: Path, name: str, rank: int, pid: int, start_s: float) -> Path:
    """A trace whose first bytes say which process wrote it, and when (as Kineto writes them)."""
    doc = {"schemaVersion": 1, "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 2},
           "host_name": "node", "baseTimeNanoseconds": int(start_s * 1e9),
           "traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 10.0 + i, "dur": 0.5,
                            "pid": pid, "tid": pid} for i in range(3)]}
    p = d / name
    p.write_text(json.dumps(doc))
    return p


def test_runs_one_after_another_are_split_oldest_first(tmp_path):
    t0 = 1.8e9
    files = [_trace(tmp_path, f"h_{pid}.1.pt.trace.json", rank, pid, t0 + at)
             for rank, pid, at in [(0, 10, 0.0), (1, 11, 0.4), (1, 21, 60.3), (0, 20, 60.0)]]
    runs = split_runs(files)
    assert [[p.files[0].name for p in r] for r in runs] == [["h_10.1.pt.trace.json", "h_11.1.pt.trace.json"],
                                                            ["h_20.1.pt.trace.json", "h_21.1.pt.trace.json"]]


def test_two_jobs_writing_at_once_are_not_runs(tmp_path):
    # two 2-rank jobs started together: their processes' starts interleave
    t0 = 1.8e9
    files = [_trace(tmp_path, f"h_{pid}.1.pt.trace.json", rank, pid, t0 + at)
             for rank, pid, at in [(0, 10, 0.0), (0, 20, 0.1), (1, 11, 0.2), (1, 21, 0.3)]]
    assert split_runs(files) is None
    # ... or one just after the other, closer than either's own ranks are to one another
    files = [_trace(tmp_path, f"g_{pid}.1.pt.trace.json", rank, pid, t0 + at)
             for rank, pid, at in [(0, 30, 0.0), (1, 31, 0.2), (0, 40, 0.3), (1, 41, 0.5)]]
    assert split_runs(files) is None


def test_a_job_rerun_on_more_ranks_is_two_runs(tmp_path):
    t0 = 1.8e9
    files = [_trace(tmp_path, f"h_{pid}.1.pt.trace.json", rank, pid, t0 + at)
             for rank, pid, at in [(0, 10, 0.0), (0, 20, 60.0), (1, 21, 60.1), (2, 22, 60.1), (3, 23, 60.2)]]
    assert [sorted(p.rank for p in r) for r in split_runs(files)] == [[0], [0, 1, 2, 3]]


def test_a_process_counted_into_another_jobs_run_is_refused(tmp_path):
    # job A's rank 1 started its profiler late, after job B's rank 0: A1 would join B0's run
    t0 = 1.8e9
    files = [_trace(tmp_path, f"h_{pid}.1.pt.trace.json", rank, pid, t0 + at)
             for rank, pid, at in [(0, 10, 0.0), (0, 20, 5.0), (1, 11, 10.0), (1, 21, 15.0)]]
    assert split_runs(files) is None


def test_the_cli_takes_run_and_refuses_zero(reran, tmp_path):
    out = tmp_path / "out"
    ok = subprocess.run([sys.executable, "-m", "diagnose.cli", "analyze", str(reran), "--run", "-1", "--out", str(out)],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    body = json.loads((out / "diagnosis.json").read_text())
    assert body["findings"][0]["id"] == json.loads(
        (Path(__file__).resolve().parent / "golden" / f"{NEWER}.json").read_text())["findings"][0]["id"]
    zero = subprocess.run([sys.executable, "-m", "diagnose.cli", "analyze", str(reran), "--run", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert zero.returncode == 2 and "--run 0" in zero.stderr and len(zero.stderr.strip().splitlines()) == 1


def test_diff_compares_two_runs_of_one_directory(reran, tmp_path):
    """A job rerun into one directory after a fix is its own before and after."""
    out = tmp_path / "diff"
    res = subprocess.run([sys.executable, "-m", "diagnose.cli", "diff", str(reran), str(reran), "--before-run", "1",
                          "--after-run", "-1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    body = json.loads((out / "diff.json").read_text())
    golden = Path(__file__).resolve().parent / "golden"
    for side, name in (("before", OLDER), ("after", NEWER)):
        assert body[side]["top"] == json.loads((golden / f"{name}.json").read_text())["findings"][0]["id"]
    assert body["before"]["run_in_directory"] == 1 and body["after"]["run_in_directory"] == -1
    assert "(run 1 of those written there)" in res.stdout and "(the newest run written there)" in res.stdout
    # without a run each side is refused, and the line says how to pick one
    res = subprocess.run([sys.executable, "-m", "diagnose.cli", "diff", str(reran), str(reran), "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "--before-run/--after-run" in res.stderr


def test_scale_picks_one_run_of_a_directory_rerun_into(reran, tmp_path):
    """`diagnose scale --runs N=DIR --run N=K`: the point at N is that run's alone; without --run
    the refusal names it; --run without its --runs, K = 0 or not N=K: one line each."""
    from click.testing import CliRunner

    from diagnose.cli import main
    from diagnose.scaling import measure_point

    base = ["scale", "--runs", f"1={FIXTURES / OLDER}", "--runs", f"2={reran}", "--out", str(tmp_path / "s")]
    res = CliRunner().invoke(main, base)
    assert res.exit_code == 2 and "scale --run N=K" in res.output, res.output
    res = CliRunner().invoke(main, [*base, "--run", "2=-1"])
    assert res.exit_code == 0, res.output
    points = {p["nproc"]: p for p in json.loads((tmp_path / "s" / "scaling.json").read_text())["runs"]}

    def traces_of(name: str) -> Path:  # the run's traces alone, as they lie in the rerun directory
        d = tmp_path / name
        d.mkdir()
        for f in (FIXTURES / name).glob("*.pt.trace.json.gz"):
            shutil.copy(f, d / f.name)
        return d

    alone, _ = measure_point(2, traces_of(NEWER))
    assert points[2]["step_ms"] == alone.step_ms and points[2]["causes_ms"] == alone.causes_ms
    older, _ = measure_point(2, traces_of(OLDER))
    assert points[2]["step_ms"] != older.step_ms  # the run picked, not the other
    assert f"N=2: run -1 of the runs written into {reran} (--run 2=-1)" in res.output
    for bad, said in ((["--run", "3=1"], "no --runs 3=DIR"), (["--run", "2=0"], "runs count from 1"),
                      (["--run", "2"], "--run takes N=K")):
        res = CliRunner().invoke(main, [*base, *bad])
        assert res.exit_code == 2 and said in res.output and len(res.output.strip().splitlines()) == 1, res.output
