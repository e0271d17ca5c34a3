"""The step graph (diagnose/step/graph.py): replay fidelity on every shared trace, what-ifs by
replay on hand-built runs whose answer is known by construction, and on the shared traces."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pytest

from diagnose.analyzers import reduce_rank
from diagnose.context import build_context
from diagnose.ingest.assemble import load_run
from diagnose.step import graph as sg
from tests.conftest import SHARED, shared_run

STEP_US, WORK_US, TRANSFER_US = 10_000.0, 3_000.0, 500.0
DL_NAME = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"


def _x(cat, name, ts, dur, tid):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def write_run(directory, steps=6, extra_us=None, dl_us=None):
    """Two gloo ranks. Each step: an optional DataLoader wait, WORK_US of compute plus the rank's
    extra, the all-reduce (everyone leaves TRANSFER_US after the last arrival), then the rank waits
    for it and finishes the step with 1 ms of optimizer work. Steps follow each other."""
    extra_us, dl_us = extra_us or {}, dl_us or {}
    t0 = 1_000_000.0
    evs = {0: [], 1: []}
    for s in range(steps):
        arrive = {r: t0 + dl_us.get(r, 0.0) + WORK_US + extra_us.get(r, 0.0) for r in (0, 1)}
        leave = max(arrive.values()) + TRANSFER_US
        end = leave + 1_000.0
        for r in (0, 1):
            e = evs[r]
            e.append(_x("user_annotation", f"ProfilerStep#{s}", t0, end - t0, 1))
            if dl_us.get(r):
                e.append(_x("user_annotation", DL_NAME, t0, dl_us[r], 1))
            e.append(_x("cpu_op", "aten::mm", t0 + dl_us.get(r, 0.0), arrive[r] - t0 - dl_us.get(r, 0.0), 1))
            e.append(_x("cpu_op", "c10d::allreduce_", arrive[r], 5.0, 1))
            e.append(_x("user_annotation", "gloo:all_reduce", arrive[r] + 2, leave - arrive[r] - 2, 3))
            e.append(_x("cpu_op", "aten::add_", leave, 1_000.0, 1))
        t0 = end
    for r in (0, 1):
        doc = {"schemaVersion": 1, "distributedInfo": {"backend": "gloo", "rank": r, "world_size": 2},
               "host_name": "node", "traceEvents": evs[r]}
        (directory / f"rank{r}.pt.trace.json").write_bytes(orjson.dumps(doc))
    return directory


def graph_of(path):
    return sg.build_graph(load_run([path], reduce=reduce_rank))


def saved(g, w=None, tr=None):
    return sg.replay(g).mean_step_ms - sg.replay(g, w, tr).mean_step_ms


def test_unedited_replay_reproduces_a_hand_built_run_exactly(tmp_path):
    g = graph_of(write_run(tmp_path, extra_us={1: 2_000.0}, dl_us={0: 500.0}))
    assert sg.fidelity(g) < 1e-9
    rep = sg.replay(g)
    assert rep.mean_step_ms == pytest.approx((WORK_US + 2_000 + TRANSFER_US + 1_000) / 1000, abs=1e-6)


def test_straggler_edit_gives_back_its_lateness(tmp_path):
    g = graph_of(write_run(tmp_path, extra_us={1: 2_000.0}))
    assert saved(g, sg.rank_at_median(g, {1})) == pytest.approx(2.0, abs=1e-3)
    # the punctual rank brought to the median changes nothing
    assert saved(g, sg.rank_at_median(g, {0})) == pytest.approx(0.0, abs=1e-3)


def test_freed_wait_that_exposes_another_saves_nothing(tmp_path):
    # rank 0 waits 1 ms in its DataLoader, but rank 1 is 3 ms late anyway: removing the DataLoader
    # wait only lengthens rank 0's wait for rank 1
    g = graph_of(write_run(tmp_path, extra_us={1: 3_000.0}, dl_us={0: 1_000.0}))
    dl = sg.without_parts(g, {"dataloader": 1.0})
    assert saved(g, dl) == pytest.approx(0.0, abs=1e-3)


def test_two_causes_on_one_rank_combine_to_less_than_their_sum(tmp_path):
    # rank 1 waits 2 ms in its DataLoader and computes 3 ms longer: each fix alone, then both
    g = graph_of(write_run(tmp_path, extra_us={1: 3_000.0}, dl_us={1: 2_000.0}))
    dl = sg.without_parts(g, {"dataloader": 1.0})
    one = saved(g, dl)
    two = saved(g, sg.rank_at_median(g, {1}))
    both = saved(g, sg.rank_at_median(g, {1}, dl))
    assert one == pytest.approx(2.0, abs=1e-3)
    assert two == pytest.approx(5.0, abs=1e-3)  # its whole excess over rank 0, DataLoader included
    assert both == pytest.approx(5.0, abs=1e-3) and both < one + two


def test_best_transfer_edit(tmp_path):
    g = graph_of(write_run(tmp_path))
    assert saved(g, None, sg.best_transfers(g)) == pytest.approx(0.0, abs=1e-3)  # every step alike


def test_critical_path_runs_through_the_late_rank(tmp_path):
    g = graph_of(write_run(tmp_path, extra_us={1: 2_000.0}))
    cp = sg.critical_path(g, sg.replay(g))
    assert cp.steps == 6
    # before the collective the path is on rank 1 (it arrived last), after it on the rank that ends last
    assert cp.by_rank_ms.get(1, 0.0) >= (WORK_US + 2_000) / 1000 - 1e-3
    assert cp.by_part_ms["communication"] == pytest.approx(TRANSFER_US / 1000, abs=1e-3)


def _sets_with_steps():
    return sorted(p.parent.relative_to(SHARED).as_posix() for p in SHARED.glob("**/*.json*")
                  if "corpus" not in p.parts)


@pytest.mark.parametrize("name", sorted(set(_sets_with_steps())) if SHARED.exists() else [])
def test_unedited_replay_within_5_percent_on_every_shared_trace(name):
    try:
        run = shared_run(name)
    except Exception as exc:  # sets without complete steps are not analysed at all
        pytest.skip(f"{name}: {exc}")
    g = sg.build_graph(run)
    assert sg.fidelity(g) <= 0.05


def test_resnet_dataloader_what_if_on_one_rank_is_its_whole_dataloader_wait():
    """One rank: nothing else can be exposed, so the replay gives back the whole DataLoader wait
    (31.4 ms/step). The measured fix nw0 -> nw4 gave back 26.5: the four workers cost the step
    2.7 ms of compute and 2.2 ms of idle elsewhere, which no replay of nw0 can see (the issue's
    15% target is not met by this figure: +18.6%)."""
    run = shared_run("kineto_resnet50_dataloader_v100/nw0")
    ctx = build_context(run)
    g = sg.build_graph(run)
    predicted = saved(g, sg.without_parts(g, {"dataloader": 1.0}))
    assert predicted == pytest.approx(ctx.table["dataloader_ms"].mean(), abs=1e-3)


def test_dlrm_critical_path_runs_through_the_late_rank():
    """param_dlrm_8rank_v100: rank 7 enters the first all_to_all last (its NCCL kernel lasts
    10 us where rank 1's lasts 7.6 ms): the critical path spends most of its lane time there."""
    g = sg.build_graph(shared_run("param_dlrm_8rank_v100"))
    cp = sg.critical_path(g, sg.replay(g))
    assert max(cp.by_rank_ms, key=cp.by_rank_ms.get) == 7


def test_a_graph_that_cannot_be_built_costs_only_the_replay(tmp_path, monkeypatch):
    import diagnose.context as context
    from diagnose.pipeline import diagnose_paths

    def broken(run, **kw):
        raise ValueError("boom")

    monkeypatch.setattr(context, "build_graph", broken)
    d = diagnose_paths([write_run(tmp_path, extra_us={1: 2_000.0})])
    assert "straggler" in [f.id for f in d.findings]
    assert "replay" not in d.extras
    assert any("step graph could not be built (ValueError: boom)" in w for w in d.warnings)


def test_findings_carry_the_replayed_figure_and_keep_their_own(tmp_path):
    """Rank 0 waits 1.5 ms in its DataLoader, rank 1 computes 3 ms longer: rank 0's DataLoader
    wait hides under its wait for rank 1, so removing it alone gives back nothing (measured, not
    flagged); bringing rank 1 to rank 0's 4.5 ms of work gives back 1.5 ms."""
    from diagnose.pipeline import diagnose_paths

    d = diagnose_paths([write_run(tmp_path, extra_us={1: 3_000.0}, dl_us={0: 1_500.0})])
    f = {x.id: x for x in d.findings}
    st = f["straggler"]
    assert st.recoverable_ms == pytest.approx(1.5, abs=0.01) and st.ranks == (1,)
    assert st.metrics["own_estimate_ms"] == pytest.approx(1.5, abs=0.01)
    assert "Replayed on the step graph" in st.method and "own estimate" in st.method
    # the DataLoader wait is measured (its own figure stays the check's), but costs nothing: not flagged
    dl = next(c for c in d.checks if c.id == "dataloader_starvation")
    assert dl.status == "passed" and dl.measured_ms == pytest.approx(1.5, abs=0.01)
    assert dl.reason.startswith("removing it gives back 0.00 ms per step") and "other waits take its place" in dl.reason
    rep = d.extras["replay"]
    assert rep["replaces_estimates"] and rep["by_cause_ms"]["dataloader_starvation"] == pytest.approx(0.0, abs=1e-3)
    assert rep["by_cause_ms"]["straggler"] == pytest.approx(1.5, abs=0.01)
    # every cause removed, flagged or not: rank 1 then matches rank 0's 3 ms of work (both together
    # give back 3 ms, more than the sum of the single ones), and the 0.5 ms transfer hidden
    assert rep["clean_step_ms"] == pytest.approx(7.5 - 3.0 - 0.5, abs=0.01)
    assert rep["by_cause_ms"]["exposed_communication"] == pytest.approx(0.5, abs=0.01)
    # CPU traces have no device idle classes: the per-op launch overhead is not modelled and stands
    lo = f["launch_overhead"]
    assert "own_estimate_ms" not in lo.metrics and "replay_recoverable_ms" not in lo.metrics
    # a count of ops reads as a whole number (it was "over 382.0 ops")
    import re

    reason = next(c.reason for c in d.checks if c.id == "launch_overhead")
    assert re.search(r" over \d+ ops: ", reason), reason


def test_an_unfaithful_replay_leaves_the_own_estimates(tmp_path, monkeypatch):
    import diagnose.whatif as whatif
    from diagnose.pipeline import diagnose_paths

    monkeypatch.setattr(whatif, "FIDELITY_OK", -1.0)  # no replay is faithful enough
    d = diagnose_paths([write_run(tmp_path, extra_us={1: 3_000.0}, dl_us={0: 1_500.0})])
    # flagged by its own measure, which it keeps; the replay's figure is only a metric
    dl = next(x for x in d.findings if x.id == "dataloader_starvation")
    assert dl.recoverable_ms == pytest.approx(1.5, abs=0.01) and dl.metrics["replay_recoverable_ms"] == 0.0
    assert "own_estimate_ms" not in dl.metrics and not d.extras["replay"]["replaces_estimates"]
    assert any("reproduces the measured steps only within" in w for w in d.warnings)


FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_two_causes_on_one_rank_combined_is_less_than_the_sum():
    """A recorded 2-rank job (tests/fixtures/cpu_straggler_dataloader_2rank): rank 1 sleeps 100 ms
    before each backward and waits about 100 ms per step for its own slow DataLoader. Removing the
    DataLoader alone leaves rank 1 late by its sleep; bringing rank 1 to rank 0 removes both (its
    DataLoader wait is part of its work between collectives); both together give back what the
    straggler's edit alone does, less than the sum of the two."""
    from diagnose.pipeline import diagnose_paths

    d = diagnose_paths([FIXTURES / "cpu_straggler_dataloader_2rank"])
    f = {x.id: x for x in d.findings}
    st, dl = f["straggler"], f["dataloader_starvation"]
    assert st.ranks == (1,) and 1 in dl.ranks
    comb = d.extras["replay"]["combined_what_if_ms"]
    assert comb < st.recoverable_ms + dl.recoverable_ms - 50  # far less: the DataLoader's ~100 ms counted once
    assert comb == pytest.approx(st.recoverable_ms, rel=0.05)
    # the injected sizes: 256 samples x 0.4 ms of sleep (sleeps overshoot, never undershoot), and
    # the 100 ms sleep on top of that for the straggler (less whatever contention it relieves)
    assert dl.recoverable_ms >= 0.95 * 256 * 0.4 and st.recoverable_ms >= dl.recoverable_ms + 80


def test_step_nodes_pair_each_rank_steps_start_and_end_as_a_lookup_by_rank_and_step_would():
    """StepGraph.step_nodes by sorting: the same pairs, in the same order, as a dict by (rank, step)
    (the last start and end of a pair that repeats, at its first end's place; a step missing
    either left out), on random node lists with repeats and gaps."""
    def by_dict(rank, step, kind):
        starts = {(int(rank[v]), int(step[v])): int(v) for v in np.flatnonzero(kind == sg.STEP_START)}
        ends: dict = {}
        for v in np.flatnonzero(kind == sg.STEP_END):
            if (int(rank[v]), int(step[v])) in starts:
                ends[(int(rank[v]), int(step[v]))] = int(v)
        return np.array([(starts[k], v) for k, v in ends.items()], dtype=np.int64).reshape(-1, 2)

    rng = np.random.default_rng(7)
    for _ in range(500):
        n = int(rng.integers(0, 60))
        rank = rng.integers(0, 4, n).astype(np.int32)
        step = rng.integers(-3, 5, n).astype(np.int32)
        kind = rng.choice([sg.STEP_START, sg.STEP_END, sg.ARRIVAL], n).astype(np.int8)
        assert np.array_equal(sg.step_nodes(rank, step, kind), by_dict(rank, step, kind))


def test_lane_time_summed_a_block_of_ranks_at_a_time_is_one_groupby_to_the_bit():
    """The straggler edit sums each (anchor, rank)'s lane time a block of ranks at a time: the
    same sums, bit for bit, and the same keys in the same order as one groupby over every node."""
    import pandas as pd

    rng = np.random.default_rng(11)
    for span in (3, sg.RANK_BLOCK + 1, 3 * sg.RANK_BLOCK + 7):
        n = 40 * span
        rank = rng.integers(0, span, n).astype(np.int32)
        key = rng.integers(0, 9, n).astype(np.int64) * span + rank
        w = rng.lognormal(3.0, 2.0, n) * rng.choice([1.0, 1e-9, 1e9], n)  # magnitudes where summation order shows
        one = pd.Series(w).groupby(key).sum()
        blocks = sg._lane_time(w, key, rank, span)
        assert np.array_equal(blocks.index.to_numpy(), one.index.to_numpy())
        assert np.array_equal(blocks.to_numpy(), one.to_numpy())


def test_straggler_edit_scales_each_listed_rank_as_a_lookup_by_anchor_and_rank_would():
    """rank_at_median against the lookup it replaces (a pandas reindex of each node's (anchor,
    rank) factor, NaN and missing as 1): the same weights to the bit, for several rank sets."""
    import pandas as pd

    g = sg.build_graph(shared_run("param_dlrm_8rank_v100"))
    seg = sg._anchor_segments(g)
    has = (g.lane_prev >= 0) & (seg >= 0)
    span = int(g.rank.max()) + 1
    key = seg.astype(np.int64) * span + g.rank
    w0 = g.lane_parts.total * np.linspace(0.5, 2.0, g.time.size)
    per = pd.Series(w0[has]).groupby(key[has]).sum()
    for ranks in ({1}, {0, 5}, set(range(8))):
        per_seg, per_rank = np.divmod(per.index.to_numpy(), span)
        listed = np.isin(per_rank, list(ranks))
        others = ~listed if listed.sum() < listed.size else np.ones(listed.size, dtype=bool)
        med = per[others].groupby(per_seg[others]).median()
        mine = per[listed]
        f = pd.Series(np.minimum(1.0, med.reindex(per_seg[listed]).to_numpy() / np.maximum(mine.to_numpy(), 1e-12)),
                      index=mine.index)
        want = w0.copy()
        sel = has & np.isin(g.rank, list(ranks))
        want[sel] *= f.reindex(key[sel]).fillna(1.0).to_numpy()
        got = sg.rank_at_median(g, ranks, w0)
        assert np.array_equal(got, want) and not np.array_equal(got, w0)


@pytest.mark.parametrize("name", ["param_dlrm_8rank_v100", "hta_nccl_data_rank0of2_a100"])
def test_the_graph_on_disk_reads_and_replays_as_the_graph_in_memory(name):
    """The step model holds its graph on disk (GraphOnDisk, #20): every column it reads back is the
    built graph's (values and dtype), read-only as the graph's own; the unedited replay, each edit's
    replay and the critical path are the same to the bit."""
    from diagnose.ingest.spill import Spill
    from diagnose.whatif import EDITS, StepModel, step_model

    g = sg.build_graph(shared_run(name))
    disk = sg.GraphOnDisk(g, Spill())
    for k in sg.NODE_COLUMNS:
        a, b = getattr(g, k), getattr(disk, k)
        assert a.dtype == b.dtype and np.array_equal(a, b), k
        assert not b.flags.writeable, k
        assert getattr(disk, k) is not b  # read back at each ask: nothing of it held
    assert np.array_equal(disk.lane_parts.total, g.lane_parts.total)
    for k in range(len(sg.PARTS)):
        assert np.array_equal(disk.lane_parts.column(k), g.lane_parts.column(k))
    assert disk.ranks == g.ranks
    # each lane node's anchor, found once where the graph is put on disk: the straggler edit's
    seg = disk.anchor_segments()
    assert np.array_equal(seg, sg._anchor_segments(g)) and np.array_equal(seg, g.anchor_segments())
    assert (seg >= 0).any() and not seg.flags.writeable
    model = step_model(g)
    assert isinstance(model.graph, sg.GraphOnDisk)
    mem = StepModel(graph=g, base=sg.replay(g), fidelity=model.fidelity, steps=model.steps)  # in memory
    assert isinstance(model.base, sg.ReplayOnDisk) and model.base.mean_step_ms == mem.base.mean_step_ms
    for a, b in ((sg.replay(g), sg.replay(disk)), (mem.base, model.base.loaded())):
        assert np.array_equal(a.time, b.time) and np.array_equal(a.via, b.via)
        assert np.array_equal(a.via_cat, b.via_cat) and np.array_equal(a.step_ms, b.step_ms)
    for cause in list(EDITS) + ["best_transfer"]:
        assert mem.saving(cause) == model.saving(cause), cause
    every = {c: (tuple(g.ranks[:1]) if c == "straggler" else ()) for c in EDITS}  # chained edits
    assert mem.without(every) == model.without(every) < model.base.mean_step_ms
    # the model reads the graph's transfers only for the edits that start from them
    # (whatif.READS_TRANSFERS): any other gives the same whether it is handed them or None
    from diagnose.whatif import EXTRA_EDITS, READS_TRANSFERS
    tr = g.transfer.copy()
    for cause, fn in {**EDITS, **EXTRA_EDITS}.items():
        if cause in READS_TRANSFERS:
            continue
        given = fn(g, g.lane_parts.total, tr, tuple(g.ranks[:1]))[1]
        bare = fn(g, g.lane_parts.total, None, tuple(g.ranks[:1]))[1]
        assert (given is tr and bare is None) or np.array_equal(given, bare), cause
    assert sg.critical_path(g, mem.base) == sg.critical_path(disk, model.base)
    s = int(g.step[g.kind == sg.STEP_END][0])
    assert sg.critical_segments(g, mem.base, s) == sg.critical_segments(disk, model.base, s)


@pytest.mark.parametrize("where", ["param_dlrm_8rank_v100", "cpu_lightning_straggler_2rank", "gpu_h200/tiny-kernels"])
def test_a_what_ifs_replay_and_edits_are_the_dense_ones_to_the_bit(where):
    """A what-if's replay keeps no path (replay(path=False): via None), its weights and transfers
    read a block at a time, never copied whole; the parts' edits (without_parts) read the parts'
    non-zero cells, not a dense column each (#20: ~50 bytes a node at the height of every check that asks a
    what-if). The times are the replay's with its path, given weights and transfers or the
    graph's; an after-arrival resume (CPU lanes) reads its transfer where it lies; the edited
    weights are max(w - the sum of each part's fraction, 0) over dense columns, bit for bit."""
    from diagnose.ingest.spill import Spill
    from diagnose.whatif import EDITS
    from tests.conftest import fixture_run

    run = shared_run(where) if (SHARED / where).is_dir() else fixture_run(Path(__file__).parent / "fixtures" / where)
    g = sg.build_graph(run)
    if where.startswith("cpu_"):
        assert g.after_arrival.any()  # the resume that reads a transfer away from its node
    disk = sg.GraphOnDisk(g, Spill())
    tr = g.transfer * 0.5
    tr.setflags(write=False)
    for graph in (g, disk):
        for w, t in ((None, None), (g.lane_parts.total * 0.7, None), (None, tr)):
            whole, bare = sg.replay(graph, w, t), sg.replay(graph, w, t, path=False)
            assert bare.via is None and bare.via_cat is None
            assert np.array_equal(bare.time, whole.time) and np.array_equal(bare.step_ms, whole.step_ms)
    touched = 0
    for fracs in ({"dataloader": 1.0}, {"idle_input": 1.0, "input_copy": 1.0}, {"idle_launch": 0.5},
                  {"idle_sync": 1.0}, {"comm_wait": 1.0}, {"dataloader": 0.3, "idle_launch": 0.5, "compute": 1.0}):
        for w in (g.lane_parts.total, g.lane_parts.total * 1.3 - 5.0):
            dense = np.maximum(w - sum(f * g.lane_parts.column(sg.PARTS.index(p)) for p, f in fracs.items()), 0.0)
            for graph in (g, disk):
                got = sg.without_parts(graph, fracs, w)
                assert got.dtype == dense.dtype and np.array_equal(got.view(np.int64), dense.view(np.int64)), fracs
        touched += not np.array_equal(dense, np.maximum(w, 0.0))
    assert touched >= 2  # some of these parts are on this run's lanes
    hidden = EDITS["exposed_communication"](disk, g.lane_parts.total, None, ())[1]
    assert np.array_equal(hidden, np.zeros(g.n_nodes))


@pytest.mark.parametrize("name", ["param_dlrm_8rank_v100", "hta_nccl_data_rank0of2_a100"])
def test_a_graph_built_into_a_spill_is_the_graph_built_in_memory(name):
    """build_graph(run, spill=...) puts each node column in the spill as the build finishes with
    it (#20: the graph never whole in memory): every column, its dtype, the lane parts, the
    anchors, the step pairs and the collectives' keys are the in-memory build's, and the step
    model of either replays the same to the bit."""
    from diagnose.ingest.spill import Spill, SpilledArray
    from diagnose.whatif import EDITS, step_model

    run = shared_run(name)
    g = sg.build_graph(run)
    spill = Spill()
    disk = sg.build_graph(run, spill=spill)
    assert isinstance(g, sg.StepGraph) and isinstance(disk, sg.GraphOnDisk)
    assert all(isinstance(h, SpilledArray) for h in disk._cols.values())  # nothing held in memory
    for k in sg.NODE_COLUMNS:
        a, b = getattr(g, k), getattr(disk, k)
        assert a.dtype == b.dtype and np.array_equal(a, b), k
    for k in range(len(sg.PARTS)):
        assert np.array_equal(disk.lane_parts.column(k), g.lane_parts.column(k))
    assert np.array_equal(disk.lane_parts.total, g.lane_parts.total)
    assert np.array_equal(disk.anchor_segments(), sg._anchor_segments(g))
    assert np.array_equal(disk.step_nodes, g.step_nodes) and disk.step_nodes.dtype == g.step_nodes.dtype
    assert disk.n_nodes == g.n_nodes and disk.n_groups == g.n_groups and disk.group_key.equals(g.group_key)
    a, b = step_model(g), step_model(disk, spill)
    assert a.base.mean_step_ms == b.base.mean_step_ms and a.fidelity == b.fidelity and a.steps == b.steps
    for cause in list(EDITS) + ["best_transfer"]:
        assert a.saving(cause) == b.saving(cause), cause
    # no temporary file to be had: the columns stay in memory, the model the same
    broken = Spill()
    broken._broken = True
    kept = sg.build_graph(run, spill=broken)
    assert not any(isinstance(h, SpilledArray) for h in kept._cols.values())
    c = step_model(kept, broken)
    assert c.base.mean_step_ms == a.base.mean_step_ms and c.saving("straggler") == a.saving("straggler")
    s = int(g.step[g.kind == sg.STEP_END][0])
    assert sg.critical_segments(kept, c.base, s) == sg.critical_segments(g, a.base, s) != []


@pytest.mark.parametrize("block", [1, 7, 10**9])
def test_a_replay_read_a_block_at_a_time_is_the_whole_graphs(monkeypatch, block):
    """replay reads the graph's columns REPLAY_BLOCK nodes at a time (#20): at any block size, from
    disk or from memory, the schedule is the one of the default block to the bit."""
    from diagnose.ingest.spill import Spill

    g = sg.build_graph(shared_run("param_dlrm_8rank_v100"))
    whole = sg.replay(g)
    disk = sg.GraphOnDisk(g, Spill())
    assert g.n_nodes == disk.n_nodes > 7 and np.array_equal(disk.stretch("time", 5, 12), g.time[5:12])
    monkeypatch.setattr(sg, "REPLAY_BLOCK", block)
    w = g.lane_parts.total * 0.5  # an edit's weights too
    for graph in (g, disk):
        r = sg.replay(graph)
        assert np.array_equal(r.time, whole.time) and np.array_equal(r.via, whole.via)
        assert np.array_equal(r.via_cat, whole.via_cat) and np.array_equal(r.step_ms, whole.step_ms)
        assert np.array_equal(sg.replay(graph, w).time, sg.replay(g, w).time)
