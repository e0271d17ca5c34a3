"""The reader, unit by unit: byte source, JSON stream, columns, one file, one run."""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import orjson
import pandas as pd
import pytest

from diagnose.errors import DiagnoseError
from diagnose.ingest import jsonsafe
from diagnose.ingest.columns import EventTable
from diagnose.ingest.load import load_trace
from diagnose.ingest.source import ReadState, iter_blocks
from diagnose.ingest.stream import CHUNK, parse_stream
from diagnose.analyzers import CHECKLIST, reduce_rank
from diagnose.step.idle import EVIDENCE_GAP_COLUMNS
from diagnose.ingest.assemble import load_one, load_files, load_run
from tests.conftest import SHARED, kept_once, names_once
from diagnose.ingest.spill import Spilled, SpilledMap, unspilled
from diagnose.output import diagnosis_dict
from diagnose.pipeline import diagnose_paths


def ev(name: str = "aten::mm", ts: float = 10.0, dur: float = 5.0, cat: str = "cpu_op", **kw) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1, **kw}


def steps_trace(n: int = 3, rank: int = 0, world: int = 1, t0: float = 1000.0, extra: list | None = None) -> dict:
    evs = []
    for s in range(n):
        t = t0 + s * 100
        evs += [ev(f"ProfilerStep#{s}", t, 100.0, "user_annotation"), ev("aten::mm", t + 10, 50.0)]
    return {"schemaVersion": 1, "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": world},
            "traceEvents": evs + (extra or []), "traceName": "x"}


def kineto(doc: dict) -> bytes:
    head = {k: v for k, v in doc.items() if k not in ("traceEvents", "traceName")}
    body = b",\n".join(b"  " + orjson.dumps(e) for e in doc["traceEvents"])
    return (orjson.dumps(head)[:-1] + b', "traceEvents": [\n' + body + b'\n  ], "traceName": "x"}\n')


def write(tmp: Path, name: str, data: bytes | dict) -> Path:
    p = tmp / name
    p.write_bytes(kineto(data) if isinstance(data, dict) else data)
    return p


def stream(data: bytes, block: int = 7) -> tuple[list, object]:
    got: list = []
    res = parse_stream(iter(data[i: i + block] for i in range(0, len(data), block)), got.extend, Path("t.json"))
    return got, res


# -- source --------------------------------------------------------------------------------

def test_gzip_is_recognised_by_magic_and_members_are_concatenated(tmp_path):
    p = write(tmp_path, "rank0.json", gzip.compress(b"[1,") + gzip.compress(b"2]"))
    assert b"".join(iter_blocks(ReadState(p, 1 << 20))) == b"[1,2]"


def test_truncated_gzip_yields_what_it_can_and_says_so(tmp_path):
    data = b"x" * 100_000 + bytes(range(256)) * 400
    z = gzip.compress(data)
    p = write(tmp_path, "a.json.gz", z[: len(z) // 2])
    st = ReadState(p, 1 << 30)
    out = b"".join(iter_blocks(st))
    assert data.startswith(out) and 0 < len(out) < len(data)
    assert st.cut and "ends early" in st.cut


def test_decompression_is_bounded(tmp_path):
    p = write(tmp_path, "a.json.gz", gzip.compress(b" " * (8 << 20)))
    with pytest.raises(DiagnoseError, match="expands beyond the 1.0 MiB limit"):
        b"".join(iter_blocks(ReadState(p, 1 << 20)))


def test_plain_file_size_is_bounded(tmp_path):
    p = write(tmp_path, "a.json", b" " * 5000)
    with pytest.raises(DiagnoseError, match="larger than the 4.0 KiB limit"):
        b"".join(iter_blocks(ReadState(p, 4096)))


def test_garbage_gzip_is_an_error(tmp_path):
    p = write(tmp_path, "a.json.gz", b"\x1f\x8b\x08garbage")
    with pytest.raises(DiagnoseError, match="not a valid gzip file"):
        b"".join(iter_blocks(ReadState(p, 1 << 20)))


# -- stream --------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [1, 3, 64, 1 << 20])
def test_stream_layouts_in_any_block_size(block):
    evs = [ev(f"e{i}") for i in range(50)]
    for data in (kineto({"a": 1, "traceEvents": evs}), orjson.dumps(evs), orjson.dumps({"traceEvents": evs, "z": [1]}),
                 b"\xef\xbb\xbf" + orjson.dumps(evs)):
        got, res = stream(data, block)
        assert got == evs and not res.salvaged


def test_metadata_before_and_after_the_events():
    data = kineto({"distributedInfo": {"rank": 3}, "deviceProperties": [{"name": "A"}, {"name": "B"}],
                   "traceEvents": [ev()]})
    _, res = stream(data)
    assert res.meta == {"distributedInfo": {"rank": 3}, "deviceProperties": [{"name": "A"}, {"name": "B"}],
                        "traceName": "x"}


def test_false_boundaries_inside_strings_and_args_do_not_split_events():
    tricky = [ev('a "}, {" b'), ev("x", args={"l": [{"k": 1}, {"k": 2}], "s": "}, {\"ph\": \"X\"}"}), ev("last")]
    filler = [ev(f"f{i}") for i in range(CHUNK // 60)]  # enough to cross a chunk boundary
    evs = filler + tricky + filler
    got, res = stream(kineto({"traceEvents": evs}), 1 << 16)
    assert got == evs and res.bad == 0


def test_truncated_stream_keeps_every_complete_event():
    evs = [ev(f"e{i}") for i in range(1000)]
    data = kineto({"traceEvents": evs})
    for cut in (len(data) // 3, len(data) - 40, data.index(b'"e500"') + 2):
        got, res = stream(data[:cut], 4096)
        assert res.salvaged
        assert got == evs[: len(got)] and len(got) >= 1
        assert data[:cut].count(b"},") - 1 <= len(got)


def test_cut_in_the_metadata_after_the_events_keeps_all_events():
    evs = [ev(f"e{i}") for i in range(10)]
    data = kineto({"traceEvents": evs})
    got, res = stream(data[: data.index(b'"traceName"') + 5])
    assert got == evs and not res.salvaged
    assert any("metadata after the events" in n for n in res.notes)


def test_corrupt_event_in_the_middle_is_skipped_and_counted():
    evs = [ev(f"e{i}") for i in range(20)]
    data = kineto({"traceEvents": evs}).replace(b'"e7"', b'"e7" oops', 1)
    got, res = stream(data)
    assert [e["name"] for e in got] == [f"e{i}" for i in range(20) if i != 7]
    assert res.bad == 1 and not res.salvaged


def test_nan_and_invalid_utf8_are_read_leniently():
    data = kineto({"traceEvents": [ev("a"), ev("b")]}).replace(b'"a"', b'"a\xff"')
    data = data.replace(b'"dur":5.0', b'"dur":NaN', 1)
    got, res = stream(data)
    assert len(got) == 2 and res.invalid_utf8 and res.lenient


@pytest.mark.parametrize("doc,msg", [
    (b"", "empty file"), (b"   \n ", "empty file"), (b"hello", "not JSON"), (b'"a string"', "not a trace"),
    (b'{"a": 1}', "not a trace"), (b"{'single': 1}", "not valid JSON"), (b"[" * 100_000, "nested deeper"),
    (b'{"traceEvents": [' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"]}", "nested deeper"),
])
def test_stream_errors(doc, msg):
    with pytest.raises(DiagnoseError, match=msg):
        stream(doc, 1 << 20)


def test_max_depth_honours_strings_and_escapes():
    assert jsonsafe.max_depth(b'[[["]]]]]\\"[[[["]]]') == 3
    assert jsonsafe.max_depth(b'{"a\\\\": [1, {"b": "\\\\"}]}') == 3
    assert jsonsafe.max_depth(b"") == 0


def test_clean_str_replaces_lone_surrogates_only():
    assert jsonsafe.clean_str("ok \U0001F600") == "ok \U0001F600"
    assert jsonsafe.clean_str("bad \udcff x") == "bad \ufffd x"


# -- columns -------------------------------------------------------------------------------

def test_table_interns_and_validates():
    t = EventTable()
    t.add([ev("a", 1.0, 2.0), ev("a", 3, 4), ev("b", "5", 1.0), ev("c", 1.0, -1.0), ev("d", True, 1.0),
           ev("e", 10**400 if False else 1e308 * 10, 1.0), 42, ev("k", 1.0, 1.0, cat="kernel", tid=[1]),
           ev("ncclKernel_x", 1.0, 1.0, cat="kernel", args={"Collective name": "allreduce", "correlation": 2**70})])
    frame, args = t.frame()
    assert frame["name"].astype(str).tolist() == ["a", "a", "k", "ncclKernel_x"]
    assert frame["kind"].astype(str).tolist() == ["cpu_op", "cpu_op", "kernel", "comm_kernel"]
    assert t.dropped == 5
    assert list(frame["name"].cat.categories) == ["a", "k", "ncclKernel_x"]  # dropped names leave no category
    assert frame["corr"].tolist() == [-1, -1, -1, -1]  # out of int64 range: no correlation
    assert args.index.tolist() == [3] and args.loc[3, "Collective name"] == "allreduce"
    assert frame["tid"].astype(str).tolist()[2] == "<list>"


def test_tid_labels_merge_int_and_str():
    t = EventTable()
    t.add([ev(tid=1), ev(tid="1"), ev(tid=2)])
    frame, _ = t.frame()
    assert frame["tid"].astype(str).tolist() == ["1", "1", "2"] and len(frame["tid"].cat.categories) == 2


# -- one file ------------------------------------------------------------------------------

def test_load_trace_matches_a_plain_parse_on_shared_traces():
    name = "hta_nccl_data_rank0of2_a100"
    f = SHARED / name / "nccl_data.json.gz"
    if not f.exists():
        pytest.skip(f"{f} absent")
    t = load_trace(f)
    raw = orjson.loads(gzip.decompress(f.read_bytes()))["traceEvents"]
    from diagnose.ingest.columns import CATEGORY_KIND

    want = [e for e in raw if e.get("ph") == "X" and e.get("cat") in CATEGORY_KIND]
    assert len(t.events) == len(want)
    assert np.array_equal(t.events["ts"].to_numpy(), np.array([e["ts"] for e in want]))
    assert t.events["name"].astype(str).tolist() == [e["name"] for e in want]
    assert t.rank == 0 and t.world_size == 2 and not t.salvaged and t.bytes_read > 0


def test_salvaged_trace_drops_steps_after_the_cut(tmp_path):
    doc = steps_trace(5)
    data = kineto(doc)
    cut = data.index(b'"ProfilerStep#4"') + 5
    # the last step marker written before the cut ends after the last complete event
    t = load_trace(write(tmp_path, "rank0.json", data[:cut]))
    assert t.salvaged
    names = t.events["name"].astype(str).tolist()
    assert "ProfilerStep#0" in names and "ProfilerStep#4" not in names
    assert any("truncated at byte" in w for w in t.warnings)


def test_rank_from_name_when_no_distributed_info(tmp_path):
    t = load_trace(write(tmp_path, "worker-7.pt.trace.json", orjson.dumps([ev()])))
    assert (t.rank, t.rank_source) == (7, "file name")


def test_only_metadata_is_an_error(tmp_path):
    p = write(tmp_path, "rank0.json", orjson.dumps({"traceEvents": [{"ph": "M", "name": "process_name"}]}))
    with pytest.raises(DiagnoseError, match="no usable events"):
        load_trace(p)


# -- one run -------------------------------------------------------------------------------

def test_unexpected_reader_error_costs_one_file_not_the_run(tmp_path, monkeypatch):
    import diagnose.ingest.assemble as run_mod

    good = write(tmp_path, "rank0.json", steps_trace())

    def boom(path, max_bytes):
        raise ValueError("a bug")

    monkeypatch.setattr(run_mod, "load_trace", boom)
    out = load_one((str(good), 1 << 20, None))
    assert out.trace is None and "internal error: ValueError: a bug" in out.error and str(good) in out.error


def test_parallel_and_serial_loading_agree(tmp_path, monkeypatch):
    import diagnose.ingest.assemble as run_mod

    for r in range(5):
        write(tmp_path, f"rank{r}.json", steps_trace(4, rank=r, world=5))
    files = sorted(tmp_path.iterdir())
    serial = load_files(files, 1 << 30, jobs=1, reduce=reduce_rank)
    monkeypatch.setattr(run_mod, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(run_mod, "IN_FLIGHT", 1)  # two files in flight: the other three queued as those finish
    parallel = load_files(files, 1 << 30, jobs=2, reduce=reduce_rank)
    assert [x.trace.rank for x in parallel] == [x.trace.rank for x in serial] == list(range(5))
    for a, b in zip(serial, parallel):
        assert unspilled(a.trace.events).equals(unspilled(b.trace.events)) and a.timeline.steps.frame().equals(b.timeline.steps.frame())
        assert dict(a.facts) == dict(b.facts) and a.facts


def test_the_local_pool_holds_a_few_files_in_flight_a_worker_not_every_file(tmp_path, monkeypatch):
    """Each submitted file's future lives until it is done: a window of IN_FLIGHT a worker keeps the
    parent's futures bounded whatever the rank count (one for every file up front held ~1 KB each)."""
    import concurrent.futures as cf

    import diagnose.ingest.assemble as run_mod

    for r in range(6):
        write(tmp_path, f"rank{r}.json", steps_trace(3, rank=r, world=6))
    seen: list[cf.Future] = []
    most = [0]

    class Counting(cf.ProcessPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            most[0] = max(most[0], sum(not f.done() for f in seen) + 1)
            seen.append(super().submit(fn, *args, **kwargs))
            return seen[-1]

    monkeypatch.setattr(run_mod, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(run_mod, "IN_FLIGHT", 1)
    monkeypatch.setattr(run_mod, "ProcessPoolExecutor", Counting)
    loaded = load_files(sorted(tmp_path.iterdir()), 1 << 30, jobs=2, reduce=reduce_rank)
    assert len(seen) == 6 and [x.trace.rank for x in loaded] == list(range(6))
    assert most[0] == 2


def test_runs_that_do_not_overlap_in_time_are_refused(tmp_path):
    write(tmp_path, "rank0.json", steps_trace(rank=0, world=2))
    write(tmp_path, "rank1.json", steps_trace(rank=1, world=2, t0=1000.0 + 3600e6))
    with pytest.raises(DiagnoseError, match="files from different runs"):
        load_run([tmp_path])


def test_a_rank_without_steps_is_skipped_beside_others(tmp_path):
    write(tmp_path, "rank0.json", steps_trace(rank=0, world=2))
    no_steps = steps_trace(rank=1, world=2)
    no_steps["traceEvents"] = [e for e in no_steps["traceEvents"] if not e["name"].startswith("ProfilerStep")]
    write(tmp_path, "rank1.json", no_steps)
    run = load_run([tmp_path])
    assert run.ranks == [0] and "no complete training step" in run.skipped[0]


def test_discover_refuses_special_files(tmp_path):
    import os

    fifo = tmp_path / "rank0.json"
    os.mkfifo(fifo)
    with pytest.raises(DiagnoseError, match="not a regular file or a directory"):
        load_run([fifo])
    with pytest.raises(DiagnoseError, match="no trace files"):
        load_run([tmp_path])  # the FIFO is not a trace file


def _same_trace(a, b) -> None:
    pd.testing.assert_frame_equal(a.events, b.events)
    pd.testing.assert_frame_equal(a.comm_args, b.comm_args)
    assert (a.thread_names, a.flows, a.dropped, a.warnings, a.salvaged, a.meta) == \
        (b.thread_names, b.flows, b.dropped, b.warnings, b.salvaged, b.meta)


@pytest.mark.parametrize("path", sorted(SHARED.glob("*/**/*.json*")), ids=lambda p: p.parent.name + "/" + p.name[:24])
def test_typed_fast_path_reads_real_traces_exactly_as_the_generic_path(path):
    _same_trace(load_trace(path), load_trace(path, typed=False))


def test_typed_fast_path_falls_back_per_chunk_on_events_it_cannot_type(tmp_path):
    # Odd events scattered through a trace longer than several chunks: each chunk holding one
    # is refused by the typed decoder and read generically; the table must be the same.
    odd = [ev(ts="12"), ev(dur=True), ev(tid=1.5), {"ph": "X", "cat": "cpu_op", "name": 7, "ts": 1, "dur": 1},
           ev(args=[1, 2]), ev(args={"correlation": 5, "External id": None, "external id": 9}),
           ev(name="nccl:all_reduce", args={"Collective name": "allreduce", "In msg nelems": [2, {"a": None}]}),
           {"ph": "M", "name": "thread_name", "pid": 1, "tid": [1], "args": {"name": "x"}},
           {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "main"}},
           ev(cat=None), ev(cat=["list"]), 5, ev(dur=-1.0), ev(ts=2**63 - 1)]
    events = []
    for i in range(60_000):
        events.append(ev(name=f"op{i % 50}", ts=float(i), dur=0.5, tid=i % 3, pid=1,
                         args={"correlation": i, "External id": i}))
        if i % 3_000 == 0:
            events.append(odd[(i // 3_000) % len(odd)])
    doc = steps_trace(3, extra=events)
    path = write(tmp_path, "rank0.pt.trace.json", kineto(doc))
    fast, generic = load_trace(path), load_trace(path, typed=False)
    _same_trace(fast, generic)
    assert fast.dropped > 0 and len(fast.events) > 60_000


def test_reduction_leaves_the_parent_only_summaries_and_evidence():
    # What bounds the parent's memory whatever the rank count: after each rank's reduction, its
    # events table holds only its collectives and the few events the checks cite as evidence.
    full = load_run([SHARED / "param_dlrm_8rank_v100"])
    run = load_run([SHARED / "param_dlrm_8rank_v100"], reduce=reduce_rank)
    assert run.ranks == full.ranks == list(range(8))
    for r in run.ranks:
        kept, tl = unspilled(run.traces[r].events), run.timelines[r]
        collectives = tl.own_collectives()
        # evidence rows per rank at most: 3 + 2 (dataloader) + 2 (launch) + 2 (pipeline) + 3 (checkpoint)
        # + 6 (host_sync) = 18
        assert len(kept) <= len(collectives) + 18 < len(full.traces[r].events) / 10
        assert set(collectives["row"]) <= set(kept.index)
        # kept rows are the same events as in the full table (evidence cites rows by label)
        pd.testing.assert_frame_equal(kept[["ts", "dur"]], full.traces[r].events.loc[kept.index, ["ts", "dur"]])
        assert kept["name"].tolist() == full.traces[r].events.loc[kept.index, "name"].astype(str).tolist()
        assert set(run.facts[r]) == {e.name for e in CHECKLIST if e.reduce}
        # each column or block of a small per-rank table costs ~1 KB a rank whatever its rows (#20):
        # only what the parent reads of a cited event, and one block per type
        assert list(kept.columns) == ["name", "ts", "dur"] and kept["name"].dtype == object
        assert len(kept._mgr.blocks) == 2 and len(collectives._mgr.blocks) == 3
        assert run.traces[r].comm_args is None  # only the reductions read the args,
        assert run.traces[r].thread_names == {} and tl.comm_threads is None  # and the threads
        # the idle model keeps its per-step sums, not its gaps (one per kernel boundary), and the
        # timeline none of its interval sets: the parent reads their cover, the same as a full load's
        mine, whole = run.idle[r], full.idle[r]
        assert len(whole.end_row) > 0 and len(whole.start) > 0
        assert all(len(getattr(mine, c)) == 0 for c in ("start", "end", "cls") + EVIDENCE_GAP_COLUMNS)
        for c in ("by_class_us", "outside_dataloader_us"):
            assert np.array_equal(getattr(mine, c), getattr(whole, c)), c
        assert tl.compute is tl.comm is tl.dataloader is tl.host_busy is tl.compiled is tl.input_copies is None
        assert len(full.timelines[r].compute) > 0
        assert np.array_equal(tl.cover.per_step, full.timelines[r].cover.per_step)
        mine, whole = unspilled(tl.cover.lanes), unspilled(full.timelines[r].cover.lanes)
        for c in ("points", "cum", "inside"):
            assert np.array_equal(getattr(mine, c), getattr(whole, c)), c
        assert tl.steps.frame().equals(full.timelines[r].steps.frame())
    # the run's collectives, gathered from the ranks' tables read back from disk: each text once
    # on disk (#20), each column read alone, a fresh copy of what the ranks' tables give
    from diagnose.ingest.spill import SpilledMap
    from diagnose.step.timeline import gather_collectives

    assert isinstance(run.collectives, SpilledMap)
    cols, again, direct = run.collective_columns(), run.collective_columns(), gather_collectives(run.timelines)
    assert cols["arrival"] is not again["arrival"] and list(cols) == list(direct)
    some = run.collective_columns(("end", "rank"))
    assert list(some) == ["end", "rank"] and np.array_equal(some["end"], direct["end"])
    for c, v in direct.items():
        assert cols[c].dtype == v.dtype, c
        np.testing.assert_array_equal(cols[c], v, err_msg=c)
    for col in ("name", "pg"):
        texts = {v: v for v in cols[col]}
        assert all(v is texts[v] for v in cols[col]) and len(texts) < len(cols[col]) / 8


@pytest.mark.parametrize("parallel", [False, True])
def test_load_progress_counts_every_file_once(tmp_path, monkeypatch, parallel):
    import diagnose.ingest.assemble as run_mod

    for r in range(3):
        write(tmp_path, f"rank{r}.json", steps_trace(4, rank=r, world=3))
    if parallel:
        monkeypatch.setattr(run_mod, "PARALLEL_MIN_BYTES", 0)
    calls = []
    loaded = load_files(sorted(tmp_path.iterdir()), 1 << 30, jobs=2 if parallel else 1,
                        progress=lambda done, n, name: calls.append((done, n, name)))
    assert [c[0] for c in calls] == [1, 2, 3] and {c[1] for c in calls} == {3}
    assert sorted(c[2] for c in calls) == ["rank0.json", "rank1.json", "rank2.json"]
    assert [x.path.name for x in loaded] == ["rank0.json", "rank1.json", "rank2.json"]  # input order kept


def test_ranks_repeated_names_and_metadata_are_kept_once():
    dlrm = sorted((SHARED / "param_dlrm_8rank_v100").glob("worker*.pt.trace.json.gz"))
    kept_once(load_files(dlrm, 10**10, 1, reduce_rank))


def test_without_a_disk_or_one_that_fills_up_ranks_stay_in_memory_and_the_diagnosis_is_the_same(monkeypatch):
    # no temporary file to be had (a read-only /tmp, a full disk): the analysis goes on in memory
    import tempfile

    real = tempfile.TemporaryFile

    def no_disk(*a, **k):
        raise OSError("read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", no_disk)
    dlrm = sorted((SHARED / "param_dlrm_8rank_v100").glob("worker*.pt.trace.json.gz"))
    kept_once(load_files(dlrm, 10**10, 1, reduce_rank), disk=False)
    monkeypatch.undo()
    with_disk = diagnosis_dict(diagnose_paths([SHARED / "param_dlrm_8rank_v100"]))
    monkeypatch.setattr(tempfile, "TemporaryFile", no_disk)
    assert diagnosis_dict(diagnose_paths([SHARED / "param_dlrm_8rank_v100"])) == with_disk

    # a disk that fills up part way through: the ranks before stay on it, the rest in memory

    class Filling:
        def __init__(self, *a, **k):
            self.f, self.room = real(*a, **k), 150_000

        def write(self, data):
            if len(data) > self.room:
                self.f.write(bytes(data)[:self.room])  # a short write, then no space
                self.room = 0
                raise OSError(28, "No space left on device")
            self.room -= len(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(tempfile, "TemporaryFile", Filling)
    loaded = load_files(dlrm, 10**10, 1, reduce_rank)
    assert isinstance(loaded[0].trace.events, Spilled) and not isinstance(loaded[-1].trace.events, Spilled)
    assert diagnosis_dict(diagnose_paths([SHARED / "param_dlrm_8rank_v100"])) == with_disk


def test_the_checks_read_each_ranks_summary_back_with_repeated_names_shared():
    # on disk a summary costs the parent nothing, read back it is a copy of its own: 1,024 ranks'
    # op lists held 41 MB at once in the straggler check before Context.facts shared their names
    from diagnose.context import build_context

    run = load_run([SHARED / "param_dlrm_8rank_v100"], reduce=reduce_rank)
    assert all(isinstance(run.facts[r], SpilledMap) for r in run.ranks)
    ctx = build_context(run)
    ops = ctx.facts("straggler")
    names_once([ops[r] for r in run.ranks])
    # one rank at a time, for checks that fold them into one table (the straggler's op diff)
    each = ctx.facts_each("straggler")
    assert next(each)[0] == run.ranks[0] and dict(ctx.facts_each("straggler")) == ops


class _Timeline:
    """Just what _align_clocks reads of a rank's timeline: its collectives."""

    def __init__(self, c: pd.DataFrame) -> None:
        self.c = c

    def own_collectives(self) -> pd.DataFrame:
        return self.c


class _Trace:
    def __init__(self, host) -> None:
        self.meta = {"host_name": host}


def _joined_offsets(run_tl, traces) -> tuple[dict[int, float], list[str]]:
    """_align_clocks as it was, by a pandas join (the oracle), for ranks on hosts of their own."""
    ref = min(run_tl)
    ref_c = run_tl[ref].own_collectives().set_index(["step", "pg", "seq"])["end"]
    offsets, warnings = {r: 0.0 for r in run_tl}, []
    if ref_c.empty:
        return offsets, ["ranks on several hosts and no collectives to align their clocks on: "
                         "cross-host timings are unaligned"]
    for r, tl in run_tl.items():
        if r == ref:
            continue
        mine = tl.own_collectives().set_index(["step", "pg", "seq"])["end"]
        joined = pd.concat([ref_c.rename("ref"), mine.rename("me")], axis=1, join="inner")
        if len(joined) == 0:
            continue
        diff = (joined["ref"] - joined["me"]).to_numpy()
        off = float(np.median(diff))
        spread = float(np.median(np.abs(diff - off)))
        if abs(off) > max(50.0, 5 * spread):
            offsets[r] = off
            warnings.append(f"rank {r}: clock offset {off / 1000:.3f} ms vs rank {ref} "
                            f"(from {len(joined)} matched collectives) applied")
    return offsets, warnings


def test_clock_offsets_match_the_pandas_join_they_replaced():
    from diagnose.ingest.assemble import _align_clocks

    rng = np.random.default_rng(7)
    applied = 0
    for trial in range(80):
        n = int(rng.integers(2, 7))
        run_tl, traces = {}, {}
        for r in range(n):
            k = int(rng.integers(0, 12))
            steps = rng.integers(0, 3, k)
            pgs = rng.choice(["default", "0", "tp:1"], k)
            c = pd.DataFrame({"step": steps.astype(np.int64), "pg": pgs.astype(object)})
            c["seq"] = c.groupby(["step", "pg"]).cumcount()
            skew = float(rng.choice([0.0, 30.0, 5_000.0, -20_000.0]))
            c["end"] = c["seq"] * 1000.0 + c["step"] * 1e5 + skew + rng.normal(0, 5, k)
            if k and rng.random() < 0.2:
                c.loc[c.index[0], "end"] = np.nan
            c = c.sample(frac=1.0, random_state=trial)  # not in key order
            run_tl[r], traces[r] = _Timeline(c), _Trace(f"host{r}")
        warnings: list[str] = []
        got = _align_clocks(run_tl, traces, warnings)
        assert (got, warnings) == _joined_offsets(run_tl, traces)
        applied += len(warnings)
    assert applied > 20  # the skews were applied often enough to compare


def test_a_spill_reads_back_what_was_put_whatever_the_order_of_puts_and_reads():
    """Puts go to the file's end without a seek while nothing was read in between (each seek
    flushed the buffered writes: 15 a rank as the ranks arrive); reads in between move the
    position, and the next put must still land at the end."""
    from diagnose.ingest.spill import Spill, SpilledArray, SpilledMap, array_stretch

    def same(h, want) -> bool:
        if isinstance(h, SpilledArray):
            return np.array_equal(array_stretch(h), want)
        return (dict(h) if isinstance(h, SpilledMap) else unspilled(h)) == want

    rng = np.random.default_rng(3)
    spill, kept = Spill(), []
    for i in range(400):
        what = rng.integers(0, 4)
        if what == 0:
            obj = {"i": i, "x": rng.random(int(rng.integers(0, 50))).tolist()}
            kept.append((spill.put(obj), obj))
        elif what == 1:
            a = rng.integers(-9, 9, int(rng.integers(0, 3000)))
            kept.append((spill.put_array(a), a))
        elif what == 2:  # values past the file's 8 KiB write buffer too
            d = {f"k{j}": "v" * int(rng.integers(0, 20000)) for j in range(int(rng.integers(1, 4)))}
            kept.append((spill.put_map(d), d))
        elif kept:  # a read in between
            assert same(*kept[int(rng.integers(0, len(kept)))])
    assert all(same(h, want) for h, want in kept)
    assert sum(isinstance(h, (SpilledArray, SpilledMap)) for h, _ in kept) > 100  # on disk, not kept as given
    assert spill._file is not None and spill._file.seek(0, 2) == spill._end
