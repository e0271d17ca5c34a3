"""The loaded run held column-wise (ingest/store.py): every rank's timeline and trace read back
from the store equal, field by field, what the rank brought back; it is read-only."""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from diagnose.analyzers import reduce_rank
from diagnose.ingest import discover_traces
from diagnose.ingest.assemble import load_files, load_run
from diagnose.ingest.load import DEFAULT_MAX_BYTES
from diagnose.ingest.spill import Spilled, unspilled
from diagnose.ingest.store import FactsStore, SpilledByRank, TimelineStore, TraceStore
from tests.conftest import shared

FIXTURES = Path(__file__).parent / "fixtures"


def _same(a, b) -> None:
    """Equal values: arrays to the bit and of the same dtype, spilled objects as read back."""
    if isinstance(a, Spilled) or isinstance(b, Spilled):
        assert isinstance(a, Spilled) and isinstance(b, Spilled) and (a.at, a.size) == (b.at, b.size)
        a, b = unspilled(a), unspilled(b)
        if hasattr(a, "equals"):
            assert a.equals(b)
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


def _loaded(path: Path):
    got = [x for x in load_files(discover_traces([path]), DEFAULT_MAX_BYTES, 1, reduce_rank) if x.trace]
    return ({x.trace.rank: x.trace for x in got}, {x.trace.rank: x.timeline for x in got},
            {x.trace.rank: x.facts for x in got}, {x.trace.rank: x.idle for x in got if x.idle is not None})


@pytest.mark.parametrize("where", ["gpu", "cpu"])
def test_each_rank_reads_back_as_it_arrived(where):
    path = shared("param_dlrm_8rank_v100") if where == "gpu" else FIXTURES / "cpu_straggler_dataloader_2rank"
    traces, timelines, facts, idle = _loaded(path)
    assert all(TimelineStore.fits(t) for t in timelines.values()) and all(TraceStore.fits(t) for t in traces.values())
    assert FactsStore.fits(facts) and (where == "gpu") == bool(idle)
    tls, trs, fs, ids = TimelineStore(timelines), TraceStore(traces), FactsStore(facts), SpilledByRank(idle)
    assert list(tls) == sorted(timelines) and len(tls) == len(timelines) and list(trs) == sorted(traces)
    for r in timelines:
        _same(tls[r], timelines[r])
        _same(trs[r], traces[r])
        assert list(fs[r]) == list(facts[r]) and list(fs[r]) and len(fs[r]) == len(facts[r])
        for check in facts[r]:
            a, b = fs[r][check], facts[r][check]
            assert pickle.dumps(a, protocol=4) == pickle.dumps(b, protocol=4)  # read back from its own bytes
        if idle:
            _same(ids[r], unspilled(idle[r]))
        assert tls[r].steps.step is not timelines[r].steps.step  # a view of the store's array, not the rank's
        with pytest.raises(ValueError):
            tls[r].steps.start[0] = 0.0  # what a rank brought back is read, never written
        with pytest.raises(ValueError):
            tls[r].cover.per_step[0, 0] = 0.0
    for missing in (max(timelines) + 1, -1, "0", 0.5, True):
        assert missing not in tls
        with pytest.raises(KeyError):
            tls[missing]


def test_the_run_is_held_column_wise_only_after_the_reductions():
    path = FIXTURES / "cpu_straggler_2rank"
    reduced = load_run([path], reduce=reduce_rank)
    assert isinstance(reduced.timelines, TimelineStore) and isinstance(reduced.traces, TraceStore)
    whole = load_run([path])  # every event kept (tools that read them): the objects as they came
    assert isinstance(whole.timelines, dict) and isinstance(whole.traces, dict)
    for r in whole.ranks:
        assert np.array_equal(whole.timelines[r].steps.start, reduced.timelines[r].steps.start)
        assert whole.traces[r].path == reduced.traces[r].path
