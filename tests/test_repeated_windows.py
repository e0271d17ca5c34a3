"""A run profiled in several windows: one trace a rank a window (diagnose/ingest/windows.py).

tests/fixtures/cpu_repeated_windows_2rank (the probes' `--schedule W,U,A,R`, R > 1) and
cpu_repeat_default_names_2rank (a job's own profiler, torch's default `repeat=0`, the default file
names; READMEs there) were refused until 2026-12-07 ("two traces for rank 0 ... mixed runs?").
The last whole window every rank wrote is analysed now, and the warning says so; traces of two
processes under one name, or a copied file, stay refused."""
from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from diagnose.errors import DiagnoseError
from diagnose.ingest.windows import choose_window, read_header
from diagnose.pipeline import diagnose_paths

FIXTURES = Path(__file__).parent / "fixtures"
RUN = FIXTURES / "cpu_repeated_windows_2rank"
OWN = FIXTURES / "cpu_repeat_default_names_2rank"


def _stamps(rank: int) -> list[str]:
    return sorted(p.name for p in RUN.glob(f"rank{rank}.*.pt.trace.json.gz"))


def test_the_last_window_of_a_repeating_schedule_is_analysed():
    d = diagnose_paths([RUN])
    assert {int(r): Path(f).name for r, f in d.run.files.items()} == {0: _stamps(0)[-1], 1: _stamps(1)[-1]}
    assert d.run.steps_analysed == 3
    assert any("2 profiled windows a rank" in w and "(window 2) is analysed" in w for w in d.warnings), d.warnings


def test_the_last_window_every_rank_wrote_when_one_rank_wrote_fewer(tmp_path):
    """A rank that ended before the second window (killed, or slower to export): window 1 for all."""
    for f in RUN.iterdir():
        if f.name != _stamps(1)[-1]:
            shutil.copy(f, tmp_path / f.name)
    d = diagnose_paths([tmp_path])
    assert {int(r): Path(f).name for r, f in d.run.files.items()} == {0: _stamps(0)[0], 1: _stamps(1)[0]}
    assert any("(window 1) is analysed" in w for w in d.warnings), d.warnings


def test_the_windows_are_one_runs_without_the_probes_records_too(tmp_path):
    """The pids, hosts and ranks in the files' first bytes say one process a rank, not the records."""
    for f in RUN.glob("*.pt.trace.json.gz"):
        shutil.copy(f, tmp_path / f.name)
    d = diagnose_paths([tmp_path])
    assert {int(r): Path(f).name for r, f in d.run.files.items()} == {0: _stamps(0)[-1], 1: _stamps(1)[-1]}


def _own(stem: str) -> list[str]:
    return sorted(p.name for p in OWN.glob(f"{stem}.*.pt.trace.json.gz"))


def test_a_jobs_own_repeating_profiler_the_last_whole_window_not_the_cut_one():
    """Three windows a rank, the third cut by the run's end (one step whole of two, half the size):
    window 2's two steps are analysed, and the warning names the cut one."""
    d = diagnose_paths([OWN])
    assert {int(r): Path(f).name for r, f in d.run.files.items()} == {0: _own("vm_6237")[1], 1: _own("vm_6238")[1]}
    assert d.run.steps_analysed == 2
    note = next(w for w in d.warnings if "profiled windows" in w)
    assert "3 profiled windows a rank" in note and "(window 2) is analysed" in note
    assert "window 3 looks cut short" in note
    assert d.extras["profiled_windows"] == {"analysed": 2, "written": 3, "every_rank": 3, "cut": [3],
                                            "asked": False}


def test_diff_says_which_window_stands_for_each_side():
    from diagnose.diff import diff_diagnoses

    said = diff_diagnoses(diagnose_paths([OWN], window=1), diagnose_paths([RUN]))["comparability"]
    assert "the before run: profiled window 1 of 3 read" in said
    assert "the after run: profiled window 2 of 2 read" in said
    plain = diff_diagnoses(diagnose_paths([FIXTURES / "cpu_straggler_2rank"]), diagnose_paths([RUN]))
    assert not any("before run: profiled window" in n for n in plain["comparability"])


def test_the_cut_window_is_analysed_when_the_user_names_its_files():
    files = [OWN / _own("vm_6237")[2], OWN / _own("vm_6238")[2]]
    d = diagnose_paths(files)
    assert d.run.steps_analysed == 1 and not any("profiled windows" in w for w in d.warnings)


def test_two_runs_under_one_name_are_still_refused(tmp_path):
    """rank0.STAMP of two jobs (a second run into the same --trace-dir): two processes, two runs."""
    for f in RUN.glob("*.pt.trace.json.gz"):
        if f.name in (_stamps(0)[0], _stamps(1)[0]):
            shutil.copy(f, tmp_path / f.name)
    for f in (FIXTURES / "cpu_straggler_2rank").glob("*.pt.trace.json.gz"):
        shutil.copy(f, tmp_path / f.name)
    assert choose_window([tmp_path]) is None
    with pytest.raises(DiagnoseError, match="two traces for rank 0: .* from two processes"):
        diagnose_paths([tmp_path])


def test_two_runs_in_one_directory_are_named_by_their_processes(tmp_path):
    """A rerun into the same tensorboard directory (the default names differ by pid): refused, and
    the error says which processes and when, not "mixed runs or repeated captures?"."""
    for f in (OWN / _own("vm_6237")[0], OWN / _own("vm_6238")[0],
              *(FIXTURES / "cpu_straggler_2rank").glob("*.pt.trace.json.gz")):
        shutil.copy(f, tmp_path / f.name)
    with pytest.raises(DiagnoseError) as got:
        diagnose_paths([tmp_path])
    said = str(got.value)
    assert "two traces for rank 0" in said and "two runs in one directory" in said, said
    assert "pid 6237 from 2026-12-07" in said, said


def test_a_copied_window_is_not_a_second_window(tmp_path):
    """The same file under another stamp starts when it starts: not one process's next window."""
    for f in RUN.glob("*.pt.trace.json.gz"):
        if f.name in (_stamps(0)[0], _stamps(1)[0]):
            shutil.copy(f, tmp_path / f.name)
    stem, stamp, rest = _stamps(0)[0].split(".", 2)
    shutil.copy(RUN / _stamps(0)[0], tmp_path / f"{stem}.{int(stamp) + 1000}.{rest}")
    assert choose_window([tmp_path]) is None
    with pytest.raises(DiagnoseError, match="two traces for rank 0: .* of one recording"):
        diagnose_paths([tmp_path])


def test_the_header_names_rank_host_and_process(tmp_path):
    h = read_header(OWN / _own("vm_6238")[0])
    assert (h.rank, h.host, h.pid) == (1, "vm", 6238)
    later = read_header(OWN / _own("vm_6238")[1])
    assert later.start_us > h.start_us
    plain = tmp_path / "plain.json"  # not compressed: the same header
    plain.write_bytes(gzip.decompress((OWN / _own("vm_6238")[0]).read_bytes()))
    assert read_header(plain) == h
    (tmp_path / "other.json").write_text('{"a": 1}')
    assert read_header(tmp_path / "other.json") is None
    (tmp_path / "cut.json.gz").write_bytes((OWN / _own("vm_6238")[0]).read_bytes()[:200])
    assert read_header(tmp_path / "cut.json.gz") is None


def _lay_out(root: Path, where) -> None:
    """The fixture's windows copied to root/where(rank, window index, file)."""
    for r, stem in enumerate(("vm_6237", "vm_6238")):
        for i, name in enumerate(_own(stem)):
            to = root / where(r, i, name)
            to.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(OWN / name, to)


def test_a_subdirectory_a_window_as_torchtitan_writes_them(tmp_path):
    """torchtitan: profile_trace/iteration_N/rank{R}_trace.json (same names in every window)."""
    _lay_out(tmp_path, lambda r, i, _: f"iteration_{4 * (i + 1)}/rank{r}_trace.json.gz")
    d = diagnose_paths([tmp_path])
    assert sorted(Path(f).parent.name for f in d.run.files.values()) == ["iteration_8"] * 2
    assert d.run.steps_analysed == 2
    assert any("(window 2: iteration_8) is analysed" in w for w in d.warnings), d.warnings


def test_a_subdirectory_a_rank(tmp_path):
    _lay_out(tmp_path, lambda r, i, name: f"rank_{r}/{name}")
    d = diagnose_paths([tmp_path])
    assert {int(r): Path(f).name for r, f in d.run.files.items()} == {0: _own("vm_6237")[1], 1: _own("vm_6238")[1]}
    one = tmp_path / "one"  # a trace a rank, no windows: read together
    _lay_out(one, lambda r, i, name: f"rank_{r}/{name}" if i == 0 else f"../unused/{name}")
    d = diagnose_paths([one])
    assert sorted(d.run.files) == [0, 1] and any("a trace a rank in its subdirectories" in w for w in d.warnings)


def test_two_runs_in_two_subdirectories_are_still_refused(tmp_path):
    for f in RUN.glob("*.pt.trace.json.gz"):
        if f.name in (_stamps(0)[0], _stamps(1)[0]):
            (tmp_path / "run_a").mkdir(exist_ok=True)
            shutil.copy(f, tmp_path / "run_a" / f.name)
    shutil.copytree(FIXTURES / "cpu_straggler_2rank", tmp_path / "run_b")
    assert choose_window([tmp_path]) is None
    with pytest.raises(DiagnoseError, match="several subdirectories"):
        diagnose_paths([tmp_path])


def test_windows_named_by_step_and_rank(tmp_path):
    """`prof.export_chrome_trace(f"trace_step{N}_rank{R}.json")` at each window: no stamp, the rank
    named twice; the first bytes say one process a rank."""
    _lay_out(tmp_path, lambda r, i, _: f"trace_step{4 * (i + 1)}_rank{r}.json.gz")
    d = diagnose_paths([tmp_path])
    assert sorted(Path(f).name for f in d.run.files.values()) == ["trace_step8_rank0.json.gz",
                                                                   "trace_step8_rank1.json.gz"]
    assert any(w.startswith(f"{tmp_path}: 3 profiled windows a rank") for w in d.warnings), d.warnings


def test_two_windows_of_one_run_passed_by_hand_are_refused_as_such():
    """Rank 0's window 1 with rank 1's window 2: not profiled at the same time, and the error
    names windows as well as runs."""
    with pytest.raises(DiagnoseError, match=r"rank 0 steps #2-#3 and rank 1 steps #6-#7.*two windows of one run"):
        diagnose_paths([OWN / _own("vm_6237")[0], OWN / _own("vm_6238")[1]])


@pytest.mark.parametrize("window, index, steps", [(1, 0, 2), (2, 1, 2), (-1, 2, 1), (3, 2, 1)])
def test_the_window_asked_for(window, index, steps):
    d = diagnose_paths([OWN], window=window)
    assert {int(r): Path(f).name for r, f in d.run.files.items()} == {0: _own("vm_6237")[index],
                                                                      1: _own("vm_6238")[index]}
    assert d.run.steps_analysed == steps
    note = next(w for w in d.warnings if "profiled windows" in w)
    assert f"the one asked for (window {index + 1})" in note
    assert "window 3 looks cut short" in note  # said of the cut window, asked for or not


def test_a_window_not_every_rank_wrote_or_no_windows_at_all_is_one_line_and_exit_2(tmp_path):
    from click.testing import CliRunner

    from diagnose.cli import main

    res = CliRunner().invoke(main, ["analyze", str(OWN), "--window", "4", "--out", str(tmp_path / "a")])
    assert res.exit_code == 2 and "--window 4: every rank wrote windows 1-3" in res.output
    res = CliRunner().invoke(main, ["analyze", str(FIXTURES / "cpu_straggler_2rank"), "--window", "1",
                                    "--out", str(tmp_path / "b")])
    assert res.exit_code == 2 and "no repeated profiler windows of one run here" in res.output
    res = CliRunner().invoke(main, ["analyze", str(OWN), "--window", "0", "--out", str(tmp_path / "c")])
    assert res.exit_code == 2 and "windows count from 1" in res.output


def test_the_terminal_and_the_report_say_which_window(tmp_path):
    from diagnose.reports.html import render

    from diagnose.output import diagnosis_dict, terminal_summary

    d = diagnose_paths([OWN])
    assert "2 step(s) from ProfilerStep (profiled window 2 of 3)" in terminal_summary(d)
    assert "(from ProfilerStep, profiled window 2 of 3)" in render(diagnosis_dict(d))
    plain = diagnose_paths([FIXTURES / "cpu_straggler_2rank"])
    assert "profiled window" not in terminal_summary(plain)


def test_two_windows_mixed_across_hosts_are_refused_too(tmp_path):
    """Rank 1's window 2 as if from another host (its clock not comparable): no step in common."""
    import json

    other = tmp_path / _own("vm_6238")[1]
    doc = json.loads(gzip.decompress((OWN / _own("vm_6238")[1]).read_bytes()))
    doc["host_name"] = "other-host"
    other.write_bytes(gzip.compress(json.dumps(doc).encode()))
    with pytest.raises(DiagnoseError, match=r"rank 0 steps #2-#3 and rank 1 steps #6-#7, no step in common"):
        diagnose_paths([OWN / _own("vm_6237")[0], other])
