"""`--cluster` at 256 and 1,024 ranks: time against the single-machine path, the client's memory,
and what travels per rank.

Builds N ranks by replicating the 8 real ranks of ../shared/traces/param_dlrm_8rank_v100, each
copy with its rank id (distributedInfo.rank, world_size and the file name) rewritten, into a
temporary directory. Then, each in its own child process (so peaks do not mix), on the same files:

- local: diagnose.pipeline.diagnose_paths, the single-machine path (its own pool of 2 processes);
- cluster: the same through a LocalCluster of 2 worker processes started in that child
  (diagnose_paths(..., reader=DaskReader)); the cluster's start is timed apart;
- remote: the same through a scheduler and 2 workers each started as a process of its own, as
  docs/cluster.md deploys them (`deployed`): the client then does only the client's work, where a
  LocalCluster's scheduler shares its process (and its CPU and memory).

Prints wall times, the ratio cluster / local, the client's peak resident memory (VmHWM of the
child; the workers' are theirs) after the analysis and after its outputs are written as
`diagnose analyze` writes them (diagnosis.json, report.html: the command's own peak), and how much
each grew per added rank (and that growth against one rank's file and its summary as it travels:
`_growth`), the bytes that travelled back per rank, and the client's own work after the last file
arrived (assembly and the checklist: what more workers cannot shorten); then, from these per-rank
costs, what 64 workers would take (`_at_64`). tests/test_bench_cluster.py runs each mode on a few ranks.

    python benchmarks/bench_cluster.py                   # 256 and 1,024 ranks, the three paths
    python benchmarks/bench_cluster.py --paths local,remote   # without the LocalCluster
    python benchmarks/bench_cluster.py --ranks 64        # a quick look
    python benchmarks/bench_cluster.py --per-file 256    # one file's CPU: local pool against a worker
    python benchmarks/bench_cluster.py --phases 512      # the client's Python memory by phase
    python benchmarks/bench_cluster.py --resident 1024   # its resident memory by phase and check
    python benchmarks/bench_cluster.py --resident 1024 --paths cluster   # the same, read on a LocalCluster
    python benchmarks/bench_cluster.py --held 256,1024   # which objects held grow with the ranks; the answer's own size
    python benchmarks/bench_cluster.py --ranks 16,64 --paths local \\
        --source ../shared/traces/kineto_resnet50_dataloader_v100/nw0   # heavier ranks (26 MB each)

`--per-file N` times each file's read (load_one and the pickling of its result, no checklist) by
the CPU of the thread that ran it and of its whole process: in a forked local pool of 2, then on a
LocalCluster of 2 as `--cluster` starts it (both warmed on 4 files first). What a worker spends
beside the read itself is Dask's own per-task work.

`--phases N` runs the single-machine path once under tracemalloc (its forked readers untraced) and
prints, at each phase of the client's analysis (the loaded ranks, matching, breakdown, step graph,
each check, the replay, each extra), the Python memory held and the highest point since the
previous mark: where the peak is, and what each rank costs there (numpy's and pandas' buffers
included; the interpreter's own pages not; its free lists of tuples, floats, lists and dicts, which
only a full collection empties, counted as held: 1.2 MB of the 2.6 held when the replays start at
1,024 ranks; `--held` empties them first).

`--resident N` runs it once more without tracemalloc and prints, at each phase and around each
check of the checklist and each extra, the resident size (VmRSS) and its highest point since the
previous mark (VmHWM, reset between marks through /proc/self/clear_refs): what the bench's peak is
made of, the interpreter's and the allocator's memory included, which tracemalloc does not see or
does not place. Run it at two rank counts and compare: a check whose rise grows with the ranks is
where the peak grows (a table of interned strings rebuilt at twice its size was found so; #20).
With `--paths cluster` the files are read on a LocalCluster of 2 started in the child (its start
is the first mark): the client's own rises while the results arrive (`load`) and after.
"""
from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
WORKERS_HERE, WORKERS_THERE = 2, 64
"""Workers of the cluster paths here; of the cluster the estimate is for (`_at_64`)."""
SOURCE = ROOT.parent / "shared" / "traces" / "param_dlrm_8rank_v100"


def build(out: Path, n: int, source: Path = SOURCE) -> Path:
    """n ranks, rank r a copy of the source's real rank r % (its ranks) with its ids rewritten."""
    d = out / f"ranks{n}"
    d.mkdir(parents=True, exist_ok=True)
    src = sorted(source.glob("*.json.gz"))
    docs = [orjson.loads(gzip.decompress(p.read_bytes())) for p in src]
    for r in range(n):
        doc = docs[r % len(docs)]
        doc["distributedInfo"] = {**doc.get("distributedInfo", {}), "rank": r, "world_size": n}
        (d / f"rank{r}.pt.trace.json").write_bytes(orjson.dumps(doc))
    return d


def _peak_mb() -> float:
    return _status_mb()[1]


def measure(kind: str, target: str) -> dict:
    from diagnose.pipeline import diagnose_paths

    start_s = 0.0
    last = [0.0, 0.0]  # when the last file's result arrived (wall, this process's CPU): the rest is the client's own work

    def seen(done: int, n: int, name: str) -> None:
        last[:] = [time.perf_counter(), time.process_time()]

    if kind == "local":
        t, cpu0 = time.perf_counter(), time.process_time()
        d = diagnose_paths([target], jobs=2, progress=seen)
        wall = time.perf_counter() - t
        back = None
    else:
        from contextlib import nullcontext

        from diagnose.ingest.cluster import connect

        t0 = time.perf_counter()
        here = nullcontext(f"local:{WORKERS_HERE}")
        with (deployed(WORKERS_HERE) if kind == "remote" else here) as address, connect(address) as reader:
            start_s = time.perf_counter() - t0
            t, cpu0 = time.perf_counter(), time.process_time()
            d = diagnose_paths([target], reader=reader, progress=seen)
            wall = time.perf_counter() - t
            back = reader.stats.bytes_back / max(reader.stats.files, 1)
    assert len(d.run.ranks_found) >= 1
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    analysed_mb = _peak_mb()
    # then what `diagnose analyze` does with it (output.analyze_outputs, the cluster closed first):
    # the command's peak is the report's, on top of what the analysis leaves
    from diagnose.output import write_json
    from diagnose.reports.html import write_report

    with tempfile.TemporaryDirectory(prefix="bench-out-") as out:
        write_json(d, Path(out))
        write_report(d, Path(out))
    return {"wall_s": wall, "start_s": start_s, "client_cpu_s": ru.ru_utime + ru.ru_stime,
            "after_read_s": t + wall - last[0] if last[0] else None, "peak_mb": analysed_mb,
            "intake_cpu_s": last[1] - cpu0 if last[0] else None,
            "peak_out_mb": _peak_mb(), "bytes_per_rank": back, "ranks": len(d.run.ranks_found),
            "read_per_rank": sum(p.stat().st_size for p in Path(target).iterdir()) / len(d.run.ranks_found),
            "top": d.top.id if d.top else None}


def _timed_read(args) -> tuple[float, float]:
    """One file read as a worker reads it: (thread CPU, process CPU) in seconds."""
    from diagnose.ingest.cluster import load_remote

    t0, p0 = time.thread_time(), time.process_time()
    load_remote([args])
    return time.thread_time() - t0, time.process_time() - p0


def per_file(n: int) -> None:
    import concurrent.futures as cf
    import multiprocessing as mp

    from diagnose.analyzers import reduce_rank
    from diagnose.ingest.cluster import connect
    from diagnose.ingest.load import DEFAULT_MAX_BYTES

    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        files = sorted(str(p) for p in build(Path(tmp), n).glob("*.json"))
        args = [(f, DEFAULT_MAX_BYTES, reduce_rank) for f in files]
        with cf.ProcessPoolExecutor(2, mp_context=mp.get_context("fork")) as ex:
            list(ex.map(_timed_read, args[:4]))
            t = time.perf_counter()
            pool = list(ex.map(_timed_read, args))
            pool_s = time.perf_counter() - t
        with connect("local:2") as reader:
            c = reader.client
            c.gather(c.map(_timed_read, args[:4], pure=False))
            t = time.perf_counter()
            on_dask = c.gather(c.map(_timed_read, args, pure=False))
            dask_s = time.perf_counter() - t
    for label, res, wall in (("forked pool of 2", pool, pool_s), ("LocalCluster of 2", on_dask, dask_s)):
        print(f"{label}: {n} files in {wall:.2f} s; per file {1e3 * sum(r[0] for r in res) / n:.1f} ms of "
              f"the reading thread's CPU, {1e3 * sum(r[1] for r in res) / n:.1f} ms of its process's")


def _between_marks(inner, label: str, mark: Callable[[str], None]):
    """`inner` with a mark before ("before <label>") and after (label) each call."""
    def marked(*a, **k):
        mark(f"before {label}")
        out = inner(*a, **k)
        mark(label)
        return out
    return marked


def _mark_phases(mark: Callable[[str], None]) -> None:
    """A mark before and after each phase of the client's analysis, each check and each extra."""
    from dataclasses import replace

    import diagnose.context as context
    import diagnose.extras as extras
    import diagnose.ingest.assemble as assemble
    import diagnose.pipeline as pipeline
    from diagnose.ingest.cluster import DaskReader

    for module, names in ((assemble, ("load_files", "gather_collectives")), (DaskReader, ("load",)),
                          (context, ("match_collectives", "build_graph", "step_model")),
                          (pipeline, ("build_context", "run_checklist", "report_extras", "annotate")),
                          (extras, ("_lateness_extra", "_timeline_extra", "_top_ops_extra", "_comm_groups_extra",
                                    "_compiled_extra", "_over_time_extra"))):
        for name in names:
            setattr(module, name, _between_marks(getattr(module, name), name, mark))
    pipeline.CHECKLIST = tuple(replace(e, analyze=_between_marks(e.analyze, f"check {e.name}", mark))
                               for e in pipeline.CHECKLIST)


def _traced_run(target: str, frames: int = 1):
    """The single-machine path under tracemalloc in this process; the pool's forked readers
    untraced (they are not the client, and tracing them slowed a 1,024-rank run past 10 min)."""
    import os
    import tracemalloc

    from diagnose import pipeline

    os.register_at_fork(after_in_child=tracemalloc.stop)
    tracemalloc.start(frames)
    return pipeline.diagnose_paths([target], jobs=2)


def phases(n: int, source: Path = SOURCE) -> None:
    import tracemalloc

    marks: list[tuple[str, float, float]] = []

    def mark(label: str) -> None:
        cur, peak = tracemalloc.get_traced_memory()
        marks.append((label, cur / 1e6, peak / 1e6))
        tracemalloc.reset_peak()

    _mark_phases(mark)
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        _traced_run(str(build(Path(tmp), n, source)))
        mark("end")
        tracemalloc.stop()
    print(f"{n} ranks, the client's Python memory (MB): held at the mark, highest since the previous mark")
    for label, cur, peak in marks:
        print(f"  {label:28s} {cur:7.1f} {peak:7.1f}")


def held(counts: list[int], source: Path = SOURCE) -> int:
    """What the client holds when the replays' annotation starts (every check done: what the run,
    the checks' results and the breakdown keep), at two rank counts, compared by where each block
    was allocated, the largest growth first: which objects grow with the ranks (#20). Each count in
    a child process of its own, under tracemalloc (4 frames, its forked readers untraced), after a
    full collection (Python's free lists emptied: they are not objects held). And the answer's own
    size, the Diagnosis returned: what it holds after a full collection less what is held once it
    is dropped (its per-rank rows grow with the ranks whatever the analysis keeps)."""
    import pickle

    snaps = []
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        for n in counts:
            target, out = build(Path(tmp), n, source), Path(tmp) / f"held{n}.pickle"
            res = subprocess.run([sys.executable, __file__, "--held-of", str(target), "--target", str(out)],
                                 cwd=ROOT, text=True, capture_output=True, check=False)
            if res.returncode != 0:
                print((res.stderr.strip().splitlines() or ["failed"])[-1][:300])
                return 1
            snaps.append(pickle.loads(out.read_bytes()))
    (a, answer_a), (b, answer_b) = snaps
    print(f"the answer itself (the Diagnosis the analysis returns, its per-rank rows that diagnosis.json "
          f"holds): {answer_a / 1e6:.2f} MB at {counts[0]} ranks, {answer_b / 1e6:.2f} at {counts[1]}")
    print(f"the client's Python memory held when the replays start: {sum(t.size for t in a.traces) / 1e6:.2f} MB "
          f"at {counts[0]} ranks, {sum(t.size for t in b.traces) / 1e6:.2f} at {counts[1]}; the largest "
          "differences by where they were allocated (most recent frame first):")
    for st in b.compare_to(a, "traceback")[:20]:
        frames = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in list(st.traceback)[::-1][:4])
        print(f"  {st.size_diff / 1e3:+9.1f} KB {st.count_diff:+7d} blocks  {frames}")
    return 0


def held_of(target: str, out: str) -> None:
    import gc
    import pickle
    import tracemalloc

    from diagnose import pipeline

    inner = pipeline.annotate
    snaps = []

    def snapshot_first(*a, **k):
        if not snaps:
            gc.collect()
            # what imports made while it ran (a module imported at its first use) is no rank's
            snaps.append(tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, f) for f in (tracemalloc.__file__, "<frozen abc>", "<frozen importlib.*")]))
        return inner(*a, **k)

    pipeline.annotate = snapshot_first
    d = _traced_run(target, frames=4)
    gc.collect()
    with_it = tracemalloc.get_traced_memory()[0]  # the snapshot held at both readings: it cancels
    del d
    gc.collect()
    Path(out).write_bytes(pickle.dumps((snaps[0], with_it - tracemalloc.get_traced_memory()[0])))


def _status_mb() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process, MB."""
    got = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            got[line[:5]] = int(line.split()[1]) / 1024
    return got.get("VmRSS", float("nan")), got.get("VmHWM", float("nan"))


def resident(n: int, source: Path = SOURCE, kind: str = "local") -> None:
    """Builds the ranks here, measures in a child process: what building them left in this one
    (the decoded source traces) would hide the analysis's rises."""
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        target = build(Path(tmp), n, source)
        res = subprocess.run([sys.executable, __file__, "--resident-of", str(target), "--paths", kind], cwd=ROOT,
                             text=True, capture_output=True)
    print(res.stdout, end="")
    if res.returncode != 0:
        print((res.stderr.strip().splitlines() or ["failed"])[-1][:300])


def resident_of(target: str, kind: str = "local") -> None:
    from contextlib import nullcontext

    import diagnose.pipeline as pipeline
    from diagnose.ingest.cluster import connect

    marks: list[tuple[str, float, float]] = []
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        print("(no /proc/self/clear_refs here: each highest point is the process's so far)")

    def mark(label: str) -> None:
        rss, hwm = _status_mb()
        marks.append((label, rss, hwm))
        try:
            Path("/proc/self/clear_refs").write_text("5")  # the high-water mark from here on
        except OSError:
            pass

    _mark_phases(mark)
    with connect("local:2") if kind == "cluster" else nullcontext() as reader:
        mark("start" + (" (the cluster up)" if reader else ""))
        d = pipeline.diagnose_paths([target], jobs=2, reader=reader)
        mark("end")
    print(f"{len(d.run.ranks_found)} ranks, the client's resident memory (MB): at the mark, highest since the "
          "previous mark, and the rise over the previous mark")
    prev = marks[0][1]
    for label, rss, hwm in marks:
        print(f"  {label:34s} {rss:7.1f} {hwm:7.1f} {hwm - prev:+6.1f}")
        prev = rss


@contextmanager
def deployed(workers: int):
    """A scheduler and `workers` workers, each a process of its own started as docs/cluster.md
    deploys them (`dask scheduler`, `dask worker ... --nthreads 1 --memory-limit 0`): the client
    then does only the client's work, where a LocalCluster's scheduler runs in its process. Yields
    the scheduler's address; all are killed after."""
    import os
    import signal

    from distributed import Client

    with tempfile.TemporaryDirectory(prefix="bench-sched-") as tmp:
        where = str(Path(tmp) / "scheduler.json")
        dask = [sys.executable, "-m", "dask"]
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "start_new_session": True}
        procs = [subprocess.Popen(dask + ["scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address",
                                          ":0", "--scheduler-file", where], **quiet)]
        try:
            procs += [subprocess.Popen(dask + ["worker", "--scheduler-file", where, "--nthreads", "1", "--nworkers",
                                               "1", "--memory-limit", "0", "--no-dashboard"], **quiet)
                      for _ in range(workers)]
            with Client(scheduler_file=where, timeout=60) as c:
                c.wait_for_workers(workers, timeout=60)
                address = c.scheduler.address
            yield address
        finally:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=30)


def run_child(kind: str, target: str, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--measure", kind, "--target", target]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if res.returncode != 0:
        return {"error": (res.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def _table(rows: list[tuple[int, dict, dict]], title: str, short: str) -> None:
    """The single machine against one other path, a row a rank count (markdown)."""
    print(f"| ranks | single machine (2 processes) | {title} | ratio | client peak, single / {short} | with its "
          f"outputs written | back per rank | client's own work after the last file, single / {short} |")
    print("|---|---|---|---|---|---|---|---|")
    for n, lo, other in rows:
        print("| " + " | ".join(_cells(n, lo, other)) + " |")


def _cells(n: int, lo: dict, cl: dict) -> list[str]:
    """One table row; a path that did not run (or failed) shows its reason or '-'."""
    ok_l, ok_c = "error" not in lo, "error" not in cl

    def pair(key: str, fmt: str, unit: str) -> str:
        return " / ".join(format(x[key], fmt) if ok else "-" for x, ok in ((lo, ok_l), (cl, ok_c))) + unit

    return [str(n),
            f"{lo['wall_s']:.1f} s" if ok_l else lo["error"],
            f"{cl['wall_s']:.1f} s (+{cl['start_s']:.1f} s)" if ok_c else cl["error"],
            f"{cl['wall_s'] / lo['wall_s']:.2f}x" if ok_l and ok_c else "-",
            pair("peak_mb", ".0f", " MB"),
            pair("peak_out_mb", ".0f", " MB"),
            f"{cl['bytes_per_rank'] / 1024:.0f} KiB" if ok_c else "-",
            pair("after_read_s", ".1f", " s")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="256,1024")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--measure", choices=["local", "cluster", "remote"])
    ap.add_argument("--target")
    ap.add_argument("--per-file", type=int, metavar="N")
    ap.add_argument("--phases", type=int, metavar="N")
    ap.add_argument("--resident", type=int, metavar="N")
    ap.add_argument("--held", metavar="N1,N2")
    ap.add_argument("--held-of", help=argparse.SUPPRESS)
    ap.add_argument("--resident-of", help=argparse.SUPPRESS)
    ap.add_argument("--source", type=Path, default=SOURCE,
                    help="the real ranks to replicate (a directory of *.json.gz; default param_dlrm_8rank_v100)")
    ap.add_argument("--paths", default="local,cluster,remote", help="which of the three to run")
    a = ap.parse_args(argv)
    if a.phases:
        phases(a.phases, a.source)
        return 0
    if a.held:
        return held([int(x) for x in a.held.split(",")], a.source)
    if a.held_of:
        held_of(a.held_of, a.target)
        return 0
    if a.resident:
        resident(a.resident, a.source, "cluster" if a.paths == "cluster" else "local")
        return 0
    if a.resident_of:
        from diagnose.heap import keep_large_blocks_mapped

        keep_large_blocks_mapped()  # as --measure
        resident_of(a.resident_of, "cluster" if a.paths == "cluster" else "local")
        return 0
    if a.per_file:
        per_file(a.per_file)
        return 0
    if a.measure:
        from diagnose.heap import keep_large_blocks_mapped

        keep_large_blocks_mapped()  # what `diagnose` does first (cli.main): the child is the command
        print(json.dumps(measure(a.measure, a.target)))
        return 0
    rows, remotes = [], []
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        for n in [int(x) for x in a.ranks.split(",")]:
            target = build(Path(tmp), n, a.source)
            skipped = {"error": "not run (--paths)"}
            local = run_child("local", str(target), a.timeout) if "local" in a.paths else skipped
            clus = run_child("cluster", str(target), a.timeout) if "cluster" in a.paths else skipped
            remote = run_child("remote", str(target), a.timeout) if "remote" in a.paths else skipped
            rows.append((n, local, clus))
            remotes.append((n, local, remote))
            print(f"{n} ranks: local {local}\n{n} ranks: cluster {clus}\n{n} ranks: remote {remote}", flush=True)
    print()
    _table(rows, "LocalCluster of 2 (its start apart)", "cluster")
    if any("error" not in r for _, _, r in remotes):
        print("\nThe same, the scheduler and 2 workers each a process of their own (`remote`: as deployed, "
              "the client doing only the client's work):\n")
        _table(remotes, "scheduler and 2 workers apart (their start apart)", "remote")
    for line in (_growth(rows) + _growth([(n, rm) for n, _, rm in remotes], ("remote",))
                 + _at_64(rows, "LocalCluster") + _at_64(remotes, "remote")):
        print(line)
    return 0


def _at_64(rows: list[tuple[int, dict, dict]], label: str) -> list[str]:
    """What a cluster of 64 workers would take, from the per-rank costs measured here (#20: an
    estimate, not a measurement). Reading: the workers' time a rank (the cluster run's wall until
    the last file, times the workers here, over the ranks: an upper bound, the client shared the
    two cores) spread over 64. Taking the results in: the client's CPU until the last file (Dask's
    handling of each result, with a LocalCluster its scheduler's too, and the client's own
    keeping of it), which more workers do not spread. The slower of the two, then the client's
    own work after the last file."""
    out = []
    for n, _, cl in rows:
        if not {"wall_s", "after_read_s", "intake_cpu_s"} <= cl.keys() or None in (cl["after_read_s"], cl["intake_cpu_s"]):
            continue
        read_rank = (cl["wall_s"] - cl["after_read_s"]) * WORKERS_HERE / n
        intake_rank = cl["intake_cpu_s"] / n
        read, intake = n * read_rank / WORKERS_THERE, n * intake_rank
        out.append(f"{n} ranks on {WORKERS_THERE} workers (estimated from the per-rank costs of the {label} run): reading "
                   f"{read:.1f} s ({1e3 * read_rank:.0f} ms a rank here, over {WORKERS_THERE}), the client taking "
                   f"the results in {intake:.1f} s ({1e3 * intake_rank:.1f} ms of CPU a rank), then its own work "
                   f"{cl['after_read_s']:.1f} s: about {max(read, intake) + cl['after_read_s']:.1f} s")
    return out


def _growth(rows: list[tuple], labels: tuple[str, ...] = ("single", "cluster")) -> list[str]:
    """Between consecutive rank counts, how much the client's peak grew, in all and per added
    rank: what "flat" is read against (#20); and that per-rank growth against what one rank's file
    holds (read on the workers) and what its summary weighs (travelled back): a client that kept
    ranks' data would grow by the one or the other, one that keeps only each rank's answer by
    neither (run it with a heavier --source: the per-rank growth stays, the file grows)."""
    out = []
    for (n0, *a), (n1, *b) in zip(rows, rows[1:]):
        cells = []
        for label, x, y in zip(labels, a, b):
            for key, what in (("peak_mb", ""), ("peak_out_mb", " with its outputs")):
                if key in x and key in y:
                    d = y[key] - x[key]
                    cells.append(f"{label}{what} {d:+.1f} MB ({d / x[key]:+.1%}, "
                                 f"{d * 1024 / (n1 - n0):.1f} KB a rank)")
        if cells:
            out.append(f"client peak from {n0} to {n1} ranks: " + "; ".join(cells))
        x, y = a[0], b[0]  # the first path's; the files and the summaries are the same for every path
        if {"peak_mb", "read_per_rank"} <= y.keys() and "peak_mb" in x:
            per_rank = (y["peak_mb"] - x["peak_mb"]) * 2**20 / (n1 - n0)
            read = y["read_per_rank"]
            back = next((z["bytes_per_rank"] for z in b if z.get("bytes_per_rank")), None)
            out.append(f"  per added rank the {labels[0]} client's peak grew {per_rank / 1024:.1f} KB: "
                       f"{per_rank / read:.2%} of the rank's file ({read / 2**20:.1f} MB)"
                       + (f", {per_rank / back:.1%} of its summary as it travels ({back / 1024:.0f} KiB)"
                          if back else ""))
    return out


if __name__ == "__main__":
    sys.exit(main())
