"""Match collectives across ranks and measure who arrives late.

A collective instance is keyed by (step, process group, order within the step):
ranks that profiled the same steps issue the same collectives in the same order per
group. Arrival = when the rank entered the collective (NCCL kernel start; on gloo,
the enqueue on the training thread). Everyone leaves together, when the last rank
has arrived and the transfer is done, so a rank's wait is (last arrival - own arrival).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from diagnose.ingest.assemble import Run
from diagnose.ingest.spill import Spill
from diagnose.step.timeline import COLLECTIVE_COLUMNS, gather_collectives

KEY = ["step", "pg", "seq"]


@dataclass(frozen=True, slots=True)
class Matched:
    per_rank: pd.DataFrame | Mapping[str, pd.Series]
    """One row per (collective, rank): KEY, rank, name, arrival, end (aligned us), dur,
    bytes, row, latest, second (second-latest arrival), tail_wait (us spent waiting for the
    last rank alone), lateness (us vs the median arrival). Nothing else: a column is 8 bytes a
    row, 0.2 MB at 1,024 DLRM ranks (#20). Once the context is built, its columns on disk
    (`on_disk`): read it with `frame`."""
    per_collective: pd.DataFrame
    """One row per collective present on >= 2 ranks: KEY, n_ranks, last_rank, latest,
    gap (latest minus second-latest arrival, us), names_agree."""
    match_ratio: float
    """Share of all collective rows that found a partner on another rank."""

    def frame(self, columns: Sequence[str] | None = None) -> pd.DataFrame:
        """per_rank's named columns that it has (every one by default): each read back where it
        lies on disk, a fresh copy a call that the reader drops when done; the table itself (or
        its selection) while it is in memory."""
        pr = self.per_rank
        names = list(pr) if columns is None else [c for c in columns if c in pr]
        if isinstance(pr, pd.DataFrame):
            return pr if columns is None else pr[names]
        return pd.DataFrame({c: pr[c] for c in names})

    def on_disk(self, spill: Spill) -> Matched:
        """The same, per_rank's columns in `spill`, each read back alone (in memory where the disk
        is not to be had). Why: held from the matching to the last extra, through every check, most
        of which never read it, the table was 0.9 MB at 1,024 replicated DLRM ranks (14 columns of
        8 rows a rank); its readers take the three to eight columns they use (#20)."""
        pr = self.per_rank
        if not isinstance(pr, pd.DataFrame) or pr.empty:
            return self
        cols = spill.put_map({c: pr[c].reset_index(drop=True) for c in pr.columns})
        return Matched(cols, self.per_collective, self.match_ratio)


def collectives_table(run: Run, columns: tuple[str, ...] = COLLECTIVE_COLUMNS + ("rank", "dur"), *,
                      aligned: bool = True) -> pd.DataFrame:
    """Every rank's collectives inside its steps (COLLECTIVE_COLUMNS, `rank`, and `dur`: end minus
    arrival, on the rank's own clock), arrival and end on the aligned clock (`aligned`, else each
    rank's own), in rank order, as one table built from the run's column arrays
    (Run.collectives): a frame per rank (`assign`, then `concat`) held about 7 KB a rank at the
    height of matching, of the graph's build and of the communication table (#20: the client's
    memory per rank)."""
    need = tuple(dict.fromkeys(columns + (("rank",) if aligned else ())))
    cols = run.collective_columns(need) if run.collectives is not None else gather_collectives(run.timelines)
    if not cols:
        return pd.DataFrame(columns=list(columns))
    off = None
    if aligned and any(run.clock_offsets_us.values()):
        ranks = np.unique(cols["rank"])
        off = np.array([run.clock_offsets_us.get(int(r), 0.0) for r in ranks])[np.searchsorted(ranks, cols["rank"])]
    # the columns are this table's alone (Run.collective_columns, gather_collectives): taken as they
    # are, not copied into one block a dtype (a second copy of every column at each reader's height, #20)
    return pd.DataFrame({c: cols[c] + off if off is not None and c in ("arrival", "end") else cols[c]
                         for c in columns}, copy=False)


class RowsByValue:
    """key -> the ascending positions where `values` equals it (empty where none), each made when
    looked up from one sort: not a dict of an array view per key, objects a rank held by each
    reader (the graph's build holds two; #20)."""

    __slots__ = ("_order", "_keys", "_lo", "_hi")

    def __init__(self, values: np.ndarray) -> None:
        self._order = np.argsort(values, kind="stable")
        self._keys, self._lo = np.unique(values[self._order], return_index=True)
        self._hi = np.append(self._lo[1:], self._order.size)

    def __getitem__(self, key: int) -> np.ndarray:
        i = int(np.searchsorted(self._keys, key))
        if i == self._keys.size or self._keys[i] != key:
            return self._order[:0]
        return self._order[self._lo[i]:self._hi[i]]


PACK_LIMIT = 2**62
"""packed_key's keys stay below this: an int64, with room for the -1 of a row outside the ranges."""


def packed_key(cols: list[np.ndarray], bounds: list[tuple[int, int]] | None = None
               ) -> tuple[np.ndarray, list[tuple[int, int]]] | None:
    """Integer columns as one int64 a row, the first column the least significant (sorting the
    keys sorts by the last column, then the one before, ...; equal keys are equal rows), and the
    (lowest, span) of each column it used. `bounds` given (another table's): rows outside them
    are -1, which no row inside equals; fitted from `cols` where None, and None where the spans'
    product does not fit. One integer a row is what a sort or a join by several columns needs,
    without pandas' copy of the columns and hash table of every row (#20)."""
    if bounds is None:
        bounds, width = [], 1
        for x in cols:
            lo = int(x.min()) if x.size else 0
            span = (int(x.max()) - lo + 1) if x.size else 1
            width *= span
            if width >= PACK_LIMIT:
                return None
            bounds.append((lo, span))
    key = np.zeros(len(cols[0]) if cols else 0, dtype=np.int64)
    inside = np.ones(key.size, dtype=bool)
    width = 1
    for x, (lo, span) in zip(cols, bounds):
        v = x.astype(np.int64) - lo
        inside &= (v >= 0) & (v < span)
        key += np.where(inside, v, 0) * width
        width *= span
    key[~inside] = -1
    return key, bounds


def match_collectives(run: Run) -> Matched:
    # not each rank's own table: those lie on disk (ingest/assemble.Keep)
    return match_table(collectives_table(run, tuple(c for c in COLLECTIVE_COLUMNS if c != "dtype") + ("rank", "dur")))


def match_table(allc: pd.DataFrame) -> Matched:
    """Matched of a collectives_table: each collective's rows on two ranks or more, with the
    latest, second-latest and median arrival of its ranks, and one row per collective.

    Each collective's figures come from one sort of the rows by (collective, arrival), not from
    a pandas groupby a figure: each groupby held the table's grouping and a column of its own
    at the matching's height, the client's at 1,024 ranks (#20). What pandas gave is kept to the
    bit: the median of an even count the mean of the two middle arrivals, the last rank the
    last row of the latest arrival (rows in table order at equal arrivals), a name missing
    from a row not counted against the others. Rows without an arrival, or without a
    collective's key, are left out."""
    empty = Matched(pd.DataFrame(columns=KEY + ["rank"]), pd.DataFrame(columns=KEY), 0.0)
    if allc.empty or allc["rank"].nunique() < 2:  # matching needs two ranks with collectives in their steps
        return empty
    n_rows = len(allc)
    gid = allc.groupby(KEY, sort=True).ngroup().to_numpy()  # -1: a key missing
    ok = (gid >= 0) & ~np.isnan(allc["arrival"].to_numpy(dtype=float))
    size = np.bincount(gid[ok], minlength=int(gid.max()) + 1)
    keep = ok & (size[np.where(ok, gid, 0)] >= 2)
    # every row matched (the usual case): the table itself, not a copy beside it
    matched = allc if bool(keep.all()) else allc[keep].copy()
    del allc
    if matched.empty:
        return Matched(matched, pd.DataFrame(columns=KEY), 0.0)
    _, gid = np.unique(gid[keep], return_inverse=True)  # collectives numbered 0.. in key order
    arr = matched["arrival"].to_numpy(dtype=float)
    order = np.lexsort((arr, gid))  # by collective, then arrival; stable: table order at ties
    by = gid[order]
    starts = np.flatnonzero(np.r_[True, by[1:] != by[:-1]])
    ends = np.r_[starts[1:], by.size]
    del by
    at = arr[order]
    n = ends - starts
    latest, second = at[ends - 1], at[ends - 2]
    median = (at[starts + (n - 1) // 2] + at[starts + n // 2]) / 2
    matched["latest"] = latest[gid]
    matched["second"] = second[gid]
    leave = np.minimum(matched["latest"], matched["end"])
    # the part of its wait (leave - arrival) spent on the last rank alone: what fixing that one rank saves
    matched["tail_wait"] = np.clip(leave - np.maximum(matched["arrival"], matched["second"]), 0, None)
    matched["lateness"] = matched["arrival"] - median[gid]
    del leave
    names, _ = pd.factorize(matched["name"])  # -1: no name
    named, width = names >= 0, int(names.max()) + 1 if names.size and names.max() >= 0 else 1
    pairs = np.unique(gid[named].astype(np.int64) * width + names[named])  # each (collective, name) once
    n_names = np.bincount(pairs // width, minlength=n.size)
    heads = order[starts]
    per_coll = pd.DataFrame({**{k: matched[k].to_numpy()[heads] for k in KEY},
                             "n_ranks": n.astype(np.int64),
                             "last_rank": matched["rank"].to_numpy()[order[ends - 1]],
                             "latest": latest, "gap": latest - second, "names_agree": n_names == 1})
    return Matched(matched.reset_index(drop=True), per_coll, len(matched) / max(n_rows, 1))


def late_group(lateness_ms: pd.Series, min_gap_ms: float, limit: int | None = None) -> list[int]:
    """The ranks above the widest gap in the ranks' mean lateness (ms, by rank), among fewer than
    half of them (and at most `limit`), latest first, when that gap is min_gap_ms or more; []
    otherwise. A slow host's ranks arrive late together: bringing any one of them to the median
    saves nothing while the group costs the whole wait (measured: 8 of 32 ranks 150 ms late each
    step read "no significant cause found"). Under jitter the widest gap is small."""
    lat = lateness_ms.sort_values(ascending=False, kind="stable")
    kmax = (len(lat) - 1) // 2 if limit is None else min((len(lat) - 1) // 2, limit)
    if kmax < 1:
        return []
    v = lat.to_numpy(dtype=float)
    gaps = v[:kmax] - v[1:kmax + 1]
    k = int(np.argmax(gaps)) + 1
    if gaps[k - 1] < min_gap_ms:
        return []
    return [int(r) for r in lat.index[:k]]


def _tail_waits(pr: pd.DataFrame, group: tuple[int, ...]) -> pd.Series:
    """tail_wait with each rank outside `group` waiting for the group alone: from the latest
    arrival among the rest (or its own, if later) to when it leaves."""
    rest = ~pr["rank"].isin(group)
    rest_latest = pr["arrival"].where(rest).groupby([pr[k] for k in KEY]).transform("max")
    leave = np.minimum(pr["latest"], pr["end"])
    alone = np.clip(leave - np.maximum(pr["arrival"], rest_latest.fillna(pr["second"])), 0, None)
    return pr["tail_wait"].where(~rest, alone)


def wait_for_group(matched: Matched, group: tuple[int, ...]) -> Matched:
    """The same, each other rank's tail_wait the time it waits for the group alone (_tail_waits);
    the group's members keep their wait for the last rank alone. With under two ranks in the
    group nothing changes (the wait for the last rank alone is already what fixing one saves)."""
    pr = matched.frame()
    if len(group) < 2 or pr.empty:
        return matched
    return Matched(pr.assign(tail_wait=_tail_waits(pr, group)), matched.per_collective, matched.match_ratio)


def group_wait_ms(matched: Matched, group: tuple[int, ...]) -> float:
    """Median over the other ranks of their mean per-step wait for `group` alone (ms, _tail_waits)."""
    pr = matched.frame(KEY + ["rank", "arrival", "end", "latest", "second", "tail_wait"])
    if pr.empty or not group:
        return 0.0
    rest = pr.assign(tail_wait=_tail_waits(pr, group))[~pr["rank"].isin(group)]
    if rest.empty:
        return 0.0
    per_step = rest.groupby(["rank", "step"])["tail_wait"].sum().groupby(level="rank").mean()
    return float(per_step.median()) / 1000
