"""The step graph's lane composition: a (nodes, parts) matrix of microseconds held by column, as
its non-zero cells (step/graph.py).

Why not the dense matrix: a lane edge carries a few of its parts (compute and an idle class or
two): 14% of the cells of 1,024 replicated DLRM ranks, whose dense float64 matrix was 2 KB a rank,
the largest piece of the client's step graph (#20). Edits read whole columns (a part removed
everywhere) and the row sums (the lane weights); the critical path reads a few rows.

The row sums are those of the dense matrix, taken once where it is built: numpy sums a row of
ten pairwise, so re-adding only the non-zero cells could differ in the last bit, and the replay
must not move with the storage."""
from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np

from diagnose.ingest.spill import Spill, array_stretch


@dataclass(frozen=True, slots=True)
class LaneParts:
    total: np.ndarray
    """Per node, the sum of its row (the lane edge's weight, us); read-only. Built by
    LanePartsBuilder."""
    rows: tuple[np.ndarray, ...]
    """Per part, the nodes whose cell is not zero (int32, ascending)."""
    values: tuple[np.ndarray, ...]
    """Per part, those cells."""

    @property
    def n_parts(self) -> int:
        return len(self.rows)

    def column(self, k: int) -> np.ndarray:
        out = np.zeros(self.total.size)
        out[self.rows[k]] = self.values[k]
        return out

    def loaded(self) -> LaneParts:
        """Itself (PartsOnDisk reads its parts back)."""
        return self

    def total_stretch(self, lo: int, hi: int) -> np.ndarray:
        """Nodes [lo, hi) of the row sums (PartsOnDisk reads only those)."""
        return self.total[lo:hi]

    def part(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Part k's non-zero cells: (nodes, values)."""
        return self.rows[k], self.values[k]

    def rows_of(self, nodes: np.ndarray) -> np.ndarray:
        """(len(nodes), n_parts): those nodes' rows (PartsOnDisk's, from memory)."""
        return _rows_of(self.rows, self.values, self.n_parts, nodes)

    def row(self, v: int) -> np.ndarray:
        out = np.zeros(self.n_parts)
        for k, (r, x) in enumerate(zip(self.rows, self.values)):
            i = int(np.searchsorted(r, v))
            if i < r.size and r[i] == v:
                out[k] = x[i]
        return out


def _rows_of(rows, values, n_parts: int, nodes: np.ndarray) -> np.ndarray:
    """LaneParts.rows_of and PartsOnDisk.rows_of: rows, values as the parts hold them (arrays or
    what Spill.put_array gave)."""
    nodes = np.asarray(nodes, dtype=np.int64)
    out = np.zeros((nodes.size, n_parts))
    for k in range(n_parts):
        r = array_stretch(rows[k])
        if not r.size:
            continue
        i = np.minimum(np.searchsorted(r, nodes), r.size - 1)  # where each node is, if it is
        hit = np.flatnonzero(r[i] == nodes)
        del r
        if hit.size:  # the cells read back where they lie: a stretch from the first to the last
            lo, hi = int(i[hit].min()), int(i[hit].max()) + 1
            out[hit, k] = array_stretch(values[k], lo, hi)[i[hit] - lo]
    return out


class LanePartsBuilder:
    """A LaneParts filled a block of rows at a time (a rank's lane edges), never as the dense
    matrix: the graph's build set the client's peak (#20), the matrix 2 KB a DLRM rank of it."""

    def __init__(self, n: int, n_parts: int) -> None:
        self._total = np.zeros(n)
        self._rows = [array("i") for _ in range(n_parts)]  # typed arrays: no object per cell
        self._values = [array("d") for _ in range(n_parts)]

    def add(self, nodes: np.ndarray, parts: np.ndarray) -> None:
        """nodes' rows (len(nodes), n_parts); each node once."""
        self._total[nodes] = parts.sum(axis=1)  # a row summed as the dense matrix's would be
        for k, (rows, values) in enumerate(zip(self._rows, self._values)):
            nz = np.flatnonzero(parts[:, k])
            if nz.size:
                rows.frombytes(nodes[nz].astype(np.int32).tobytes())
                values.frombytes(np.ascontiguousarray(parts[nz, k], dtype=np.float64).tobytes())

    def build(self) -> LaneParts:
        rows, values = [], []
        while self._rows:  # each part's typed arrays go once sorted: not every part twice at once
            r, v = np.frombuffer(self._rows.pop(0), dtype=np.int32), np.frombuffer(self._values.pop(0), dtype=np.float64)
            order = np.argsort(r, kind="stable")
            rows.append(r[order])
            values.append(v[order])
            del r, v, order
        self._total.setflags(write=False)  # edits copy it; the graph is never changed
        return LaneParts(total=self._total, rows=tuple(rows), values=tuple(values))


class PartsOnDisk:
    """A LaneParts in a spill (ingest/spill.py): the row sums and each part's cells read back when
    asked for, fresh copies the reader drops when done (step/graph.GraphOnDisk: why)."""

    __slots__ = ("_total", "_rows", "_values", "n_parts", "_n")

    def __init__(self, p: LaneParts, spill: Spill) -> None:
        self._n = p.total.size
        self._total = spill.put_array(p.total)
        self._rows = tuple(spill.put_array(r) for r in p.rows)
        self._values = tuple(spill.put_array(v) for v in p.values)
        self.n_parts = p.n_parts

    @property
    def total(self) -> np.ndarray:
        return array_stretch(self._total)

    def total_stretch(self, lo: int, hi: int) -> np.ndarray:
        return array_stretch(self._total, lo, hi)

    def part(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        return array_stretch(self._rows[k]), array_stretch(self._values[k])

    def column(self, k: int) -> np.ndarray:
        out = np.zeros(self._n)
        out[array_stretch(self._rows[k])] = array_stretch(self._values[k])
        return out

    def rows_of(self, nodes: np.ndarray) -> np.ndarray:
        """(len(nodes), n_parts): those nodes' rows, each part's non-zero nodes read back one part
        at a time and its cells only where one of them is (the critical path of one step)."""
        return _rows_of(self._rows, self._values, self.n_parts, nodes)

    def loaded(self) -> LaneParts:
        """Every part read back at once: for a reader of many rows (the critical path)."""
        return LaneParts(self.total, tuple(array_stretch(r) for r in self._rows),
                         tuple(array_stretch(v) for v in self._values))
