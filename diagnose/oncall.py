"""On-call helpers over a live run's probe directory: read step tails, request a capture.

Everything here reads the light-mode files the probes append (`rank{R}.steps.jsonl`)
and, for a capture, writes one control file; nothing talks to the job otherwise.
Those files sit in a run directory others may write to: they are read with the sidecar
guards of `diagnose.probedata` (regular files only, opened non-blocking, bounded reads), and
a file that fails them is skipped with a warning naming it.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from diagnose.errors import DiagnoseError, one_line
from diagnose.ingest import jsonsafe
from diagnose.probedata import _SIDE, as_number, read_json_sidecar, sane_world_size
from diagnose.probes.safefs import SafeDir, UnsafePath, open_regular
from diagnose.rundir import TRACES, last_attempt, newest_run

TAIL_BYTES = 256 * 1024
CONTROL = "capture.json"  # the probes' side: probes/capture.py
MAX_STATUS_BYTES = 64 * 1024
"""A rank's capture status file is a few hundred bytes."""

Note = Callable[[str], None]


def _has_live_files(d: Path) -> bool:
    try:
        return d.is_dir() and any(_SIDE.match(f.name) and "steps" in f.name for f in d.iterdir())
    except OSError:
        return False


def _live(d: Path) -> Path | None:
    """D, or the current attempt of a job torchelastic may restart (rundir.last_attempt), when it
    holds live probe files; None otherwise."""
    d = last_attempt(d, _has_live_files)[0]
    return d if _has_live_files(d) else None


def probe_dir(run_dir: str | Path, note: Note | None = None) -> Path:
    """The probe directory of RUN_DIR: RUN_DIR/traces (as `diagnose run` lays it out) or RUN_DIR
    itself, holding live probe files; or, when RUN_DIR is the parent of timestamped run
    directories (`--out`), the newest of them that has probe files (`note` says which)."""
    run = Path(run_dir)
    for d in (run / TRACES, run):
        if (live := _live(d)) is not None:
            return live
    newest = newest_run(run, lambda r: _live(r / TRACES) is not None)
    if newest is not None:
        if note is not None:
            note(f"diagnose: using the newest run in {one_line(str(run))}: {one_line(newest.name)}")
        return _live(newest / TRACES)
    if not run.exists():
        raise DiagnoseError("no such directory", run)
    raise DiagnoseError("no live probe files (rank*.steps.jsonl): was the job started with `diagnose run` "
                        "or probes.watch()?", run)


def _step_record(rec) -> dict | None:
    """A step record fit for the live view: numbers where numbers are expected, else None."""
    if not isinstance(rec, dict):
        return None
    step = rec.get("step")
    start, dur = as_number(rec.get("start")), as_number(rec.get("dur_ms"))
    if not isinstance(step, int) or isinstance(step, bool) or math.isnan(start) or math.isnan(dur):
        return None
    dl, comm = as_number(rec.get("dataloader_ms")), as_number(rec.get("comm_ms"))
    return {**rec, "start": start, "dur_ms": dur, "dataloader_ms": 0.0 if math.isnan(dl) else dl,
            "comm_ms": 0.0 if math.isnan(comm) else comm}


def tail_records(path: Path, max_bytes: int = TAIL_BYTES) -> list[dict]:
    """The complete step records at the end of a steps file (a partial last line is skipped).

    Raises UnsafePath for anything but a regular file (a FIFO would block the reader)."""
    with open_regular(path) as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - max_bytes))
        chunk = f.read(max_bytes)
    lines = chunk.split(b"\n")
    if size > max_bytes:
        lines = lines[1:]  # the first line is cut by the seek
    out = []
    for line in lines:
        try:
            rec = _step_record(jsonsafe.loads(line))
        except ValueError:  # not JSON, cut, or nested too deep
            continue
        if rec is not None:
            out.append(rec)
    return out


def live_tails(pdir: Path, warnings: list[str] | None = None) -> dict[int, list[dict]]:
    """Each rank's last step records; a steps file that cannot be read safely is skipped (and
    named in `warnings` when given)."""
    tails = {}
    try:
        entries = sorted(pdir.iterdir())
    except OSError as exc:
        raise DiagnoseError(f"cannot list directory ({exc.strerror or exc})", pdir) from None
    for f in entries:
        m = _SIDE.match(f.name)
        if m and m.group(2) == "steps.jsonl":
            try:
                tails[int(m.group(1))] = tail_records(f)
            except (UnsafePath, OSError) as exc:
                if warnings is not None:
                    warnings.append(one_line(str(exc) if isinstance(exc, UnsafePath)
                                             else f"{f}: cannot read ({exc.strerror or exc})"))
    return tails


PROGRESS_MIN_S = 5.0
PROGRESS_STEPS = 5
"""A rank is progressing when its last step finished within PROGRESS_STEPS of its median step
time (at least PROGRESS_MIN_S) ago."""


@dataclass(frozen=True, slots=True)
class Progress:
    quiet: dict[int, float]
    """Ranks not progressing: seconds since their last finished step."""
    ages: dict[int, float]
    """Every rank with a step log: seconds since its last finished step."""
    steps: dict[int, int]
    limit_s: float

    def moving(self, expected: list[int]) -> bool:
        """Every expected rank (every rank seen, when none are) is progressing."""
        want = set(expected) or set(self.ages)
        return bool(self.ages) and want <= set(self.ages) and not self.quiet


def progress(tails: dict[int, list[dict]], now: float | None = None, min_s: float = PROGRESS_MIN_S,
             steps: int = PROGRESS_STEPS) -> Progress:
    """Which ranks are still finishing steps, from their step logs' last records (quiet: no step
    finished for `steps` median steps, at least min_s)."""
    now = time.time() if now is None else now
    ages = {r: max(0.0, now - (t[-1]["start"] + t[-1]["dur_ms"] / 1000)) for r, t in tails.items() if t}
    durs = sorted(x["dur_ms"] for t in tails.values() for x in t[-20:])
    step_s = durs[len(durs) // 2] / 1000 if durs else 0.0
    limit = max(min_s, steps * step_s)
    return Progress(quiet={r: a for r, a in ages.items() if a > limit}, ages=ages,
                    steps={r: int(t[-1]["step"]) for r, t in tails.items() if t}, limit_s=limit)


def expected_ranks(pdir: Path, seen: set[int], warnings: list[str] | None = None) -> list[int]:
    """Ranks 0..world-1 per the sidecars' world size, else the ranks seen. A world size that no
    job has (not an int in 1..MAX_WORLD_SIZE) is ignored, with a warning."""
    world = 0
    for f in sorted(pdir.glob("rank*.probe.json")):
        try:
            body = read_json_sidecar(f)
        except ValueError as exc:
            if warnings is not None:
                warnings.append(f"{exc}: ignored")
            continue
        raw = body.get("world_size") if isinstance(body, dict) else None
        ws = sane_world_size(raw)
        if ws is None:
            if raw is not None and warnings is not None:
                warnings.append(f"{one_line(str(f))}: world_size {one_line(repr(raw))[:40]} is not a plausible "
                                "number of ranks; ignored")
            continue
        world = max(world, ws)
    return list(range(world)) if world >= len(seen) and world > 0 else sorted(seen)


@dataclass(frozen=True, slots=True)
class CaptureRequest:
    id: str
    start_step: int
    steps: int


@dataclass(slots=True)
class CaptureResult:
    request: CaptureRequest
    directory: Path
    done: list[int] = field(default_factory=list)
    missed: dict[int, str] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def check_capture_steps(steps: int) -> None:
    """The bounds every rank applies to a request (probes/capture.py): refused here at once rather
    than after the whole timeout, which is all a rank's silent refusal would show."""
    from diagnose.probes.capture import MAX_STEPS

    if not 1 <= steps <= MAX_STEPS:
        raise DiagnoseError(f"--steps {steps}: must be 1..{MAX_STEPS} (the ranks refuse other values)")


def write_control(pdir: Path, name: str, body: dict) -> None:
    """A control file, written through a private temp directory and one rename (never through a
    symlink someone planted under the final or a temp name)."""
    try:
        with SafeDir.open(pdir, create=False, strict=False) as d:
            d.write_atomic(name, json.dumps(body).encode())
    except OSError as exc:
        raise DiagnoseError(f"cannot write {name} ({one_line(str(exc))})", pdir) from None


def request_capture(pdir: Path, steps: int, margin_s: float = 2.0) -> CaptureRequest:
    """Ask every rank to profile the same `steps` steps, starting a little after the furthest rank."""
    check_capture_steps(steps)
    tails = live_tails(pdir)
    if not any(tails.values()):
        raise DiagnoseError("the run has not finished a step yet; try again in a moment", pdir)
    furthest = max(t[-1]["step"] for t in tails.values() if t)
    durs = sorted(r["dur_ms"] for t in tails.values() for r in t[-20:])
    step_ms = durs[len(durs) // 2] if durs else 1000.0
    # ranks notice at their next step boundary; leave room for a warm-up step and the slowest poller
    ahead = max(3, int(margin_s * 1000 / max(step_ms, 1.0)) + 2)
    req = CaptureRequest(id=uuid.uuid4().hex[:12], start_step=furthest + ahead, steps=steps)
    write_control(pdir, CONTROL, {"id": req.id, "start_step": req.start_step, "steps": req.steps})
    return req


def _read_status(f: Path) -> dict | None:
    body = read_json_sidecar(f, MAX_STATUS_BYTES)
    if not isinstance(body, dict):
        return None
    rank = body.get("rank")
    return body if isinstance(rank, int) and not isinstance(rank, bool) else None


def wait_for_capture(pdir: Path, req: CaptureRequest, timeout_s: float, poll_s: float = 0.5,
                     progress=None) -> CaptureResult:
    """Wait until every expected rank has reported (done or missed), or the timeout passes."""
    out = pdir / f"capture-{req.id}"
    result = CaptureResult(request=req, directory=out)
    seen = set(live_tails(pdir, result.warnings))
    ranks = expected_ranks(pdir, seen, result.warnings)
    deadline = time.monotonic() + timeout_s
    bad: dict[str, str] = {}
    while True:
        reported = {}
        if out.is_dir():
            for f in sorted(out.glob("rank*.capture.json")):
                try:
                    body = _read_status(f)
                except ValueError as exc:
                    bad[f.name] = str(exc)  # a FIFO, a huge or broken file: reported once, at the end
                    continue
                if body is not None:
                    reported[body["rank"]] = body
        if set(ranks) <= set(reported) or time.monotonic() > deadline:
            break
        if progress:
            progress(len(reported), len(ranks))
        time.sleep(poll_s)
    result.warnings += [f"{why}: ignored" for why in bad.values()]
    for r in ranks:
        body = reported.get(r)
        if body is None:
            result.missing.append(r)
        elif body.get("status") == "done":
            result.done.append(r)
        else:
            why = body.get("reason")
            result.missed[r] = one_line(why[:200]) if isinstance(why, str) else "?"
    return result
