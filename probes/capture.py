"""On-demand capture: profile the same N upcoming steps on every rank, when asked.

`diagnose capture RUN_DIR` writes `capture.json` (atomically) into the probe
directory: {"id", "start_step", "steps"}. Each rank notices it at a step boundary
with one `os.stat` (no read unless it changed), profiles steps
[start_step, start_step + steps) and writes `capture-{id}/rank{R}.pt.trace.json.gz`
plus a status file `capture-{id}/rank{R}.capture.json` ({"status": "done" | "missed",
"reason"}). No collective, no barrier: ranks coordinate through the step number only.
"""
from __future__ import annotations

import json
import os
import re

CONTROL = "capture.json"
_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class OnDemandCapture:
    def __init__(self, probe) -> None:
        self.probe = probe
        self.control = probe.out_dir / CONTROL
        self._mtime = None
        self._request: dict | None = None
        self._prof = None
        self._handled: set[str] = set()

    def _status(self, req: dict, status: str, reason: str = "") -> None:
        d = self.probe.out_dir / f"capture-{req['id']}"
        d.mkdir(parents=True, exist_ok=True)
        body = {"rank": self.probe.rank, "status": status, "reason": reason, "start_step": req["start_step"],
                "steps": req["steps"]}
        from probes.core import atomic_write

        atomic_write(d / f"rank{self.probe.rank}.capture.json", json.dumps(body).encode())

    def poll(self, next_step: int) -> None:
        """At a step boundary; next_step is the index of the step about to run."""
        try:
            st = os.stat(self.control)
        except FileNotFoundError:
            st = None
        if st is not None and st.st_mtime_ns != self._mtime:
            self._mtime = st.st_mtime_ns
            req = json.loads(self.control.read_text())
            ok = (isinstance(req, dict) and isinstance(req.get("id"), str) and _ID.match(req["id"])
                  and isinstance(req.get("start_step"), int) and isinstance(req.get("steps"), int)
                  and 0 < req["steps"] <= 1000)
            if ok and req["id"] not in self._handled:
                self._handled.add(req["id"])
                if next_step > req["start_step"] - 1:
                    self._status(req, "missed", f"request seen at step {next_step}, after its start")
                elif self.probe.profiler_busy():
                    self._status(req, "missed", "a scheduled profiler window was running")
                else:
                    self._request = req
        req = self._request
        if req is None:
            return
        start, n = req["start_step"], req["steps"]
        if self._prof is None and next_step == start:
            self._start(req)
        elif self._prof is not None:
            if next_step >= start + n:
                prof, self._prof, self._request = self._prof, None, None
                prof.stop()  # closes ProfilerStep#(start+n-1) and calls the export
            else:
                self._prof.step()

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
        prof.start()
        self._prof = prof

    def _export(self, prof, req: dict) -> None:
        from probes.core import export_gz

        d = self.probe.out_dir / f"capture-{req['id']}"
        d.mkdir(parents=True, exist_ok=True)
        export_gz(prof, d / f"rank{self.probe.rank}.pt.trace.json.gz")
        self._status(req, "done")

    def close(self) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()  # a job ending mid-capture still leaves what was recorded
