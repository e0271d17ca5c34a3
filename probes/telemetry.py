"""Cheap host and device signals, sampled off the training thread every few seconds.

What a fail-slow change is annotated with (diagnose/step/changes.py): did the host's CPU fill up
(another process on it), did the rank lose its core (involuntary context switches), did memory
grow, did the device clock drop or throttle. Each sample is one JSON line in
`rank{R}.telemetry.jsonl`: the wall time, the step the rank was in, and the signals. A signal this
machine cannot give is written as null (missing), never as zero: a GPU-less host has no SM clock,
not a clock of 0 MHz.

Sources: /proc (Linux; elsewhere those fields are null) and NVML through `nvidia-ml-py`
(`import pynvml`) when it is installed and the rank has a CUDA device. Reading a handful of small
/proc files costs tens of microseconds; at one sample per 2 s that is far below 0.1% of any step
(benchmarks/bench_probe_overhead.py measures it).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

from .periodic import Periodic

INTERVAL_S = 2.0
"""Default seconds between samples; DIAGNOSE_TELEMETRY_S overrides it (0: no sampling)."""
SIGNALS = ("cpu_busy", "cpu_steal", "load1", "proc_cpu", "invol_switches_per_s", "rss_mb", "thread_cpu",
           "run_wait", "sm_clock_mhz", "gpu_temp_c", "gpu_power_w", "gpu_throttle")
"""cpu_busy / cpu_steal: share of CPU time busy / stolen by the hypervisor since the last sample,
over the cores this process may run on (the whole host when it is not pinned); load1: the 1-minute load average; proc_cpu: CPU
seconds this process used per second; invol_switches_per_s: times the kernel took the CPU from it
per second (a process competing for its core); rss_mb: resident memory; thread_cpu / run_wait:
share of wall time the training thread ran on a CPU / was ready to run and waited for one (the
kernel's run-queue delay, /proc/self/task/TID/schedstat: a thread starved of cores by other work on
the host, its DataLoader's workers among them); the gpu_* fields from NVML (gpu_throttle: the
throttle-reason bits, 0 when none)."""

# NVML's throttle reason bits (nvml.h, nvmlClocksThrottleReason*), named for the annotation
THROTTLE = {0x1: "idle", 0x2: "application clocks", 0x4: "power cap", 0x8: "hardware slowdown",
            0x20: "sync boost", 0x40: "thermal (software)", 0x80: "thermal (hardware)",
            0x100: "power brake", 0x200: "display clocks"}


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(65536).decode("ascii", "replace")
    except OSError:
        return None


def _cpu_times(cpus: set[int] | None) -> tuple[float, float, float] | None:
    """(total, idle incl. iowait, steal) jiffies over the given cores (None: the whole host)."""
    text = _read("/proc/stat")
    if text is None:
        return None
    total = idle = steal = 0.0
    found = False
    for line in text.splitlines():
        if not line.startswith("cpu"):
            continue
        head, *vals = line.split()
        if cpus is None:
            if head != "cpu":
                continue
        elif head == "cpu" or not head[3:].isdigit() or int(head[3:]) not in cpus:
            continue
        v = [float(x) for x in vals[:8]] + [0.0] * max(0, 8 - len(vals))
        total += sum(v)  # user nice system idle iowait irq softirq steal (guest is inside user)
        idle += v[3] + v[4]
        steal += v[7]
        found = True
    return (total, idle, steal) if found else None


def _status() -> tuple[float | None, float | None]:
    """(resident MB, involuntary context switches so far) of this process."""
    text = _read("/proc/self/status")
    if text is None:
        return None, None
    rss = invol = None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            rss = float(line.split()[1]) / 1024
        elif line.startswith("nonvoluntary_ctxt_switches:"):
            invol = float(line.split()[1])
    return rss, invol


def _schedstat(tid: int | None) -> tuple[float, float] | None:
    """(ns on a CPU, ns waiting on a run queue) of thread `tid` so far (None: not Linux, no schedstat)."""
    text = _read(f"/proc/self/task/{tid}/schedstat") if tid is not None else None
    try:
        on, wait = text.split()[:2] if text else (None, None)
        return (float(on), float(wait)) if on is not None else None
    except ValueError:
        return None


GPU_SIGNALS = ("sm_clock_mhz", "gpu_temp_c", "gpu_power_w", "gpu_throttle")


class _Nvml:
    """The rank's device through NVML, or nothing (no package, no driver, no CUDA device)."""

    def __init__(self) -> None:
        self.handle = None
        try:
            import pynvml  # nvidia-ml-py

            torch = sys.modules.get("torch")  # the job's own; never imported from this thread
            if torch is None or not torch.cuda.is_available():
                return
            pynvml.nvmlInit()
            index = torch.cuda.current_device()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:
                ids = [x.strip() for x in visible.split(",")]
                index = int(ids[index]) if index < len(ids) and ids[index].isdigit() else index
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # noqa: BLE001 - no NVML: the GPU signals are missing, nothing else changes
            self.handle = None

    def sample(self) -> dict:
        out = dict.fromkeys(GPU_SIGNALS)
        if self.handle is None:
            return out
        n, h = self.nvml, self.handle
        for key, fn in (("sm_clock_mhz", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
                        ("gpu_temp_c", lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
                        ("gpu_power_w", lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0),
                        ("gpu_throttle", lambda: n.nvmlDeviceGetCurrentClocksThrottleReasons(h))):
            try:
                out[key] = float(fn())
            except Exception:  # noqa: BLE001 - one signal the device does not give: missing
                out[key] = None
        return out


class Sampler(Periodic):
    """Samples SIGNALS every INTERVAL_S on its own daemon thread; `write(line)` appends one line."""

    def __init__(self, write, current_step, on_error, interval_s: float = INTERVAL_S,
                 tid: int | None = None) -> None:
        self.write = write
        self.current_step = current_step
        self.on_error = on_error
        self.interval_s = max(0.2, interval_s)
        try:
            cpus = os.sched_getaffinity(0)
            self.cpus = cpus if len(cpus) < (os.cpu_count() or len(cpus)) else None
        except (AttributeError, OSError):
            self.cpus = None
        self.nvml = None
        self._last = None
        # the training loop's thread: the caller's (the probe starts it from a step's end) where
        # given, not the process's main thread (Ray Train, a trainer run from a worker thread)
        self.tid = tid if tid is not None else threading.main_thread().native_id
        super().__init__("diagnose-telemetry")

    def _run(self) -> None:
        self.nvml = _Nvml()  # here, not on the training thread: nvmlInit can take a while
        self.sample()  # the first sample sets the counters' baseline
        while not self._stop.wait(self.interval_s):
            try:
                line = self.sample()
                if line is not None:
                    self.write(json.dumps(line, separators=(",", ":")) + "\n")
            except Exception as exc:  # noqa: BLE001 - a probe must never disturb the job
                self.on_error(exc)
                return

    def sample(self) -> dict | None:
        """One sample: None for the first (rates need two readings)."""
        now, wall = time.monotonic(), time.time()
        cpu = _cpu_times(self.cpus)
        proc = time.process_time()
        rss, invol = _status()
        load = _read("/proc/loadavg")
        sched = _schedstat(self.tid)
        last, self._last = self._last, (now, cpu, proc, invol, sched)
        if last is None:
            return None
        dt = now - last[0]
        line: dict = {"wall": round(wall, 3), "step": int(self.current_step())}
        d_total = cpu[0] - last[1][0] if cpu and last[1] else 0.0
        line["cpu_busy"] = round(1 - (cpu[1] - last[1][1]) / d_total, 4) if d_total > 0 else None
        line["cpu_steal"] = round((cpu[2] - last[1][2]) / d_total, 4) if d_total > 0 else None
        line["load1"] = float(load.split()[0]) if load else None
        line["proc_cpu"] = round((proc - last[2]) / dt, 4) if dt > 0 else None
        line["invol_switches_per_s"] = (round((invol - last[3]) / dt, 2) if dt > 0 and invol is not None
                                        and last[3] is not None else None)
        line["rss_mb"] = round(rss, 1) if rss is not None else None
        ok = dt > 0 and sched is not None and last[4] is not None
        line["thread_cpu"] = round((sched[0] - last[4][0]) / 1e9 / dt, 4) if ok else None
        line["run_wait"] = round((sched[1] - last[4][1]) / 1e9 / dt, 4) if ok else None
        line.update(self.nvml.sample() if self.nvml is not None else dict.fromkeys(GPU_SIGNALS))
        return line
