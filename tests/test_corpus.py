"""The corpus of hostile and broken inputs, through the whole CLI: never lie, never crash.

Each case's expected outcome (docs/bad-input.md has the same table):
- error: exit 2, exactly one stderr line naming the file (or directory) and the problem;
- degrade: exit 0, what is valid analysed, what was skipped named in diagnosis.json;
- ok: exit 0, analysed like any trace.
No Python traceback may reach the user in any case.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from diagnose.cli import main
from tests.conftest import ROOT, SHARED, built_once
from tests.corpus.make_corpus import DEFAULT_PAIR as PAIR
from tests.corpus.make_corpus import CASES, N_BAD_WITH_NAN, SKEW_US, XSS, make_corpus

GPU = SHARED / "hta_nccl_data_rank0of2_a100" / "nccl_data.json.gz"

# case -> (outcome, what the error line / warnings / skipped must say)
ERRORS = {
    "empty_file": "empty file",
    "zero_events": "no trace events",
    "only_metadata": "no usable events",
    "not_json": "not JSON",
    "json_not_trace": "JSON but not a trace",
    "truncated_before_events": "truncated before the first complete event",
    "no_steps": "no complete training step",
    "mixed_world_sizes": "files from different runs",
    "mixed_runs": "files from different runs",
    "duplicate_ranks": "two traces for rank 0",
    "recursion_bomb": "nested deeper",
    "recursion_bomb_in_event": "nested deeper",
    "decompression_bomb": "expands beyond the 102.4 MiB limit (decompression bomb?)",
}
# the file the error line must name (else the case directory)
ERROR_FILE = {"empty_file": "rank0.pt.trace.json", "zero_events": "rank0.pt.trace.json",
              "only_metadata": "rank0.pt.trace.json", "not_json": "rank0.pt.trace.json",
              "json_not_trace": "rank0.pt.trace.json", "truncated_before_events": "rank0.json",
              "recursion_bomb": "rank0.pt.trace.json", "recursion_bomb_in_event": "rank0.pt.trace.json.gz",
              "decompression_bomb": "rank0.pt.trace.json.gz"}
DEGRADED = {
    "truncated_json": ["truncated at byte", "salvaged"],
    "truncated_gz": ["gzip stream ends early", "salvaged"],
    "truncated_gpu_single": ["truncated at byte", "step marker(s) after the cut dropped"],
    "empty_beside_good": ["skipped", "empty file", "1 of 2 ranks: missing rank(s) 1"],
    "bad_fields": [f"skipped {N_BAD_WITH_NAN} malformed events", "unrecognised categories (<list>)"],
    "unknown_categories": ["ignored 2 events in unrecognised categories (my_custom_category, None)"],
    "no_steps_one_rank": ["no complete training step", "1 of 2 ranks"],
    "missing_ranks": ["2 of 4 ranks: missing rank(s) 2, 3"],
    "clock_skew": ["clock offset"],
    "non_utf8": ["invalid UTF-8 bytes replaced by U+FFFD"],
    "stray_json_beside_traces": ["hparams.json: JSON but not a trace", "notes.json: not valid JSON"],
}
OK = ["list_form", "gzip_named_json", "single_step", "thousands_of_steps", "huge_strings", "hostile_names"]
EXTRA_ARGS = {"decompression_bomb": ["--max-trace-gb", "0.1"]}


_CORPUS: dict[str, Path] = {}
"""The corpus, built once per process (no analyzer code makes it): a mutation run's forked test
sessions (benchmarks/mutation.py) reuse it instead of rebuilding it for every mutant."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    # a real job recorded once (tests/fixtures/cpu_straggler_2rank/README.md): no torchrun per run
    if not _CORPUS or not all(p.exists() for p in _CORPUS.values()):
        _CORPUS.clear()
        gpu = GPU if GPU.exists() else None
        out = built_once(tmp_path_factory, "corpus", lambda d: make_corpus(d, PAIR, gpu))
        _CORPUS.update({name: out / name for name in CASES})
    return _CORPUS


@pytest.fixture(scope="module")
def analyzed(corpus, tmp_path_factory):
    """A case analysed once for the module: (CLI result, output directory)."""
    done: dict[str, tuple] = {}

    def get(case: str):
        if case not in done:
            out = tmp_path_factory.mktemp(case)
            done[case] = (analyze(corpus[case], out), out)
        return done[case]
    return get


def analyze(case_dir: Path, out: Path, *extra: str):
    res = CliRunner().invoke(main, ["analyze", str(case_dir), "--out", str(out), *extra])
    # nothing but a clean exit: an exception here would be a traceback for the user
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    return res


def diagnosis(out: Path) -> dict:
    return json.loads((out / "diagnosis.json").read_bytes().decode("utf-8"))  # strict UTF-8


def test_every_case_has_an_expected_outcome(corpus):
    assert set(corpus) == set(ERRORS) | set(DEGRADED) | set(OK)


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_error_cases_exit_2_with_one_line(corpus, case, tmp_path):
    res = analyze(corpus[case], tmp_path, *EXTRA_ARGS.get(case, []))
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and not res.stdout.strip(), res.output
    line = lines[0]
    assert line.startswith("diagnose: error: ") and ERRORS[case] in line, line
    named = ERROR_FILE.get(case)
    assert (named and line.split(": ", 2)[2].startswith(str(corpus[case] / named))) or \
        (not named and str(corpus[case]) in line), line
    assert not (tmp_path / "diagnosis.json").exists()


@pytest.mark.parametrize("case", sorted(DEGRADED))
def test_degraded_cases_analyse_what_is_valid_and_say_what_was_skipped(corpus, case, tmp_path):
    res = analyze(corpus[case], tmp_path)
    assert res.exit_code == 0, res.output
    d = diagnosis(tmp_path)
    said = "\n".join(d["warnings"] + d["skipped"])
    for needle in DEGRADED[case]:
        assert needle in said, (needle, said)
    assert d["run"]["steps_analysed"] >= 1 and d["checks"]


@pytest.mark.parametrize("case", OK)
def test_ok_cases_analyse_normally(analyzed, case):
    res, out = analyzed(case)
    assert res.exit_code == 0, res.output
    assert res.output.startswith("VERDICT:")
    d = diagnosis(out)
    assert d["skipped"] == []
    assert (out / "report.html").exists()


def test_skipped_files_are_named_with_their_reason(corpus, tmp_path):
    analyze(corpus["empty_beside_good"], tmp_path)
    d = diagnosis(tmp_path)
    assert d["skipped"] == [f"{corpus['empty_beside_good'] / 'rank1.pt.trace.json'}: empty file"]
    assert d["run"]["ranks_found"] == [0] and d["run"]["ranks_missing"] == [1]


@pytest.mark.parametrize("case", ["truncated_json", "truncated_gz"])
def test_truncated_rank_is_salvaged_and_still_analysed(corpus, case, tmp_path):
    analyze(corpus[case], tmp_path)
    d = diagnosis(tmp_path)
    assert d["run"]["ranks_found"] == [0, 1]
    # the cut dropped the last step(s), never invented one
    assert 1 <= d["run"]["steps_analysed"] < 5
    # Kineto writes the gloo threads last, so a cut may take rank 1's transfers with it: then the
    # straggler cannot be measured, but nothing may be blamed on rank 0
    for f in d["findings"]:
        assert f["id"] != "straggler" or f["ranks"] == [1], f


def test_findings_on_a_salvaged_rank_have_lower_confidence(corpus):
    from diagnose.analyzers import reduce_rank
    from diagnose.pipeline import diagnose_run
    from diagnose.ingest.assemble import load_run

    levels = ["low", "medium", "high"]
    run = load_run([corpus["gzip_named_json"]], reduce=reduce_rank)
    before = {f.id: f.confidence for f in diagnose_run(run).findings}
    run.traces = dict(run.traces)  # held column-wise, each lookup a fresh object (ingest/store.py)
    run.traces[1].salvaged = True  # the same data, as if rank 1's file had been cut
    after = {f.id: f.confidence for f in diagnose_run(run).findings}
    assert before
    for fid, level in before.items():
        assert level == "low" or levels.index(after[fid]) < levels.index(level), (fid, level, after[fid])


def test_clock_skew_is_detected_applied_and_the_straggler_still_named(corpus, tmp_path):
    analyze(corpus["clock_skew"], tmp_path)
    d = diagnosis(tmp_path)
    offset = d["run"]["clock_offsets_us"]["1"]
    assert abs(offset + SKEW_US) < 10_000, offset  # rank 1's clock runs 250 ms ahead: corrected by -250 ms
    top = d["findings"][0]
    assert top["id"] == "straggler" and top["ranks"] == [1]


def test_single_step_lowers_confidence(corpus, tmp_path):
    analyze(corpus["single_step"], tmp_path)
    d = diagnosis(tmp_path)
    assert d["run"]["steps_analysed"] == 1
    assert d["findings"] and all(f["confidence"] != "high" for f in d["findings"])


def test_thousands_of_steps(analyzed):
    d = diagnosis(analyzed("thousands_of_steps")[1])
    assert d["run"]["steps_analysed"] >= 2990
    assert len(d["breakdown"]) == 2 * d["run"]["steps_analysed"]


def test_huge_strings_stay_out_of_the_outputs(analyzed):
    out = analyzed("huge_strings")[1]
    assert (out / "diagnosis.json").stat().st_size < 2 << 20
    assert (out / "report.html").stat().st_size < 8 << 20


def test_hostile_names_leave_no_executable_markup(analyzed):
    from tests.test_report import assert_inert

    out = analyzed("hostile_names")[1]
    d = diagnosis(out)
    names = [e["name"] for f in d["findings"] for e in f["events"]]
    assert any(XSS["script"] in n for n in names)  # the payload did reach the report's input
    page = assert_inert((out / "report.html").read_text(encoding="utf-8"), XSS.values())
    assert any(XSS["script"] in s for s in page.section_text.values())  # shown, as text


def test_unicode_file_names_do_not_break_outputs(corpus, tmp_path):
    src = corpus["gzip_named_json"]
    weird = tmp_path / "in"
    weird.mkdir()
    for i, f in enumerate(sorted(src.iterdir())):
        (weird / f"rank{i}.<b>é\u202e.json").write_bytes(f.read_bytes())
    res = analyze(weird, tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert diagnosis(tmp_path / "out")["run"]["files"]


def test_control_characters_in_a_file_name_keep_the_error_on_one_line(tmp_path):
    bad = tmp_path / "in"
    bad.mkdir()
    (bad / "rank0\n\x1b[31mfake error\x1b[0m.json").write_bytes(b"")
    res = analyze(bad, tmp_path / "out")
    assert res.exit_code == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "\\n" in lines[0] and "\x1b" not in lines[0] and "empty file" in lines[0]


def test_non_utf8_file_names_do_not_crash(corpus, tmp_path):
    src = corpus["gzip_named_json"]
    weird = tmp_path / "in"
    weird.mkdir()
    for i, f in enumerate(sorted(src.iterdir())):
        (weird / (f"rank{i}" + "\udcff" + ".json")).write_bytes(f.read_bytes())
    res = analyze(weird, tmp_path / "out")
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("case,code", [("truncated_gz", 0), ("not_json", 2), ("recursion_bomb", 2)])
def test_real_subprocess(corpus, case, code, tmp_path):
    res = subprocess.run([sys.executable, "-m", "diagnose.cli", "analyze", str(corpus[case]), "--out",
                          str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == code, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    if code == 2:
        assert res.stderr.count("\n") == 1 and res.stderr.startswith("diagnose: error: ")
    else:
        assert res.stdout.startswith("VERDICT:")
