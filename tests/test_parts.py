"""The step graph's lane composition held by column (step/parts.py): built a block of rows at a
time, in any order, every read gives what the dense matrix gave, to the bit."""
from __future__ import annotations

import numpy as np
import pytest

from diagnose.step.parts import LanePartsBuilder


def _dense(seed: int, n: int = 300) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dense = rng.exponential(1000.0, (n, 10)) * (rng.random((n, 10)) < 0.15)
    dense[:, 4] = 0.0  # a part no edge carries
    dense[17] = 0.0  # an edge with no parts
    return dense


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_built_by_blocks_it_reads_as_the_dense_matrix(seed):
    """As the graph fills it: a rank's lane edges at a time, rows in no order, some never written
    (collective ends, a lane's first point)."""
    dense = _dense(seed)
    dense[::7] = 0.0
    rng = np.random.default_rng(seed + 10)
    b = LanePartsBuilder(len(dense), 10)
    nodes = rng.permutation(np.setdiff1d(np.arange(len(dense)), np.arange(0, len(dense), 7)))
    for block in np.array_split(nodes, 9):
        b.add(block, dense[block])
    b.add(np.empty(0, dtype=np.int64), np.zeros((0, 10)))
    lp = b.build()
    assert np.array_equal(lp.total, dense.sum(axis=1))  # the dense rows' sums, not re-added cells
    for k in range(10):
        assert np.array_equal(lp.column(k), dense[:, k])
        assert np.all(np.diff(lp.rows[k]) > 0)
    for v in (0, 7, 17, 100, len(dense) - 1):
        assert np.array_equal(lp.row(v), dense[v])
    assert sum(r.size for r in lp.rows) == int(np.count_nonzero(dense))  # only the non-zero cells


def test_weights_cannot_be_edited_in_place():
    b = LanePartsBuilder(3, 2)
    b.add(np.arange(3), np.ones((3, 2)))
    with pytest.raises(ValueError):
        b.build().total[0] = 0.0
