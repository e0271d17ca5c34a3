"""The per-rank probe: every-step timings, collective timings, profiler windows, sidecars.

Contract with the job it watches: a probe never raises into user code, never
blocks on I/O it does not own, and never issues a collective or a barrier (ranks
may diverge; a probe must not be what hangs them). Every failure is logged once,
and the failing part switches itself off while training continues.

Files written in `out_dir` (all per rank, all atomic or append-only):
- `rank{R}.steps.jsonl`  one JSON line per step, flushed every step (survives a killed rank)
- `rank{R}.probe.json`   run metadata + summary, rewritten atomically (temp file + rename)
- `rank{R}.{stamp}.pt.trace.json.gz`  torch.profiler traces of the scheduled windows
"""
from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from diagnose.output import write_atomic as atomic_write  # one atomic writer for the whole project

log = logging.getLogger("diagnose.probes")


@dataclass(slots=True)
class Schedule:
    """torch.profiler schedule: skip `wait` steps, warm up `warmup`, record `active`; `repeat` cycles (0 = forever)."""

    wait: int = 2
    warmup: int = 2
    active: int = 5
    repeat: int = 1
    enabled: bool = True

    @classmethod
    def parse(cls, text: str | None) -> Schedule:
        """'2,2,5' or '2,2,5,1' or 'off'."""
        if not text:
            return cls()
        if text.strip().lower() in ("0", "off", "none", "light"):
            return cls(enabled=False)
        parts = [int(x) for x in text.split(",")]
        return cls(*parts[:4])


@dataclass(slots=True)
class StepRecord:
    step: int
    start: float
    """Wall-clock (time.time) at the step's start: comparable across ranks on one host."""
    dur_ms: float
    dataloader_ms: float
    comm_ms: float
    collectives: list = field(default_factory=list)
    """[name, arrival offset ms from step start, duration ms, bytes, group] per collective."""
    spans: list = field(default_factory=list)
    """[kind, name, offset ms from step start, duration ms, info dict] for other timed work
    (checkpoint saves, host syncs, ...)."""


class Probe:
    """One rank's probe. Create with `Probe.for_this_process(out_dir)`; drive with
    `on_data_wait`, `on_collective`, `on_step` (the API and the launcher both do)."""

    def __init__(self, out_dir: str | Path, rank: int, world_size: int, schedule: Schedule | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.world_size = world_size
        self.schedule = schedule or Schedule()
        self.step = 0
        self._t0 = time.perf_counter()
        self._wall0 = time.time()
        self._dl_ms = 0.0
        self._comm_ms = 0.0
        self._colls: list = []
        self._spans: list = []
        self._pending_cuda: list = []
        self._lock = threading.Lock()  # comm-hook futures complete on other threads
        self._failed: set[str] = set()
        self._steps_file = None
        self._profiler = None
        self._traces_written = 0
        self._sched_steps = 0
        self._capture = None
        self._hang = None
        self.max_log_bytes = _env_mb("DIAGNOSE_PROBE_MAX_LOG_MB", 64)
        self.meta: dict = {}
        self._summary = {"steps": 0, "dataloader_ms": 0.0, "comm_ms": 0.0, "step_ms": 0.0}
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._fail("output", exc)

    # ---- safety -------------------------------------------------------------------
    def _fail(self, part: str, exc: BaseException) -> None:
        if part not in self._failed:
            self._failed.add(part)
            log.warning("diagnose probe (rank %s): %s disabled after error: %s; training continues",
                        self.rank, part, exc)

    def ok(self, part: str) -> bool:
        return part not in self._failed and "output" not in self._failed

    # ---- events from the training loop --------------------------------------------
    def on_data_wait(self, seconds: float) -> None:
        self._dl_ms += seconds * 1000.0

    def on_collective(self, name: str, start: float, end: float, nbytes: int, group: str) -> None:
        """start/end are time.perf_counter() values; end may be the enqueue time of an async op."""
        try:
            with self._lock:
                dur = (end - start) * 1000.0
                self._comm_ms += dur
                if len(self._colls) < 4096:  # bound memory if a step issues a flood of tiny ops
                    self._colls.append([name, round((start - self._t0) * 1000.0, 4), round(dur, 4), int(nbytes),
                                        group])
        except Exception as exc:  # noqa: BLE001 - a probe must never raise into training
            self._fail("collectives", exc)

    def on_cuda_collective(self, name: str, start: float, e0, e1, nbytes: int, group: str) -> None:
        """A collective timed by two CUDA events; resolved at a later step boundary, never synced."""
        with self._lock:
            if len(self._pending_cuda) < 4096:
                self._pending_cuda.append((name, start, e0, e1, nbytes, group))

    def _resolve_cuda(self) -> None:
        if not self._pending_cuda or not self.ok("cuda timing"):
            return
        try:
            with self._lock:
                pending, self._pending_cuda = self._pending_cuda, []
            keep = []
            for item in pending:
                name, start, e0, e1, nbytes, group = item
                if e0.query() and e1.query():
                    dur_s = e0.elapsed_time(e1) / 1000.0
                    self.on_collective(name, start, start + dur_s, nbytes, group)
                else:
                    keep.append(item)  # the device is behind: read it at the next boundary
            with self._lock:
                self._pending_cuda = keep + self._pending_cuda
        except Exception as exc:  # noqa: BLE001
            self._fail("cuda timing", exc)

    def on_span(self, kind: str, name: str, start: float, end: float, **info) -> None:
        """Any other timed work inside the step (start/end: time.perf_counter())."""
        try:
            with self._lock:
                if len(self._spans) < 1024:
                    self._spans.append([kind, name, round((start - self._t0) * 1000.0, 4),
                                        round((end - start) * 1000.0, 4), info])
        except Exception as exc:  # noqa: BLE001
            self._fail("spans", exc)

    def on_step(self) -> None:
        """Step boundary (after optimizer.step, or the user's `w.step()`)."""
        now = time.perf_counter()
        self._resolve_cuda()
        try:
            with self._lock:
                rec = StepRecord(step=self.step, start=self._wall0, dur_ms=round((now - self._t0) * 1000.0, 4),
                                 dataloader_ms=round(self._dl_ms, 4), comm_ms=round(self._comm_ms, 4),
                                 collectives=self._colls, spans=self._spans)
                self._colls = []
                self._spans = []
            self._write_step(rec)
            s = self._summary
            s["steps"] += 1
            s["dataloader_ms"] += rec.dataloader_ms
            s["comm_ms"] += rec.comm_ms
            s["step_ms"] += rec.dur_ms
        except Exception as exc:  # noqa: BLE001
            self._fail("step log", exc)
        self._profiler_step()
        self.step += 1
        if self.step == 1:
            self._start_hang_watch()
        self._poll_capture()
        self._dl_ms = 0.0
        self._comm_ms = 0.0
        self._t0 = time.perf_counter()
        self._wall0 = time.time()

    def _poll_capture(self) -> None:
        if not self.ok("capture"):
            return
        try:
            if self._capture is None:
                from probes.capture import OnDemandCapture

                self._capture = OnDemandCapture(self)
            self._capture.poll(self.step)
        except Exception as exc:  # noqa: BLE001
            self._fail("capture", exc)

    def _start_hang_watch(self) -> None:
        """From the first step on (the process group exists by then): answer `diagnose hang`."""
        if not self.ok("hang watch"):
            return
        try:
            from probes.hang import HangWatcher

            self._hang = HangWatcher(self.out_dir, self.rank, lambda exc: self._fail("hang watch", exc))
            self._hang.start()
        except Exception as exc:  # noqa: BLE001
            self._fail("hang watch", exc)

    def profiler_busy(self) -> bool:
        return self._profiler is not None

    # ---- files ------------------------------------------------------------------
    def _write_step(self, rec: StepRecord) -> None:
        if not self.ok("step log"):
            return
        path = self.out_dir / f"rank{self.rank}.steps.jsonl"
        if self._steps_file is None:
            self._steps_file = open(path, "a", buffering=1 << 16)
        elif self._steps_file.tell() > self.max_log_bytes:
            # bounded size: keep the previous file as .1 (one generation), start a new one
            self._steps_file.close()
            os.replace(path, path.with_name(f"rank{self.rank}.steps.1.jsonl"))
            self._steps_file = open(path, "a", buffering=1 << 16)
        f = self._steps_file
        f.write(json.dumps({"step": rec.step, "start": rec.start, "dur_ms": rec.dur_ms, "dataloader_ms":
                            rec.dataloader_ms, "comm_ms": rec.comm_ms, "collectives": rec.collectives,
                            **({"spans": rec.spans} if rec.spans else {})},
                           separators=(",", ":")) + "\n")
        f.flush()  # one write syscall per step: a killed rank leaves every finished step readable

    def write_sidecar(self, final: bool = False) -> None:
        if not self.ok("sidecar"):
            return
        try:
            body = {"format": "diagnose-probe/1", "rank": self.rank, "world_size": self.world_size,
                    "final": final, "schedule": {"wait": self.schedule.wait, "warmup": self.schedule.warmup,
                                                 "active": self.schedule.active, "repeat": self.schedule.repeat,
                                                 "enabled": self.schedule.enabled},
                    "meta": self.meta, "summary": self._summary, "traces_written": self._traces_written,
                    "disabled_parts": sorted(self._failed)}
            atomic_write(self.out_dir / f"rank{self.rank}.probe.json", json.dumps(body, indent=1).encode())
        except Exception as exc:  # noqa: BLE001
            self._fail("sidecar", exc)

    # ---- profiler -----------------------------------------------------------------
    def start_profiler(self) -> None:
        if not self.schedule.enabled or self._profiler is not None or not self.ok("profiler"):
            return
        try:
            import torch

            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            sch = self.schedule
            self._profiler = torch.profiler.profile(
                activities=acts,
                schedule=torch.profiler.schedule(wait=sch.wait, warmup=sch.warmup, active=sch.active,
                                                 repeat=sch.repeat),
                on_trace_ready=self._export_trace, record_shapes=True)
            self._profiler.start()
        except Exception as exc:  # noqa: BLE001
            self._profiler = None
            self._fail("profiler", exc)

    def _profiler_step(self) -> None:
        if self._profiler is None:
            return
        try:
            self._profiler.step()
            self._sched_steps += 1
            sch = self.schedule
            if sch.repeat and self._sched_steps > (sch.wait + sch.warmup + sch.active) * sch.repeat:
                # every scheduled window is written: stop, back to light mode, profiler free for captures
                self._profiler.stop()
                self._profiler = None
        except Exception as exc:  # noqa: BLE001
            self._fail("profiler", exc)
            self._profiler = None

    def _export_trace(self, prof) -> None:
        if not self.ok("trace export"):
            return
        try:
            stamp = f"{int(time.time() * 1000)}"
            export_gz(prof, self.out_dir / f"rank{self.rank}.{stamp}.pt.trace.json.gz")
            self._traces_written += 1
        except Exception as exc:  # noqa: BLE001
            self._fail("trace export", exc)

    def _quietly(self, part: str, fn) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a probe must never raise into training
            self._fail(part, exc)

    def close(self) -> None:
        if self._hang is not None:
            self._hang.stop()
        if self._capture is not None:
            self._quietly("capture", self._capture.close)
        if self._profiler is not None:
            self._quietly("profiler", self._profiler.stop)
            self._profiler = None
        if self._steps_file is not None:
            self._quietly("step log", self._steps_file.close)
            self._steps_file = None
        self.write_sidecar(final=True)


def _env_mb(name: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(name, default))) * 1024**2
    except ValueError:
        return default * 1024**2


def export_gz(prof, final: Path) -> None:
    """Export a profiler trace gzipped, via temp files and a rename: readers see a whole trace or none."""
    fd, raw = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(raw)
        # the exporter can fail without raising (a full disk): never publish a cut trace
        with open(raw, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - 64))
            tail = f.read().rstrip()
        if not tail.endswith(b"}"):
            raise OSError(f"the profiler wrote an incomplete trace ({size} bytes): disk full?")
        with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb", compresslevel=3) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(raw + ".gz", final)
    finally:
        for p in (raw, raw + ".gz", raw + ".tmp"):  # .tmp: the exporter's own, left when it fails
            Path(p).unlink(missing_ok=True)
