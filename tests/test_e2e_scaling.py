"""`diagnose scale --nproc 1,2` on real gloo jobs: the injected cause is the largest lost-speedup bar."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import EXAMPLE, ROOT

pytestmark = pytest.mark.e2e
pytest.importorskip("torch")


def scale(out, *script_args):
    cmd = [sys.executable, "-m", "diagnose.cli", "scale", "--nproc", "1,2", "--out", str(out), "--",
           sys.executable, str(EXAMPLE), *script_args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((out / "scaling.json").read_text()), res


@pytest.fixture(scope="module")
def straggler(tmp_path_factory):
    out = tmp_path_factory.mktemp("straggler")
    s, res = scale(out, "--pathology", "straggler")
    return out, s, res


def test_straggler_is_the_largest_bar_and_runs_reanalyse(straggler):
    tmp_path, s, res = straggler
    assert s["waterfall"][0]["id"] == "straggler", res.stdout
    assert "unexplained" in [b["id"] for b in s["waterfall"]]
    # the page opens with a sentence naming the rank, as analyze's does
    assert "the largest loss is waiting for a straggler on rank 1" in s["verdict"], s["verdict"]
    step = s["runs"][-1]["step_ms"]
    assert all(b["delta_ms"] <= step for b in s["waterfall"]) and all(w["step_ms"] > 0 for w in s["what_if"])
    assert (tmp_path / "report.html").exists() and list(tmp_path.glob("n2/*/diagnosis.json"))
    # each size ran in a fresh run directory under OUT/nN/; --runs takes that parent (its newest run)
    # the same analysis post hoc from the saved run directories
    again = subprocess.run([sys.executable, "-m", "diagnose.cli", "scale", "--runs", f"1={tmp_path / 'n1'}",
                            "--runs", f"2={tmp_path / 'n2'}", "--out", str(tmp_path / "again")],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 0, again.stderr
    s2 = json.loads((tmp_path / "again" / "scaling.json").read_text())
    assert s2["waterfall"] == s["waterfall"]


def test_allreduce_dominated_model_loses_speedup_to_communication(tmp_path):
    """A wide model on tiny batches: the 2-rank all-reduce of ~10 MB dwarfs the compute, and exposed
    communication is the largest cause of the lost speedup; removing it is the what-if that gives
    back most. Compute inflation is not a cause but the growth left with every cause removed: on this
    2-core host the second rank's gloo thread reduces its 10 MB and DDP copies gradients into buckets
    on the same two cores (one run: aten::copy_ +3.4, aten::mm +2.4, aten::div_ +1.1 ms per step from
    N=1 to N=2), so it came to 2.8-12.3 ms against 10.4-11.5 ms of communication in four runs, above it
    once (and once in CI): a real loss of this host, not a misread cause."""
    s, res = scale(tmp_path, "--batch-size", "8", "--hidden", "1024", "--repeat", "1")
    causes = [b["id"] for b in s["waterfall"] if b["id"] not in ("compute_inflation", "unexplained")]
    assert causes[0] == "exposed_communication", res.stdout
    single = {w["id"]: w["step_ms"] for w in s["what_if"] if w["id"] != "every_cause"}
    assert min(single, key=single.get) == "exposed_communication", res.stdout
    assert "unexplained" in [b["id"] for b in s["waterfall"]]


def test_equally_slow_loader_is_baseline_not_lost_speedup(tmp_path):
    """The loader is as slow at 1 rank as at 2: it is the baseline's cause and costs no speedup.
    Not asserted: which bar comes first. Every bar of this job is noise-sized (4 runs, 2026-12-05:
    the DataLoader's -0.006 to 0.0, the others -0.034 to 0.028), so the first was the DataLoader's
    once in CI without a broken tool; a loader counted as lost speedup would be a bar of its share
    of the step (it waits 407 of a 474 ms step: 85%). The bound is under a third of that: a CI run
    (2026-12-05, evening) measured the DataLoader's bar at -0.104 beside compute inflation at -0.088
    (both bars negative: the one-rank run was the slower; two reruns passed), past the 0.05 this bound was, with the
    tool reading the cause right."""
    s, res = scale(tmp_path, "--pathology", "dataloader")
    assert [f["id"] for f in s["baseline"]][:1] == ["dataloader_starvation"], res.stdout
    bars = {b["id"]: b["lost_speedup"] for b in s["waterfall"]}
    assert abs(bars["dataloader_starvation"]) < 0.25, bars
    assert "unexplained" in bars


def test_what_if_removes_the_injected_wait_from_the_step(straggler):
    """The what-if on one faulty run: the step without the straggler is the step minus (most of) the
    150 ms the straggler makes the others wait, never more than the step.

    Its accuracy against a second, fixed run is measured by `benchmarks/bench_whatif.py`, not
    asserted here: two separate jobs on a shared 2-core machine differ by the machine's noise and
    core contention (fixed runs measured at 105, 154 and 187 ms per step for the same job), so such
    a test turned red without a broken tool."""
    _, s, _ = straggler
    top = s["runs"][-1]
    assert top["causes_from"] == "replay"
    step = top["step_ms"]
    without = {w["id"]: w["step_ms"] for w in s["what_if"]}["straggler"]
    assert 0.0 < without < step
    assert 0.6 * 150.0 <= step - without <= 150.0 * 1.3, (step, without)
