"""Read each rank's trace where it lies: on the workers of a Dask cluster (`--cluster`).

A 1,024-rank job's traces sit on its hosts' local disks or on a shared filesystem that is slow
to read from one client. Each rank is already reduced to a small summary in a worker process
(assemble.load_one: timeline, each check's per-rank facts, the few events cited as evidence);
here that same function runs on Dask workers next to the files, and only its result, pickled,
travels back. The client then assembles the Run and runs the checklist exactly as for local
files, so the diagnosis is the same.

Why Dask and not a home-made pool: users who analyse thousands of ranks already run a
scheduler (or can start one with their job's launcher), and it brings worker liveness,
transport and placement (`workers=` restrictions) that are hard to get right by hand.
What is ours: which worker reads which file (each file once, on a worker that sees it) and
what happens when a worker dies (its files retried once on another worker that sees them,
then reported as skipped: dask's own retry would wait forever for a restricted task whose
only worker is gone).

Paths are listed on the workers, never on the client; `$VAR` and `~` are expanded on each
worker, so `--local-path '$SLURM_TMPDIR/traces'` names each host's own node-local disk.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from diagnose.errors import DiagnoseError
from diagnose.ingest.assemble import INTERNAL_ERROR, Loaded, Progress, Reduce, Keep, load_one, packed
from diagnose.ingest.discover import discover_traces
from diagnose.ingest.windows import Choice, choose_window

INSTALL = "pip install 'torch-diagnose[dask]'"
LOCAL = "local:"
POLL_S = 0.5
"""How often the client checks that the workers holding unfinished files are still alive."""
IDLE_S = 0.02
"""The client's sleep when no file finished: short beside a file's read (tenths of a second)."""
RESULT_WAIT_S = 5.0
"""How long to wait for a finished file's result before checking that its worker still holds it."""
CONNECT_TIMEOUT_S = 10.0
"""Dask retries a refused connection until then: a scheduler not up yet, or a wrong address."""
BATCH_FILES = 8
"""Files per task at most: per-task overhead shared (see `batches`), progress still every few files."""
BATCH_BYTES = 64 * 1024**2
"""Trace bytes per task at most: a big trace's own read dwarfs a task's overhead, so it goes alone."""
MIN_BATCHES = 4
"""Tasks per worker at least, when it has that many files."""
LOW_LEVEL_LOG = 16
"""Dask's `distributed.admin.low-level-log-length` (1,000 by default) while connected: how many of
its recent messages each batched stream keeps, and a scheduler's transitions and events, for
Dask's own debugging. At 1,000 the client kept every task it submitted (the pickled graph sent
to the scheduler) and a LocalCluster's scheduler, in the client's process, every task message it
sent to a worker, each task's arguments included: at 1,024 DLRM ranks the client held 2.7 MB
of Python memory once the last result had arrived, 1.6 with the logs short (tracemalloc; #20).
Not shortened: the record of the machine's
load (`distributed.admin.system-monitor.log-length`, two samples a second, 7,200 kept); at 16 the
cluster path took 55-59 s at 1,024 ranks against 43-47 s (two runs each)."""
TASKS_IN_FLIGHT = 4
"""Tasks submitted to a worker at a time, its next one submitted as one finishes: not every task of
the run at once, whose states the client (and a LocalCluster's scheduler, in the client's process)
kept until the end (#20: 128 tasks at 1,024 DLRM ranks against 32 at 256). One run each, within
the run-to-run noise: with a quarter as many tasks the client kept 1.5 MB less once the results
had arrived; bounded so, its rise while they arrived was 6.9 MB against 7.5 and 7.7."""


@dataclass(frozen=True, slots=True, order=True)
class Listed:
    """A trace file as a worker lists it. Several workers listing the same (path, size, mtime)
    see one file (a shared filesystem, or two workers on one host): it is read once."""

    given: int
    """Which of the paths the user gave it was found under (results keep the given order)."""
    path: str
    size: int
    mtime_ns: int


@dataclass(slots=True)
class ClusterStats:
    """What the cluster did, for the terminal line and the benchmark."""

    address: str
    workers: int = 0
    files: int = 0
    bytes_back: int = 0
    """Pickled bytes of the per-rank results that travelled to the client, in all."""
    read_on: dict[str, int] = field(default_factory=dict)
    """Files read per worker address."""
    retried: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)

    def line(self) -> str:
        per = self.bytes_back / self.files / 1024 if self.files else 0.0
        out = (f"cluster {self.address}: {self.files} file(s) read on {len(self.read_on)} of {self.workers} "
               f"worker(s); {self.bytes_back / 1024**2:.1f} MiB travelled back ({per:.0f} KiB per file)")
        if self.retried:
            out += f"; {len(self.retried)} retried after a worker was lost"
        if self.lost:
            out += f"; {len(self.lost)} skipped (lost with their worker)"
        return out


# -- what runs on the workers (module-level: Dask pickles these by reference) ---------------------

def _version() -> str:
    """This installation's version and a digest of its code (`code_digest`)."""
    from diagnose import __version__

    return f"{__version__}+{code_digest()}"


BESIDE = ("probes", "reports", "examples")
"""Packages installed as diagnose.<name> from the repository's top-level folders (pyproject's
package-dir): inside the package in a wheel, beside it in an editable install. Left out of the
digest, which would otherwise differ between the two for the same code; the reading and the
reductions a worker runs are not in them."""


def code_digest() -> str:
    """A digest of the diagnose package's own source files (their paths and bytes). The version
    alone did not tell two builds apart: a worker left on older code of the same version would
    reduce its ranks by other rules, and the client would mix its results with the others' in one
    diagnosis without a word. The same files give the same digest however they were installed."""
    import hashlib

    import diagnose

    root = Path(diagnose.__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if rel.parts[0] in BESIDE:
            continue
        h.update(rel.as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def list_here(paths: list[str], window: int | None = None) -> tuple[str, list[Listed], list[str], list]:
    """On a worker: (its host, the trace files it sees under `paths`, problems with what it sees,
    the windows it chose). A path that does not exist here is another host's: nothing to list, no
    problem. Where a path holds one run's repeated profiler windows (ingest/windows.py), only the
    window chosen here is listed, and the choice returned: the client checks that every worker
    chose the same one (DaskReader.listing)."""
    found: list[Listed] = []
    problems: list[str] = []
    chose: list = []
    for i, raw in enumerate(paths):
        p = os.path.expanduser(os.path.expandvars(raw))
        if not os.path.exists(p):
            continue
        try:
            choice = choose_window([p], window)
            files = choice.files if choice is not None else discover_traces([p])
        except DiagnoseError as exc:
            problems.append(str(exc))
            continue
        chose.append((i, choice))
        for f in files:
            try:
                st = f.stat()
            except OSError:
                continue
            found.append(Listed(i, str(f), st.st_size, st.st_mtime_ns))
    return socket.gethostname(), found, problems, chose


RESULT_PROTOCOL = 4
"""Pickle protocol of the results. Not 5: unpickled in-band, each numpy array of protocol 5 stays a
view on a buffer object of its own, which for a rank's many small arrays cost the client 2.7x
their memory (1,000 arrays of 20 floats: 761 KB against 280 KB) and 9.6 MB more at 512 DLRM
ranks than the local pool's results (tracemalloc after loading)."""


def load_remote(batch: list[tuple[str, int, Reduce | None]]) -> list[bytes]:
    """On a worker: each file's Loaded, what the client writes to its spill as it arrives already
    pickled (assemble.packed), pickled here so that what travels is counted exactly. load_one by
    this module's name, not assemble.load_packed: tests slow a worker's read through it."""
    return [pickle.dumps(packed(load_one(args)), protocol=RESULT_PROTOCOL) for args in batch]


def batches(files: list[Listed], at_least: int | None = None) -> list[list[Listed]]:
    """One worker's files (biggest first) cut into tasks: up to BATCH_FILES files and BATCH_BYTES
    each, and at least `at_least` tasks when there are that many files, so that progress moves
    and a lost worker's finished tasks are kept. One task per file cost the client (which also
    hosts a LocalCluster's scheduler) about 4.5 ms of CPU a file and the worker about 2 ms beside
    the read itself (256 DLRM ranks here, getrusage and thread_time): on a 2-core machine that is
    a sixth of the 37-45 ms a file's read takes there."""
    per = max(1, min(BATCH_FILES, len(files) // max(MIN_BATCHES if at_least is None else at_least, 1)))
    out: list[list[Listed]] = []
    for f in files:
        last = out[-1] if out else None
        if last is None or len(last) >= per or sum(g.size for g in last) + f.size > BATCH_BYTES:
            out.append([f])
        else:
            last.append(f)
    return out


def _one_choice(chose: dict[str, list], hosts: dict[str, str]) -> Choice | None:
    """The window every worker read, where the paths hold repeated windows; DiagnoseError where
    workers chose differently (one host's ranks wrote fewer windows, or one window a rank beside
    another host's several): their ranks would be read from different windows as one run."""
    picked = {(addr, i): (c if c is not None and c.written > 1 else None) for addr, got in chose.items() for i, c in got}
    windowed = {i for (_, i), c in picked.items() if c is not None}
    if not windowed:
        return None
    # per path with windows: one window number, and no worker reading it as one trace a rank
    ways = {(i, c.analysed if c is not None else 0) for (_, i), c in picked.items() if i in windowed}
    if len(ways) != len(windowed):
        said = "; ".join(sorted({f"{hosts.get(a, a)}: " + (f"window {c.analysed} of {c.written}" if c is not None
                                                             else "one trace a rank")
                                 for (a, _), c in picked.items()}))
        raise DiagnoseError(f"the workers' traces are not one window of one run ({said}); pass one window's "
                            "own directory (or --window K)")
    return next(c for c in picked.values() if c is not None)


# -- the client side ------------------------------------------------------------------------------

def _killed(exc: BaseException | None) -> bool:
    return type(exc).__name__ == "KilledWorker"

def parse_address(text: str) -> tuple[str, int | None]:
    """(`ADDRESS` or "local", workers for a LocalCluster); a bad one raises ValueError."""
    t = text.strip()
    if t.startswith(LOCAL):
        n = t[len(LOCAL):]
        if not n.isdigit() or not 1 <= int(n) <= 1024:
            raise ValueError(f"{text!r}: local:N needs N workers, 1 to 1024 (e.g. local:2)")
        return "local", int(n)
    if "://" in t:
        scheme, rest = t.split("://", 1)
        if scheme not in ("tcp", "tls", "ucx", "inproc", "ws", "wss") or not rest:
            raise ValueError(f"{text!r}: not a Dask scheduler address (tcp://HOST:8786, or local:N)")
        return t, None
    host, _, port = t.rpartition(":")
    if host and port.isdigit():
        return f"tcp://{t}", None
    raise ValueError(f"{text!r}: not a Dask scheduler address (tcp://HOST:8786, or local:N)")


def paths_to_read(paths: tuple[str, ...], cluster: str | None, local_path: tuple[str, ...],
                  hta: bool = False) -> list[str]:
    """The paths a command reads, with --cluster's rules checked (DiagnoseError otherwise): shared
    by `analyze`, `diff` and `scale`, below the CLI so no command module imports the CLI's."""
    if local_path and cluster is None:
        raise DiagnoseError("--local-path names a directory on the workers of --cluster; give --cluster ADDRESS too")
    if cluster is not None:
        try:
            parse_address(cluster)
        except ValueError as exc:
            raise DiagnoseError(f"--cluster {exc}") from None
        if hta:
            raise DiagnoseError("--hta reads the traces on this machine; with --cluster they are read on the "
                                "workers: drop one")
    out = list(paths) + list(local_path)
    if not out:
        raise DiagnoseError("no traces given: pass TRACE_DIR (or, with --cluster, --local-path DIR)")
    return out


def _spawn_environ() -> dict:
    """The environment Dask gives the LocalCluster's workers, less MALLOC_TRIM_THRESHOLD_: Dask sets
    it to 64 KiB so that long-lived workers hand freed memory back to the OS; ours live for one
    analysis, and each rank's reduction builds and frees many small frames. Measured on 256 DLRM
    ranks here: a file's read alone 31-32 ms of the worker thread's CPU with it, 27-30 without
    (21-25 in a forked local pool); with the checks' reduction too (`bench_cluster.py --per-file
    256`, two runs each) 42-47 against 37-45 ms: within that noise."""
    import dask

    env = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}) or {})
    env.pop("MALLOC_TRIM_THRESHOLD_", None)
    return env


@contextmanager
def connect(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Iterator["DaskReader"]:
    """A reader on the scheduler at `address` (or on a LocalCluster started here and stopped after)."""
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise DiagnoseError(f"--cluster needs Dask, which is not installed: {INSTALL}") from None
    try:
        where, n = parse_address(address)
    except ValueError as exc:
        raise DiagnoseError(f"--cluster {exc}") from None
    import dask

    # read where each is made (the client's and a LocalCluster's scheduler's message streams and
    # logs): set while they are, Dask's own after
    with dask.config.set({"distributed.admin.low-level-log-length": LOW_LEVEL_LOG}):
        cluster = None
        try:
            if n is not None:
                # one thread per process: the per-rank work is pandas/numpy that holds the GIL often;
                # port 0: the scheduler's HTTP endpoints on a free port, never a clash with a running cluster's
                with dask.config.set({"distributed.nanny.pre-spawn-environ": _spawn_environ()}):
                    cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                           dashboard_address=":0", silence_logs=logging.ERROR)
                client = Client(cluster)
            else:
                client = Client(where, timeout=timeout_s)
        except (OSError, TimeoutError) as exc:
            if cluster is not None:
                cluster.close()
            raise DiagnoseError(f"cannot reach the Dask scheduler at {address} ({exc})") from None
        try:
            yield DaskReader(client, address if n is None else f"LocalCluster of {n}")
        finally:
            client.close()
            if cluster is not None:
                cluster.close()


class DaskReader:
    """Lists the traces on the workers and loads each file once, on a worker that sees it."""

    def __init__(self, client, label: str) -> None:
        self.client = client
        self.stats = ClusterStats(label)
        self.windows: Choice | None = None
        """Of one run's repeated profiler windows, the one the workers read (set by listing)."""

    def _check_workers(self) -> None:
        here = _version()
        try:
            versions = self.client.run(_version)
        except (ImportError, AttributeError) as exc:
            raise DiagnoseError(f"the Dask workers cannot import diagnose ({exc}): install torch-diagnose "
                                "(the client's version) on every worker") from None
        if not versions:
            raise DiagnoseError(f"the Dask scheduler at {self.stats.address} has no workers")
        other = {a: v for a, v in versions.items() if v != here}
        if other:
            a, v = next(iter(other.items()))
            raise DiagnoseError(f"worker {a} runs torch-diagnose {v}, this client {here} (version+code digest): "
                                f"install one build everywhere ({len(other)} worker(s) differ)")
        self.stats.workers = len(versions)

    def listing(self, paths: list[str], window: int | None = None) -> tuple[dict[Listed, list[str]], dict[str, str]]:
        """Every file the workers see, with the workers that see it; and each worker's host."""
        self._check_workers()
        seen = self.client.run(list_here, [str(p) for p in paths], window)
        hosts: dict[str, str] = {}
        where: dict[Listed, list[str]] = {}
        problems: list[str] = []
        chose: dict[str, list] = {}
        for addr in sorted(seen):
            host, found, bad, picked = seen[addr]
            hosts[addr] = host
            problems += bad
            chose[addr] = picked
            for f in found:
                where.setdefault(f, []).append(addr)
        self.windows = _one_choice(chose, hosts)
        if not where:
            if problems:
                raise DiagnoseError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
            names = ", ".join(map(str, paths))
            raise DiagnoseError(f"no worker of {self.stats.address} sees a trace file under {names} "
                                "(paths are read on the workers, with $VAR and ~ expanded there)")
        return where, hosts

    def load(self, paths: list[str | Path], max_bytes: int, reduce: Reduce | None,
             progress: Progress | None = None, window: int | None = None) -> list[Loaded]:
        """Each file's Loaded, in the order a local read would give (given path, then file).
        window: of one run's repeated profiler windows, which (`--window K`); `self.windows` says
        which the workers read."""
        from distributed import as_completed

        where, hosts = self.listing([str(p) for p in paths], window)
        files = sorted(where)
        # task keys numbered on from the runs this reader served before (diff: two): never reused
        number = {f: self.stats.files + i for i, f in enumerate(files)}
        self.stats.files += len(files)
        assigned: dict[str, int] = {a: 0 for a in hosts}
        plan: dict[Listed, str] = {}
        for f in sorted(files, key=lambda f: -f.size):  # biggest first, each to its least-loaded reader
            a = min(where[f], key=lambda a: (assigned[a], a))
            plan[f] = a
            assigned[a] += f.size
        tell = progress or (lambda done, n, name: None)
        out: dict[Listed, Loaded] = {}
        keep = Keep()
        tried: dict[Listed, list[str]] = {f: [] for f in files}
        pending: dict[object, list[Listed]] = {}

        def submit(batch: list[Listed], addr: str) -> None:
            for f in batch:
                tried[f].append(addr)
            first = batch[0]
            more = f"+{len(batch) - 1}" if len(batch) > 1 else ""
            fut = self.client.submit(load_remote, [(f.path, max_bytes, reduce) for f in batch], workers=[addr],
                                     allow_other_workers=False, pure=False, retries=0,
                                     key=f"diagnose-load-{len(tried[first])}-{number[first]}-{Path(first.path).name}{more}")
            pending[fut] = batch
            ready.add(fut)

        def lost(f: Listed, addr: str) -> None:
            """The worker reading `f` is gone: once more elsewhere (alone), else skipped."""
            again = [a for a in where[f] if a not in tried[f] and a in alive]
            if len(tried[f]) < 2 and again:
                self.stats.retried.append(f.path)
                submit([f], min(again, key=lambda a: (assigned[a], a)))
                return
            why = ("and again on its retry" if len(tried[f]) > 1 else "and no other worker sees it")
            self.stats.lost.append(f.path)
            out[f] = Loaded(Path(f.path), error=f"{f.path}: worker {addr} on {hosts.get(addr, '?')} was lost "
                                                f"while reading it, {why}")
            tell(len(out), len(files), Path(f.path).name)

        def feed(addr: str) -> None:
            """Submit the worker's next tasks, up to TASKS_IN_FLIGHT of its own in flight."""
            busy = sum(1 for b in pending.values() if tried[b[0]][-1] == addr)
            while queued[addr] and busy < TASKS_IN_FLIGHT:
                submit(queued[addr].popleft(), addr)
                busy += 1

        def gone(addr: str) -> None:
            """A lost worker's tasks not yet submitted: each file to another worker that sees it
            (a first read there, not a retry), else skipped."""
            for f in (f for batch in queued.pop(addr, ()) for f in batch):
                other = [a for a in where[f] if a in alive and a in queued]
                if other:
                    queued[min(other, key=lambda a: (assigned[a], a))].append([f])
                    continue
                self.stats.lost.append(f.path)
                out[f] = Loaded(Path(f.path), error=f"{f.path}: worker {addr} on {hosts.get(addr, '?')} was lost "
                                                    "before reading it, and no other worker sees it")
                tell(len(out), len(files), Path(f.path).name)

        ready = as_completed()
        alive = set(hosts)
        biggest_first = sorted(files, key=lambda f: -f.size)
        queued = {addr: deque(batches([f for f in biggest_first if plan[f] == addr])) for addr in sorted(hosts)}
        for addr in sorted(hosts):
            feed(addr)
        checked = time.monotonic()
        while pending or any(queued.values()):
            done = ready.next_batch(block=False) if not ready.is_empty() else []
            for fut in done:
                if fut not in pending:
                    continue  # cancelled after its worker was lost: already retried or skipped
                batch = pending.pop(fut)
                addr = tried[batch[0]][-1]
                if fut.status == "finished":
                    try:  # its result still lies on the worker: a worker lost now takes it along
                        blobs = fut.result(timeout=RESULT_WAIT_S)
                    except TimeoutError:
                        if addr in set(self.client.nthreads()):
                            pending[fut] = batch  # a slow transfer: fetch it next round
                            ready.add(fut)
                        else:  # dask would recompute it on the one worker allowed, which is gone
                            fut.cancel()
                            for f in batch:
                                lost(f, addr)
                        continue
                    for f, blob in zip(batch, blobs):
                        self.stats.bytes_back += len(blob)
                        self.stats.read_on[addr] = self.stats.read_on.get(addr, 0) + 1
                        out[f] = keep.take(pickle.loads(blob))
                        tell(len(out), len(files), Path(f.path).name)
                elif fut.status == "error" and not _killed(fut.exception()):
                    # load_one never raises: this is the result failing to pickle, or the like
                    for f in batch:
                        out[f] = Loaded(Path(f.path), error=f"{f.path}: could not be read on worker {addr} "
                                                            f"({INTERNAL_ERROR}: {fut.exception()!r:.200}; please report it)")
                        tell(len(out), len(files), Path(f.path).name)
                else:  # its worker killed too often (KilledWorker), or cancelled with the cluster
                    for f in batch:
                        lost(f, addr)
                fut.release()
                if addr in alive and addr in queued:
                    feed(addr)
            if not done:
                time.sleep(IDLE_S)
            if time.monotonic() - checked < POLL_S:
                continue
            checked = time.monotonic()
            try:
                alive = set(self.client.nthreads())
            except (OSError, TimeoutError) as exc:
                raise DiagnoseError(f"lost the Dask scheduler at {self.stats.address} ({exc})") from None
            for fut, batch in list(pending.items()):
                if tried[batch[0]][-1] not in alive:
                    del pending[fut]
                    fut.cancel()
                    for f in batch:
                        lost(f, tried[f][-1])
            for addr in [a for a in queued if a not in alive]:
                gone(addr)
            for addr in queued:
                feed(addr)
        return [out[f] for f in files]

