"""`diagnose diff`: before/after a fix on the real ResNet50 DataLoader traces (nw0 -> nw4)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from diagnose.cli import main
from diagnose.diff import diff_diagnoses, diff_summary
from diagnose.reports.diff import render_diff
from tests.conftest import ROOT, shared, shared_diagnosis

NW0, NW4 = "kineto_resnet50_dataloader_v100/nw0", "kineto_resnet50_dataloader_v100/nw4"
HOSTILE = "<script>document.body.dataset.pwned='diff'</script>"


def _diagnosis(name: str):
    return shared_diagnosis(name)


def test_diff_cli_reports_dataloader_gone_and_step_time(tmp_path):
    """The acceptance run, as a user types it (a real process)."""
    before, after = shared(NW0), shared(NW4)
    res = subprocess.run([sys.executable, "-m", "diagnose.cli", "diff", str(before), str(after),
                          "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    m = re.search(r"STEP TIME: ([\d.]+) ms -> ([\d.]+) ms \(([-+][\d.]+)%\)", res.stdout)
    assert m, res.stdout
    assert float(m.group(1)) == pytest.approx(155, abs=3) and float(m.group(2)) == pytest.approx(128, abs=3)
    assert float(m.group(3)) == pytest.approx(-17, abs=2)
    assert "findings gone: dataloader_starvation" in res.stdout
    assert "findings appeared: none" in res.stdout
    diff = json.loads((tmp_path / "diff.json").read_text())
    assert diff["findings_gone"] == ["dataloader_starvation"] and diff["findings_appeared"] == []
    assert diff["step_ms"]["before"] == pytest.approx(155, abs=3)
    assert diff["step_ms"]["after"] == pytest.approx(128, abs=3)
    dl = next(c for c in diff["causes"] if c["id"] == "dataloader_starvation")
    assert dl["change"] == "gone" and dl["before_status"] == "flagged" and dl["after_status"] == "passed"
    assert dl["before_ms"] == pytest.approx(31.4, abs=1) and dl["after_ms"] is None
    assert dl["component_after_ms"] < 1 and dl["component_change_ms"] < -25
    # the before run's prediction against the step time the fix gave
    pr = diff["prediction"]
    assert pr["causes"] == ["dataloader_starvation"] and pr["predicted_saving_ms"] == pytest.approx(dl["before_ms"])
    assert pr["measured_saving_ms"] == pytest.approx(diff["step_ms"]["before"] - diff["step_ms"]["after"], abs=1e-3)
    assert re.search(r"PREDICTED vs MEASURED: fixing dataloader_starvation was predicted to give back 31\.\d ms/step; "
                     r"the step got 26\.\d ms shorter \(\+1\d%\)", res.stdout), res.stdout
    html = (tmp_path / "report.html").read_text()
    assert "Predicted vs measured" in html and "Before: recoverable / step" in html
    assert "GONE" in html and "nw0" in html and "nw4" in html and 'class="side"' in html


def test_swapped_runs_show_the_finding_appearing():
    diff = diff_diagnoses(_diagnosis(NW4), _diagnosis(NW0))
    assert diff["findings_appeared"] == ["dataloader_starvation"] and not diff["findings_gone"]
    assert diff["step_ms"]["change_pct"] > 0.15
    assert "findings appeared: dataloader_starvation" in diff_summary(diff)


def test_same_run_twice_changes_nothing():
    d = _diagnosis(NW0)
    diff = diff_diagnoses(d, d)
    assert diff["step_ms"]["change_ms"] == 0 and diff["step_ms"]["change_pct"] == 0
    assert not (diff["findings_gone"] or diff["findings_appeared"] or diff["findings_changed"])
    assert diff["prediction"] is None
    assert diff["findings_unchanged"] == ["dataloader_starvation"]
    assert not diff["comparability"]
    assert set(diff["breakdown_change_ms"].values()) == {0}


def test_different_jobs_are_flagged_as_not_like_for_like():
    diff = diff_diagnoses(_diagnosis(NW0), _diagnosis("param_dlrm_8rank_v100"))
    assert any("world size differs" in n for n in diff["comparability"])


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    res = CliRunner().invoke(main, ["diff", str(tmp_path / "nope"), str(shared(NW4)), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert res.output.strip().startswith("diagnose: error:") and len(res.output.strip().splitlines()) == 1


def test_render_diff_escapes_trace_text_and_tolerates_odd_input():
    diff = diff_diagnoses(_diagnosis(NW0), _diagnosis(NW4), before_label=HOSTILE, before_path=HOSTILE)
    diff["before"]["findings"][0]["title"] = HOSTILE
    diff["causes"][0]["title"] = HOSTILE
    diff["comparability"] = [HOSTILE]
    diff["before"]["run"]["device_name"] = HOSTILE
    text = render_diff(diff)
    assert HOSTILE not in text and text.count("<script") == 4
    for odd in ({}, {"before": None, "causes": [None, 1], "step_ms": "x"}, {"findings_gone": [HOSTILE]}):
        assert HOSTILE not in render_diff(odd) and render_diff(odd).startswith("<!DOCTYPE html>")


def test_every_recorded_step_is_compared_and_an_unusual_window_is_said():
    """Two runs under the probes: beside the profiled steps' means, every other recorded step's
    (diagnose/step/window.py), and a side whose window caught its one evaluation is named."""
    from diagnose.pipeline import diagnose_paths

    fixtures = ROOT / "tests" / "fixtures"
    before = diagnose_paths([fixtures / "gpu_h200" / "none_long_timed"])
    after = diagnose_paths([fixtures / "cpu_window_unlike_run_2rank"])
    diff = diff_diagnoses(before, after)
    wb, wa = before.extras["window"], after.extras["window"]
    every = diff["every_step_ms"]
    assert (every["before"], every["after"]) == (wb["run_step_ms"], wa["run_step_ms"])
    assert every["steps"] == [wb["run_steps"], wa["run_steps"]]
    assert every["change_pct"] == pytest.approx(wa["run_step_ms"] / wb["run_step_ms"] - 1, abs=1e-3)
    # the profiled steps say +500%, every step -8%: both shown, the window's caution with them
    assert diff["step_ms"]["change_pct"] > 4 and every["change_pct"] < 0
    summary = diff_summary(diff)
    assert "EVERY STEP (the probes' record, outside the profiled steps): 12.9 ms -> 11.9 ms" in summary
    assert [n for n in diff["comparability"] if n.startswith("the after run: the profiled steps 47-51")]
    assert not [n for n in diff["comparability"] if n.startswith("the before run's")]
    assert "Every step" in render_diff(diff)
    # a run without the record (the shared traces): no every-step line
    assert diff_diagnoses(_diagnosis(NW0), after)["every_step_ms"] is None


def test_a_side_with_nothing_named_but_a_rank_waiting_says_so():
    """Recorded fixtures: before, rank 1 a straggler (named); after, a healthy job whose rank 1
    still waited ~11% of its step at too few collectives to tell (extras.unnamed_wait): "top cause:
    none" is not said alone, in diff.json, the summary or the page."""
    from tests.conftest import fixture_diagnosis

    fixtures = ROOT / "tests" / "fixtures"
    before, after = (fixture_diagnosis(fixtures / n) for n in ("cpu_straggler_2rank", "cpu_accum_2rank"))
    diff = diff_diagnoses(before, after)
    assert "straggler" in diff["findings_gone"] and diff["after"]["top"] is None
    assert "unnamed_wait" not in diff["before"] and diff["after"]["unnamed_wait"] == after.extras["unnamed_wait"]
    lines = diff_summary(diff).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("after: "))
    assert lines[at].endswith("top cause: none")
    assert lines[at + 1].startswith("  caution (after): rank 1 waited ") and "for a late peer" in lines[at + 1]
    page = render_diff(json.loads(json.dumps(diff)))
    assert re.search(r'class="warn">Caution: rank 1 waited [\d.]+ ms per step \(\d+%\) at collectives', page)
    # a hand-edited side: no caution, no crash
    diff["after"]["unnamed_wait"] = {"rank": HOSTILE}
    assert HOSTILE not in render_diff(diff)


def test_a_fixed_cause_no_replay_expresses_is_added_to_the_combined_what_if():
    """Fixing CPU contention (and the uneven turns it caused): the combined replay has no edit for
    contention, so the prediction was the turns' 28.1 ms against 131.3 measured (-79%). Its own
    figure now comes on top (fixtures' READMEs)."""
    from pathlib import Path

    from diagnose.pipeline import diagnose_paths

    fixtures = Path(__file__).parent / "fixtures"
    before = diagnose_paths([fixtures / "cpu_cores_contended_2rank"])
    after = diagnose_paths([fixtures / "cpu_cores_uncontended_2rank"])
    d = diff_diagnoses(before, after)
    p = d["prediction"]
    assert set(p["causes"]) == {"cpu_contention", "load_imbalance"} == set(d["findings_gone"])
    contention = next(f for f in before.findings if f.id == "cpu_contention")
    assert "replay_recoverable_ms" not in contention.metrics
    combined = before.extras["replay"]["combined_what_if_ms"]
    assert p["predicted_saving_ms"] == pytest.approx(combined + contention.recoverable_ms, abs=0.01)
    assert "plus cpu_contention's own figure" in p["method"]
    assert abs(p["error"]) < 0.25, p
