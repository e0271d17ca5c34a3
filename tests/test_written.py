"""diagnosis.json and report.html are written as they are made (#20): the same bytes as the whole
text made at once (orjson's for the JSON, `render`'s for the page), in pieces none of which is
near the whole, and a write that fails half way leaves the file that was there."""
from __future__ import annotations

import math

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import diagnose.output as output
import diagnose.probes.safefs as safefs
from diagnose.model import Grid
from diagnose.output import JSON_OPTIONS, _clean, diagnosis_dict, json_parts, write_json
from diagnose.reports.html import render, write_report
from tests.test_report import trace_set
from tests.conftest import shared_diagnosis

SETS = ("param_dlrm_8rank_v100", "kineto_resnet50_dataloader_v100/nw0", "hta_sampled_2rank_of128")

floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, 1e-300, 2.5])
scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | floats
           | st.text(max_size=8) | st.sampled_from(["\ud800x", "é", "\"<\\/>\"", "\n"])
           | floats.map(np.float64) | st.integers(-5, 5).map(np.int64))
grids = st.lists(st.lists(floats, min_size=2, max_size=2), max_size=4).map(lambda rows: Grid(rows or np.zeros((0, 2))))
arrays = st.lists(floats, max_size=4).map(np.array)
keys = st.text(max_size=4) | st.integers(-3, 3) | st.sampled_from(["1", "-1", "None"]) | st.none()
values = st.recursive(scalars | grids | arrays,
                      lambda inner: st.lists(inner, max_size=5) | st.lists(inner, max_size=3).map(tuple)
                      | st.dictionaries(keys, inner, max_size=5), max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(values, st.integers(0, 3), st.integers(0, 3))
def test_json_in_pieces_is_orjsons_text_byte_for_byte(x, levels, items):
    """Whatever is cut into pieces (every level, long containers only, nothing), the text is
    orjson's for the whole: indents, empty containers, NaN as null, non-text keys as _clean
    writes them (1 and "1" collide to one key), Grids a row at a time, numpy's numbers."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(output, "PIECE_LEVELS", levels)
        mp.setattr(output, "PIECE_ITEMS", items)
        try:
            whole = orjson.dumps(_clean(x), option=JSON_OPTIONS)
        except orjson.JSONEncodeError:  # what orjson refuses whole (a lone surrogate in a key) it refuses in pieces
            with pytest.raises(orjson.JSONEncodeError):
                b"".join(json_parts(x))
            return
        assert b"".join(json_parts(x)) == whole


@pytest.mark.parametrize("name", SETS)
def test_written_outputs_are_the_whole_texts(name, tmp_path):
    """The files are what the whole texts would be: diagnosis.json orjson's of diagnosis_dict,
    report.html render's of it (its breakdown rows as a list, not made as read)."""
    trace_set(name)
    d = shared_diagnosis(name)
    assert len(d.breakdown) > 1
    write_json(d, tmp_path)
    write_report(d, tmp_path)
    dd = diagnosis_dict(d)
    assert isinstance(dd["breakdown"], list)
    assert (tmp_path / "diagnosis.json").read_bytes() == orjson.dumps(dd, option=JSON_OPTIONS)
    assert (tmp_path / "report.html").read_bytes() == render(dd).encode("utf-8")
    assert dd == diagnosis_dict(d, rows_when_read=True) | {"breakdown": dd["breakdown"]}
    assert list(diagnosis_dict(d, rows_when_read=True)["breakdown"]) == dd["breakdown"]


def test_outputs_are_written_in_pieces_none_near_the_whole(tmp_path, monkeypatch):
    """Neither output is made whole before it is written: the largest piece handed to the file
    is a small part of it (a page made as one text, or orjson's whole document, would be all of it)."""
    trace_set(SETS[0])
    d = shared_diagnosis(SETS[0])
    pieces: dict[str, list[int]] = {}
    real = safefs.write_atomic

    def counting(path, data, mode=0o644):
        assert callable(data), f"{path.name} handed over whole"
        pieces[path.name] = [len(p) for p in data()]
        real(path, data, mode)

    monkeypatch.setattr(safefs, "write_atomic", counting)
    monkeypatch.setattr(output, "write_atomic", counting)
    write_json(d, tmp_path)
    write_report(d, tmp_path)
    for name, sizes in pieces.items():
        total = (tmp_path / name).stat().st_size
        assert sum(sizes) == total
        assert max(sizes) < total / 4, (name, max(sizes), total)
    assert set(pieces) == {"diagnosis.json", "report.html"}


def test_a_write_that_fails_half_way_leaves_the_old_file(tmp_path):
    """The pieces go to a private temp file renamed into place at the end: a failure while they
    are made (a bug, a full disk) leaves the previous file whole and no temp file behind."""
    target = tmp_path / "diagnosis.json"
    safefs.write_atomic(target, lambda: iter([b"{", b'"a": 1', b"}"]))
    assert target.read_bytes() == b'{"a": 1}'

    def broken():
        yield b'{"b": '
        raise RuntimeError("made half way")

    with pytest.raises(RuntimeError):
        safefs.write_atomic(target, broken)
    assert target.read_bytes() == b'{"a": 1}'
    assert [p.name for p in tmp_path.iterdir()] == ["diagnosis.json"]


def test_a_nan_in_a_grid_written_in_pieces_is_null():
    """The lateness heatmap's Grid, written a row at a time, as _clean writes it whole."""
    g = Grid([[1.0, math.nan], [math.inf, 2.0]])
    text = b"".join(json_parts({"extras": {"lateness": {"matrix": g}}}))
    assert orjson.loads(text)["extras"]["lateness"]["matrix"] == [[1.0, None], [None, 2.0]]
