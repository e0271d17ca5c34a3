"""Vectorised interval arithmetic on sorted, disjoint interval sets.

An interval set is a pair of float arrays (starts, ends), sorted and disjoint.
Everything here is numpy over whole arrays: no per-interval Python loop, so a
million kernels cost milliseconds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Intervals:
    starts: np.ndarray
    ends: np.ndarray

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def total(self) -> float:
        return float(np.sum(self.ends - self.starts))

    @staticmethod
    def empty() -> Intervals:
        z = np.zeros(0, dtype=np.float64)
        return Intervals(z, z)


def union(starts, ends) -> Intervals:
    """Merge possibly overlapping intervals into a sorted disjoint set."""
    s = np.asarray(starts, dtype=np.float64)
    e = np.asarray(ends, dtype=np.float64)
    if s.size == 0:
        return Intervals.empty()
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    run_max = np.maximum.accumulate(e)
    # a new merged interval begins where a start lies beyond every earlier end
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > run_max[:-1]
    idx = np.flatnonzero(new)
    out_s = s[idx]
    out_e = np.maximum.reduceat(e, idx)
    keep = out_e > out_s
    return Intervals(out_s[keep], out_e[keep])


def member(points: np.ndarray, a: Intervals) -> np.ndarray:
    """Whether each point lies inside `a` (an interval holds its start, not its end)."""
    if len(a) == 0:
        return np.zeros(points.size, dtype=bool)
    i = np.searchsorted(a.starts, points, side="right") - 1
    ok = i >= 0
    out = np.zeros(points.size, dtype=bool)
    out[ok] = points[ok] < a.ends[i[ok]]
    return out


def _combine(a: Intervals, b: Intervals, op: str) -> Intervals:
    pts = np.unique(np.concatenate([a.starts, a.ends, b.starts, b.ends]))
    if pts.size < 2:
        return Intervals.empty()
    mids = (pts[:-1] + pts[1:]) * 0.5
    in_a = member(mids, a)
    in_b = member(mids, b)
    if op == "and":
        sel = in_a & in_b
    elif op == "or":
        sel = in_a | in_b
    else:  # "minus"
        sel = in_a & ~in_b
    return union(pts[:-1][sel], pts[1:][sel])


def intersect(a: Intervals, b: Intervals) -> Intervals:
    return _combine(a, b, "and")


def merge(a: Intervals, b: Intervals) -> Intervals:
    return _combine(a, b, "or")


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """a minus b."""
    if len(a) == 0 or len(b) == 0:
        return a
    return _combine(a, b, "minus")


def covered(a: Intervals, lo, hi) -> np.ndarray:
    """Length of `a` inside each window [lo[i], hi[i]); windows may be any order."""
    lo = np.asarray(lo, dtype=np.float64)
    hi = np.asarray(hi, dtype=np.float64)
    if len(a) == 0:
        return np.zeros(lo.size)
    before = np.concatenate([[0.0], np.cumsum(a.ends - a.starts)])
    return np.maximum(running(a, hi, before) - running(a, lo, before), 0.0)


def running(a: Intervals, x, before: np.ndarray | None = None) -> np.ndarray:
    """Length of `a` up to each x (covered() is its difference between two points); before: the
    running sum of a's lengths, [0, l0, l0 + l1, ...], when already at hand."""
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros(x.size)
    if len(a) == 0:
        return out
    if before is None:
        before = np.concatenate([[0.0], np.cumsum(a.ends - a.starts)])
    i = np.searchsorted(a.starts, x, side="right") - 1
    ok = i >= 0
    ii = i[ok]
    out[ok] = before[ii] + np.minimum(x[ok], a.ends[ii]) - a.starts[ii]
    return out


def clip(a: Intervals, lo: float, hi: float) -> Intervals:
    if len(a) == 0:
        return a
    s = np.maximum(a.starts, lo)
    e = np.minimum(a.ends, hi)
    keep = e > s
    return Intervals(s[keep], e[keep])
