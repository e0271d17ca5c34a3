"""The loaded run held column-wise from the moment each rank arrives (ingest/store.py): every
rank's trace, timeline, checks' summaries and idle model read back from the rows equal, field by
field, what the same rank gives when its objects are kept; the rows are read-only."""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from diagnose.analyzers import reduce_rank
from diagnose.ingest import discover_traces
from diagnose.ingest.assemble import Loaded, load_files, load_run
from diagnose.ingest.load import DEFAULT_MAX_BYTES
from diagnose.ingest.spill import Spilled, SpilledMap, unspilled
from diagnose.ingest.store import Arrivals, ByRank
from tests.conftest import shared

FIXTURES = Path(__file__).parent / "fixtures"


def _same(a, b) -> None:
    """Equal values: arrays to the bit and of the same dtype, what lies on disk as read back."""
    if isinstance(a, Spilled) or isinstance(b, Spilled):
        assert isinstance(a, Spilled) and isinstance(b, Spilled)
        a, b = unspilled(a), unspilled(b)
        if hasattr(a, "equals"):
            assert a.equals(b)
            return
    if isinstance(a, SpilledMap) or isinstance(b, SpilledMap):
        assert isinstance(a, SpilledMap) and isinstance(b, SpilledMap) and list(a) == list(b)
        for k in a:  # each summary read back from its own bytes
            assert pickle.dumps(a[k], protocol=4) == pickle.dumps(b[k], protocol=4)
        return
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    elif hasattr(a, "__dataclass_fields__"):
        assert type(a) is type(b)
        for f in a.__dataclass_fields__:
            _same(getattr(a, f), getattr(b, f))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert type(a) is type(b) and a == b


def _load(path: Path, hold: bool, monkeypatch) -> list[Loaded]:
    with monkeypatch.context() as m:
        if not hold:  # every rank kept as its objects, as where no row fits
            m.setattr(Arrivals, "add", lambda self, *a: None)
        return [x for x in load_files(discover_traces([path]), DEFAULT_MAX_BYTES, 1, reduce_rank) if x.ok]


@pytest.mark.parametrize("where", ["gpu", "cpu"])
def test_each_rank_reads_back_as_its_objects_give_it(where, monkeypatch):
    path = shared("param_dlrm_8rank_v100") if where == "gpu" else FIXTURES / "cpu_straggler_dataloader_2rank"
    held, objects = _load(path, True, monkeypatch), _load(path, False, monkeypatch)
    assert len(held) == len(objects) >= 2
    assert all(x._rows is not None for x in held) and all(x._rows is None for x in objects)
    for x, y in zip(held, objects):
        assert x.path == y.path and x.reduced and x.error is None
        _same(x.trace, y.trace)
        _same(x.timeline, y.timeline)
        _same(x.facts, y.facts)
        assert (x.idle is None) == (y.idle is None) == (where == "cpu")
        if x.idle is not None:
            _same(unspilled(x.idle), unspilled(y.idle))
        tl = x.timeline
        with pytest.raises(ValueError):
            tl.steps.start[0] = 0.0  # what a rank brought back is read, never written
        with pytest.raises(ValueError):
            tl.cover.per_step[0, 0] = 0.0
        with pytest.raises(AttributeError):
            x.trace = y.trace  # a kept rank is not written either


def test_the_run_is_rank_keyed_views_of_the_rows_only_after_the_reductions():
    path = FIXTURES / "cpu_straggler_2rank"
    reduced = load_run([path], reduce=reduce_rank)
    for m in (reduced.traces, reduced.timelines, reduced.facts, reduced.idle):
        assert isinstance(m, ByRank)
    assert list(reduced.timelines) == reduced.ranks == [0, 1] and len(reduced.traces) == 2
    for missing in (2, -1, "0", 0.5, True):
        assert missing not in reduced.timelines
        with pytest.raises(KeyError):
            reduced.timelines[missing]
    whole = load_run([path])  # every event kept (tools that read them): the objects as they came
    assert isinstance(whole.timelines, dict) and isinstance(whole.traces, dict)
    for r in whole.ranks:
        assert np.array_equal(whole.timelines[r].steps.start, reduced.timelines[r].steps.start)
        assert whole.traces[r].path == reduced.traces[r].path and reduced.traces[r].rank == r


def test_a_ranks_path_is_its_directory_and_the_name_it_arrived_with():
    """Each lookup of a rank's trace gives its file's Path, made of one Path for the directory
    and the name the arriving Path gave, held (the same text object at every lookup of the
    timeline's file name, which is that name), not parsed again: pathlib to 3.11 interns a path's
    parts, and a name built and dropped per rank at every check's lookup grew the interpreter's
    table of interned strings (1.9 MB at 1,024 ranks; store.Arrivals.path)."""
    d = FIXTURES / "cpu_straggler_2rank"
    run = load_run([d], reduce=reduce_rank)
    assert isinstance(run.traces, ByRank)
    names = {}
    for r in run.ranks:
        p = run.traces[r].path
        assert isinstance(p, Path) and p.parent == d and p.name.startswith("rank") and p.exists()
        assert run.timelines[r].file == p.name and run.timelines[r].file is run.timelines[r].file
        names[r] = p.name
    assert len(set(names.values())) == len(run.ranks)


def test_an_outcome_travels_from_where_it_was_read_and_a_kept_rank_does_not(monkeypatch):
    x = Loaded(Path("rank0.json"), error="unreadable")
    assert pickle.loads(pickle.dumps(x)).error == "unreadable"
    kept = _load(FIXTURES / "cpu_straggler_2rank", True, monkeypatch)[0]
    with pytest.raises(TypeError):
        pickle.dumps(kept)


class _Positions:
    """Rows that give back the position they were asked for: what ByRank looks up, bare."""

    def timeline(self, p: int) -> int:
        return p


@pytest.mark.parametrize("ranks", [[0, 1, 2, 3], [4, 5, 6], [0, 2, 3, 7], [5], []])
def test_by_rank_is_a_mapping_of_exactly_its_ranks(ranks):
    """Contiguous ranks are found by arithmetic, others by a search: the same answers either way."""
    positions = {r: 10 * i for i, r in enumerate(reversed(ranks))}  # arrival order is not rank order
    m = ByRank(_Positions(), "timeline", positions)
    assert list(m) == sorted(ranks) and len(m) == len(ranks)
    for r in range(-2, 10):
        for key in (r, np.int64(r), np.int32(r)):
            assert (key in m) == (r in positions)
            if r in positions:
                assert m[key] == positions[r]
            else:
                with pytest.raises(KeyError):
                    m[key]
    for bad in (True, False, 1.0, "1", None):
        assert bad not in m
        with pytest.raises(KeyError):
            m[bad]
    assert m.get(99, "none") == "none"
