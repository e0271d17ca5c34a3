"""Hang hints from torch.distributed Flight Recorder dumps: which rank did not enter the
collective everyone else waits in.

Each rank's Flight Recorder keeps its last collectives per process group, numbered by
`collective_seq_id` in issue order. In a hang, the ranks that reached collective #N wait in it
for the ones whose last entry is below N: those are the ranks to look at (a rank-dependent
branch that skips a collective, a data or I/O stall, an exception swallowed on one rank).
When every rank entered the same last collective, no rank is missing: the collective itself
is stuck (network, a dead peer process) or the ranks wait elsewhere.

Dumps are read as JSON only (the Flight Recorder's pickle format is never unpickled: a dump
is untrusted input) from `rank{R}.fr.json` files: written by the probes on request
(`diagnose hang RUN_DIR`), or collected by the user in the same JSON form.
"""
from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from diagnose.errors import DiagnoseError, one_line
from diagnose.ingest import jsonsafe
from diagnose.oncall import write_control
from diagnose.probes.safefs import UnsafePath, read_regular
from diagnose.units import rank_ranges

CONTROL = "hang.json"
MAX_DUMP_BYTES = 256 * 1024**2
_RANK = re.compile(r"rank(\d+)\.fr\.json$")


@dataclass(frozen=True, slots=True)
class Entered:
    seq: int
    op: str
    time_ns: int | None


@dataclass(frozen=True, slots=True)
class GroupState:
    group: str
    """Process group: its id and description, as the dump names it."""
    last: dict[int, Entered]
    """Per rank that has entries in this group: the last collective it entered."""
    frontier: Entered
    behind: tuple[int, ...]
    """Ranks whose last collective is below the frontier: they did not enter it."""
    waiting: tuple[int, ...]
    """Ranks at the frontier."""


@dataclass(slots=True)
class HangReport:
    groups: list[GroupState]
    suspects: list[int]
    no_dump: list[int] = field(default_factory=list)
    """Expected ranks that wrote nothing (stuck without releasing the GIL, or dead)."""
    unavailable: dict[int, str] = field(default_factory=dict)
    """Ranks that answered without a Flight Recorder (not enabled, old torch)."""


def read_dump(path: Path) -> dict:
    """One rank's dump; raises DiagnoseError naming the file (a FIFO, device, oversized file or
    nesting bomb too: read non-blocking and bounded, parsed with a depth limit)."""
    try:
        doc = jsonsafe.loads(read_regular(path, MAX_DUMP_BYTES))
    except UnsafePath as exc:
        raise DiagnoseError(str(exc)) from None
    except OSError as exc:
        raise DiagnoseError(f"cannot read ({exc.strerror or exc})", path) from None
    except ValueError as exc:  # orjson's JSONDecodeError (its depth limit included) and TooDeep
        raise DiagnoseError(f"not valid JSON ({exc}; Flight Recorder dumps are read in their JSON form only, a "
                            "pickle dump is never unpickled)", path) from None
    # a recorder with nothing recorded yet writes no "entries" at all, only its version and configs
    known = isinstance(doc, dict) and ("diagnose_error" in doc or isinstance(doc.get("entries"), list)
                                       or ("version" in doc and "pg_config" in doc))
    if not known or not isinstance(doc.get("entries", []), list):
        raise DiagnoseError("JSON but not a Flight Recorder dump (no entries, version or pg_config)", path)
    return doc


def _label(x) -> str | None:
    """A scalar as text; None for containers (str() of a deeply nested value recurses)."""
    return str(x) if isinstance(x, (str, int, float)) and not isinstance(x, bool) else None


def _last_entered(doc: dict) -> dict[str, Entered]:
    last: dict[str, Entered] = {}
    for e in doc.get("entries") or []:
        if not isinstance(e, dict) or e.get("is_p2p") is True:
            continue  # point-to-point ops are numbered apart and need not match across all ranks
        seq, pg = e.get("collective_seq_id"), e.get("process_group")
        if type(seq) is not int:
            continue
        if isinstance(pg, list):
            pg = ":".join(x for x in map(_label, pg[:2]) if x is not None)
        key = one_line(_label(pg) or _label(e.get("pg_id")) or "?")[:80]
        t = e.get("time_created_ns")
        cur = last.get(key)
        if cur is None or seq > cur.seq:
            last[key] = Entered(seq=seq, op=one_line(_label(e.get("profiling_name")) or "?")[:80],
                                time_ns=t if type(t) is int else None)
    return last


def analyze_hang(dumps: dict[int, dict], expected: list[int]) -> HangReport:
    """Pure: per process group, who is behind the others' last collective."""
    unavailable = {r: one_line(_label(d["diagnose_error"]) or "?")[:200] for r, d in dumps.items()
                   if "diagnose_error" in d}
    per_rank = {r: _last_entered(d) for r, d in dumps.items() if r not in unavailable}
    groups: list[GroupState] = []
    for g in sorted({k for v in per_rank.values() for k in v}):
        last = {r: v[g] for r, v in per_rank.items() if g in v}
        front = max(last.values(), key=lambda x: x.seq)
        behind = tuple(sorted(r for r, x in last.items() if x.seq < front.seq))
        waiting = tuple(sorted(r for r, x in last.items() if x.seq == front.seq))
        groups.append(GroupState(group=g, last=last, frontier=front, behind=behind, waiting=waiting))
    no_dump = sorted(set(expected) - set(dumps))
    suspects = sorted({r for s in groups for r in s.behind} | set(no_dump))
    return HangReport(groups=groups, suspects=suspects, no_dump=no_dump, unavailable=unavailable)


def render_hang(rep: HangReport, now_ns: int | None = None) -> str:
    now_ns = now_ns if now_ns is not None else time.time_ns()
    lines: list[str] = []
    stuck = [s for s in rep.groups if s.behind]
    if stuck:
        names = rank_ranges(rep.suspects)
        lines.append(f"HANG HINT: rank(s) {names} did not enter the collective the others wait in")
        for s in stuck:
            f = s.frontier
            ago = f" {(now_ns - f.time_ns) / 1e9:.1f} s ago" if f.time_ns and now_ns > f.time_ns else ""
            lines.append(f"  process group {s.group}: rank(s) {rank_ranges(s.waiting)} entered collective "
                         f"#{f.seq} ({f.op}){ago} and wait in it")
            for r in s.behind:
                x = s.last[r]
                lines.append(f"    rank {r}: last entered #{x.seq} ({x.op}), {f.seq - x.seq} behind")
        lines.append("  next: see what those ranks are doing now (py-spy dump --pid PID): a rank-dependent branch "
                     "that skips a collective, a data or I/O stall, or an exception caught on one rank.")
    elif rep.groups:
        lines.append("HANG HINT: every rank that answered entered the same last collective; no rank is missing "
                     "from it")
        for s in rep.groups:
            lines.append(f"  process group {s.group}: #{s.frontier.seq} ({s.frontier.op}) on rank(s) "
                         f"{rank_ranges(s.waiting)}")
        lines.append("  next: the collective itself is stuck (network, a dead peer process) or the ranks wait "
                     "outside collectives; check the job's logs and the interconnect.")
    else:
        lines.append("HANG HINT: no collective recorded by the Flight Recorder on any rank that answered (it records "
                     "only if TORCH_FR_BUFFER_SIZE is set before the process group starts: diagnose run --flight-recorder)")
    if rep.no_dump:
        lines.append(f"  no dump from rank(s) {rank_ranges(rep.no_dump)}: stuck holding the GIL (a C "
                     "extension, a busy loop) or gone; they are suspects too")
    for r, why in sorted(rep.unavailable.items()):
        lines.append(f"  rank {r}: no Flight Recorder ({why}); set TORCH_FR_BUFFER_SIZE=2000 before the process "
                     "group starts (diagnose run --flight-recorder does)")
    return "\n".join(lines)


def read_dumps(directory: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for p in sorted(directory.glob("rank*.fr.json")):
        m = _RANK.search(p.name)
        if m:
            out[int(m.group(1))] = read_dump(p)
    return out


def request_dumps(pdir: Path) -> str:
    hid = uuid.uuid4().hex[:12]
    write_control(pdir, CONTROL, {"id": hid, "time": time.time()})  # the probes ignore stale requests
    return hid


def wait_for_dumps(directory: Path, expected: list[int], timeout_s: float, poll_s: float = 0.5) -> dict[int, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        have = {int(m.group(1)) for p in directory.glob("rank*.fr.json") if (m := _RANK.search(p.name))} \
            if directory.is_dir() else set()
        if (have and set(expected) <= have) or time.monotonic() >= deadline:
            return read_dumps(directory) if directory.is_dir() else {}
        time.sleep(poll_s)
