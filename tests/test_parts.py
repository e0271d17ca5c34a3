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


@pytest.mark.parametrize("block", [1, 3, 4096])
def test_rows_and_elements_read_where_they_lie_are_the_whole_arrays(block):
    """The critical path of one step reads the nodes its chain reaches (#20): ArrayBlocks gives a
    spilled array's elements, one or many, as the array has them at any block size, each block
    read once; rows_of gives LaneParts' rows from memory and from disk as row() does."""
    from diagnose.ingest.spill import ArrayBlocks, Spill
    from diagnose.step.parts import LanePartsBuilder, PartsOnDisk

    rng = np.random.default_rng(5)
    a = rng.normal(size=1000)
    spill = Spill()
    blocks = ArrayBlocks(spill.put_array(a), block=block)
    idx = rng.integers(0, a.size, 50)
    assert np.array_equal(blocks[idx], a[idx]) and blocks[idx].dtype == a.dtype
    assert blocks[999] == a[999] and blocks[np.int64(0)] == a[0] and blocks[np.array([], dtype=int)].size == 0
    assert len(blocks._read) <= len(set((idx // block).tolist()) | {999 // block, 0})
    # at most `keep` blocks held (the critical path's reader), the least recently read going
    # first; an element of one let go is read again, the same
    few = ArrayBlocks(spill.put_array(a), block=block, keep=2)
    for i in list(idx) + [999, 0, int(idx[0])]:
        assert few[int(i)] == a[i] and len(few._read) <= 2
    assert np.array_equal(few[idx], a[idx]) and len(few._read) <= 2
    few[0], few[999], few[0]
    assert list(few._read) == ([999 // block, 0] if block < 1000 else [0])
    b = LanePartsBuilder(40, 5)
    nodes = np.arange(40)
    cells = rng.random((40, 5)) * (rng.random((40, 5)) < 0.3)
    b.add(nodes, cells)
    mem = b.build()
    disk = PartsOnDisk(mem, spill)
    ask = np.array([39, 0, 7, 7, 22])
    want = np.stack([mem.row(int(v)) for v in ask])
    assert np.array_equal(mem.rows_of(ask), want) and np.array_equal(disk.rows_of(ask), want)
    assert disk.rows_of(np.array([], dtype=int)).shape == (0, 5)
