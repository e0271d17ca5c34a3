"""A run profiled in several windows (`--schedule W,U,A,R`, R > 1): one trace a rank a window.

tests/fixtures/cpu_repeated_windows_2rank (README there) was refused until 2026-12-07 ("two traces
for rank 0 ... mixed runs?"), by `diagnose run` itself at the end of the run. The last window every
rank wrote is analysed now, and the warning says so; traces without the probes' records stay
refused (several traces a rank there may be two runs)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from diagnose.errors import DiagnoseError
from diagnose.pipeline import diagnose_paths

RUN = Path(__file__).parent / "fixtures" / "cpu_repeated_windows_2rank"


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


def test_several_traces_a_rank_without_the_probes_records_are_still_refused(tmp_path):
    for f in RUN.glob("*.pt.trace.json.gz"):
        shutil.copy(f, tmp_path / f.name)
    with pytest.raises(DiagnoseError, match="two traces for rank 0"):
        diagnose_paths([tmp_path])
