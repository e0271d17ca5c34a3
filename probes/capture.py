"""On-demand capture: profile the same N upcoming steps on every rank, when asked.

`diagnose capture RUN_DIR` writes `capture.json` (atomically) into the probe
directory: {"id", "start_step", "steps"}. Each rank notices it at a step boundary
with one `lstat` (no read unless it changed), profiles steps
[start_step, start_step + steps) and writes `capture-{id}/rank{R}.pt.trace.json.gz`
plus a status file `capture-{id}/rank{R}.capture.json` ({"status": "done" | "missed",
"reason"}). No collective, no barrier: ranks coordinate through the step number only.

The control file is untrusted (the run directory may be shared): it is read only when it is a
regular file of at most MAX_CONTROL_BYTES, opened non-blocking (a FIFO or a symlink to
/dev/zero cannot stall a step); a bad one is ignored and polling goes on; at most one request
is taken per MIN_INTERVAL_S, so forged requests cannot keep a rank profiling.
"""
from __future__ import annotations

import json
import logging
import re
import time

from .safefs import SafeDir, UnsafePath

CONTROL = "capture.json"
MAX_CONTROL_BYTES = 64 * 1024
MAX_STEPS = 1000
MIN_INTERVAL_S = 10.0
ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # fullmatch: no trailing newline, no path separator

log = logging.getLogger("diagnose.probes")


def valid_request(req) -> bool:
    """The bounds a rank applies; `diagnose capture` checks the same before writing a request."""
    return (isinstance(req, dict) and isinstance(req.get("id"), str) and ID.fullmatch(req["id"]) is not None
            and _int(req.get("start_step")) and req["start_step"] >= 0
            and _int(req.get("steps")) and 0 < req["steps"] <= MAX_STEPS)


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_control(d: SafeDir, name: str) -> dict | None:
    """A control file's JSON object, or None for anything unusable (absent, not a regular file,
    too large, not JSON, nested too deep): the caller ignores it and keeps polling."""
    try:
        data = d.read_small(name, MAX_CONTROL_BYTES)
        body = json.loads(data) if data is not None else None
    except (UnsafePath, OSError, ValueError, RecursionError) as exc:
        log.debug("diagnose probe: ignoring %s: %s", name, exc)
        return None
    return body if isinstance(body, dict) else None


def signature(st) -> tuple | None:
    return None if st is None else (st.st_ino, st.st_mtime_ns, st.st_size)


class OnDemandCapture:
    def __init__(self, probe) -> None:
        self.probe = probe
        self._seen = None
        self._next_ok = 0.0
        self._request: dict | None = None
        self._prof = None
        self._handled: set[str] = set()

    def _subdir(self, req: dict) -> SafeDir:
        return self.probe.directory().subdir(f"capture-{req['id']}")

    def _status(self, req: dict, status: str, reason: str = "") -> None:
        body = {"rank": self.probe.rank, "status": status, "reason": reason, "start_step": req["start_step"],
                "steps": req["steps"]}
        with self._subdir(req) as d:
            d.write_atomic(f"rank{self.probe.rank}.capture.json", json.dumps(body).encode())

    def poll(self, next_step: int) -> None:
        """At a step boundary; next_step is the index of the step about to run."""
        d = self.probe.directory()
        if d is not None and self._request is None and time.monotonic() >= self._next_ok:
            sig = signature(d.lstat(CONTROL))
            if sig is not None and sig != self._seen:
                self._seen = sig
                self._consider(read_control(d, CONTROL), next_step)
        req = self._request
        if req is None:
            return
        start, n = req["start_step"], req["steps"]
        if self._prof is None and next_step == start:
            if self.probe.job_profiler:  # the job's own profiler came on after the request was taken
                self._request = None
                self._status(req, "missed", "the job runs its own torch.profiler (one profiler at a time)")
            else:
                self._start(req)
        elif self._prof is not None:
            if next_step >= start + n:
                self.probe.settle_works()
                prof, self._prof, self._request = self._prof, None, None
                with self.probe.own_profiler():
                    prof.stop()  # closes ProfilerStep#(start+n-1) and calls the export
            else:
                with self.probe.own_profiler():
                    self._prof.step()

    def _consider(self, req: dict | None, next_step: int) -> None:
        if not valid_request(req) or req["id"] in self._handled:
            return
        self._handled.add(req["id"])
        self._next_ok = time.monotonic() + MIN_INTERVAL_S
        try:
            if next_step > req["start_step"] - 1:
                self._status(req, "missed", f"request seen at step {next_step}, after its start")
            elif self.probe.profiler_busy():
                self._status(req, "missed", "a scheduled profiler window was running")
            elif self.probe.job_profiler:
                self._status(req, "missed", "the job runs its own torch.profiler (one profiler at a time)")
            else:
                with self._subdir(req):  # refuse a planted capture-{id} (symlink, foreign) before profiling
                    pass
                self._request = req
        except OSError as exc:  # this request only: later ones are still served
            log.warning("diagnose probe (rank %s): capture %s refused: %s", self.probe.rank, req["id"], exc)

    def _start(self, req: dict) -> None:
        import torch

        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        # a schedule that always records: ProfilerStep#N markers, and stop() calls on_trace_ready
        prof = torch.profiler.profile(activities=acts, record_shapes=True,
                                      schedule=lambda _step: torch.profiler.ProfilerAction.RECORD,
                                      on_trace_ready=lambda p: self._export(p, req))
        # number the ProfilerStep#N markers by the job's own step, the same on every rank
        prof.step_num = req["start_step"]
        with self.probe.own_profiler():
            prof.start()
        self._prof = prof

    def _export(self, prof, req: dict) -> None:
        from .core import export_gz

        try:
            with self._subdir(req) as d:
                export_gz(prof, d, f"rank{self.probe.rank}.pt.trace.json.gz")
            self._status(req, "done")
        except OSError as exc:  # this capture only (a full disk, a directory swapped meanwhile)
            log.warning("diagnose probe (rank %s): capture %s not written: %s", self.probe.rank, req["id"], exc)
        self._next_ok = time.monotonic() + MIN_INTERVAL_S  # counted from the end of the capture

    def active(self) -> bool:
        return self._prof is not None

    def close(self) -> None:
        if self._prof is not None:
            self.probe.settle_works()
            prof, self._prof = self._prof, None
            with self.probe.own_profiler():
                prof.stop()  # a job ending mid-capture still leaves what was recorded
