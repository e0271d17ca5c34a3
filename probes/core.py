"""The per-rank probe: every-step timings, collective timings, profiler windows, sidecars.

Contract with the job it watches: a probe never raises into user code, never
blocks on I/O it does not own, and never issues a collective or a barrier (ranks
may diverge; a probe must not be what hangs them). Every failure is logged once,
and the failing part switches itself off while training continues. The job's own torch
profiler comes first: torch runs one at a time, and the probe's stands aside (on_job_profiler).

Files written in `out_dir` (all per rank, all atomic or append-only):
- `rank{R}.steps.jsonl`  one JSON line per step, flushed every step (survives a killed rank); on
  CUDA ranks it also carries earlier steps as the device ran them (`device_ms`), and at close
  one last line with only `device_ms`: the steps the device finished after the host's last step
- `rank{R}.probe.json`   run metadata + summary, rewritten atomically (temp file + rename)
- `rank{R}.{stamp}.pt.trace.json.gz`  torch.profiler traces of the scheduled windows

Under torchelastic with restarts allowed (`torchrun --max-restarts N`, N > 0), each attempt of the
job writes into `out_dir/attempt{K}/` (K: TORCHELASTIC_RESTART_COUNT): a restarted job's ranks
start again from step 0, and their files must not mix with the failed attempt's (two traces per
rank, step logs counting from 0 twice). The analysis reads the last attempt (diagnose/rundir.py).

All of them go through `safefs` (the run directory may be shared: no symlink, FIFO or foreign
file planted there is followed). R is resolved once, before the first file is named: the
process group's rank when it exists, else the launcher's RANK; a process that is not a training
rank (a child of one, which inherits RANK) writes nothing.
"""
from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .device_steps import DeviceSteps, capturing
from .inflight import InFlight
from .optimizers import StepMarker
from .safefs import SafeDir

log = logging.getLogger("diagnose.probes")

# Set in the environment by the process that claimed a rank: its children inherit RANK from the
# launcher, but they are not that rank (an evaluation subprocess, a helper that steps an optimizer).
ENV_OWNER = "DIAGNOSE_PROBE_OWNER"
GC_PASS_MS = 1.0
"""A middle-generation collection this long or longer has its place in the step recorded (full
passes always): shorter ones are summed only (gc_ms), too short to move a figure."""
MAX_GC_PASSES = 64
"""Collections placed a step, at most (a step that collects more is summed all the same)."""


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
        """'2,2,5' or '2,2,5,1' or 'off'; raises ValueError naming what is wrong."""
        if not text:
            return cls()
        if text.strip().lower() in ("0", "off", "none", "light"):
            return cls(enabled=False)
        try:
            parts = [int(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"schedule {text!r}: expected wait,warmup,active[,repeat] (integers) or 'off'") from None
        if not 3 <= len(parts) <= 4:
            raise ValueError(f"schedule {text!r}: expected 3 or 4 numbers: wait,warmup,active[,repeat]")
        wait, warmup, active, *rest = parts
        repeat = rest[0] if rest else 1
        if min(wait, warmup, repeat) < 0 or active < 1 or max(parts) > 1_000_000:
            raise ValueError(f"schedule {text!r}: wait, warmup and repeat must be >= 0 and active >= 1")
        return cls(wait, warmup, active, repeat)


def resolve_identity() -> tuple[int, int] | None:
    """(rank, world size) of this process, or None when it is not a training rank.

    The process group knows best (mp.spawn, srun and mpirun set no RANK); then the launcher's RANK;
    a process with neither is a single-process job: rank 0 of 1. A child of a process that already
    claimed a rank inherited its RANK but is not that rank: None.
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - no usable torch.distributed: fall back to the environment
        pass
    owner = os.environ.get(ENV_OWNER)
    if owner and owner != str(os.getpid()):
        return None
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        return None


def elastic_attempt() -> int | None:
    """torchelastic's attempt number when the job may be restarted (TORCHELASTIC_MAX_RESTARTS > 0),
    else None: a job that cannot restart keeps the flat layout."""
    try:
        if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
            return max(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), 0)
    except ValueError:
        pass
    return None


@dataclass(slots=True)
class StepRecord:
    step: int
    start: float
    """Wall-clock (time.time) at the step's start: comparable across ranks on one host."""
    dur_ms: float
    dataloader_ms: float
    comm_ms: float
    """Wall time with at least one collective in flight: DDP's bucket all-reduces overlap, so
    their durations are merged, never added (the sum can exceed the step)."""
    first_batch_ms: float = 0.0
    """Of dataloader_ms, the wait for a training iterator's first batch (an epoch's start); written
    only when non-zero."""
    gc_ms: float = 0.0
    """Time in Python's garbage collections of generations 1 and 2 during the step (the training
    process stopped; generation 0's, microseconds each, are not timed); written only when non-zero."""
    gc_full: int = 0
    """... of them full passes (generation 2), which walk every tracked object; written only
    when non-zero, with gc_full_ms."""
    gc_full_ms: float = 0.0
    """Time in those full passes."""
    dataloader_gc_ms: float = 0.0
    """Of dataloader_ms, garbage collections that ran during the fetches (a pass that begins
    inside one reads as the DataLoader's wait in the trace); written only when non-zero."""
    gc_passes: list = field(default_factory=list)
    """[offset ms from step start, duration ms, generation, inside a DataLoader fetch (0/1)] for
    each full pass and each middle-generation pass of GC_PASS_MS or more: where in the step the
    process stopped, so the analysis sets that time apart from what the trace shows it doing then.
    The offset can be negative: a pass during the previous step's boundary work."""
    collectives: list = field(default_factory=list)
    """[name, arrival offset ms from step start, duration ms, bytes, group] per collective."""
    spans: list = field(default_factory=list)
    """[kind, name, offset ms from step start, duration ms, info dict] for other timed work
    (checkpoint saves, host syncs, ...)."""
    device: list = field(default_factory=list)
    """[step, ms] for earlier steps as the device ran them, read during this one (CUDA ranks:
    probes/device_steps.py)."""
    run_wait_ms: float | None = None
    """The training thread's time ready to run and waiting for a core during the step (the
    kernel's run-queue delay, /proc/thread-self/schedstat); written where read (Linux, from the
    second step on)."""


def _in_flight_ms(colls: list) -> float:
    """Length of the union of the collectives' [start, start + duration] (ms)."""
    total, end = 0.0, float("-inf")
    for start, dur in sorted((c[1], c[2]) for c in colls):
        if start + dur <= end:
            continue
        total += start + dur - max(start, end)
        end = start + dur
    return total


class Probe:
    """One rank's probe. Create with `Probe.for_this_process(out_dir)`; drive with
    `on_data_wait`, `on_collective`, `on_step` (the API and the launcher both do)."""

    def __init__(self, out_dir: str | Path, rank: int | None = None, world_size: int | None = None,
                 schedule: Schedule | None = None, strict_dir: bool = True) -> None:
        """rank None: resolved (`resolve_identity`) when the first file is about to be named.
        strict_dir: out_dir is the tool's own (made by the launcher): never a symlink, ours only;
        False for a directory the user named (`probes.watch(DIR)`)."""
        self.out_dir = Path(out_dir)
        self.attempt = elastic_attempt()
        """torchelastic's attempt when restarts are allowed: files go to out_dir/attempt{N}/."""
        self._claimed = rank is not None
        self.rank = rank if rank is not None else -1
        self.world_size = world_size if world_size is not None else 1
        self.strict_dir = strict_dir
        self._dir: SafeDir | None = None
        self.schedule = schedule or Schedule()
        self.step = 0
        self._new_step()
        self.gc_clock_ms = 0.0
        """Time in timed garbage collections since the probe started (never reset): a fetch reads it
        before and after to know the collections inside it."""
        self.fetching = 0
        """DataLoader fetches in progress (patches._TimedIter): a collection then is marked inside one."""
        self._gc_passes: list = []
        self._colls: list = []
        self._spans: list = []
        self._pending_cuda: list = []
        self._device_steps = DeviceSteps()
        self._lock = threading.Lock()  # comm-hook futures complete on other threads
        self._failed: set[str] = set()
        self._steps_file = None
        self._profiler = None
        self._traces_written = 0
        self._sched_steps = 0
        self._windows_done = False  # every scheduled window written: no profiler again (captures aside)
        self._capture = None
        # CPU collectives issued while a profiler records: finished before it stops (inflight.py)
        self._inflight = InFlight()
        # set while the probe itself drives one of its profilers: any other profiler that prepares
        # or starts is the job's own, and the probe's stands aside (patches._job_profiler)
        self._own_call = threading.local()
        self._in_own_calls = 0  # across threads, for `busy`
        self._busy_lock = threading.Lock()
        self.job_profiler = False
        self._hang = None
        self._telemetry = None
        self._sched_fd: int | None = None  # the training thread's /proc schedstat, kept open (run_wait_ms)
        self._sched_last: int | None = None
        self.max_log_bytes = _env_mb("DIAGNOSE_PROBE_MAX_LOG_MB", 64)
        self.meta: dict = {}
        self._summary = {"steps": 0, "dataloader_ms": 0.0, "comm_ms": 0.0, "step_ms": 0.0}
        self.optimizers = StepMarker()  # which optimizer.step() ends a step (`diagnose run`'s hooks)

    # ---- safety -------------------------------------------------------------------
    def _fail(self, part: str, exc: BaseException) -> None:
        if part not in self._failed:
            self._failed.add(part)
            log.warning("diagnose probe (rank %s): %s disabled after error: %s; training continues",
                        self.rank, part, exc)

    def ok(self, part: str) -> bool:
        return part not in self._failed and "output" not in self._failed

    def claim(self) -> bool:
        """Fix this process's rank before any per-rank file is named; False: write nothing."""
        if not self._claimed:
            self._claimed = True
            ident = resolve_identity()
            if ident is None:
                self._failed.add("output")  # not a training rank: silent by design, not an error
                log.debug("diagnose probe: pid %s is a child of a rank, not a rank: writing nothing", os.getpid())
                return False
            self.rank, self.world_size = ident
            os.environ[ENV_OWNER] = str(os.getpid())
        return self.ok("output")

    def directory(self) -> SafeDir | None:
        """The output directory, opened once (after the rank is claimed)."""
        if self._dir is None and self.claim():
            try:
                top = SafeDir.open(self.out_dir, create=True, strict=self.strict_dir)
                # a directory the launcher made: the launcher says it once for the whole run
                if top.warning and not self.strict_dir:
                    log.warning("diagnose probe (rank %s): %s", self.rank, top.warning)
                self._dir = self._attempt_dir(top)
            except Exception as exc:  # noqa: BLE001
                self._fail("output", exc)
        return self._dir

    def _attempt_dir(self, top: SafeDir, create: bool = True) -> SafeDir:
        """`top` itself, or this torchelastic attempt's subdirectory of it (opened, `top` closed)."""
        if self.attempt is None:
            return top
        try:
            return top.subdir(f"attempt{self.attempt}", create=create)
        finally:
            top.close()

    # ---- events from the training loop --------------------------------------------
    def on_data_wait(self, seconds: float, first: bool = False, gc_ms: float = 0.0) -> None:
        """first: the fetch was a training iterator's first (an epoch's start); gc_ms: of the
        wait, Python's garbage collections that ran during the fetch."""
        self._dl_ms += seconds * 1000.0
        self._dl_gc_ms += gc_ms
        if first:
            self._dl_first_ms += seconds * 1000.0

    def on_gc(self, seconds: float, generation: int, start: float | None = None) -> None:
        """One garbage collection of `generation` (2: a full pass) that began at `start`
        (time.perf_counter()), from gc.callbacks. Takes no lock: a collection can run while this
        thread holds one (an allocation inside on_collective), and list.append is atomic."""
        ms = seconds * 1000.0
        self._gc_ms += ms
        self.gc_clock_ms += ms
        if generation >= 2:
            self._gc_full += 1
            self._gc_full_ms += ms
        if start is not None and (generation >= 2 or ms >= GC_PASS_MS) and len(self._gc_passes) < MAX_GC_PASSES:
            self._gc_passes.append((start, ms, generation, self.fetching > 0))

    def on_collective(self, name: str, start: float, end: float, nbytes: int, group: str) -> None:
        """start/end are time.perf_counter() values; end may be the enqueue time of an async op."""
        try:
            with self._lock:
                dur = (end - start) * 1000.0
                if len(self._colls) < 4096:  # bound memory if a step issues a flood of tiny ops
                    self._colls.append([name, round((start - self._t0) * 1000.0, 4), round(dur, 4), int(nbytes),
                                        group])
                else:
                    self._comm_ms += dur  # past the cap: added, the step's length bounds it below
        except Exception as exc:  # noqa: BLE001 - a probe must never raise into training
            self._fail("collectives", exc)

    def on_cuda_collective(self, name: str, start: float, e0, e1, nbytes: int, group: str) -> None:
        """A collective timed by two CUDA events; resolved at a later step boundary, never synced."""
        with self._lock:
            if len(self._pending_cuda) < 4096:
                self._pending_cuda.append((name, start, e0, e1, nbytes, group))

    def _resolve_cuda(self) -> None:
        if not self._pending_cuda or not self.ok("cuda timing") or capturing():
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
        run_wait = self._run_wait() if self.ok("run wait") else None
        self._resolve_cuda()
        # earlier steps as the device ran them, read now (never waited for)
        device = (self._quietly("device timing", self._device_steps.resolved, []) if self.ok("device timing")
                  else [])
        try:
            # a pass recorded from here on (the step's own writing) is the next step's, at a
            # negative offset from its start
            passes, self._gc_passes = self._gc_passes, []
            with self._lock:
                dur_ms = (now - self._t0) * 1000.0
                comm = min(_in_flight_ms(self._colls) + self._comm_ms, dur_ms)
                rec = StepRecord(step=self.step, start=self._wall0, dur_ms=round(dur_ms, 4),
                                 dataloader_ms=round(self._dl_ms, 4), comm_ms=round(comm, 4),
                                 first_batch_ms=round(self._dl_first_ms, 4), gc_ms=round(self._gc_ms, 4),
                                 dataloader_gc_ms=round(self._dl_gc_ms, 4),
                                 gc_full=self._gc_full, gc_full_ms=round(self._gc_full_ms, 4),
                                 gc_passes=[[round((t - self._t0) * 1000.0, 3), round(ms, 3), gen, int(inside)]
                                            for t, ms, gen, inside in passes],
                                 collectives=self._colls, spans=self._spans, device=device, run_wait_ms=run_wait)
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
        if self.ok("device timing"):
            self._quietly("device timing", lambda: self._device_steps.mark(self.step))
        self._profiler_step()
        self.step += 1
        if self.step == 1:
            self._start_hang_watch()
            self._start_telemetry()
            # the model and optimizer are known after the first step: a capture or an analysis
            # of a run still going reads them from here (the final sidecar adds the summary)
            self.write_sidecar()
        self._poll_capture()
        self._new_step()

    def _new_step(self) -> None:
        """The step's own sums from zero, and its start (the collectives and spans lists are
        swapped under the lock in on_step)."""
        self._dl_ms = self._dl_first_ms = self._dl_gc_ms = 0.0
        self._gc_ms = self._gc_full_ms = 0.0
        self._gc_full = 0
        self._comm_ms = 0.0
        self._t0 = time.perf_counter()
        self._wall0 = time.time()

    def _poll_capture(self) -> None:
        if not self.ok("capture"):
            return
        try:
            if self._capture is None:
                from .capture import OnDemandCapture

                self._capture = OnDemandCapture(self)
            self._capture.poll(self.step)
        except Exception as exc:  # noqa: BLE001
            self._fail("capture", exc)

    def _start_hang_watch(self) -> None:
        """From the first step on (the process group exists by then): answer `diagnose hang`."""
        if not self.ok("hang watch"):
            return
        try:
            from .hang import HangWatcher

            d = self.directory()
            if d is None:
                return
            self._hang = HangWatcher(d, self.rank, lambda exc: self._fail("hang watch", exc))
            self._hang.start()
        except Exception as exc:  # noqa: BLE001
            self._fail("hang watch", exc)

    def _start_telemetry(self) -> None:
        """From the first step on: host and device signals every few seconds, on their own thread
        (probes/telemetry.py), one line each in rank{R}.telemetry.jsonl."""
        if not self.ok("telemetry"):
            return
        try:
            from .telemetry import INTERVAL_S, Sampler

            every = float(os.environ.get("DIAGNOSE_TELEMETRY_S") or INTERVAL_S)
            d = self.directory()
            if d is None or every <= 0:
                return
            f = d.open_append(f"rank{self.rank}.telemetry.jsonl", buffering=1 << 12)

            def write(line: str) -> None:
                if f.tell() < self.max_log_bytes:  # bounded: at 2 s a sample, 64 MB is months
                    f.write(line)
                    f.flush()

            # called from the first step's end: this thread runs the loop (its run-queue wait is
            # what cpu_contention reads), whichever thread of the process that is
            self._telemetry = (Sampler(write, lambda: self.step, lambda exc: self._fail("telemetry", exc), every,
                                       tid=threading.get_native_id()), f)
            self._telemetry[0].start()
        except Exception as exc:  # noqa: BLE001
            self._fail("telemetry", exc)

    def profiler_busy(self) -> bool:
        return self._profiler is not None

    def recording(self) -> bool:
        """A profiler of the probe's (a scheduled window or a capture) exists now, or the job's own records."""
        if self._profiler is not None or (self._capture is not None and self._capture.active()):
            return True
        if self.job_profiler:
            from torch.autograd import profiler as ap

            return bool(getattr(ap, "_is_profiler_enabled", False))
        return False

    def on_async_work(self, work) -> None:
        """A CPU collective's work handle, issued with async_op=True while recording."""
        if self.recording():
            self._inflight.add(work)

    @contextmanager
    def own_profiler(self):
        """Around every call the probe makes into one of its own profilers."""
        self._own_call.depth = getattr(self._own_call, "depth", 0) + 1
        with self._busy_lock:
            self._in_own_calls += 1
        try:
            yield
        finally:
            self._own_call.depth -= 1
            with self._busy_lock:
                self._in_own_calls -= 1

    def busy(self) -> bool:
        """A thread is inside one of the probe's own profiler calls (a window's stop and export,
        seconds for a large trace): a SIGTERM's flush waits for it (probes/sigterm.py)."""
        return self._in_own_calls > 0

    def in_own_profiler_call(self) -> bool:
        return getattr(self._own_call, "depth", 0) > 0

    def on_job_profiler(self) -> None:
        """A profiler the probe did not start is about to prepare or start (or was already on).

        torch runs one profiler at a time: a second one raises "Profiler is already enabled on this
        thread" into whichever starts last (the job's, killing it, as until 2026-12-06) or takes the
        first one's events. The job's comes first: the probe stops its own (what its window recorded
        is written), starts none again and refuses captures; timings, collectives and the rest go on.
        """
        if self.job_profiler:
            return
        self.job_profiler = True
        if self.schedule.enabled and not self._windows_done:  # else nothing is lost: no word of it
            self.meta["job_profiler"] = True
            rank = self.rank if self.rank >= 0 else os.environ.get("RANK", "?")  # may not be claimed yet
            log.warning("diagnose probe (rank %s): the job runs its own torch.profiler; the probe's profiler "
                        "stands aside for the rest of the job (step times, collectives and input waits go on)",
                        rank)
        self._windows_done = True
        self._release_profilers()

    def on_job_trace(self, path) -> None:
        """The job's own profiler wrote a trace: its path kept (the last JOB_TRACES_KEPT) in the
        sidecar, for `diagnose run` to analyse with the probes' records (diagnose/launch.py)."""
        try:
            p = os.fspath(path)
        except TypeError:  # not a path: nothing to name (torch itself will have refused it)
            return
        if not isinstance(p, str):
            return
        kept = self.meta.setdefault("job_traces", [])
        kept.append(os.path.abspath(p))
        del kept[:-JOB_TRACES_KEPT]

    def _release_profilers(self) -> None:
        """Stop the probe's capture and scheduled profiler, if on: what they recorded is written."""
        if self._capture is not None:
            self._quietly("capture", self._capture.close)
        if self._profiler is not None:
            prof, self._profiler = self._profiler, None
            self._quietly("profiler", self.settle_works)
            self._quietly("profiler", lambda: self._stop_own(prof))

    def _stop_own(self, prof) -> None:
        # once a job at most: catch_warnings resets the "shown once" registries of every warning
        with self.own_profiler(), warnings.catch_warnings():
            # stopping a window cut short in its warmup warns "Incorrect schedule" into the job's output
            warnings.filterwarnings("ignore", message="Incorrect schedule", category=UserWarning)
            prof.stop()

    def settle_works(self) -> None:
        """Before a profiler of the probe stops: its CPU collectives' threads are done (inflight.py)."""
        if self.ok("profiler") and not self._inflight.settle():
            self.meta["unsettled_windows"] = self._inflight.unsettled

    # ---- files ------------------------------------------------------------------
    def _write_step(self, rec: StepRecord) -> None:
        d = self.directory()
        if d is None or not self.ok("step log"):
            return
        name = f"rank{self.rank}.steps.jsonl"
        if self._steps_file is None:
            self._steps_file = d.open_append(name, buffering=1 << 16)
        elif self._steps_file.tell() > self.max_log_bytes:
            # bounded size: keep the previous file as .1 (one generation), start a new one
            self._steps_file.close()
            d.replace(name, f"rank{self.rank}.steps.1.jsonl")
            self._steps_file = d.open_append(name, buffering=1 << 16)
        self._write_line({"step": rec.step, "start": rec.start, "dur_ms": rec.dur_ms, "dataloader_ms":
                          rec.dataloader_ms, "comm_ms": rec.comm_ms, "collectives": rec.collectives,
                          **({"first_batch_ms": rec.first_batch_ms} if rec.first_batch_ms else {}),
                          **({"gc_ms": rec.gc_ms} if rec.gc_ms else {}),
                          **({"dataloader_gc_ms": rec.dataloader_gc_ms} if rec.dataloader_gc_ms else {}),
                          **({"gc_full": rec.gc_full, "gc_full_ms": rec.gc_full_ms} if rec.gc_full else {}),
                          **({"gc_passes": rec.gc_passes} if rec.gc_passes else {}),
                          **({"spans": rec.spans} if rec.spans else {}),
                          **({"device_ms": rec.device} if rec.device else {}),
                          **({"run_wait_ms": rec.run_wait_ms} if rec.run_wait_ms is not None else {})})

    def _write_line(self, record: dict) -> None:
        f = self._steps_file
        if f is None:
            return
        f.write(json.dumps(record, separators=(",", ":")) + "\n")
        f.flush()  # one write syscall per step: a killed rank leaves every finished step readable

    def write_sidecar(self, final: bool = False) -> None:
        d = self.directory()
        if d is None or not self.ok("sidecar"):
            return
        try:
            if isinstance(self.meta.get("gc"), dict):  # as the script left it: frozen or disabled after setup
                import gc

                self.meta["gc"].update(enabled=gc.isenabled(), frozen=gc.get_freeze_count())
            body = {"format": "diagnose-probe/1", "rank": self.rank, "world_size": self.world_size,
                    "final": final, "schedule": {"wait": self.schedule.wait, "warmup": self.schedule.warmup,
                                                 "active": self.schedule.active, "repeat": self.schedule.repeat,
                                                 "enabled": self.schedule.enabled},
                    "meta": self.meta, "summary": self._summary, "traces_written": self._traces_written,
                    "disabled_parts": sorted(self._failed)}
            d.write_atomic(f"rank{self.rank}.probe.json", json.dumps(body, indent=1).encode())
        except Exception as exc:  # noqa: BLE001
            self._fail("sidecar", exc)

    # ---- profiler -----------------------------------------------------------------
    def start_profiler(self) -> None:
        if not self.schedule.enabled or self._windows_done or self._profiler is not None or not self.ok("profiler"):
            return
        if self.directory() is None:
            return  # not a training rank, or nowhere to write: do not profile
        try:
            import torch

            if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):  # on before the probe came
                self.on_job_profiler()
                return

            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            sch = self.schedule
            self._profiler = torch.profiler.profile(
                activities=acts,
                schedule=torch.profiler.schedule(wait=sch.wait, warmup=sch.warmup, active=sch.active,
                                                 repeat=sch.repeat),
                on_trace_ready=self._export_trace, record_shapes=True)
            with self.own_profiler():
                self._profiler.start()
        except Exception as exc:  # noqa: BLE001
            self._profiler = None
            self._fail("profiler", exc)

    def _profiler_step(self) -> None:
        if self._profiler is None:
            return
        try:
            from torch.profiler import ProfilerAction

            if self._profiler.current_action == ProfilerAction.RECORD_AND_SAVE:
                self.settle_works()  # this step ends the window: stops the profiler and exports
            with self.own_profiler():
                self._profiler.step()
            self._sched_steps += 1
            sch = self.schedule
            if sch.repeat and self._sched_steps > (sch.wait + sch.warmup + sch.active) * sch.repeat:
                # every scheduled window is written: stop, back to light mode, profiler free for captures.
                # Not started again: each step hook asks for a profiler, and a new one each step
                # (as until 2026-12-06) profiled the rest of the job, started and stopped every step
                self._windows_done = True
                self.settle_works()  # not recording since the last export: forgets this step's works
                self._stop_own(self._profiler)
                self._profiler = None
        except Exception as exc:  # noqa: BLE001
            self._fail("profiler", exc)
            self._profiler = None

    def _export_trace(self, prof) -> None:
        d = self.directory()
        if d is None or not self.ok("trace export"):
            return
        try:
            stamp = f"{int(time.time() * 1000)}"
            export_gz(prof, d, f"rank{self.rank}.{stamp}.pt.trace.json.gz")
            self._traces_written += 1
        except Exception as exc:  # noqa: BLE001
            self._fail("trace export", exc)

    def _run_wait(self) -> float | None:
        """ms the calling (training) thread waited for a core since the last step end: the change of
        its schedstat's second field, read from a descriptor opened at the first step end and kept
        (2 us a read; opened there, not at start, so that it is the thread that runs the loop)."""
        try:
            if self._sched_fd is None:
                self._sched_fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            ns = int(os.pread(self._sched_fd, 128, 0).split()[1])
        except OSError:
            self._failed.add("run wait")  # not Linux, or no schedstat: nothing to record, said nowhere
            return None
        except Exception as exc:  # noqa: BLE001 - a probe must never raise into training
            self._fail("run wait", exc)
            return None
        last, self._sched_last = self._sched_last, ns
        return None if last is None else round(max(ns - last, 0) / 1e6, 4)

    def _quietly(self, part: str, fn, default=None):
        """fn()'s value, or `default` once `part` has failed (logged once, switched off)."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a probe must never raise into training
            self._fail(part, exc)
            return default

    def close(self) -> None:
        if self._sched_fd is not None:
            fd, self._sched_fd = self._sched_fd, None
            self._quietly("run wait", lambda: os.close(fd))
        hang_done = True
        if self._hang is not None:
            hang_done = self._hang.stop()
        if self._telemetry is not None:
            sampler, f = self._telemetry
            if sampler.stop():
                self._quietly("telemetry", f.close)
            self._telemetry = None
        self._release_profilers()
        if self.ok("device timing") and self.ok("step log"):  # steps still queued on the device: one last line
            tail = self._quietly("device timing", self._device_steps.drain, [])
            if tail:
                self._quietly("step log", lambda: self._write_line({"device_ms": tail}))
        if self._steps_file is not None:
            self._quietly("step log", self._steps_file.close)
            self._steps_file = None
        self.write_sidecar(final=True)
        # the hang thread uses the directory's descriptor: never close it under a running thread
        # (a reused descriptor number would point it at another directory); at exit it is freed anyway
        if self._dir is not None and hang_done:
            self._quietly("output", self._dir.close)
            self._dir = None

    def remove_temp_files(self) -> None:
        """A write interrupted by a signal never reaches its rename: drop its private temp dirs."""
        if not self._claimed or not self.ok("output"):
            return
        try:  # close() may have run already (SIGTERM: finish first, then this): open it again
            d = self._dir or self._attempt_dir(SafeDir.open(self.out_dir, create=False, strict=self.strict_dir),
                                                create=False)
        except OSError:
            return
        prefix = f"rank{self.rank}."
        try:
            d.remove_private_tmps(prefix)
            for n in [n for n in os.listdir(d.fd) if n.startswith("capture-")]:
                try:
                    with d.subdir(n, create=False) as sub:
                        sub.remove_private_tmps(prefix)
                except OSError:
                    continue
        except OSError:
            pass
        finally:
            if d is not self._dir:
                d.close()


JOB_TRACES_KEPT = 16
"""The job's own traces named in a rank's sidecar: enough windows back to find the last whole one
(diagnose/ingest/windows.py), bounded however long the run."""


def _env_mb(name: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(name, default))) * 1024**2
    except ValueError:
        return default * 1024**2


def export_gz(prof, d: SafeDir, final: str) -> None:
    """Export a profiler trace gzipped into `d` as `final`, via a private temp directory and one
    rename: readers see a whole trace or none, and nothing planted in a shared directory is
    followed (the C++ exporter writes through /proc/self/fd into the private directory)."""
    raw = "trace.json"
    with d.private_tmp(final) as tmp:
        prof.export_chrome_trace(tmp.fd_path(raw))
        # the exporter can fail without raising (a full disk): never publish a cut trace
        with tmp.open_read(raw) as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - 64))
            tail = f.read().rstrip()
        if not tail.endswith(b"}"):
            raise OSError(f"the profiler wrote an incomplete trace ({size} bytes): disk full?")
        with tmp.open_read(raw) as src, tmp.open_new(raw + ".gz") as out, \
                gzip.GzipFile(filename="", mode="wb", fileobj=out, compresslevel=3) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        tmp.publish(raw + ".gz", final)
