"""On-call helpers over a live run's probe directory: read step tails, request a capture.

Everything here reads the light-mode files the probes append (`rank{R}.steps.jsonl`)
and, for a capture, writes one control file; nothing talks to the job otherwise.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from diagnose.errors import DiagnoseError
from diagnose.probedata import _SIDE

TAIL_BYTES = 256 * 1024
CONTROL = "capture.json"  # the probes' side: probes/capture.py


def probe_dir(run_dir: str | Path) -> Path:
    """RUN_DIR/traces (as `diagnose run` lays it out) or RUN_DIR itself, holding live probe files."""
    run = Path(run_dir)
    for d in (run / "traces", run):
        if d.is_dir() and any(_SIDE.match(f.name) and "steps" in f.name for f in d.iterdir()):
            return d
    if not run.exists():
        raise DiagnoseError("no such directory", run)
    raise DiagnoseError("no live probe files (rank*.steps.jsonl): was the job started with `diagnose run` "
                        "or probes.watch()?", run)


def tail_records(path: Path, max_bytes: int = TAIL_BYTES) -> list[dict]:
    """The complete step records at the end of a steps file (a partial last line is skipped)."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - max_bytes))
        chunk = f.read()
    lines = chunk.split(b"\n")
    if size > max_bytes:
        lines = lines[1:]  # the first line is cut by the seek
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    return out


def live_tails(pdir: Path) -> dict[int, list[dict]]:
    tails = {}
    for f in sorted(pdir.iterdir()):
        m = _SIDE.match(f.name)
        if m and m.group(2) == "steps.jsonl":
            tails[int(m.group(1))] = tail_records(f)
    return tails


def expected_ranks(pdir: Path, seen: set[int]) -> list[int]:
    world = 0
    for f in pdir.glob("rank*.probe.json"):
        try:
            world = max(world, int(json.loads(f.read_text()).get("world_size") or 0))
        except (ValueError, OSError, AttributeError, TypeError):
            continue
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


def request_capture(pdir: Path, steps: int, margin_s: float = 2.0) -> CaptureRequest:
    """Ask every rank to profile the same `steps` steps, starting a little after the furthest rank."""
    tails = live_tails(pdir)
    if not any(tails.values()):
        raise DiagnoseError("the run has not finished a step yet; try again in a moment", pdir)
    furthest = max(t[-1]["step"] for t in tails.values() if t)
    durs = sorted(r["dur_ms"] for t in tails.values() for r in t[-20:] if isinstance(r.get("dur_ms"), (int, float)))
    step_ms = durs[len(durs) // 2] if durs else 1000.0
    # ranks notice at their next step boundary; leave room for a warm-up step and the slowest poller
    ahead = max(3, int(margin_s * 1000 / max(step_ms, 1.0)) + 2)
    req = CaptureRequest(id=uuid.uuid4().hex[:12], start_step=furthest + ahead, steps=steps)
    tmp = pdir / f".{CONTROL}.{req.id}"
    tmp.write_text(json.dumps({"id": req.id, "start_step": req.start_step, "steps": req.steps}))
    os.replace(tmp, pdir / CONTROL)
    return req


def wait_for_capture(pdir: Path, req: CaptureRequest, timeout_s: float, poll_s: float = 0.5,
                     progress=None) -> CaptureResult:
    """Wait until every expected rank has reported (done or missed), or the timeout passes."""
    out = pdir / f"capture-{req.id}"
    seen = set(live_tails(pdir))
    ranks = expected_ranks(pdir, seen)
    deadline = time.monotonic() + timeout_s
    result = CaptureResult(request=req, directory=out)
    while True:
        reported = {}
        if out.exists():
            for f in out.glob("rank*.capture.json"):
                try:
                    body = json.loads(f.read_text())
                    reported[int(body["rank"])] = body
                except (ValueError, OSError, KeyError, TypeError):
                    continue
        if set(ranks) <= set(reported) or time.monotonic() > deadline:
            break
        if progress:
            progress(len(reported), len(ranks))
        time.sleep(poll_s)
    for r in ranks:
        body = reported.get(r)
        if body is None:
            result.missing.append(r)
        elif body.get("status") == "done":
            result.done.append(r)
        else:
            result.missed[r] = str(body.get("reason", "?"))[:200]
    return result
