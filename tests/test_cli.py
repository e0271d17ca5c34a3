"""The CLI: bad input gives one clear line and exit 2; good input writes diagnosis.json."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from diagnose.cli import main
from tests.conftest import shared


def run_cli(*args):
    return CliRunner().invoke(main, list(args))


def one_line_error(res, needle: str):
    assert res.exit_code == 2, res.output
    lines = [l for l in res.output.splitlines() if l.strip()]
    assert len(lines) == 1, res.output
    assert needle in lines[0]
    assert "Traceback" not in res.output


def test_missing_directory(tmp_path):
    one_line_error(run_cli("analyze", str(tmp_path / "nope"), "--out", str(tmp_path / "o")), "nope")


def test_directory_without_traces(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    one_line_error(run_cli("analyze", str(tmp_path), "--out", str(tmp_path / "o")), "no trace files")


def test_truncated_gz_names_the_file(tmp_path):
    raw = gzip.compress(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 1, "dur": 1}]
                                    * 1000}).encode())
    bad = tmp_path / "rank0.pt.trace.json.gz"
    bad.write_bytes(raw[: len(raw) // 3])
    one_line_error(run_cli("analyze", str(tmp_path), "--out", str(tmp_path / "o")), "rank0.pt.trace.json.gz")


def test_non_trace_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"lr": 0.1}))
    one_line_error(run_cli("analyze", str(tmp_path), "--out", str(tmp_path / "o")), "config.json")


def test_not_json_names_the_file(tmp_path):
    (tmp_path / "rank0.json").write_text("hello, world")
    one_line_error(run_cli("analyze", str(tmp_path), "--out", str(tmp_path / "o")), "rank0.json")


def test_stray_json_beside_traces_is_skipped_not_fatal(tmp_path):
    src = shared("edge_hta_ddp_world1_v100")
    for f in src.glob("*.gz"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "hparams.json").write_text("{}")
    res = run_cli("analyze", str(tmp_path), "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / "o" / "diagnosis.json").read_text())
    assert any("hparams.json" in s for s in out["skipped"])


def test_diagnosis_json_contract(tmp_path):
    res = run_cli("analyze", str(shared("param_dlrm_8rank_v100")), "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert res.output.startswith("VERDICT:")
    d = json.loads((tmp_path / "diagnosis.json").read_text())
    assert d["schema_version"] == "1.18"
    for b in d["breakdown"]:  # 1.1: other_ms split by why the device idled (GPU run)
        assert b["other_by_cause_ms"] and abs(sum(b["other_by_cause_ms"].values()) - b["other_ms"]) < 1e-3
    for key in ("world_size", "backend", "device", "steps_analysed", "ranks_found", "ranks_missing"):
        assert key in d["run"]
    rec = [f["recoverable_ms"] for f in d["findings"]]
    assert rec == sorted(rec, reverse=True)
    for f in d["findings"]:
        assert {"id", "title", "severity", "recoverable_ms", "share_of_step", "ranks", "fix", "confidence",
                "metrics", "events"} <= f.keys()
        assert f["severity"] in ("high", "medium", "low") and 0 <= f["share_of_step"] <= 1
        for e in f["events"]:
            assert {"rank", "file", "ts_us", "dur_us", "name"} <= e.keys()
    assert [c["status"] for c in d["checks"]]
    assert {c["status"] for c in d["checks"]} <= {"flagged", "passed", "not_measurable"}


def test_real_subprocess_exit_codes(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "diagnose.cli", "analyze", str(shared("edge_hta_ddp_world1_v100")),
                         "--out", str(tmp_path)], capture_output=True, text=True)
    assert ok.returncode == 0 and "no significant cause" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "diagnose.cli", "analyze", str(tmp_path / "missing")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def test_analyze_does_not_import_torch(tmp_path):
    code = ("import sys; from diagnose.cli import main; from diagnose.pipeline import diagnose_paths; "
            f"diagnose_paths([{str(shared('edge_hta_ddp_world1_v100'))!r}]); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_cli_starts_without_loading_the_analysis():
    """`diagnose watch`, `hang` and `--help` start in a tenth of a second: importing the CLI loads
    neither pandas nor the checklist (they come with the command that needs them)."""
    code = ("import sys, diagnose.cli; heavy = [m for m in ('pandas', 'numpy', 'diagnose.analyzers', "
            "'diagnose.pipeline') if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_progress_line_only_after_a_while_and_cleared(capsys):
    from diagnose.output import ProgressLine

    quiet = ProgressLine(after_s=60)
    quiet(1, 8, "rank0.json")
    quiet.close()
    assert capsys.readouterr().err == ""
    p = ProgressLine(after_s=0)
    p(3, 8, "rank\n2.json")  # a hostile file name stays on the line
    p.close()
    err = capsys.readouterr().err
    # click drops the erase-line escape when stderr is not a terminal, as here
    assert "reading traces: 3/8 ranks" in err and "rank\\n2.json" in err and err.endswith(("\r", "\r\x1b[K"))
    assert "\n" not in err


def test_probe_env_silences_kineto_unless_the_job_chose():
    from diagnose.launch import probe_env

    assert probe_env(Path("t"), "2,2,5", base={})["KINETO_LOG_LEVEL"] == "6"
    assert probe_env(Path("t"), "2,2,5", base={"KINETO_LOG_LEVEL": "2"})["KINETO_LOG_LEVEL"] == "2"


@pytest.mark.parametrize("command, threads", [
    (["torchrun", "--nproc_per_node=2", "train.py"], "1"),
    (["/usr/bin/torchrun", "--nproc-per-node", "4", "train.py", "--lr", "1"], "1"),
    (["python", "-m", "torch.distributed.run", "--nproc_per_node=2", "train.py"], "1"),
    (["torchrun", "--nproc_per_node=1", "train.py"], None),       # torchrun sets nothing for one process
    (["torchrun", "train.py", "--nproc_per_node=2"], None),       # the script's own flag, not torchrun's
    (["python", "train.py", "--nproc_per_node=2"], None),         # not torchrun at all
    (["torchrun", "--nproc_per_node=gpu", "train.py"], None),     # unknown count: leave it to torchrun
])
def test_torchrun_banner_is_avoided_only_where_torchrun_would_set_one_thread(command, threads):
    from diagnose.launch import quiet_launcher

    assert quiet_launcher(command, {}).get("OMP_NUM_THREADS") == threads
    assert quiet_launcher(command, {"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "8"  # the user's choice


def test_probes_join_traces_recorded_elsewhere(tmp_path):
    """`analyze THEIR_TRACES --probes RUN_DIR`: a job that ran its own profiler under `diagnose run`
    has its traces in its own directory and the probes' records in the run's traces/."""
    import json
    import shutil

    from tests.conftest import ROOT

    src = ROOT / "tests" / "fixtures" / "cpu_checkpoint_2rank"
    theirs, run = tmp_path / "theirs", tmp_path / "run"
    theirs.mkdir()
    (run / "traces").mkdir(parents=True)
    for f in src.iterdir():
        if ".pt.trace." in f.name:
            shutil.copy(f, theirs)
        elif f.name.startswith("rank"):
            shutil.copy(f, run / "traces")
    res = run_cli("analyze", str(theirs), "--out", str(tmp_path / "alone"))
    assert res.exit_code == 0, res.output
    assert "probe_steps" not in json.loads((tmp_path / "alone" / "diagnosis.json").read_text())["run"]["metadata"]
    res = run_cli("analyze", str(theirs), "--probes", str(run), "--out", str(tmp_path / "joined"))
    assert res.exit_code == 0, res.output
    steps = json.loads((tmp_path / "joined" / "diagnosis.json").read_text())["run"]["metadata"]["probe_steps"]
    assert set(steps) == {"0", "1"} and min(steps.values()) > 0
    one_line_error(run_cli("analyze", str(theirs), "--probes", str(theirs), "--out", str(tmp_path / "o")),
                   "no probe records")
