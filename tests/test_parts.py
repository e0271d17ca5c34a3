"""The step graph's lane composition held by column (step/parts.py): every read gives what the
dense matrix gave, to the bit."""
from __future__ import annotations

import numpy as np
import pytest

from diagnose.step.parts import LaneParts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reads_match_the_dense_matrix(seed):
    rng = np.random.default_rng(seed)
    dense = rng.exponential(1000.0, (257, 10)) * (rng.random((257, 10)) < 0.15)
    dense[:, 4] = 0.0  # a part no edge carries
    dense[17] = 0.0  # an edge with no parts
    lp = LaneParts.of(dense)
    assert np.array_equal(lp.total, dense.sum(axis=1))  # the same sums, not re-added ones
    assert np.array_equal(lp.dense(), dense)
    for k in range(10):
        assert np.array_equal(lp.column(k), dense[:, k])
    for v in (0, 17, 100, 256):
        assert np.array_equal(lp.row(v), dense[v])
    # what is kept: the non-zero cells
    assert sum(r.size for r in lp.rows) == int(np.count_nonzero(dense))


def test_weights_cannot_be_edited_in_place():
    lp = LaneParts.of(np.ones((3, 2)))
    with pytest.raises(ValueError):
        lp.total[0] = 0.0


def test_built_by_blocks_as_from_the_dense_matrix():
    """The graph fills it a rank's lane edges at a time, in no order of rows (step/graph.py)."""
    from diagnose.step.parts import LanePartsBuilder

    rng = np.random.default_rng(5)
    dense = rng.exponential(1000.0, (300, 10)) * (rng.random((300, 10)) < 0.2)
    dense[::7] = 0.0  # rows no block writes (collective ends, a lane's first point)
    b = LanePartsBuilder(300, 10)
    nodes = rng.permutation(np.setdiff1d(np.arange(300), np.arange(0, 300, 7)))
    for block in np.array_split(nodes, 9):
        b.add(block, dense[block])
    b.add(np.empty(0, dtype=np.int64), np.zeros((0, 10)))
    got, want = b.build(), LaneParts.of(dense)
    assert np.array_equal(got.total, want.total) and not got.total.flags.writeable
    for k in range(10):
        assert np.array_equal(got.rows[k], want.rows[k]) and np.array_equal(got.values[k], want.values[k])
