"""One multi-node job's run directories, found side by side and analysed together.

Each node of a multi-node job runs its own `diagnose run` (a torchrun a node), and each makes its
own run directory holding that node's ranks. A node's analysis alone cannot see the others: a
peer's slow step reads as communication here (recorded: a 2-node job's node 0 called rank 1's 100
ms sleep "exposed communication"; the caution beside its verdict says so). Where the nodes share a
filesystem and one --out, their run directories sit side by side, and once each node's launcher
has analysed its own ranks it looks for the others of the same job and analyses every rank
together, into its run directory's `all-nodes/`.

The same job, by evidence, all of it required:
- the same rendezvous in every rank's environment as the probes recorded it (MASTER_ADDR,
  MASTER_PORT, WORLD_SIZE, TORCHELASTIC_RUN_ID, SLURM_JOB_ID; probes/meta.py);
- ranks disjoint from the others' (a directory holding one of ours is another run, or a copy);
- a run directory of the same owner as ours (a shared --out may hold other users' runs);
- records that overlap in time (a job is synchronous; a job that ran before on the same address
  and port, a static rendezvous's 29500, ended before this one began).
Finished: a sibling's launcher holds its run lock while its job runs and while it analyses its own
ranks (rundir.RunLock), and each launcher releases its own before it looks, so none waits on
another's wait. A node's launcher waits for the siblings it found, at most WAIT_S; it waits for
none when it found none (node-local disks: nothing to wait for; the line it prints says how to
analyse them together). One analysis for the job: the first launcher to create the claim file in
the first run directory (by name) of the job analyses; the others name where it is.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from diagnose.probedata import (
    MAX_STEP_LINE_BYTES,
    _lines_newest_first,
    has_records,
    read_meta,
)
from diagnose.probes.safefs import open_regular
from diagnose.rundir import TRACES, last_attempt, run_dirs, run_is_live

TOGETHER = "all-nodes"
"""The directory of the job's analysis, in the run directory of the launcher that made it."""
CLAIM = ".all-nodes.claim"
IDENTITY = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
WAIT_S = 120.0
"""How long a node's launcher waits for the other nodes' launchers to finish their own analysis."""
POLL_S = 0.5
MAX_DIRS = 64
"""The newest run directories of --out looked at: a job's nodes start within its rendezvous."""
MAX_RANK_FILES = 4096
MAX_LINE = MAX_STEP_LINE_BYTES
_META = re.compile(r"^rank(\d+)\.probe\.json$")
_STEPS = re.compile(r"^rank(\d+)\.steps\.jsonl$")


@dataclass(frozen=True, slots=True)
class NodeRun:
    run_dir: Path
    traces: Path
    """Its traces directory (a restarted job's last attempt)."""
    ranks: frozenset[int]
    identity: tuple[str | None, ...]
    span: tuple[float, float] | None
    """Epoch seconds: the first step's start on any rank, the last step's end on any rank."""


def node_run(run_dir: Path) -> NodeRun | None:
    """What the probes wrote in one run directory, or None where they wrote no rendezvous facts."""
    traces, _ = last_attempt(run_dir / TRACES, has_records)
    metas: dict[int, dict] = {}
    starts, ends = [], []
    try:
        names = sorted(os.listdir(traces))[:MAX_RANK_FILES]
    except OSError:
        return None
    for name in names:
        if m := _META.match(name):
            try:
                metas[int(m.group(1))] = read_meta(traces / name)
            except ValueError:
                continue
        elif _STEPS.match(name) and (span := _record_span(traces / name)) is not None:
            starts.append(span[0])
            ends.append(span[1])
    envs = [m.get("env") for m in metas.values() if isinstance(m.get("env"), dict)]
    if not envs:
        return None
    identity = _identity(envs[0])
    if None in identity[:3]:  # no address, port or world size: nothing to tell the job by
        return None
    if any(_identity(e) != identity for e in envs):
        return None  # ranks of different jobs in one directory: not one node's run
    span = (min(starts), max(ends)) if starts and ends else None
    return NodeRun(run_dir=run_dir, traces=traces, ranks=frozenset(metas), identity=identity, span=span)


def _identity(env: dict) -> tuple[str | None, ...]:
    return tuple(None if env.get(k) is None else str(env[k]) for k in IDENTITY)


def _record_span(path: Path) -> tuple[float, float] | None:
    """(first step's start, last step's end), epoch seconds, from a rank's step record: its first
    line and its last whole one (read from the end, bounded)."""
    try:
        with open_regular(path) as f:
            first = _step(f.readline(MAX_LINE))
            size = os.fstat(f.fileno()).st_size
            last = next((s for line in _lines_newest_first(f, size) if line and (s := _step(line))), None)
    except OSError:
        return None
    if first is None or last is None:
        return None
    return first[0], last[0] + last[1] / 1000


def _step(line: bytes) -> tuple[float, float] | None:
    """(start, dur_ms) of one step record's line, or None."""
    try:
        rec = json.loads(line)
        start, dur = rec["start"], rec["dur_ms"]
    except (ValueError, TypeError, KeyError):
        return None
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (start, dur))
    return (float(start), float(dur)) if ok else None


def _overlap(a: tuple[float, float] | None, b: tuple[float, float] | None) -> bool:
    return a is not None and b is not None and a[0] <= b[1] and b[0] <= a[1]


def siblings(ours: NodeRun) -> list[NodeRun]:
    """The other run directories of our job beside ours (newest first, each rank once)."""
    found: list[NodeRun] = []
    taken = set(ours.ranks)
    for d in reversed(run_dirs(ours.run_dir.parent)[-MAX_DIRS:]):
        if d == ours.run_dir or not _same_owner(d, ours.run_dir):
            continue
        n = node_run(d)
        if n is None or n.identity != ours.identity or n.ranks & taken or not _overlap(n.span, ours.span):
            continue
        found.append(n)
        taken |= n.ranks
    return found


def _same_owner(a: Path, b: Path) -> bool:
    """A job's nodes run as one user: another user's directory in a shared --out is never joined
    (it could hold made-up records matching our rendezvous)."""
    try:
        return os.lstat(a).st_uid == os.lstat(b).st_uid
    except OSError:
        return False


def _claim(members: list[NodeRun], ours: NodeRun) -> Path | None:
    """None: ours is the job's analysis to make. Else the directory another launcher claimed for it."""
    first = min(members, key=lambda n: n.run_dir.name).run_dir
    path = first / CLAIM
    mine = str(ours.run_dir / TOGETHER)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if not isinstance(exc, FileExistsError):
            return None  # cannot write there (another user's directory): this launcher analyses, its own copy
        try:
            with open_regular(path) as f:
                named = f.read(4096).decode("utf-8", "replace").strip()
        except OSError:
            named = ""
        return Path(named) if named else first
    try:
        os.write(fd, mine.encode())
    finally:
        os.close(fd)
    return None


@dataclass(frozen=True, slots=True)
class Together:
    """What a node's launcher found of its job's other nodes."""

    members: tuple[NodeRun, ...]
    """Every node run of the job found here, ours first."""
    still_running: tuple[Path, ...] = ()
    elsewhere: Path | None = None
    """Another launcher's analysis of the job, when it claimed it first."""


def find_together(run_dir: Path, say, wait_s: float = WAIT_S) -> Together | None:
    """Our job's other node runs beside ours, once their launchers have finished (at most wait_s),
    and who analyses them; None when there are none to join (`say`: a line to the user)."""
    ours = node_run(run_dir)
    if ours is None:
        return None
    others = siblings(ours)
    if not others:
        return None
    deadline = time.monotonic() + wait_s
    live = [n.run_dir for n in others if run_is_live(n.run_dir)]
    if live:
        say(f"waiting for the other nodes' launchers to finish ({len(live)} of {len(others)}; at most "
            f"{wait_s:.0f} s) to analyse every node's ranks together")
    while live and time.monotonic() < deadline:
        time.sleep(POLL_S)
        live = [d for d in live if run_is_live(d)]
    members = (ours, *others)
    if live:
        return Together(members=members, still_running=tuple(live))
    return Together(members=members, elsewhere=_claim(list(members), ours))
