"""Communication by process group and collective kind: its exposed time, and what it moved and how fast.

Exposed time: the communication the breakdown books as exposed (not hidden under compute, not
the wait for the last rank), each instant given to the collective running then
(exposed_by_group): what each kind of communication costs the step, summing to exposed_comm.

For every collective whose message size is known (record_param_comms on NCCL traces, the probes'
records or Input Dims on gloo), the transfer time is the time from the last rank's arrival to the
collective's end where it is matched across ranks (step/collectives.py: the wait for late ranks
is the straggler's, not the link's), else from the rank's own arrival (an upper bound: it
includes any wait for peers, and the table says so).

algbw = size / transfer time; busbw = algbw x the factor that makes it comparable with the
link's peak whatever the collective (nccl-tests' PERFORMANCE.md): all-reduce 2(n-1)/n,
all-gather, reduce-scatter and all-to-all (n-1)/n, broadcast, reduce and send/recv 1, for a
group of n ranks. Size is nccl-tests' too: the trace records each rank's input ("In msg
nelems" x dtype, or the input tensor), which is the whole buffer except for all-gather, whose
size is its output, n x the input.

A group's collectives are latency-bound when their median message is under SMALL_MESSAGE_BYTES:
there a collective's time is mostly fixed per-call latency, and bus bandwidth keeps growing
with size (nccl-tests' curves rise up to tens of MB), so a low busbw says "too many small
messages", not "slow link".
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pandas as pd

from diagnose.ingest.assemble import Run
from diagnose.step.breakdown import exposed_comm, waits_by_rank
from diagnose.step.collectives import KEY, Matched, RowsByValue, collectives_table, packed_key
from diagnose.step.intervals import covered, intersect, union

SMALL_MESSAGE_BYTES = 1024**2
"""Under 1 MiB a collective is latency-bound (the communication check's "small collectives" use it too)."""

_KINDS = (  # on the name lower-cased with _ and - removed; the first match wins (reduce last)
    ("all_reduce", re.compile(r"allreduce")),
    ("all_gather", re.compile(r"allgather")),
    ("reduce_scatter", re.compile(r"reducescatter")),
    ("all_to_all", re.compile(r"alltoall")),
    ("broadcast", re.compile(r"broadcast|bcast")),
    ("send_recv", re.compile(r"sendrecv|send|recv")),
    ("barrier", re.compile(r"barrier")),
    ("reduce", re.compile(r"reduce")),
)


def collective_kind(name: str) -> str:
    """all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send_recv, barrier, reduce or
    unknown, from an NCCL kernel's, a gloo op's or a c10d op's name."""
    flat = re.sub(r"[_\-\s]", "", name.lower())
    return next((kind for kind, pattern in _KINDS if pattern.search(flat)), "unknown")


def bus_factor(kind: str, n: int) -> float | None:
    """busbw / algbw for a collective of this kind over n ranks (None: no bandwidth to speak of)."""
    if n < 1 or kind in ("barrier", "unknown"):
        return None
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


@dataclass(frozen=True, slots=True)
class GroupComm:
    """One (process group, collective kind): its exposed time and, where the trace records sizes,
    what its collectives moved and how fast (medians over them)."""

    group: str
    kind: str
    ranks: int
    """Group size n (the trace's pg_config, else the world size, else the ranks loaded)."""
    count: int
    """Collectives in the profiled steps, summed over the ranks loaded."""
    exposed_ms_per_step: float
    """exposed_by_group: the median rank's exposed communication in these collectives."""
    sized: int = 0
    """Collectives of known size (the bandwidth figures below are over these; None when 0)."""
    median_bytes: float | None = None
    """nccl-tests' size: the buffer (an all-gather's output)."""
    median_transfer_ms: float | None = None
    algbw_gbps: float | None = None
    """Median of size / transfer time, GB/s (10^9 bytes)."""
    busbw_gbps: float | None = None
    regime: str | None = None
    """latency-bound (median message under SMALL_MESSAGE_BYTES) or bandwidth-bound."""
    transfer: str | None = None
    """matched across ranks (last arrival to end), own arrival (includes waits: a lower bound on the
    bandwidth) or mixed."""


def group_sizes(run: Run) -> dict[str, int]:
    """Process group name -> size, from the traces' distributedInfo.pg_config."""
    sizes: dict[str, int] = {}
    for tr in run.traces.values():
        info = tr.meta.get("distributedInfo")
        for pg in (info.get("pg_config") or []) if isinstance(info, dict) else []:
            if isinstance(pg, dict) and isinstance(pg.get("pg_size"), int) and pg["pg_size"] > 0:
                sizes[str(pg.get("pg_name"))] = pg["pg_size"]
    return sizes


def comm_table(run: Run, matched: Matched) -> tuple[GroupComm, ...]:
    """Every (group, kind) with a collective in the profiled steps, and the OUTSIDE row when some
    exposed communication is in none; sorted by exposed time, largest first.

    The table's rows go into groups by codes (their texts named once each), and the transfers
    matched across ranks are joined to them once, not once a group: a text column a row, a copy
    of the table with them and one of the matched rows at each group's join were the report's
    height at 1,024 ranks (#20: 1.84 MB above its base at 1,024 replicated DLRM ranks)."""
    exposed = exposed_by_group(run, matched)
    matched_tx = _Transfers(matched)  # before the table is read: not both at once
    allc = collectives_table(run, tuple(KEY) + ("name", "bytes", "arrival", "end", "rank"), aligned=False)
    tx = matched_tx.of(allc)
    del matched_tx
    nbytes = allc["bytes"].to_numpy(dtype=float)
    own = (allc["end"] - allc["arrival"]).to_numpy(dtype=float)  # from the rank's own arrival
    # each row's (group, kind) as one code; the texts as str() names them (NaN: "nan")
    pg_codes, pg_at = _codes(allc["pg"].to_numpy())
    name_codes, name_at = _codes(allc["name"].to_numpy())
    del allc
    width = max(len(name_at), 1)
    pairs, at = np.unique(pg_codes * width + name_codes, return_inverse=True)
    del pg_codes, name_codes
    pg_text, kinds = [str(u) for u in pg_at], [collective_kind(str(u)) for u in name_at]
    named = [(pg_text[int(c) // width], kinds[int(c) % width]) for c in pairs]
    keys = sorted(set(named))  # groupby's order: by group, then kind
    pos = {k: i for i, k in enumerate(keys)}
    group = np.array([pos[x] for x in named], dtype=np.int64)[at.reshape(-1)] if named \
        else np.zeros(0, dtype=np.int64)
    del at
    sizes = group_sizes(run)
    world = run.world_size or len(run.ranks)
    rows = []
    for k, (pg, kind) in enumerate(keys):
        mine = np.flatnonzero(group == k)
        n = sizes.get(pg, world)
        rows.append(GroupComm(group=pg, kind=kind, ranks=int(n), count=int(mine.size),
                              exposed_ms_per_step=exposed.get((pg, kind), 0.0),
                              **_bandwidth(nbytes[mine], own[mine], tx[mine], kind, n)))
    if OUTSIDE in exposed:
        rows.append(GroupComm(group=OUTSIDE[0], kind=OUTSIDE[1], ranks=world, count=0,
                              exposed_ms_per_step=exposed[OUTSIDE]))
    return tuple(sorted(rows, key=lambda x: -x.exposed_ms_per_step))


def _codes(values: np.ndarray, at: dict | None = None, grow: bool = True) -> tuple[np.ndarray, dict]:
    """Each value's code in `at` (value -> code, new values given the next code in order of first
    appearance; not `grow`: -1 for a value it lacks), and `at`: pd.factorize's codes by a dict of
    the few distinct texts (factorize sizes its hash table by the rows: 1 MB at 1,024 ranks'
    16,384 keys, #20)."""
    at = {} if at is None else at
    if grow:
        codes = (at.setdefault(v, len(at)) for v in values.tolist())
    else:
        codes = (at.get(v, -1) for v in values.tolist())
    return np.fromiter(codes, dtype=np.int64, count=len(values)), at


class _Transfers:
    """The transfers matched across ranks, from the collective's last arrival to each rank's end
    where positive (aligned clocks there), by (step, group, order, rank); `of(table)` gives them
    to a collectives_table's rows (NaN: none), where a key is the matched table's twice the last
    of them in its order (as a merge of the two assigned in its order gives).

    Joined by one integer a key, packed from the matched table's ranges and sorted, made before
    the table is read: a pandas merge held both sides, its hash tables and its result at once
    (#20, the communication table's height at 1,024 ranks)."""

    def __init__(self, matched: Matched) -> None:
        self._matched = matched
        self.keys, self.tx = np.zeros(0, dtype=np.int64), np.zeros(0)
        self.bounds: list[tuple[int, int]] = []
        self.pg: dict = {}
        self.packed = True
        pr = matched.frame(KEY + ["rank", "latest", "end"])
        if not len(pr) or "latest" not in pr:
            return
        t = (pr["end"] - pr["latest"]).to_numpy(dtype=float)
        ok = t > 0
        keys = self._pack(pr, fit=True)
        del pr
        if keys is None:
            self.packed = False
            return
        keys, t = keys[ok], t[ok]
        order = np.argsort(keys, kind="stable")
        keys, t = keys[order], t[order]
        last = np.append(keys[1:] != keys[:-1], True)  # the last of each key, in the table's order
        self.keys, self.tx = keys[last], t[last]

    def _column(self, df: pd.DataFrame, k: str, grow: bool) -> np.ndarray | None:
        x = df[k].to_numpy()
        if k == "pg":  # a code a group, the matched table's (_codes: why not pd.factorize)
            return _codes(x, self.pg, grow)[0]
        return x if np.issubdtype(x.dtype, np.integer) else None

    def _pack(self, df: pd.DataFrame, fit: bool) -> np.ndarray | None:
        """One int64 a row (packed_key); `fit`: the ranges taken from df (the matched table's).
        None where a key is not integers (or, fitting, the four do not fit); a row of another
        table outside the ranges (a group the matched table has not) is -1: no match."""
        cols = [self._column(df, k, grow=fit) for k in KEY + ["rank"]]
        if any(x is None for x in cols):
            return None
        packed = packed_key(cols, None if fit else self.bounds)
        if packed is None:
            return None
        key, self.bounds = packed
        return key

    def of(self, table: pd.DataFrame) -> np.ndarray:
        out = np.full(len(table), np.nan)
        if self.packed:
            if not self.keys.size:
                return out  # nothing matched with a positive transfer
            mine = self._pack(table, fit=False)
            if mine is not None:
                at = np.minimum(np.searchsorted(self.keys, mine), self.keys.size - 1)
                hit = (self.keys[at] == mine) & (mine >= 0)
                out[hit] = self.tx[at[hit]]
                return out
        # keys that are not integers in either table, or too wide to pack: pandas' join
        pr = self._matched.frame(KEY + ["rank", "latest", "end"])
        t = (pr["end"] - pr["latest"]).to_numpy(dtype=float)
        m = table[KEY + ["rank"]].reset_index(drop=True).reset_index().merge(
            pr[KEY + ["rank"]][t > 0].assign(tx=t[t > 0]), on=KEY + ["rank"], how="inner")
        out[m["index"].to_numpy()] = m["tx"].to_numpy()
        return out


def _bandwidth(nbytes: np.ndarray, own: np.ndarray, tx: np.ndarray, kind: str, n: int) -> dict:
    """The size and speed fields of one group's collectives of known size ({} when none): their
    bytes, transfers from their own arrival, and from the last arrival where matched (NaN: not)."""
    sized = nbytes > 0
    if not sized.any():
        return {}
    nbytes, own, tx = nbytes[sized], own[sized], tx[sized]
    is_matched = ~np.isnan(tx)
    transfer = np.where(is_matched, tx, own)
    keep = transfer > 0
    if not keep.any():
        return {}
    size = nbytes[keep] * (n if kind == "all_gather" else 1)
    alg = float(np.median(size / transfer[keep] / 1e3))  # bytes per us -> GB/s
    factor = bus_factor(kind, n)
    med = float(np.median(size))
    used = is_matched[keep]
    return dict(sized=int(keep.sum()), median_bytes=med, median_transfer_ms=float(np.median(transfer[keep])) / 1000,
                algbw_gbps=alg, busbw_gbps=alg * factor if factor is not None else None,
                regime="latency-bound" if med < SMALL_MESSAGE_BYTES else "bandwidth-bound",
                transfer="matched across ranks" if used.all() else
                "own arrival (includes waits)" if not used.any() else "mixed")


OUTSIDE = ("", "outside collectives (point-to-point, DDP bucket work)")
"""exposed_by_group's row for exposed communication no collective covers."""


def exposed_by_group(run: Run, matched: Matched) -> dict[tuple[str, str], float]:
    """(process group, kind) -> exposed communication ms per step, the median over ranks of
    exposed_per_rank (a row's median rank, so the rows need not sum to the median rank's total)."""
    # a column of every rank's ms a row, filled one rank at a time: not a dict a rank held for
    # them all at once, at the communication table's height (#20)
    n = sum(1 for r in run.ranks if len(run.timelines[r].steps))  # the ranks _exposed_each gives
    cols: dict[tuple[str, str], np.ndarray] = {}
    for i, (_, mine) in enumerate(_exposed_each(run, matched)):
        for k, v in mine.items():
            if k not in cols:
                cols[k] = np.zeros(n)
            cols[k][i] = v
    return {k: float(np.median(cols[k])) for k in sorted(cols)}


def exposed_per_rank(run: Run, matched: Matched) -> dict[int, dict[tuple[str, str], float]]:
    """rank -> (process group, kind) -> exposed communication ms per step (_exposed_each, every
    rank's at once)."""
    return dict(_exposed_each(run, matched))


def _exposed_each(run: Run, matched: Matched) -> Iterator[tuple[int, dict[tuple[str, str], float]]]:
    """(rank, (process group, kind) -> exposed communication ms per step), rank after rank, for
    the ranks with a step.

    Per rank, the time the breakdown books as exposed_comm (step/breakdown.py exposed_comm)
    inside the profiled steps, given to the collective running then; where two overlap, to the
    one that started first (what the later one waited behind). Exposure outside every collective
    (on CPU ranks DDP's bucket copies, gloo's point-to-point transfers) is the row OUTSIDE, so a
    rank's rows sum to its exposed_comm_ms."""
    waits = waits_by_rank(run, matched)
    # every rank's collectives in one table, named once (per-rank frames were 1.1 s at 1,024 ranks)
    allc = collectives_table(run, ("rank", "pg", "name", "arrival", "end"), aligned=False)
    kinds = {n: collective_kind(n) for n in set(allc["name"].astype(str))}
    c_rank, c_pg = allc["rank"].to_numpy(), allc["pg"].astype(str).to_numpy()
    c_kind = np.array([kinds[n] for n in allc["name"].astype(str)], dtype=object)
    c_start, c_end = allc["arrival"].to_numpy(dtype=float), allc["end"].to_numpy(dtype=float)
    rows_of = RowsByValue(c_rank)
    for r in run.ranks:
        tl = run.timelines[r]
        n = len(tl.steps)
        if not n:
            continue
        lo_s, hi_s = tl.steps.start, tl.steps.end
        exposed = intersect(exposed_comm(run, r, waits), union(lo_s, hi_s))
        rows = rows_of[r]
        rows = rows[np.argsort(c_start[rows], kind="stable")]  # by arrival, ties in table order
        start, end = c_start[rows], c_end[rows]
        # disjoint pieces: each collective from where the earlier ones (by start) had all ended
        before = np.maximum.accumulate(np.concatenate([[-np.inf], end[:-1]]))
        lo = np.maximum(start, before)
        us = covered(exposed, lo, np.maximum(lo, end))
        mine: dict[tuple[str, str], float] = {}
        for key, v in zip(zip(c_pg[rows], c_kind[rows]), us):
            mine[key] = mine.get(key, 0.0) + float(v) / 1000 / n
        rest = float(covered(exposed, lo_s, hi_s).sum() - us.sum()) / 1000 / n
        if rest > 1e-6:
            mine[OUTSIDE] = rest
        yield r, mine
