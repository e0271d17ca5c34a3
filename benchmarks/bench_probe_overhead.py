"""Probe overhead: the same real 2-rank gloo job with and without the probes.

Reports step-time ratios (probed / bare), measured in this one command:
- light mode (every-step timings, collective and DDP timing, no profiler);
- with a profiler window: steps outside the window and steps inside it.
Runs alternate bare/probed to spread machine noise evenly; the median ratio is reported.

    python benchmarks/bench_probe_overhead.py [--steps 40] [--pairs 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EXAMPLE = ROOT / "examples" / "train_ddp.py"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(tmp: Path, tag: str, steps: int, probe_schedule: str | None) -> list[list[float]]:
    """Per-rank step times (ms) of one job; probe_schedule None = no probes."""
    from diagnose.launch import probe_env

    log = tmp / f"{tag}.steps"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if probe_schedule is not None:
        env = probe_env(tmp / f"{tag}-probe", probe_schedule, env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(EXAMPLE), "--steps", str(steps), "--step-log", str(log)]
    subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=ROOT)
    return [[float(x) for x in Path(f"{log}.rank{r}").read_text().split()] for r in range(2)]


def median_of(times: list[list[float]], lo: int, hi: int) -> float:
    """Median step time over both ranks for steps [lo, hi)."""
    return statistics.median(t for rank in times for t in rank[lo:hi])


def probe_cost_per_step_us(n: int = 5000) -> float:
    """In-process cost of one step's probe work: a timed batch fetch, two collectives, the step record."""
    import time

    from diagnose.probes.core import Probe, Schedule
    from diagnose.probes.patches import _TimedIter

    with tempfile.TemporaryDirectory() as d:
        probe = Probe(d, 0, 2, Schedule(enabled=False))
        data = _TimedIter(iter(range(n)), probe)
        t = time.perf_counter()
        for _ in range(n):
            next(data)
            now = time.perf_counter()
            probe.on_collective("ddp_bucket_allreduce", now, now, 2_629_636, "default")
            probe.on_collective("all_reduce", now, now, 4, "default")
            probe.on_step()
        cost = (time.perf_counter() - t) / n * 1e6
        probe.close()
    return cost


def telemetry_cost_us(n: int = 2000) -> float:
    """One telemetry sample (probes/telemetry.py: /proc reads, NVML where present), on its own thread
    in a job: its share of the job's time is this over the sampling interval, whatever the step."""
    import time

    from diagnose.probes.telemetry import Sampler

    s = Sampler(write=lambda line: None, current_step=lambda: 0, on_error=lambda exc: None)
    s.sample()
    t = time.perf_counter()
    for _ in range(n):
        s.sample()
    return (time.perf_counter() - t) / n * 1e6


def gc_callback_cost_us(n: int = 20000) -> tuple[float, float]:
    """(bare, with the probes' callback) microseconds per generation-0 collection, the probes'
    gc.callbacks entry (probes/patches._gc, which returns at once for generation 0) off and on,
    alternating blocks in this process: what it adds to each of the collections a job makes
    anyway, the most frequent kind (every few hundred allocations)."""
    import gc
    import time

    from diagnose.probes import patches
    from diagnose.probes.core import Probe, Schedule

    def per_collection() -> float:
        t = time.perf_counter()
        for _ in range(n // 10):
            gc.collect(0)
        return (time.perf_counter() - t) / (n // 10) * 1e6

    with tempfile.TemporaryDirectory() as d:
        probe = Probe(d, 0, 1, Schedule(enabled=False))
        bare, timed = [], []
        for _ in range(10):
            bare.append(per_collection())
            undo = patches._gc(probe)
            timed.append(per_collection())
            undo()
        probe.close()
    return statistics.median(bare), statistics.median(timed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--pairs", type=int, default=3)
    a = ap.parse_args()
    wait, warmup, active = 10, 2, 8  # profiled steps 12..19 (0-based: after wait+warmup)
    window = (wait + warmup, wait + warmup + active)
    outside = (window[1] + 3, a.steps)  # after the window and its export
    light, out_r, in_r = [], [], []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for i in range(a.pairs):
            bare = run_job(tmp, f"bare{i}", a.steps, None)
            lite = run_job(tmp, f"light{i}", a.steps, "off")
            prof = run_job(tmp, f"prof{i}", a.steps, f"{wait},{warmup},{active}")
            base = median_of(bare, 3, a.steps)
            light.append(median_of(lite, 3, a.steps) / base)
            out_r.append(median_of(prof, *outside) / median_of(bare, *outside))
            in_r.append(median_of(prof, *window) / median_of(bare, *window))
            print(f"pair {i}: bare {base:.2f} ms/step; light x{light[-1]:.3f}; "
                  f"profiled outside window x{out_r[-1]:.3f}; inside window x{in_r[-1]:.3f}", flush=True)
    cost = probe_cost_per_step_us()
    bare_ms = statistics.median(b for b in [median_of(bare, 3, a.steps)])
    print(f"\nin-process probe work per step: {cost:.1f} us = {cost / 1000 / bare_ms:.4%} of a {bare_ms:.1f} ms step")
    from diagnose.probes.telemetry import INTERVAL_S

    tel = telemetry_cost_us()
    print(f"telemetry: {tel:.1f} us per sample, one per {INTERVAL_S:.0f} s = {tel / 1e6 / INTERVAL_S:.4%} of the time "
          "(off the training thread)")
    gc_bare, gc_timed = gc_callback_cost_us()
    print(f"a generation-0 garbage collection: {gc_bare:.2f} us bare, {gc_timed:.2f} us with the probes' callback "
          f"(+{gc_timed - gc_bare:.2f} us)")
    print("\nstep-time ratio, probed / bare (median of pairs)")
    print(f"  light mode (no profiler):         x{statistics.median(light):.3f}")
    print(f"  outside profiled windows:         x{statistics.median(out_r):.3f}")
    print(f"  inside profiled windows:          x{statistics.median(in_r):.3f}")


if __name__ == "__main__":
    main()
