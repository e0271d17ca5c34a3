import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from diagnose.step.intervals import covered, intersect, merge, subtract, union


def brute(starts, ends, grid):
    return np.array([any(s <= g < e for s, e in zip(starts, ends)) for g in grid])


def test_union_merges_overlaps_and_touching():
    a = union([0, 5, 3, 20], [4, 6, 8, 30])
    assert a.starts.tolist() == [0, 20] and a.ends.tolist() == [8, 30]


def test_covered_counts_only_inside_windows():
    a = union([0, 20], [8, 30])
    assert covered(a, [0, 7, 100], [10, 25, 200]).tolist() == [8, 6, 0]


ivs = st.lists(st.tuples(st.integers(0, 50), st.integers(1, 10)), max_size=8)


@settings(max_examples=200, deadline=None)
@given(ivs, ivs)
def test_set_operations_match_brute_force(xa, xb):
    a = union([s for s, _ in xa], [s + d for s, d in xa])
    b = union([s for s, _ in xb], [s + d for s, d in xb])
    grid = np.arange(0, 70) + 0.5
    ma, mb = brute(a.starts, a.ends, grid), brute(b.starts, b.ends, grid)
    for got, want in ((intersect(a, b), ma & mb), (merge(a, b), ma | mb), (subtract(a, b), ma & ~mb)):
        assert (brute(got.starts, got.ends, grid) == want).all()
        assert covered(got, [0], [70])[0] == want.sum()
