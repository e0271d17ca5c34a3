"""step/appended.py: a run-wide column grown rank after rank gives what joining the ranks' arrays
would; the step breakdown held as one frame gives back the rows it was computed as."""
from pathlib import Path

import numpy as np
import pytest

from diagnose.step.appended import Appended


def _appended(parts):
    col = Appended()
    for p in parts:
        col.add(p)
    return col


@pytest.mark.parametrize("parts", [
    [np.array([1, 2], dtype=np.int64), np.array([], dtype=np.int64), np.array([3], dtype=np.int64)],
    [np.array([0.5, np.nan]), np.array([-1e300])],
    [np.array(["a", None], dtype=object), np.array([(1, 2), "b"], dtype=object)],
    [np.array([1, 2], dtype=np.int64), np.array([0.5])],  # ranks that disagree: numpy promotes
    [np.array([1.5]), np.array(["x"], dtype=object)],
    [np.array([1, 2], dtype=np.int32), np.array([3], dtype=np.int32)],  # no typed buffer here
    [np.array([True, False]), np.array([], dtype=bool), np.array([True])],
], ids=["int64", "float64", "objects", "int-then-float", "float-then-object", "int32", "bool"])
def test_a_grown_column_is_the_ranks_arrays_joined(parts):
    got, want = _appended(parts).array(), np.concatenate(parts)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert [type(x) for x in got.tolist()] == [type(x) for x in want.tolist()]
    np.testing.assert_array_equal(got, want)
    if all(p.dtype == object for p in parts):  # the ranks' own objects, not copies
        assert all(a is b for a, b in zip(got, want))
    assert _appended(parts).n == want.size


def test_nothing_appended_is_an_empty_column():
    assert Appended().array().size == 0 and Appended().n == 0


@pytest.mark.parametrize("where", ["hta_nccl_data_rank0of2_a100", "param_dlrm_8rank_v100", "cpu_straggler_2rank"])
def test_the_breakdown_frame_gives_back_its_rows_as_computed(where):
    """The checks read the breakdown as a frame; the report's rows are made from it at the end.
    Each value keeps the type it was computed with (the ms as numpy floats, as each rank's arrays
    gave them), every row once, in rank order, and the frame is those rows' fields."""
    import pandas as pd

    from diagnose.context import build_context
    from diagnose.step.breakdown import CAUSE_COLUMNS, FIELDS, GC_IN_FETCH, HAS_CAUSES, MS_FIELDS, breakdown_rows
    from diagnose.step.idle import CLASSES
    from tests.conftest import fixture_run, shared_run

    fixtures = Path(__file__).resolve().parent / "fixtures"
    run = fixture_run(fixtures / where) if where.startswith("cpu_") else shared_run(where)
    table = build_context(run).table
    rows = list(breakdown_rows(table))
    assert len(rows) == len(table) > 0
    assert [(b.rank, b.step) for b in rows] == sorted((b.rank, b.step) for b in rows)
    for b in rows:
        assert type(b.rank) is int and type(b.step) is int and type(b.start_us) is float
        assert all(type(getattr(b, f)) is np.float64 for f in MS_FIELDS)
        assert type(b.other_by_cause_ms) is dict
    again = pd.DataFrame({f: [getattr(b, f) for b in rows] for f in FIELDS if f != "other_by_cause_ms"})
    pd.testing.assert_frame_equal(again, table[list(again.columns)])
    # the split by cause, a column per class in the frame, a dict per row (empty without a split)
    assert list(table.columns) == list(again.columns) + list(CAUSE_COLUMNS) + [HAS_CAUSES, GC_IN_FETCH]
    for b, (_, row) in zip(rows, table.iterrows()):
        assert b.other_by_cause_ms == ({c: row[k] for c, k in zip(CLASSES, CAUSE_COLUMNS)} if row[HAS_CAUSES] else {})
        assert all(type(v) is float for v in b.other_by_cause_ms.values())
    assert all(bool(b.other_by_cause_ms) == run.timelines[b.rank].is_gpu for b in rows)  # GPU: idle split


def test_the_diagnosis_holds_its_breakdown_as_columns_and_reads_as_its_rows(tmp_path):
    """Diagnosis.breakdown is the breakdown frame's columns (BreakdownRows, #20), each row made
    when read: it reads as the tuple of rows it replaced (length, order, indexing from either end,
    slices, equality both ways), survives pickling, and diagnosis.json's rows are those rows."""
    import pickle
    from dataclasses import asdict

    import orjson

    from diagnose.context import build_context
    from diagnose.output import write_json
    from diagnose.pipeline import diagnose_run
    from diagnose.step.breakdown import BreakdownRows, breakdown_rows
    from tests.conftest import shared_run

    run = shared_run("param_dlrm_8rank_v100")
    want = tuple(breakdown_rows(build_context(run).table))
    d = diagnose_run(shared_run("param_dlrm_8rank_v100"))
    rows = d.breakdown
    assert isinstance(rows, BreakdownRows) and len(rows) == len(want) >= 8
    assert rows == want and want == tuple(rows) and rows == list(want) and rows != want[:-1]
    assert rows[0] == want[0] and rows[-1] == want[-1] and rows[2:5] == want[2:5] and rows[::-3] == want[::-3]
    with pytest.raises(IndexError):
        rows[len(want)]
    assert pickle.loads(pickle.dumps(d)) == d
    write_json(d, tmp_path)
    assert orjson.loads((tmp_path / "diagnosis.json").read_bytes())["breakdown"] == \
        orjson.loads(orjson.dumps([asdict(s) for s in want], option=orjson.OPT_SERIALIZE_NUMPY))
