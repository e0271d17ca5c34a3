"""`--cluster`: the ranks' traces read on Dask workers where they lie (diagnose/ingest/cluster.py).

Real LocalClusters of 2 worker processes on this machine. Two hosts with node-local disks are
simulated by giving each worker its own directory through its environment ($DIAGNOSE_TEST_DISK,
expanded on the worker, as $SLURM_TMPDIR would be on a real host): a worker sees only the ranks
under its own directory.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from tests.conftest import kept_once, shared
from diagnose.errors import DiagnoseError
from diagnose.output import diagnosis_dict
from diagnose.analyzers import reduce_rank
from diagnose.ingest.load import DEFAULT_MAX_BYTES
from diagnose.pipeline import diagnose_paths

distributed = pytest.importorskip("distributed")  # the test extra installs it: this guards a bare checkout

import diagnose.ingest.cluster as dcluster  # noqa: E402
from diagnose.ingest.cluster import ClusterStats, Listed, batches, connect, parse_address  # noqa: E402

DLRM = shared("param_dlrm_8rank_v100")
DISK = "$DIAGNOSE_TEST_DISK/traces"


def rank_files() -> dict[int, Path]:
    return {int(p.name[len("worker")]): p for p in sorted(DLRM.glob("worker*.pt.trace.json.gz"))}


@pytest.fixture(scope="module")
def cluster():
    c = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                                 silence_logs=50)
    client = distributed.Client(c)
    yield c, client
    client.close()
    c.close()


def workers(client) -> list[str]:
    client.wait_for_workers(2, timeout=60)
    return sorted(client.scheduler_info()["workers"])


def give_disks(client, disks: list[Path]) -> None:
    """Worker i sees disks[i] as its $DIAGNOSE_TEST_DISK."""
    for addr, disk in zip(workers(client), disks):
        client.run(lambda v=str(disk): os.environ.__setitem__("DIAGNOSE_TEST_DISK", v), workers=[addr])


def two_hosts(tmp_path: Path, first: range, second: range) -> list[Path]:
    files = rank_files()
    disks = []
    for name, ranks in (("hostA", first), ("hostB", second)):
        d = tmp_path / name / "traces"
        d.mkdir(parents=True)
        for r in ranks:
            shutil.copy(files[r], d / files[r].name)
        disks.append(d.parent)
    return disks


def as_json(d) -> dict:
    return orjson.loads(orjson.dumps(diagnosis_dict(d), option=orjson.OPT_SERIALIZE_NUMPY))


def completed_loads(stream: list[dict]) -> list[str]:
    """Which files' loads Dask itself recorded as run to completion (its task stream, not ours)."""
    return [t["key"] for t in stream if str(t["key"]).startswith("diagnose-load-")]


def test_ranks_on_two_hosts_local_disks_give_the_single_machine_diagnosis(cluster, tmp_path):
    c, client = cluster
    disks = two_hosts(tmp_path, range(0, 4), range(4, 7))  # rank 7 on neither host
    give_disks(client, disks)
    single = diagnose_paths([d / "traces" for d in disks])
    with distributed.get_task_stream(client) as ts, connect(c.scheduler_address) as reader:
        spread = diagnose_paths([DISK], reader=reader)
    assert as_json(spread) == as_json(single)
    assert list(spread.run.ranks_found) == list(range(7)) and spread.run.world_size == 8
    assert any("missing rank(s) 7" in w for w in spread.warnings)
    # each file read once, by the worker whose disk holds it
    keys = completed_loads(ts.data)
    assert len(keys) == 7 and len({k.split("-", 3)[3] for k in keys}) == 7
    assert sorted(reader.stats.read_on.values()) == [3, 4]
    assert reader.stats.files == 7 and not reader.stats.retried and not reader.stats.lost
    assert 0 < reader.stats.bytes_back < 7 * 2 * 1024**2  # summaries, not the traces (2-6 MB of JSON each)


WINDOWS = Path(__file__).parent / "fixtures" / "cpu_repeat_default_names_2rank"


def _windows_on_two_hosts(tmp_path: Path, rank1_windows: int = 3) -> list[Path]:
    """Rank 0's repeated profiler windows on host A's disk, rank 1's on host B's."""
    disks = []
    for host, stem, n in (("hostA", "vm_6237", 3), ("hostB", "vm_6238", rank1_windows)):
        d = tmp_path / host / "traces"
        d.mkdir(parents=True)
        for f in sorted(WINDOWS.glob(f"{stem}.*"))[:n]:
            shutil.copy(f, d / f.name)
        disks.append(d.parent)
    return disks


def test_repeated_windows_on_node_local_disks_are_chosen_on_the_workers(cluster, tmp_path):
    """Each worker sees one rank's windows: the same window is chosen on both (the last whole one,
    or the one asked for), as the single machine chooses it from both directories."""
    c, client = cluster
    disks = _windows_on_two_hosts(tmp_path)
    give_disks(client, disks)
    for window in (None, 1):
        single = diagnose_paths([d / "traces" for d in disks], window=window)
        with connect(c.scheduler_address) as reader:
            spread = diagnose_paths([DISK], reader=reader, window=window)
        assert {r: Path(f).name for r, f in spread.run.files.items()} == \
            {r: Path(f).name for r, f in single.run.files.items()}
        assert spread.extras["profiled_windows"] == single.extras["profiled_windows"]
        assert [f.id for f in spread.findings] == [f.id for f in single.findings]
        assert any("profiled windows a rank" in w for w in spread.warnings)


def test_workers_that_would_read_different_windows_are_refused(cluster, tmp_path):
    """Host B's rank wrote one window only: host A's would be read from window 2, B's from 1."""
    c, client = cluster
    give_disks(client, _windows_on_two_hosts(tmp_path, rank1_windows=1))
    with connect(c.scheduler_address) as reader, pytest.raises(DiagnoseError, match="not one window of one run"):
        diagnose_paths([DISK], reader=reader)


def test_a_shared_path_seen_by_every_worker_is_read_once(cluster):
    c, client = cluster
    workers(client)
    with distributed.get_task_stream(client) as ts, connect(c.scheduler_address) as reader:
        spread = diagnose_paths([DLRM], reader=reader)
    assert as_json(spread) == as_json(diagnose_paths([DLRM]))
    keys = completed_loads(ts.data)
    assert len(keys) == 8 and len({k.split("-", 3)[3] for k in keys}) == 8
    assert sorted(reader.stats.read_on.values()) == [4, 4]  # split by bytes over the two workers


def test_ranks_repeated_names_and_metadata_arrive_once(cluster):
    c, client = cluster
    workers(client)
    with connect(c.scheduler_address) as reader:
        kept_once(reader.load([DLRM], DEFAULT_MAX_BYTES, reduce_rank))


def test_diff_reads_both_runs_on_the_cluster(cluster, tmp_path, capsys):
    from diagnose.diff import run_diff

    c, client = cluster
    workers(client)
    assert run_diff(str(DLRM), str(DLRM), tmp_path / "here") == 0
    assert run_diff(str(DLRM), str(DLRM), tmp_path / "there", cluster=c.scheduler_address) == 0
    said = capsys.readouterr().err
    assert ": 16 file(s) read on 2 of 2 worker(s)" in said  # both runs, counted together
    assert (orjson.loads((tmp_path / "there" / "diff.json").read_bytes())
            == orjson.loads((tmp_path / "here" / "diff.json").read_bytes()))


def kill_at_first_result(client, victim: str):
    """A progress callback that SIGKILLs the `victim` worker's process when the first file is done:
    the victim still holds files it has not finished."""
    pid = client.run(os.getpid, workers=[victim])[victim]
    fired = []

    def progress(done: int, total: int, name: str) -> None:
        if not fired:
            fired.append(name)
            os.kill(pid, signal.SIGKILL)
    return progress, fired


def test_a_worker_killed_mid_analysis_has_its_files_retried_on_the_other(cluster):
    c, client = cluster
    victim = workers(client)[1]
    progress, fired = kill_at_first_result(client, victim)
    with connect(c.scheduler_address) as reader:
        spread = diagnose_paths([DLRM], reader=reader, progress=progress)
    assert fired
    assert reader.stats.retried, "the victim had unfinished files"
    assert not reader.stats.lost and not spread.skipped
    assert list(spread.run.ranks_found) == list(range(8))
    assert as_json(spread) == as_json(diagnose_paths([DLRM]))


def slow_down(client, addr: str, s: float) -> None:
    """The worker at `addr` waits `s` before each file: its tasks finish after the other's."""
    def patch(s=s):
        import time

        import diagnose.ingest.cluster as c

        read = c.load_one
        c.load_one = lambda args: (time.sleep(s), read(args))[1]
    client.run(patch, workers=[addr])


def test_files_batched_into_tasks_are_read_once_and_give_the_single_machine_diagnosis(cluster, monkeypatch):
    c, client = cluster
    workers(client)
    monkeypatch.setattr(dcluster, "MIN_BATCHES", 1)  # 4 files a worker: one task each
    with distributed.get_task_stream(client) as ts, connect(c.scheduler_address) as reader:
        spread = diagnose_paths([DLRM], reader=reader)
    assert as_json(spread) == as_json(diagnose_paths([DLRM]))
    keys = completed_loads(ts.data)
    assert len(keys) == 2 and all(k.endswith("+3") for k in keys), keys
    assert sorted(reader.stats.read_on.values()) == [4, 4] and reader.stats.files == 8


def test_a_killed_workers_unfinished_batch_is_retried_file_by_file(cluster, monkeypatch):
    c, client = cluster
    victim = workers(client)[1]
    monkeypatch.setattr(dcluster, "MIN_BATCHES", 1)
    slow_down(client, victim, 1.0)  # its one task of 4 files is still running when the other's arrives
    progress, fired = kill_at_first_result(client, victim)
    with distributed.get_task_stream(client) as ts, connect(c.scheduler_address) as reader:
        spread = diagnose_paths([DLRM], reader=reader, progress=progress)
    assert fired and len(reader.stats.retried) == 4 and not reader.stats.lost
    retries = [k for k in completed_loads(ts.data) if k.startswith("diagnose-load-2-")]
    assert len(retries) == 4 and not any("+" in k for k in retries), retries  # each retried alone
    assert list(spread.run.ranks_found) == list(range(8))
    assert as_json(spread) == as_json(diagnose_paths([DLRM]))


def test_results_travel_in_a_protocol_that_unpickles_small_arrays_compactly():
    """Protocol 5 unpickles each array as a view on a buffer of its own: a DLRM rank's result took
    94 KB in the client against 78 KB with protocol 4 (#20). The results use the compact one."""
    import pickle
    import tracemalloc

    from diagnose.ingest.assemble import load_one

    args = (str(rank_files()[0]), DEFAULT_MAX_BYTES, reduce_rank)

    def held(blob: bytes) -> int:
        tracemalloc.start()
        try:
            x = pickle.loads(blob)  # noqa: F841 - held while measured
            return tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()

    (travelled,) = dcluster.load_remote([args])
    assert held(travelled) < 0.9 * held(pickle.dumps(load_one(args), protocol=5))


def test_batches_cut_one_workers_files_by_count_and_bytes():
    def files(sizes):
        return [Listed(0, f"/t/rank{i}.json", size, 0) for i, size in enumerate(sizes)]

    mb = 1024**2
    many = files([mb] * 40)
    cut = batches(many)
    assert [len(b) for b in cut] == [8] * 5 and [f for b in cut for f in b] == many  # order kept
    assert [len(b) for b in batches(files([mb] * 10))] == [2] * 5  # at least MIN_BATCHES tasks
    assert [len(b) for b in batches(files([mb] * 3))] == [1, 1, 1]
    assert [len(b) for b in batches(files([100 * mb, 30 * mb, 30 * mb, 30 * mb] + [mb] * 28))] == [1, 2, 8, 8, 8, 5]  # 100 MB alone; 30+30; 30 and 7 small
    assert batches([]) == []


def test_a_worker_lost_with_files_no_other_sees_reports_them_skipped(cluster, tmp_path):
    c, client = cluster
    disks = two_hosts(tmp_path, range(0, 4), range(4, 8))
    give_disks(client, disks)
    victim = workers(client)[1]  # holds hostB: ranks 4-7
    progress, fired = kill_at_first_result(client, victim)
    with connect(c.scheduler_address) as reader:
        spread = diagnose_paths([DISK], reader=reader, progress=progress)
    assert fired and reader.stats.lost and not reader.stats.retried
    lost = {int(Path(p).name[len("worker")]) for p in reader.stats.lost}
    assert lost <= set(range(4, 8))
    assert set(spread.run.ranks_found) == set(range(8)) - lost
    assert all("was lost while reading it, and no other worker sees it" in s for s in spread.skipped)
    assert len(spread.skipped) == len(lost)


def test_the_command_line_with_a_local_cluster(tmp_path):
    res = CliRunner().invoke(_main(), ["analyze", "--cluster", "local:2", str(DLRM), "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "cluster LocalCluster of 2: 8 file(s) read on 2 of 2 worker(s)" in res.output
    written = orjson.loads((tmp_path / "diagnosis.json").read_bytes())
    assert written == as_json(diagnose_paths([DLRM]))


def test_the_documented_deployment_a_scheduler_and_a_worker_a_host(tmp_path):
    """docs/cluster.md's deployment as written: `dask scheduler`, then `dask worker ... --nthreads 1
    --memory-limit 0` started apart for each host (one process each here, where the docs say as
    many as the host's free cores), each worker's environment naming its own disk, and the
    command in a process of its own: not a LocalCluster the client starts and knows."""
    disks = two_hosts(tmp_path, range(0, 4), range(4, 7))  # rank 7 on neither host
    where = tmp_path / "scheduler.json"
    dask = [sys.executable, "-m", "dask"]
    procs = [subprocess.Popen(dask + ["scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address",
                                      ":0", "--scheduler-file", str(where)],
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        for disk in disks:
            procs.append(subprocess.Popen(
                dask + ["worker", "--scheduler-file", str(where), "--nthreads", "1", "--nworkers", "1",
                        "--memory-limit", "0", "--no-dashboard"],
                env={**os.environ, "DIAGNOSE_TEST_DISK": str(disk)}, start_new_session=True,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        with distributed.Client(scheduler_file=str(where), timeout=60) as c:
            c.wait_for_workers(2, timeout=60)
            address = c.scheduler.address
        res = subprocess.run([sys.executable, "-m", "diagnose.cli", "analyze", "--cluster", address,
                              "--local-path", DISK, "--out", str(tmp_path / "out")],
                             capture_output=True, text=True, timeout=300)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the worker's nanny and its process with it
            except ProcessLookupError:
                pass
            p.wait(timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"cluster {address}: 7 file(s) read on 2 of 2 worker(s)" in res.stdout + res.stderr
    written = orjson.loads((tmp_path / "out" / "diagnosis.json").read_bytes())
    assert written == as_json(diagnose_paths([d / "traces" for d in disks]))
    assert any("missing rank(s) 7" in w for w in written["warnings"])


def test_a_worker_on_other_code_of_the_same_version_is_refused_by_name(cluster):
    """A worker left on older code of the same version would reduce its ranks by other rules, and
    its results would join the others' in one diagnosis: the client compares a digest of the code
    too, and names the worker."""
    c, client = cluster
    odd = workers(client)[1]

    def other_code(on: bool) -> None:
        import diagnose.ingest.cluster as cl

        if on:
            cl._real_digest, cl.code_digest = cl.code_digest, lambda: "0123456789ab"
        elif hasattr(cl, "_real_digest"):
            cl.code_digest = cl._real_digest
            del cl._real_digest

    client.run(other_code, True, workers=[odd])
    try:
        with pytest.raises(DiagnoseError, match=rf"worker {odd} runs torch-diagnose \S+\+0123456789ab, this "
                                                rf"client \S+\+{dcluster.code_digest()} .*1 worker\(s\) differ"):
            with connect(c.scheduler_address) as reader:
                diagnose_paths([DLRM], reader=reader)
    finally:
        client.run(other_code, False, workers=[odd])
    with connect(c.scheduler_address) as reader:  # the same code again: read as before
        assert len(diagnose_paths([DLRM], reader=reader).run.ranks_found) == 8


def test_the_code_digest_follows_the_files_not_where_they_are(tmp_path):
    """The same files copied elsewhere give the same digest; one byte changed in one, another."""
    import diagnose

    def digest_of(root: Path) -> str:
        code = f"import sys; sys.path.insert(0, {str(root)!r}); import diagnose.ingest.cluster as c; " \
               f"assert c.__file__.startswith({str(root)!r}), c.__file__; print(c.code_digest())"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              check=True, cwd=tmp_path).stdout.strip()

    copy = tmp_path / "elsewhere"
    shutil.copytree(Path(diagnose.__file__).resolve().parent, copy / "diagnose",
                    ignore=shutil.ignore_patterns("__pycache__"))
    assert digest_of(copy) == dcluster.code_digest()
    # a wheel installs the probes, reports and examples inside the package, an editable install
    # keeps them beside it: the same code either way
    (copy / "diagnose" / "reports").mkdir()
    (copy / "diagnose" / "reports" / "html.py").write_text("# installed inside the package\n")
    assert digest_of(copy) == dcluster.code_digest()
    f = copy / "diagnose" / "analyzers" / "straggler.py"
    f.write_bytes(f.read_bytes() + b"\n")
    assert digest_of(copy) != dcluster.code_digest()
    # what is left out is exactly what pyproject maps in from beside the package
    import tomllib

    cfg = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    mapped = cfg["tool"]["setuptools"]["package-dir"]
    assert set(dcluster.BESIDE) == {k.removeprefix("diagnose.") for k in mapped if k != "diagnose"}


def test_dasks_own_logs_are_kept_short_while_connected():
    """Dask keeps its last 1,000 messages on each stream, and its transitions, for its debugging:
    the client kept every task it sent, and a LocalCluster's scheduler (in the client's process)
    every task message with its arguments (#20). Short while connected; Dask's own after."""
    import dask

    before = dask.config.get("distributed.admin.low-level-log-length")
    with connect("local:1") as reader:
        sched = reader.client.cluster.scheduler
        kept = [reader.client.scheduler_comm.recent_message_log.maxlen, sched.transition_log.maxlen] + \
            [b.recent_message_log.maxlen for b in sched.stream_comms.values()]
        assert len(kept) == 3 and set(kept) == {dcluster.LOW_LEVEL_LOG}
    assert dask.config.get("distributed.admin.low-level-log-length") == before


def _main():
    from diagnose.cli import main

    return main


@pytest.mark.parametrize("text, want", [
    ("local:2", ("local", 2)), ("tcp://10.0.0.1:8786", ("tcp://10.0.0.1:8786", None)),
    ("sched:8786", ("tcp://sched:8786", None)), ("tls://h:1", ("tls://h:1", None)),
])
def test_addresses(text, want):
    assert parse_address(text) == want


@pytest.mark.parametrize("argv, says", [
    (["analyze", "--cluster", "local:0", "x"], "local:N needs N workers"),
    (["analyze", "--cluster", "http://x:1", "x"], "not a Dask scheduler address"),
    (["analyze", "--local-path", "/x"], "give --cluster ADDRESS too"),
    (["analyze", "--cluster", "local:2"], "no traces given"),
    (["analyze", "--cluster", "local:2", "--hta", "x"], "--hta reads the traces on this machine"),
    (["scale", "--cluster", "local:2", "--nproc", "1,2", "--", "python", "t.py"], "give --runs N=DIR"),
    (["diff", "--cluster", "local:2", "--hta", "a", "b"], "--hta reads the traces on this machine"),
    (["diff", "--cluster", "nowhere", "a", "b"], "not a Dask scheduler address"),
])
def test_bad_cluster_options_are_one_line_and_exit_2(argv, says):
    res = CliRunner().invoke(_main(), argv)
    assert res.exit_code == 2 and says in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1


def test_an_unreachable_scheduler_is_one_error():
    with pytest.raises(DiagnoseError, match="cannot reach the Dask scheduler at tcp://127.0.0.1:9 "):
        with connect("tcp://127.0.0.1:9", timeout_s=1):
            pass


def test_without_dask_the_option_says_how_to_install_it_and_plain_analyze_never_imports_it(tmp_path):
    code = ("import sys; sys.modules['distributed'] = None\n"  # as if not installed: import raises
            "from click.testing import CliRunner\nfrom diagnose.cli import main\n"
            f"r = CliRunner().invoke(main, ['analyze', '--cluster', 'local:2', {str(DLRM)!r}])\n"
            "print('A', r.exit_code, r.output.strip())\n"
            f"r = CliRunner().invoke(main, ['analyze', {str(DLRM)!r}, '--out', {str(tmp_path)!r}])\n"
            "print('B', r.exit_code, 'dask' in sys.modules or 'distributed' in sys.modules and "
            "sys.modules['distributed'] is not None)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    lines = {ln[:1]: ln[2:] for ln in out.splitlines() if ln[:2] in ("A ", "B ")}
    assert lines["A"].startswith("2 ") and "pip install 'torch-diagnose[dask]'" in lines["A"], out
    assert lines["B"] == "0 False", out


def test_the_stats_line():
    s = ClusterStats("tcp://h:8786", workers=4, files=8, bytes_back=8 * 300 * 1024, read_on={"a": 5, "b": 3},
                     retried=["x"], lost=[])
    assert s.line() == ("cluster tcp://h:8786: 8 file(s) read on 2 of 4 worker(s); 2.3 MiB travelled back "
                        "(300 KiB per file); 1 retried after a worker was lost")


def test_a_workers_tasks_go_a_few_at_a_time_and_each_file_is_read_once(cluster, monkeypatch):
    """TASKS_IN_FLIGHT a worker, the next submitted as one finishes (#20: every task's state held
    at once grew with the rank count): the same diagnosis, each file read once."""
    c, client = cluster
    workers(client)
    monkeypatch.setattr(dcluster, "TASKS_IN_FLIGHT", 1)  # 4 one-file tasks a worker, one at a time
    with distributed.get_task_stream(client) as ts, connect(c.scheduler_address) as reader:
        spread = diagnose_paths([DLRM], reader=reader)
    assert as_json(spread) == as_json(diagnose_paths([DLRM]))
    keys = completed_loads(ts.data)
    assert len(keys) == 8 and all(k.startswith("diagnose-load-1-") for k in keys), keys
    assert sorted(reader.stats.read_on.values()) == [4, 4] and not reader.stats.retried


def test_a_killed_workers_tasks_not_yet_submitted_go_to_the_other(cluster, monkeypatch):
    c, client = cluster
    victim = workers(client)[1]
    monkeypatch.setattr(dcluster, "TASKS_IN_FLIGHT", 1)
    slow_down(client, victim, 1.0)  # its first task is still running when the other's first arrives
    progress, fired = kill_at_first_result(client, victim)
    with connect(c.scheduler_address) as reader:
        spread = diagnose_paths([DLRM], reader=reader, progress=progress)
    assert fired and not reader.stats.lost and not spread.skipped
    assert len(reader.stats.retried) == 1  # the one in flight; the three queued are first reads elsewhere
    assert list(spread.run.ranks_found) == list(range(8))
    assert as_json(spread) == as_json(diagnose_paths([DLRM]))
