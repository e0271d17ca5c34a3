"""One column of a run-wide table, its values appended rank after rank into one buffer.

Why (#20, the client's memory per rank): a table gathered from every rank as a list of each
rank's arrays, joined at the end, holds a few small arrays a rank until then: numpy's and
Python's cost per object, not data, and memory that stays the process's once freed. Gathering
the run's collectives so (step/timeline.gather_collectives) raised the client's resident memory
3.1 MB at 1,024 replicated DLRM ranks against 0.7 at 256; one buffer a column, 1.1 against 0.4.
"""
from __future__ import annotations

from array import array

import numpy as np

_CODES = {np.dtype(np.int64): "q", np.dtype(np.float64): "d", np.dtype(np.bool_): "b"}


class Appended:
    """`array()` gives what np.concatenate of the appended arrays would: numbers of one dtype grow
    in one typed buffer, objects in one list; where the ranks' dtypes differ (or have no typed
    buffer here) their arrays are kept and concatenated, as numpy promotes them."""

    __slots__ = ("n", "_dtype", "_buf", "_parts")

    def __init__(self) -> None:
        self.n = 0
        self._dtype: np.dtype | None = None
        self._buf: array | list | None = None
        self._parts: list[np.ndarray] | None = None

    def add(self, v: np.ndarray) -> None:
        if self._dtype is None:
            self._dtype = v.dtype
            code = _CODES.get(v.dtype)
            self._buf = array(code) if code else ([] if v.dtype == object else None)
            if self._buf is None:
                self._parts = []
        elif self._parts is None and v.dtype != self._dtype:
            self._parts = [self.array()]
            self._buf = None
        if self._parts is not None:
            self._parts.append(v)
        elif isinstance(self._buf, list):
            self._buf.extend(v.tolist())  # an object array's own objects, not copies
        else:
            assert self._buf is not None
            self._buf.frombytes(np.ascontiguousarray(v).tobytes())
        self.n += v.size

    def array(self) -> np.ndarray:
        """The column (its own memory, sized to fit); empty float64 when nothing was appended,
        as np.concatenate of no arrays cannot say."""
        if self._parts is not None:
            return np.concatenate(self._parts)
        if self._dtype is None:
            return np.empty(0)
        if isinstance(self._buf, list):  # fromiter: a tuple or list in it stays one cell
            return np.fromiter(self._buf, dtype=object, count=len(self._buf))
        return np.frombuffer(self._buf, dtype=self._dtype).copy()
