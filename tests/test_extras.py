"""The report's extras at more ranks than it draws one by one (extras.shown_ranks)."""
from __future__ import annotations

import gzip
from pathlib import Path

import orjson
import pytest

from diagnose.extras import MAX_TIMELINE_RANKS
from diagnose.pipeline import diagnose_paths
from diagnose.output import diagnosis_dict
from reports.html import render
from tests.conftest import built_once

STRAGGLER = Path(__file__).parent / "fixtures" / "cpu_straggler_2rank"
WORLD, LATE = 24, 21


def _spread(out: Path) -> None:
    """The recorded 2-rank straggler job as 24 ranks: rank 21 the late rank's trace, every other
    rank the punctual one's (rank ids rewritten), as a bigger job with one slow host would be."""
    src = sorted(STRAGGLER.glob("rank*.json.gz"))
    punctual, late = (orjson.loads(gzip.decompress(p.read_bytes())) for p in src)
    for r in range(WORLD):
        doc = late if r == LATE else punctual
        doc["distributedInfo"] = {**doc["distributedInfo"], "rank": r, "world_size": WORLD}
        (out / f"rank{r}.pt.trace.json").write_bytes(orjson.dumps(doc))


@pytest.fixture(scope="module")
def spread(tmp_path_factory):
    return diagnose_paths([str(built_once(tmp_path_factory, "straggler24", _spread))])


def test_a_late_rank_past_the_first_sixteen_is_drawn_and_the_page_says_which_ranks_it_shows(spread):
    d = spread
    assert d.top is not None and d.top.id == "straggler" and d.top.ranks == (LATE,)
    tl = d.extras["timeline"]
    drawn = [x["rank"] for x in tl["ranks"]]
    assert LATE in drawn and len(drawn) == MAX_TIMELINE_RANKS and drawn == sorted(drawn)
    assert LATE in [x["rank"] for x in d.extras["top_ops"]["ranks"]]
    assert tl["shown"]["ranks"] == MAX_TIMELINE_RANKS and tl["shown"]["of"] == WORLD
    # the critical path runs through the late rank; every rank it passes is drawn, so it is drawn
    assert {seg[2] for seg in tl["critical_path"]} <= set(drawn) and LATE in {seg[2] for seg in tl["critical_path"]}
    html = render(diagnosis_dict(d))
    assert f"{MAX_TIMELINE_RANKS} of {WORLD} ranks shown" in html
    assert "on the ranks shown" in html


def test_lateness_heatmap_labels_each_collective_as_found_in_the_trace():
    """One column per collective (step, group, order), labelled as a reader finds it in the trace;
    the group only when there are several; each cell the rank's lateness in ms; 200 columns at most."""
    from types import SimpleNamespace

    import pandas as pd

    from diagnose.extras import _lateness_extra
    from diagnose.step.collectives import Matched

    rows = []
    for rank in (1, 0):
        for step, pg, seq, name in ((5, "1", 0, "nccl:all_reduce"), (4, "0", 1, "nccl:broadcast"),
                                    (4, "0", 0, "c10d::allreduce_"), (4, "1", 0, "gloo:all_gather")):
            rows.append({"rank": rank, "step": step, "pg": pg, "seq": seq, "name": name,
                         "lateness": 1000.0 * (rank + 1) * (seq + 1), "arrival": 0.0})
    def matched(frame):
        return Matched(frame, pd.DataFrame(), 1.0)

    ctx = SimpleNamespace(matched=matched(pd.DataFrame(rows)))
    got = _lateness_extra(ctx)
    assert got["collectives"] == ["step 4 · allreduce_ #0 (group 0)", "step 4 · broadcast #1 (group 0)",
                                  "step 4 · all_gather #0 (group 1)", "step 5 · all_reduce #0 (group 1)"]
    assert got["ranks"] == [1, 0]
    assert got["lateness_ms"].tolist() == [[2.0, 4.0, 2.0, 2.0], [1.0, 2.0, 1.0, 1.0]]
    one = _lateness_extra(SimpleNamespace(matched=matched(pd.DataFrame([r for r in rows if r["pg"] == "0"]))))
    assert one["collectives"] == ["step 4 · allreduce_ #0", "step 4 · broadcast #1"]
    many = pd.DataFrame([{"rank": r, "step": 1, "pg": "0", "seq": s, "name": "x", "lateness": 0.0}
                         for s in range(250) for r in (0, 1)])
    capped = _lateness_extra(SimpleNamespace(matched=matched(many.iloc[::-1])))
    assert capped["collectives"] == [f"step 1 · x #{s}" for s in range(200)]  # the first 200, in order
    assert capped["ranks"] == [1, 0] and capped["lateness_ms"].values.shape == (2, 200)
    # held as one array (model.Grid, #20): equal cell for cell, NaN to NaN; written as lists
    from diagnose.model import Grid
    from diagnose.output import _clean

    holes = _lateness_extra(SimpleNamespace(matched=matched(pd.DataFrame(rows[:3] + rows[5:]))))
    assert holes["lateness_ms"] == Grid(holes["lateness_ms"].tolist()) != Grid([[0.0]])
    assert _clean(holes)["lateness_ms"] == [[2.0, 4.0, None, 2.0], [1.0, 2.0, 1.0, None]]


def test_the_lateness_pivot_is_pandas_pivot_table():
    """_pivot_mean, the heatmap's matrix made from arrays (#20), gives pivot_table's rows, columns
    and cells (sort=False: first-appearance order; a (row, col) without a value NaN; rows and
    columns with none left out; repeated cells their mean), whatever the input's order."""
    import numpy as np
    import pandas as pd

    from diagnose.extras import _pivot_mean

    rng = np.random.default_rng(7)
    for trial in range(600):
        n = int(rng.integers(1, 60))
        rows = rng.choice([3, 11, 0, 7, 1024], size=n)
        cols = rng.integers(0, 9, size=n)
        values = rng.normal(size=n) * 1000
        if trial % 3 == 0:
            values[rng.random(n) < 0.2] = np.nan  # some rows without a lateness
        if trial % 2:  # half the trials: every (row, col) at most once, as matched rows are
            _, first = np.unique(rows.astype(np.int64) * 16 + cols, return_index=True)
            rows, cols, values = rows[np.sort(first)], cols[np.sort(first)], values[np.sort(first)]
        want = pd.DataFrame({"r": rows, "c": cols, "v": values}).pivot_table(index="r", columns="c", values="v",
                                                                            sort=False)
        r, c, m = _pivot_mean(rows, cols, values)
        assert r.tolist() == want.index.tolist() and c.tolist() == want.columns.tolist(), trial
        assert m.shape == want.shape and np.array_equal(m, want.to_numpy(dtype=float), equal_nan=True), trial


def _copying_clean(x):
    """output._clean as it was, copying every list, dict and text: the oracle."""
    import math

    from diagnose.model import Grid

    if isinstance(x, Grid):
        return _copying_clean(x.tolist())
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, str):
        return x.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(x, dict):
        return {str(k): _copying_clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_copying_clean(v) for v in x]
    return x


def test_clean_copies_only_what_it_changes():
    """diagnosis.json's cleaning returns what needs no change as it is (#20: copying the report's
    timeline lanes twice was most of the JSON's memory): the same JSON as a cleaning that copies
    everything, on random nests of what a Diagnosis holds, and the same objects where nothing
    changed."""
    import random

    from diagnose.model import Grid
    from diagnose.output import _clean

    rng = random.Random(20)
    leaves = [1.5, float("nan"), float("inf"), -0.0, 3, True, None, "ok", "rank 7 · x", "bad \udcff name",
              "naïve"]

    def nest(depth: int):
        if depth == 0 or rng.random() < 0.3:
            return rng.choice(leaves)
        kind = rng.randrange(5)
        if kind == 0:
            return {rng.choice(["a", "b", "c", 4, "d"]): nest(depth - 1) for _ in range(rng.randrange(4))}
        if kind == 1:
            return tuple(nest(depth - 1) for _ in range(rng.randrange(4)))
        if kind == 2:
            return Grid([[rng.choice([1.0, float("nan")]) for _ in range(2)] for _ in range(2)])
        return [nest(depth - 1) for _ in range(rng.randrange(5))]

    for _ in range(2000):
        x = nest(4)
        assert orjson.dumps(_clean(x)) == orjson.dumps(_copying_clean(x))
    clean = {"a": [[1.0, 2.5], [3.0, 0.5]], "b": {"c": "text", "d": [1, None, True]}, "e": "naïve"}
    out = _clean(clean)
    assert out is clean and out["a"][1] is clean["a"][1]
    dirty = {"a": [[1.0, float("nan")], [3.0, 0.5]], "b": ("x",)}
    out = _clean(dirty)
    assert out == {"a": [[1.0, None], [3.0, 0.5]], "b": ["x"]} and out["a"][1] is dirty["a"][1]


def test_diagnosis_dict_shares_the_extras_and_writes_the_same_json():
    """The JSON's extras are the Diagnosis's own lists where they are JSON already; the file is
    the one a deep copy gives."""
    import copy
    import pickle
    from dataclasses import replace

    from tests.conftest import fixture_diagnosis

    d = fixture_diagnosis(Path(__file__).parent / "fixtures" / "cpu_straggler_2rank")  # read, not changed
    # and lists the cleaning must change in what it writes: a NaN, a tuple, a key not a text
    d = replace(d, extras={**d.extras, "dirty": {"xs": [1.0, float("nan"), ("t", 2)], 3: ["x"]}})
    option = orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY
    before = pickle.dumps(d.extras)  # its bytes: NaN and all, every value and what shares what
    copied = orjson.dumps(diagnosis_dict(replace(d, extras=copy.deepcopy(d.extras))), option=option)
    body = diagnosis_dict(d)
    lanes = d.extras["timeline"]["ranks"][0]["lanes"]
    key = next(k for k, v in lanes.items() if v)
    assert body["extras"]["timeline"]["ranks"][0]["lanes"][key] is lanes[key]
    assert orjson.dumps(body, option=option) == copied
    assert pickle.dumps(d.extras) == before  # the cleaning changed none of the Diagnosis's own lists


@pytest.mark.parametrize("seed", range(4))
def test_the_heatmaps_collectives_sorted_as_pandas_sorts_them(seed):
    """The lateness heatmap sorts the matched rows by (step, group, order) by one packed integer a
    row (#20: the keys sorted as a table set the extra's height at 1,024 ranks): the same order
    and the same first row of each collective as sort_values and duplicated give, ties kept in
    the table's order; keys that are not integers go to pandas."""
    import numpy as np
    import pandas as pd

    from diagnose.extras import _sorted_keys

    rng = np.random.default_rng(seed)
    n = 300
    kf = pd.DataFrame({"step": rng.integers(-1, 4, n), "pg": rng.choice(["0", "10", "2", "tp:1"], n).astype(object),
                       "seq": rng.integers(0, 6, n)})
    if seed == 3:
        kf["seq"] = kf["seq"].astype(float)  # not integers: pandas' own
    ks = kf.reset_index(drop=True).sort_values(["step", "pg", "seq"])
    at, first = _sorted_keys(kf)
    assert np.array_equal(at, ks.index.to_numpy()) and np.array_equal(first, ~ks.duplicated().to_numpy())
    assert 1 < first.sum() < n
