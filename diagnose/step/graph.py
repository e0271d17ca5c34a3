"""The step as a dependency graph across ranks: replay, what-ifs by replay, critical path.

Model (aligned clocks, every rank loaded):
- Each rank has a *lane*: its program, the thread of work that steps run on (GPU: the
  device's compute, idle and exposed-communication time; CPU: the training thread). The lane
  is a chain of points in time order: step starts and ends, collective arrivals, and resume
  points. A lane edge's weight is the measured time between two consecutive points minus the
  time the lane was *blocked* on communication in between (the breakdown's exposed
  communication), and carries its composition (DataLoader wait, each idle class of the idle
  model, the rest: compute and host work).
- A collective instance (step, process group, order: diagnose/step/collectives.py) ends on
  rank r no earlier than the last participant's arrival plus r's transfer (measured end minus
  the measured last arrival), and its arrival waits for the previous collective on the same
  rank when it started after that one ended (stream order).
- A blocked stretch of a lane ends at a *resume* point that depends on the end of the
  collective it waited for (the latest one on the rank ending inside the stretch). A stretch that
  ends before any of its collectives end, but after one's last participant arrived, resumes at
  that last arrival plus the rank's transfer, less the measured tail it did not wait for (CPU ranks: a main thread waiting at the end of
  backward resumes while the gloo thread still closes the transfer: waiting for a late peer all
  the same, so it moves with that peer). A blocked
  stretch neither explains stays lane time; where it lies between one of the rank's
  collectives' last arrival and its end (a CPU rank's main thread waiting while the gloo thread
  still transfers, resuming before the transfer's last bookkeeping), it is the lane part
  `comm_wait`, which hiding communication removes; before the last arrival it is waiting for a
  peer and stays.
Every edge goes from an earlier measured time to a later one, so processing nodes in measured
time order is a topological order, and the longest-path schedule (each node at the max over
its predecessors of their time plus the edge weight) is one pass. With measured weights it
reproduces every measured point; where it does not (clock skew, a collective that ends before
its last arrival), the fidelity figure says by how much.

Edits change weights, never the dependencies: remove DataLoader waits, bring a rank's lane
segments to the median rank's, shrink transfers to their best observed duration, remove sync
drains, halve host-launch gaps. The what-if of an edit is the unedited replay's mean step
minus the edited one's: a freed wait that exposes another costs nothing, and removing two
causes together is not the sum of removing each.

Columnar: nodes and edges are numpy arrays; the one Python loop runs over nodes (a few per
collective per rank), never over trace events.
"""
from __future__ import annotations

from array import array
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np
import pandas as pd

from diagnose.ingest.assemble import Run
from diagnose.ingest.spill import ArrayBlocks, Spill, array_stretch
from diagnose.step.bandwidth import SMALL_MESSAGE_BYTES, collective_kind
from diagnose.step.collectives import RowsByValue, collectives_table
from diagnose.step.cover import LANE_SETS
from diagnose.step.intervals import Intervals, covered, intersect, subtract, union
from diagnose.step.parts import LaneParts, LanePartsBuilder, PartsOnDisk
from diagnose.step.pauses import Pauses
from diagnose.step.timeline import COLLECTIVE_COLUMNS

# node kinds, in the order they are processed at equal times
STEP_START, ARRIVAL, COLL_END, RESUME, STEP_END = range(5)
# lane composition columns: DataLoader wait, the idle model's classes, pageable input copies (each
# measured where the trace is read: step/cover.py), waiting on a transfer no collective end
# explains, Python's garbage collections (the probes' record: step/pauses.py), the rest last
PARTS = LANE_SETS + ("comm_wait", "gc", "compute")
"""input_copy: device time on pageable input copies with no kernel alongside (busy, not idle:
RankTimeline.input_copies). gc: the process stopped in a collection (CPU ranks whose probes place
them); taken out of the DataLoader's part where it began inside a fetch, else out of the rest."""
DL, COMM_WAIT, GC, COMPUTE = 0, len(LANE_SETS), len(LANE_SETS) + 1, len(PARTS) - 1
# edge categories on the critical path
LANE, TRANSFER, ORDER = range(3)


@dataclass(frozen=True, slots=True)
class StepGraph:
    """Nodes (one row each) and the weights that edits change. Node arrays are parallel."""

    rank: np.ndarray
    kind: np.ndarray
    time: np.ndarray
    """Measured time of the node (aligned us); its processing order."""
    step: np.ndarray
    """The rank's step the node belongs to (step bounds and collectives; lane points between)."""
    seg: np.ndarray
    """Anchor id of a step bound or collective arrival, the same on every rank (lines ranks' work up
    for the median); -1 for other nodes."""
    lane_prev: np.ndarray
    """Previous node on the rank's lane (-1: the rank's first point, anchored at its time)."""
    lane_parts: LaneParts
    """(nodes, len(PARTS)): the lane edge ending at the node, by part (us); `total`, its weight."""
    group: np.ndarray
    """Collective instance of an ARRIVAL or COLL_END node (-1 otherwise)."""
    transfer: np.ndarray
    """COLL_END: the rank's transfer (us) after the last arrival."""
    order_prev: np.ndarray
    """ARRIVAL: the rank's previous COLL_END it must follow (stream order; -1: none)."""
    resume_of: np.ndarray
    """RESUME: the COLL_END it waited for; its lag (measured resume minus that end) is in lag."""
    lag: np.ndarray
    after_arrival: np.ndarray
    """RESUME: waits for its collective's last arrival (group), not its end (a later node): it
    comes at that arrival plus the rank's transfer plus lag (<= 0: how long before the transfer's
    end the lane went on), so shrinking the transfer moves it too."""
    n_groups: int
    group_key: pd.DataFrame
    """One row per collective instance: step, pg, seq, and what it moved: name, dtype, bytes (the
    largest over its ranks; NaN when not recorded)."""
    step_nodes: np.ndarray
    """(k, 2): the STEP_START and STEP_END node of each (rank, step) that has both, in the order of
    the ends (`step_nodes`): what a replay's step durations are read at."""

    @property
    def ranks(self) -> list[int]:
        return np.unique(self.rank).tolist()

    @property
    def n_nodes(self) -> int:
        return int(self.time.size)

    def stretch(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Nodes [lo, hi) of a node column (GraphOnDisk reads only those)."""
        return getattr(self, name)[lo:hi]

    def column_at(self, name: str, nodes: np.ndarray) -> np.ndarray:
        """A node column at these nodes (GraphOnDisk reads the blocks they lie in)."""
        return getattr(self, name)[nodes]

    def anchor_segments(self) -> np.ndarray:
        """_anchor_segments of this graph (GraphOnDisk keeps it, found once)."""
        return _anchor_segments(self)


NODE_COLUMNS = ("rank", "kind", "time", "step", "seg", "lane_prev", "group", "transfer", "order_prev",
                "resume_of", "lag", "after_arrival")
"""StepGraph's per-node arrays (lane_parts apart)."""


class GraphOnDisk:
    """A StepGraph whose node columns and lane composition lie in a spill (ingest/spill.py), each
    read back when a reader asks for it: a fresh, read-only copy the reader drops when done. It
    reads as a StepGraph (the same attributes); the functions here take each column once a call,
    never once a node.

    Why (#20, the client's memory per rank): the step model's graph was held from its build to the
    last replay, through every check and extra, most of them never reading it: 2.0 MB at 1,024
    replicated DLRM ranks (25,728 nodes), the largest piece of the client's model of the run. The
    unedited replay's step durations stay in memory (StepModel.base, ReplayOnDisk: each what-if is
    measured against their mean)."""

    __slots__ = ("_cols", "lane_parts", "n_groups", "group_key", "step_nodes", "n_nodes")

    def __init__(self, g: StepGraph, spill: Spill) -> None:
        cols = {k: spill.put_array(getattr(g, k)) for k in NODE_COLUMNS}
        # found once here, where the graph's columns are in memory: found at each straggler edit
        # from columns read back, it set the replays' height at 1,024 ranks (0.76 MB; #20)
        cols["anchor_seg"] = spill.put_array(_anchor_segments(g))
        self._hold(cols, PartsOnDisk(g.lane_parts, spill), g.n_groups, g.group_key, g.step_nodes, g.n_nodes)

    @classmethod
    def written(cls, cols: dict, lane_parts: PartsOnDisk, *, n_groups: int, group_key: pd.DataFrame,
                step_nodes: np.ndarray, n_nodes: int) -> GraphOnDisk:
        """One whose node columns (NODE_COLUMNS and anchor_seg) were put in the spill as its build
        went (build_graph with a spill): the graph never whole in memory."""
        g = object.__new__(cls)
        g._hold(cols, lane_parts, n_groups, group_key, step_nodes, n_nodes)
        return g

    def _hold(self, cols: dict, lane_parts: PartsOnDisk, n_groups: int, group_key: pd.DataFrame,
              step_nodes: np.ndarray, n_nodes: int) -> None:
        assert set(cols) == set(NODE_COLUMNS) | {"anchor_seg"}, sorted(cols)
        self._cols, self.lane_parts = cols, lane_parts
        self.n_groups, self.group_key, self.step_nodes, self.n_nodes = n_groups, group_key, step_nodes, n_nodes

    def column(self, name: str) -> np.ndarray:
        return self.stretch(name, 0, self.n_nodes)

    def stretch(self, name: str, lo: int, hi: int) -> np.ndarray:
        return array_stretch(self._cols[name], lo, hi)

    def column_at(self, name: str, nodes: np.ndarray) -> np.ndarray:
        return ArrayBlocks(self._cols[name])[nodes]

    @property
    def ranks(self) -> list[int]:
        return np.unique(self.rank).tolist()

    def anchor_segments(self) -> np.ndarray:
        return self.column("anchor_seg")


for _name in NODE_COLUMNS:  # each node column a property reading it back (GraphOnDisk.column)
    setattr(GraphOnDisk, _name, property(lambda self, _name=_name: self.column(_name)))


@dataclass(frozen=True, slots=True)
class Replay:
    time: np.ndarray
    """Replayed time of every node."""
    via: np.ndarray | None
    """The predecessor that set each node's time (-1: anchored), and the edge category; None in a
    what-if's replay (replay(path=False): only the critical path reads them)."""
    via_cat: np.ndarray | None
    step_ms: np.ndarray
    """Replayed duration (ms) of each (rank, step) of StepGraph.step_nodes, in their order: an array,
    not a dict by (rank, step), which held ~0.2 KB a rank for every replay alive (#20)."""

    @property
    def mean_step_ms(self) -> float:
        return mean_ms(self.step_ms)

    def loaded(self) -> Replay:
        return self

    def blocks(self, keep: int | None = None) -> Replay:
        """Itself (ReplayOnDisk reads its nodes a block at a time)."""
        return self


def mean_ms(step_ms: np.ndarray) -> float:
    """A replay's mean step (ms), Replay's and ReplayOnDisk's."""
    return float(np.mean(step_ms)) if step_ms.size else 0.0


class ReplayOnDisk:
    """A Replay whose node arrays (time, via, via_cat) lie in a spill, read back whole by `loaded`
    (the critical path's readers, once a call); its step durations stay in memory (every what-if
    is measured against their mean). Why (#20): the step model's unedited replay was held from
    its build to the last extra, 13 bytes a node (0.34 MB at 1,024 replicated DLRM ranks), and
    only the critical path reads its nodes."""

    __slots__ = ("_cols", "step_ms")

    def __init__(self, rep: Replay, spill: Spill) -> None:
        self._cols = {k: spill.put_array(getattr(rep, k)) for k in ("time", "via", "via_cat")}
        self.step_ms = rep.step_ms

    @property
    def mean_step_ms(self) -> float:
        return mean_ms(self.step_ms)

    def loaded(self) -> Replay:
        time, via, via_cat = (array_stretch(self._cols[k]) for k in ("time", "via", "via_cat"))
        return Replay(time=time, via=via, via_cat=via_cat, step_ms=self.step_ms)

    def blocks(self, keep: int | None = None) -> Replay:
        """The same read a block of nodes at a time as they are asked for (ingest/spill.ArrayBlocks,
        `keep` blocks held at most): for a reader that follows a chain (the critical path)."""
        time, via, via_cat = (ArrayBlocks(self._cols[k], keep=keep) for k in ("time", "via", "via_cat"))
        return Replay(time=time, via=via, via_cat=via_cat, step_ms=self.step_ms)


def _shift(iv: Intervals, off: float) -> Intervals:
    return Intervals(iv.starts + off, iv.ends + off) if off else iv


# a rank's collectives table (timeline.COLLECTIVE_COLUMNS) with its rank, less its event rows
ALL_COLLECTIVE_COLUMNS = tuple(c for c in COLLECTIVE_COLUMNS if c != "row") + ("rank",)


class _Stretches:
    """Each rank's intervals back to back in typed arrays, put once in rank order and read after:
    a dict of Intervals was four arrays and two objects a rank, held across the build (#20)."""

    def __init__(self) -> None:
        self._starts, self._ends = array("d"), array("d")
        self._ranks, self._upto = array("q"), array("q")

    def put(self, r: int, iv: Intervals) -> None:
        assert not self._ranks or r > self._ranks[-1], "ranks are put in order"
        self._starts.frombytes(np.ascontiguousarray(iv.starts, dtype=np.float64).tobytes())
        self._ends.frombytes(np.ascontiguousarray(iv.ends, dtype=np.float64).tobytes())
        self._ranks.append(r)
        self._upto.append(len(self._starts))

    def get(self, r: int) -> Intervals:
        i = bisect_left(self._ranks, r)
        if i == len(self._ranks) or self._ranks[i] != r:
            raise KeyError(r)
        a, b = (self._upto[i - 1] if i else 0), self._upto[i]
        if a == b:
            return Intervals.empty()
        return Intervals(np.frombuffer(self._starts, dtype=np.float64, count=b - a, offset=8 * a),
                         np.frombuffer(self._ends, dtype=np.float64, count=b - a, offset=8 * a))


def build_graph(run: Run, *, resume_slack_us: float = 1.0, spill: Spill | None = None,
                pauses: dict[int, Pauses] | None = None) -> StepGraph | GraphOnDisk:
    """The dependency graph of every profiled step of every loaded rank; with `spill`, a
    GraphOnDisk whose node columns went to the spill each as soon as the build was done with it
    (the graph whole in memory at the build's end set the client's height at 1,024 ranks: #20).
    pauses: each rank's garbage collections placed on its steps (step/pauses.py), the lane part "gc"."""
    pauses = pauses or {}
    done: dict = {}  # the finished node columns (on disk, with a spill)

    def finished(name: str, a: np.ndarray) -> None:
        done[name] = a if spill is None else spill.put_array(a)

    allc = collectives_table(run, ALL_COLLECTIVE_COLUMNS)
    keys = allc[["step", "pg", "seq"]].drop_duplicates().reset_index(drop=True)
    allc = allc.merge(keys.reset_index().rename(columns={"index": "group"}), on=["step", "pg", "seq"])
    # what each instance moved, for edits that depend on it (reductions in fp32: whatif.py)
    what = allc.groupby("group").agg(name=("name", "first"), dtype=("dtype", "first"), bytes=("bytes", "max"))
    keys = keys.join(what)
    latest = allc.groupby("group")["arrival"].transform("max").to_numpy(dtype=float)
    c_end = np.maximum(allc["end"].to_numpy(dtype=float), latest)  # never before the last arrival
    c_rank = allc["rank"].to_numpy().copy()
    c_arr = allc["arrival"].to_numpy(dtype=float, copy=True)
    c_step = allc["step"].to_numpy().astype(np.int64)
    c_pg = allc["pg"].to_numpy().copy()
    c_seq = allc["seq"].to_numpy().astype(np.int64)
    c_group = allc["group"].to_numpy().astype(np.int64)
    del allc  # what is read of it is copied out: every collective row, merged, goes before the nodes come

    # node columns, filled per rank, sorted once at the end; typed arrays, not lists: a list holds
    # a Python number per cell, ~4x the memory, and each as narrow as the graph keeps it (#20: the
    # build of this graph sets the client's peak) (ref: the collective row a RESUME waited for, a
    # COLL_END's own)
    cols: dict[str, array] = {k: array(code) for k, code in (
        ("rank", "i"), ("kind", "b"), ("time", "d"), ("step", "q"), ("seg", "i"), ("group", "i"),
        ("transfer", "d"), ("ref", "q"))}
    # segment ids: a stable code per (kind, step, pg, seq) so ranks' segments line up
    seg_codes: dict[tuple, int] = {}
    after_rows: set[int] = set()  # RESUME rows that wait for a last arrival, not an end

    def add(r: int, kind: int, t: float, step: int, seg: tuple | None, group: int = -1, transfer: float = 0.0,
            ref: int = -1) -> None:
        for k, v in (("rank", r), ("kind", kind), ("time", t), ("step", step), ("group", group),
                     ("transfer", transfer), ("ref", ref)):
            cols[k].append(v)
        cols["seg"].append(-1 if seg is None else seg_codes.setdefault(seg, len(seg_codes)))

    blocked_by_rank, comm_wait = _Stretches(), _Stretches()  # read again once the nodes are sorted
    rows_of = RowsByValue(c_rank)  # each rank's collective rows, found once (not a scan per rank)
    for r in run.ranks:
        tl = run.timelines[r]
        off = run.clock_offsets_us.get(r, 0.0)
        lo = tl.steps.start + off
        hi = tl.steps.end + off
        steps = tl.steps.step
        blocked = _shift(tl.cover.exposed_comm(), off)
        for s, a, b in zip(steps, lo, hi):
            add(r, STEP_START, float(a), int(s), ("start", int(s)))
            add(r, STEP_END, float(b), int(s), ("end", int(s)))
        mine = rows_of[r]
        for i in mine:
            st, gi = int(c_step[i]), int(c_group[i])
            add(r, ARRIVAL, float(c_arr[i]), st, ("arr", st, c_pg[i], int(c_seq[i])), gi)
            add(r, COLL_END, float(c_end[i]), st, None, gi, transfer=float(c_end[i] - latest[i]), ref=int(i))
        # resume points: the end of each blocked stretch inside the steps
        win = union(lo, hi)
        bl = Intervals(np.maximum(blocked.starts, win.starts.min()), np.minimum(blocked.ends, win.ends.max()))
        keep = bl.ends > bl.starts
        bl = Intervals(bl.starts[keep], bl.ends[keep])
        ends_r = c_end[mine]
        order = np.argsort(ends_r, kind="stable")
        se = ends_r[order]
        explained = np.zeros(len(bl), dtype=bool)
        own_r, last_r, end_r = c_arr[mine], latest[mine], c_end[mine]
        # each stretch's step and last collective end, searched for all of the rank's stretches at
        # once: one search a stretch was ~90,000 calls at 1,024 DLRM ranks
        in_step = (np.searchsorted(lo, bl.ends, side="right") - 1).tolist()
        last_end = (np.searchsorted(se, bl.ends + resume_slack_us, side="right") - 1).tolist()
        for n_b, (b0, b1, k, j) in enumerate(zip(bl.starts.tolist(), bl.ends.tolist(), in_step, last_end)):
            st = int(steps[max(k, 0)])
            if j < 0 or se[j] < b0:
                # nothing ended inside the stretch; one this rank had joined when the stretch began,
                # whose last rank arrived inside it and whose transfer was still closing when the
                # lane went on, explains it from that arrival
                if tl.is_gpu:
                    continue  # lane time: a device lane resumes at kernel ends
                tail = np.flatnonzero((own_r <= b0 + resume_slack_us) & (last_r >= b0) & (last_r <= b1)
                                      & (end_r > b1 + resume_slack_us))
                if not tail.size:
                    continue  # lane time
                i = mine[tail[np.argmax(last_r[tail])]]
                explained[n_b] = True
                add(r, RESUME, float(b1), st, None, int(c_group[i]), ref=int(i))
                after_rows.add(len(cols["kind"]) - 1)
                continue
            explained[n_b] = True
            i = mine[order[j]]
            add(r, RESUME, max(float(b1), float(c_end[i])), st, None, int(c_group[i]), ref=int(i))
        blocked_by_rank.put(r, Intervals(bl.starts[explained], bl.ends[explained]))
        in_transfer = union(latest[mine], c_end[mine])
        comm_wait.put(r, intersect(Intervals(bl.starts[~explained], bl.ends[~explained]), in_transfer))

    kind = np.asarray(cols.pop("kind"), dtype=np.int8)
    time = np.asarray(cols.pop("time"), dtype=float)
    order = np.lexsort((kind, time))
    kind, time = kind[order], time[order]

    def sorted_column(k: str, dtype: type) -> np.ndarray:
        # each typed column goes as soon as its sorted copy is made: the graph's build sets the
        # client's peak (#20), and both copies of every column at once were most of it
        return np.asarray(cols.pop(k), dtype=dtype)[order]

    # node ids, ranks, steps and codes fit 32 bits: half the memory of the graph's index columns
    rank, step, seg = (sorted_column(k, np.int32) for k in ("rank", "step", "seg"))
    finished("group", sorted_column("group", np.int32))
    ref = sorted_column("ref", np.int64)
    finished("transfer", sorted_column("transfer", float))
    after_arrival = np.isin(order, list(after_rows))
    n = time.size
    # what needs the step and anchor columns, found now: those go before the lanes' pass
    nodes_of_steps = step_nodes(rank, step, kind)
    if spill is not None:  # GraphOnDisk keeps the anchors (found at each straggler edit otherwise)
        finished("anchor_seg", _anchor_segments_of(kind, rank, seg))
    finished("step", step)
    finished("seg", seg)
    del step, seg

    # COLL_END node of each collective row (its ref): to link resumes
    end_nodes = np.flatnonzero(kind == COLL_END)
    end_node_of_row = np.full(len(c_rank), -1, dtype=np.int64)
    end_node_of_row[ref[end_nodes]] = end_nodes
    resume_of = np.full(n, -1, dtype=np.int32)
    lag = np.zeros(n)
    res = np.flatnonzero(kind == RESUME)
    for v in res:
        e = int(end_node_of_row[ref[v]])
        resume_of[v] = e
        # after-arrival resumes keep how long before the transfer's end the lane went on (<= 0): the
        # replay places them at the last arrival plus the (edited) transfer less that
        lag[v] = time[v] - time[e] if after_arrival[v] else max(time[v] - time[e], 0.0)
    # the collective rows are done with: what is left to build is per node (#20: the build's height)
    del c_rank, c_arr, c_step, c_pg, c_seq, c_group, c_end, latest, rows_of, end_node_of_row, ref
    for k, a in (("resume_of", resume_of), ("lag", lag), ("after_arrival", after_arrival)):
        finished(k, a)
    del resume_of, lag, after_arrival

    # lane chains and the composition of each lane edge
    lane_prev = np.full(n, -1, dtype=np.int32)
    lane_parts = LanePartsBuilder(n, len(PARTS))
    order_prev = np.full(n, -1, dtype=np.int32)
    nodes_of = RowsByValue(rank)  # in time order within each rank
    for r in run.ranks:
        mine = nodes_of[r]
        lane = mine[kind[mine] != COLL_END]
        if lane.size < 2:
            continue
        lane_prev[lane[1:]] = lane[:-1]
        a, b = time[lane[:-1]], time[lane[1:]]
        lane_w = np.maximum(b - a - covered(blocked_by_rank.get(r), a, b), 0.0)
        parts = np.zeros((lane.size - 1, len(PARTS)))
        parts[:, :len(LANE_SETS)] = run.timelines[r].cover.lane_parts(a, b, run.clock_offsets_us.get(r, 0.0))
        parts[:, COMM_WAIT] = covered(comm_wait.get(r), a, b)
        if (pz := pauses.get(r)) is not None:
            # the process stood still: lane time, never a blocked stretch; the trace showed it as the
            # DataLoader's wait where it began inside a fetch, else as host work between ops
            lane_blocked = blocked_by_rank.get(r)
            parts[:, GC] = covered(subtract(pz.every, lane_blocked), a, b)
            parts[:, DL] -= np.minimum(covered(subtract(pz.in_fetch, lane_blocked), a, b), parts[:, DL])
        # what is left is compute and host work; parts never exceed the edge
        scale = np.where(parts[:, :COMPUTE].sum(axis=1) > lane_w,
                         lane_w / np.maximum(parts[:, :COMPUTE].sum(axis=1), 1e-12), 1.0)
        parts[:, :COMPUTE] *= scale[:, None]
        parts[:, COMPUTE] = lane_w - parts[:, :COMPUTE].sum(axis=1)
        lane_parts.add(lane[1:], parts)
        # stream order: an arrival after the rank's previous collective ended waits for it
        ends = mine[kind[mine] == COLL_END]
        arr = mine[kind[mine] == ARRIVAL]
        if ends.size and arr.size:
            j = np.searchsorted(time[ends], time[arr], side="left") - 1  # ends strictly before
            ok = j >= 0
            order_prev[arr[ok]] = ends[j[ok]]
    del nodes_of, blocked_by_rank, comm_wait
    for k, a in (("rank", rank), ("kind", kind), ("time", time), ("lane_prev", lane_prev), ("order_prev", order_prev)):
        finished(k, a)
    del rank, kind, time, lane_prev, order_prev
    if spill is None:
        return StepGraph(**done, lane_parts=lane_parts.build(), n_groups=len(keys), group_key=keys,
                         step_nodes=nodes_of_steps)
    return GraphOnDisk.written(done, PartsOnDisk(lane_parts.build(), spill), n_groups=len(keys), group_key=keys,
                               step_nodes=nodes_of_steps, n_nodes=n)


REPLAY_BLOCK = 4096
"""Nodes of the graph's columns a replay reads at a time. What it needs whole is what it writes
(each node's time and predecessor, read back at any earlier node); the columns it only reads,
the weights among them, a block at a time: the eight it reads of the graph's, whole, were 34 B a
node more at each replay (#20: at 1,024 replicated DLRM ranks, 25,728 nodes, a replay of the
graph on disk peaked at 1.65 MB of Python memory, 1.03 in blocks; tracemalloc)."""
_REPLAY_COLUMNS = ("kind", "time", "lane_prev", "group", "order_prev", "resume_of", "lag", "after_arrival")
AS_LISTS = 128
"""Nodes whose columns the replay's loop reads as lists at a time: a Python object a cell, so a
short stretch (tracemalloc, a replay of the graph on disk at 1,024 DLRM ranks: 1.03 MB at its
height with numpy's elements; as lists a block of REPLAY_BLOCK nodes at a time 1.45, 512 nodes
1.15, 128 nodes 1.08)."""


def replay(g: StepGraph, lane_w: np.ndarray | None = None, transfer: np.ndarray | None = None, *,
           path: bool = True) -> Replay:
    """Longest-path schedule of the graph with these lane weights and transfers (default: measured).
    path: keep each node's predecessor (via, via_cat) for the critical path; a what-if needs its
    step durations only (Replay.via and via_cat None).

    What it holds whole is what it writes, each node's time (and predecessor): the weights and
    transfers, given or the graph's, are read a block of nodes at a time with the other columns
    (#20: a what-if replay held its weights and transfers twice, ~50 bytes a node, at the height
    of every check that asks one; 1,024 replicated DLRM ranks, 25,728 nodes: 1.3 MB)."""
    n = g.n_nodes
    # typed arrays, and the columns read as short lists: an element of a numpy array read in this
    # loop costs ~100 ns, of these ~30 (a replay at 1,024 DLRM ranks 23 -> 11 ms); the same float
    # arithmetic, so the same schedule to the bit
    t = array("d", [0.0]) * n
    via, via_cat = (array("i", [-1]) * n, array("b", [-1]) * n) if path else (None, None)
    # the one weight read away from its node: an after-arrival resume's collective's transfer (CPU
    # lanes only: a device lane resumes at kernel ends), so the whole column only where there is one
    tr_at = transfer
    if tr_at is None and any(g.stretch("after_arrival", lo, lo + REPLAY_BLOCK).any() for lo in range(0, n, REPLAY_BLOCK)):
        tr_at = g.transfer
    group_start = [-np.inf] * g.n_groups
    group_last = [-1] * g.n_groups
    for lo in range(0, n, REPLAY_BLOCK):
        hi = min(lo + REPLAY_BLOCK, n)
        block = [g.stretch(c, lo, hi) for c in _REPLAY_COLUMNS]
        block.append(g.lane_parts.total_stretch(lo, hi) if lane_w is None else lane_w[lo:hi])
        block.append(g.stretch("transfer", lo, hi) if transfer is None else transfer[lo:hi])
        for at in range(lo, hi, AS_LISTS):
            # node v is row v - at of these lists; t and via are indexed by node
            kind, time, lane_prev, group, order_prev, resume_of, lag, after_arrival, w, tr = (
                c[at - lo:at - lo + AS_LISTS].tolist() for c in block)
            for i in range(len(kind)):
                v = at + i
                k = kind[i]
                if k == COLL_END:
                    gi = group[i]
                    t[v] = group_start[gi] + tr[i]
                    if path:
                        via[v], via_cat[v] = group_last[gi], TRANSFER
                    continue
                p = lane_prev[i]
                if p < 0:
                    t[v] = time[i]  # the rank's first point is anchored where it was measured
                else:
                    t[v] = t[p] + w[i]
                    if path:
                        via[v], via_cat[v] = p, LANE
                if k == ARRIVAL:
                    o = order_prev[i]
                    if o >= 0 and t[o] > t[v]:
                        t[v] = t[o]
                        if path:
                            via[v], via_cat[v] = o, ORDER
                    gi = group[i]
                    if t[v] > group_start[gi]:
                        group_start[gi], group_last[gi] = t[v], v
                elif k == RESUME:
                    if after_arrival[i]:  # the last arrival is processed by now (measured before this point)
                        gi = group[i]
                        resumed = group_start[gi] + max(float(tr_at[resume_of[i]]) + lag[i], 0.0)
                        if resumed > t[v]:
                            t[v] = resumed
                            if path:
                                via[v], via_cat[v] = group_last[gi], ORDER
                        continue
                    e = resume_of[i]
                    if t[e] + lag[i] > t[v]:
                        t[v] = t[e] + lag[i]
                        if path:
                            via[v], via_cat[v] = e, ORDER
        del block
    times = np.frombuffer(t, dtype=np.float64)  # views of the typed arrays, not copies
    if not path:
        return Replay(time=times, via=None, via_cat=None, step_ms=_durations_ms(g, times))
    return Replay(time=times, via=np.frombuffer(via, dtype=np.intc).astype(np.int32, copy=False),
                  via_cat=np.frombuffer(via_cat, dtype=np.int8), step_ms=_durations_ms(g, times))


def _durations_ms(g: StepGraph, t: np.ndarray) -> np.ndarray:
    return (t[g.step_nodes[:, 1]] - t[g.step_nodes[:, 0]]) / 1000


def step_nodes(rank: np.ndarray, step: np.ndarray, kind: np.ndarray) -> np.ndarray:
    """StepGraph.step_nodes: per (rank, step), its STEP_START and STEP_END node (the last of each
    where one repeats), at the first of its ends' positions; (rank, step)s lacking either left out.
    By sorting, not by dicts of (rank, step) tuples: ~0.2 KB a rank at the build's height (#20)."""
    s, e = np.flatnonzero(kind == STEP_START), np.flatnonzero(kind == STEP_END)
    ks, ke = _rank_step_key(rank[s], step[s]), _rank_step_key(rank[e], step[e])
    start_keys, last_start = _last_of_each(ks)
    end_keys, last_end = _last_of_each(ke)
    _, first_end = np.unique(ke, return_index=True)  # sorted as end_keys
    at = np.searchsorted(start_keys, end_keys)
    has = (at < start_keys.size) & (start_keys[np.minimum(at, max(start_keys.size - 1, 0))] == end_keys) \
        if start_keys.size else np.zeros(end_keys.size, dtype=bool)
    order = np.argsort(first_end[has], kind="stable")
    pairs = np.stack([s[last_start[at[has]]], e[last_end[has]]], axis=1)[order]
    return pairs.astype(np.int64).reshape(-1, 2)


def _rank_step_key(rank: np.ndarray, step: np.ndarray) -> np.ndarray:
    """One int64 per (rank, step) of 32-bit values, ordered as the pairs."""
    return (rank.astype(np.int64) << 32) + (step.astype(np.int64) + (1 << 31))


def _last_of_each(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct keys, sorted, and where each last occurs."""
    u, i = np.unique(keys[::-1], return_index=True)
    return u, keys.size - 1 - i


def measured_step_ms(g: StepGraph) -> np.ndarray:
    """Measured duration (ms) of each (rank, step) of g.step_nodes, in their order."""
    return _durations_ms(g, g.time)


def fidelity(g: StepGraph, rep: Replay | None = None) -> float:
    """Largest relative error of the unedited replay over every (rank, step)."""
    rep = rep or replay(g)
    meas = measured_step_ms(g)
    ok = meas > 0
    errs = np.abs(rep.step_ms[ok] - meas[ok]) / meas[ok]
    return float(errs.max()) if errs.size else 0.0


# ---- edits: each returns new lane weights (and transfers); the graph is never changed ----

def without_parts(g: StepGraph, parts: dict[str, float], w: np.ndarray | None = None) -> np.ndarray:
    """Lane weights `w` (default: the graph's) with a fraction of some parts removed (e.g.
    {"dataloader": 1.0, "idle_launch": 0.5}): max(w - the fractions' sum, 0). Read as the parts
    are held, their non-zero cells: a dense column of each part and their sum were 8 bytes a node
    apiece at the height of the checks that ask for the edit (#20); added in the order a dense sum
    adds them, so the same bits."""
    w = g.lane_parts.total if w is None else w
    got = [g.lane_parts.part(PARTS.index(p)) for p in parts]
    rows = np.unique(np.concatenate([r for r, _ in got])) if got else np.empty(0, dtype=np.int64)
    cut = np.zeros(rows.size)
    for (r, v), frac in zip(got, parts.values()):
        cut[np.searchsorted(rows, r)] += frac * v  # each node once a part
    del got
    out = np.maximum(w, 0.0)  # what max(w - 0, 0) gives where no part has a cell
    out[rows] = np.maximum(w[rows] - cut, 0.0)
    return out


def _anchor_segments(g: StepGraph) -> np.ndarray:
    """For each lane node, the anchor it leads to: the next step bound or collective arrival on its
    rank (every rank has those; resume points do not always exist), as that anchor's seg id."""
    return _anchor_segments_of(g.kind, g.rank, g.seg)


def _anchor_segments_of(kind: np.ndarray, rank: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """_anchor_segments of the graph's kind, rank and seg columns."""
    out = np.full(kind.size, -1, dtype=np.int32)
    # every rank's lane nodes, rank after rank, each in node (time) order: one pass for all ranks
    # (a pass per rank over every node was O(ranks x nodes): 0.3 s a call at 1,024 ranks); node
    # positions in 32 bits, as the graph's (#20: this sets the replay's height at 1,024 ranks)
    lane = np.flatnonzero(kind != COLL_END).astype(np.int32)
    lane = lane[np.argsort(rank[lane], kind="stable")]
    anchor = kind[lane] != RESUME
    del kind
    # next anchor at or after each position: reverse running minimum of anchor positions; one found
    # past the end of a rank's lane belongs to the next rank: none
    pos = np.where(anchor, np.arange(lane.size, dtype=np.int32), np.int32(lane.size))
    nxt = np.minimum.accumulate(pos[::-1])[::-1] if lane.size else pos
    ok = nxt < lane.size
    ok[ok] = rank[lane[nxt[ok]]] == rank[lane[ok]]
    out[lane[ok]] = seg[lane[nxt[ok]]]
    return out


def rank_at_median(g: StepGraph, ranks: set[int], w: np.ndarray | None = None) -> np.ndarray:
    """Lane weights with each listed rank's work brought down to the median rank's: between two
    anchors every rank has (step bounds, collective arrivals), a rank's lane time above the median
    of the other ranks' (all ranks' when none is left) is scaled down to it. Garbage collections
    (part "gc") are not work: left out of the sums and kept as they are (the gc_pause check's)."""
    w = g.lane_parts.total if w is None else w  # copied at the end, once the sums are done (#20)
    # the lane nodes that lead to an anchor, by position: every array below is theirs, not the
    # graph's (arrays the graph's length set the replay's height at 1,024 ranks, #20)
    seg = g.anchor_segments()
    at_h = np.flatnonzero((g.lane_prev >= 0) & (seg >= 0)).astype(np.int32)
    rank = g.rank
    span = int(rank.max()) + 1 if rank.size else 1
    rank = rank[at_h]
    key = seg[at_h].astype(np.int64) * span + rank  # one integer per (anchor, rank)
    del seg
    paused = _cells_at(g.lane_parts.part(GC), at_h, w)
    per = _lane_time(w[at_h] - paused, key, rank, span)
    per_seg, per_rank = np.divmod(per.index.to_numpy(), span)
    listed = np.isin(per_rank, list(ranks))
    del per_rank
    others = ~listed if listed.sum() < listed.size else np.ones(listed.size, dtype=bool)  # all ranks' if none is left
    med = per[others].groupby(per_seg[others]).median()
    # every listed rank at once (a pass over every node per rank was O(ranks x nodes) for a group)
    mine = per[listed]
    if not len(mine):
        return w.copy()
    factor = np.minimum(1.0, med.reindex(per_seg[listed]).to_numpy() / np.maximum(mine.to_numpy(), 1e-12))
    keys = mine.index.to_numpy()
    del per, per_seg, med, mine, others, listed
    # each listed node's factor looked up in the ascending keys (a pandas reindex over every node
    # held hash tables the size of the graph): every one is there (per holds each node's key, and
    # the node's rank is listed); a NaN factor (no other rank reaches that anchor) leaves it be
    sel = np.isin(rank, list(ranks))
    at_h, key, paused = at_h[sel], key[sel], paused[sel]
    at = np.minimum(np.searchsorted(keys, key), keys.size - 1).astype(np.int32)
    del key, keys, sel, rank
    keep = ~np.isnan(factor[at])
    w = w.copy()
    v, kept = at_h[keep], paused[keep]
    w[v] = (w[v] - kept) * factor[at[keep]] + kept
    return w


def _cells_at(part: tuple[np.ndarray, np.ndarray], nodes: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A part's cells at these nodes (0 where it has none), never above the weights w there (an
    edit may have removed some of the lane time already)."""
    rows, values = part
    out = np.zeros(nodes.size)
    if rows.size:
        i = np.minimum(np.searchsorted(rows, nodes), rows.size - 1)
        hit = rows[i] == nodes
        out[hit] = values[i[hit]]
    return np.minimum(out, np.maximum(w[nodes], 0.0))


RANK_BLOCK = 128
"""Ranks summed together in _lane_time."""


def _lane_time(w: np.ndarray, key: np.ndarray, rank: np.ndarray, span: int) -> pd.Series:
    """Lane weights `w` summed by key (one per (anchor, rank)), keys ascending. Summed by pandas
    (compensated, each group's nodes in node order) a block of ranks at a time: a key's nodes all
    lie on one rank, so the sums are those of one groupby over every node, whose tables set the
    replay's height at 1,024 ranks (#20)."""
    if span <= RANK_BLOCK:  # one block: no selection to copy
        return pd.Series(w).groupby(key).sum()
    blocks = ((rank >= lo) & (rank < lo + RANK_BLOCK) for lo in range(0, span, RANK_BLOCK))
    return pd.concat([pd.Series(w[sel]).groupby(key[sel]).sum() for sel in blocks]).sort_index()


def best_transfers(g: StepGraph) -> np.ndarray:
    """Each collective's transfer shrunk to its best over the profiled steps (same rank, group, order)."""
    tr = g.transfer.copy()
    ce = np.flatnonzero(g.kind == COLL_END)
    if not ce.size:
        return tr
    key = g.group_key.iloc[g.group[ce]]
    frame = pd.DataFrame({"rank": g.rank[ce], "pg": key["pg"].to_numpy(), "seq": key["seq"].to_numpy(),
                          "tr": tr[ce]})
    tr[ce] = frame.groupby(["rank", "pg", "seq"])["tr"].transform("min").to_numpy()
    return tr


def large_fp32_reductions(c: pd.DataFrame) -> np.ndarray:
    """Which collectives (rows with name, dtype, bytes) are bandwidth-bound fp32 gradient
    reductions: all-reduces and reduce-scatters of fp32 from SMALL_MESSAGE_BYTES up."""
    return ((c["dtype"] == "fp32").to_numpy() & (c["bytes"].to_numpy(dtype=float) >= SMALL_MESSAGE_BYTES)
            & np.array([collective_kind(str(n)) in ("all_reduce", "reduce_scatter") for n in c["name"]],
                       dtype=bool))


def halved_fp32_reductions(g: StepGraph, tr: np.ndarray) -> np.ndarray:
    """Transfers with each bandwidth-bound fp32 all-reduce or reduce-scatter halved: the same
    gradients in bf16 move half the bytes (latency-bound ones, under SMALL_MESSAGE_BYTES, keep theirs)."""
    halve = large_fp32_reductions(g.group_key)
    out = tr.copy()
    ce = np.flatnonzero(g.kind == COLL_END)
    sel = ce[halve[g.group[ce]]]
    out[sel] *= 0.5
    return out


@dataclass(frozen=True, slots=True)
class CriticalPath:
    """Per step, the chain that set the step's end across ranks, by part and by rank (ms)."""

    by_part_ms: dict[str, float]
    """Mean per step: lane parts (PARTS), "communication" (transfers and stream order)."""
    by_rank_ms: dict[int, float]
    """Mean per step: critical-path time spent on each rank's lane (the ranks that set the pace)."""
    steps: int


def _step_bounds(g: StepGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(node, kind, step) of every STEP_START and STEP_END node, in node order: read a block of the
    graph's kind and step columns at a time (whole, once a step, they were 5 bytes a node at the
    annotation's height: #20)."""
    nodes, kinds, steps = [], [], []
    for lo in range(0, g.n_nodes, REPLAY_BLOCK):
        k = g.stretch("kind", lo, lo + REPLAY_BLOCK)
        at = np.flatnonzero((k == STEP_START) | (k == STEP_END))
        nodes.append(at + lo)
        kinds.append(k[at])
        steps.append(g.stretch("step", lo, lo + REPLAY_BLOCK)[at])
    if not nodes:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int8), np.empty(0, dtype=np.int64)
    return np.concatenate(nodes), np.concatenate(kinds), np.concatenate(steps)


CHAIN_BLOCKS = 8
"""Blocks of the replay's node arrays a critical path holds at most as it follows its chain back
(it goes back in time, so mostly through the last few it read; one further back is read again)."""


def _chain(g: StepGraph, rep: Replay, s: int, bounds: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None):
    """The critical path of step s, from its last rank's end back to its first rank's start, or to
    the previous step's last end where that is later: (node, predecessor, category). Ranks out of
    step (one paused after its last collective while the others began the next step) made
    consecutive steps' chains overlap, and their parts summed past the step: 356 ms of critical
    path a 235 ms step (a full garbage collection inside the window, tests/fixtures/
    cpu_gc_in_window_2rank). bounds: _step_bounds(g), where the caller asks for several steps."""
    node, kind, step = bounds if bounds is not None else _step_bounds(g)
    ends = node[(kind == STEP_END) & (step == s)]
    starts = node[(kind == STEP_START) & (step == s)]
    if not ends.size or not starts.size:
        return None, []
    floor = rep.time[starts].min()
    before = step[(kind == STEP_END) & (step < s)]
    if before.size:
        floor = max(floor, float(rep.time[node[(kind == STEP_END) & (step == before.max())]].max()))
    v = int(ends[np.argmax(rep.time[ends])])
    out = []
    while v >= 0 and rep.time[v] > floor:
        p = int(rep.via[v])
        if p < 0:
            break
        out.append((v, p, int(rep.via_cat[v])))
        v = p
    return floor, out


def critical_segments(g: StepGraph | GraphOnDisk, rep: Replay | ReplayOnDisk, s: int) -> list[tuple[float, float, int, str]]:
    """Step s's critical path as drawn over the timeline: (start us, end us, rank, what) per edge,
    in time order; `what` is a lane's largest part or "communication". On disk, the replay's and
    the graph's nodes are read a block at a time as the chain reaches them, the lane parts at its
    nodes only: the whole replay and lane parts read back for a chain of a few dozen nodes were
    1.2 MB above the extras' base at 1,024 ranks (#20)."""
    rep = rep.blocks(keep=CHAIN_BLOCKS)
    floor, chain = _chain(g, rep, s)
    if not chain:
        return []
    nodes = np.array([v for v, _, _ in chain], dtype=np.int64)
    lane = np.array([cat == LANE for _, _, cat in chain])
    rank = g.column_at("rank", nodes)
    parts = np.zeros((nodes.size, len(PARTS)))
    parts[lane] = g.lane_parts.rows_of(nodes[lane])
    out = []
    for j, (v, p, _) in enumerate(chain):
        a, b = max(rep.time[p], floor), rep.time[v]
        if b <= a:
            continue
        what = PARTS[int(np.argmax(parts[j]))] if lane[j] and parts[j].sum() > 0 else \
            "communication" if not lane[j] else "compute"
        out.append((float(a), float(b), int(rank[j]), what))
    return out[::-1]


def critical_path(g: StepGraph, rep: Replay | ReplayOnDisk) -> CriticalPath:
    """Each step's chain followed back through the replay's nodes a few blocks at a time, the lane
    parts and ranks read at the chain's nodes only: the replay, the lane parts and the graph's
    ranks read whole were ~35 bytes a node, the annotation's height at 1,024 ranks (#20)."""
    by_part = np.zeros(len(PARTS) + 1)
    by_rank: dict[int, float] = {}
    bounds = _step_bounds(g)
    steps = sorted(set(bounds[2][bounds[1] == STEP_END].tolist()))
    done = 0
    for s in steps:
        r = rep.blocks(keep=CHAIN_BLOCKS)  # a fresh reader a step: none of the last step's blocks held
        floor, chain = _chain(g, r, s, bounds)
        if floor is None:
            continue
        nodes = np.array([v for v, _, _ in chain], dtype=np.int64)
        lane = np.array([cat == LANE for _, _, cat in chain], dtype=bool)
        parts_of = g.lane_parts.rows_of(nodes[lane])
        rank_of = g.column_at("rank", nodes[lane]).tolist()
        j = 0
        for v, p, cat in chain:
            dt = r.time[v] - max(r.time[p], floor)
            if cat == LANE:
                parts = parts_of[j]
                tot = parts.sum()
                if tot > 0:
                    by_part[:len(PARTS)] += parts / tot * dt
                by_rank[rank_of[j]] = by_rank.get(rank_of[j], 0.0) + dt
                j += 1
            else:
                by_part[len(PARTS)] += dt
        done += 1
    n = max(done, 1)
    names = PARTS + ("communication",)
    return CriticalPath(by_part_ms={k: round(float(x) / n / 1000, 3) for k, x in zip(names, by_part) if x > 0},
                        by_rank_ms={r: round(float(x) / n / 1000, 3) for r, x in sorted(by_rank.items())}, steps=done)
