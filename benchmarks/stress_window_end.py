"""How often a 2-rank gloo job dies as its profiler window ends, probed or profiled by torch alone.

    python benchmarks/stress_window_end.py --runs 30 [--variants probe,torch,torch-hook,torch-probed] \
        [--amplify] [--parallel 2]

Each run: `examples/train_ddp.py --steps 12`, profiled for steps 2-3 (wait 1, warmup 1, active 2),
one variant after the other in turn so that the machine's state is shared alike:
- probe       under `diagnose run --schedule 1,1,2` (the e2e Ctrl-C test's schedule)
- torch       torch.profiler alone (`--trace-dir`, the same window)
- torch-hook  the same with a Python DDP comm hook (`--comm-hook bf16`: a callback on gloo's thread)
- torch-probed  torch.profiler alone, the job under `diagnose run`: the probes' profiler stands
              aside, and the job's own profiler stops only after its collectives have finished
`--amplify` runs the jobs under glibc's malloc debugging (libc_malloc_debug with MALLOC_CHECK_=3,
and MALLOC_PERTURB_, which fills freed memory): a write into freed memory then kills the rank
far more often (torch alone: 16 of 80 runs with `--parallel 2`, against 0 of 318 plain runs).
`--parallel K` runs K jobs of a variant at once: on a loaded machine gloo's thread waits longer
for a core, and the race widens.
Prints each variant's failed runs with the line glibc or torch left on stderr, and the counts. Set
`ulimit -c unlimited` first to keep a core of each failure (core_pattern decides where).

Why: torch 2.13's gloo backend ends a collective's profiler event on its own thread after the
collective's future has woken the training thread; a profiler stopped in between gets that write
into memory it has freed (probes/inflight.py; README, Capture: the probes, Safety).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# run as a script, this directory is on sys.path: the port helper of the overhead benchmark
from bench_probe_overhead import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
WINDOW = ("--profile-wait", "1", "--profile-warmup", "1", "--profile-active", "2", "--profile-repeat", "1")
SIGNS = ("malloc", "free(", "corrupted", "terminate called", "Segmentation", "exitcode")


def command(variant: str, out: Path) -> list[str]:
    job = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(EXAMPLE), "--steps", "12"]
    probed = [sys.executable, "-m", "diagnose.cli", "run", "--out", str(out), "--schedule", "1,1,2", "--"]
    if variant == "probe":
        return [*probed, *job]
    own = [*job, "--trace-dir", str(out / "own"), *WINDOW]
    if variant == "torch-probed":
        return [*probed, *own]
    return [*own, *(("--comm-hook", "bf16") if variant == "torch-hook" else ())]


def amplified() -> dict[str, str]:
    """glibc's checking allocator (2.34 on: a library to preload) and freed memory filled with 0xa5."""
    env = {"MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165"}
    debug = next((p for p in ("/lib/x86_64-linux-gnu/libc_malloc_debug.so.0", "/lib64/libc_malloc_debug.so.0",
                              "/usr/lib64/libc_malloc_debug.so.0") if os.path.exists(p)), None)
    if debug:
        env["LD_PRELOAD"] = ":".join(x for x in (debug, os.environ.get("LD_PRELOAD", "")) if x)
    return env


def run_batch(variant: str, k: int, env: dict, timeout: float) -> list[tuple[object, str]]:
    """k jobs of one variant at once (their own ports and directories): (exit status, stderr) each.
    A job past `timeout` is killed with its whole process group, ranks included."""
    with tempfile.TemporaryDirectory(prefix="stress-window-") as tmp, contextlib.ExitStack() as files:
        jobs = []
        for j in range(k):
            # stderr to a file, not a pipe: no job blocks on a full pipe while another is waited for
            err = files.enter_context(open(Path(tmp) / f"{j}.err", "w+b"))
            proc = subprocess.Popen(command(variant, Path(tmp) / f"out{j}"), cwd=ROOT, env=env,
                                    stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
            jobs.append((proc, err))
        deadline = time.monotonic() + timeout
        out = []
        for proc, err in jobs:
            try:
                rc: object = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = "timeout"
            err.seek(0)
            out.append((rc, err.read().decode(errors="replace")))
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=100, help="runs of each variant")
    ap.add_argument("--variants", default="probe,torch,torch-hook")
    ap.add_argument("--timeout", type=float, default=180)
    ap.add_argument("--amplify", action="store_true", help="glibc's malloc debugging in the jobs")
    ap.add_argument("--parallel", type=int, default=1,
                    help="jobs of a variant run at once (a loaded machine: the threads' races widen)")
    a = ap.parse_args(argv)
    env = {**os.environ, **(amplified() if a.amplify else {})}
    variants = a.variants.split(",")
    failed: dict[str, list[str]] = {v: [] for v in variants}
    for i in range(0, a.runs, a.parallel):
        for v in variants:
            for j, (rc, err) in enumerate(run_batch(v, min(a.parallel, a.runs - i), env, a.timeout)):
                if rc != 0:
                    sign = next((ln.strip() for ln in err.splitlines() if any(s in ln for s in SIGNS)), "")
                    failed[v].append(f"run {i + j + 1}: exit {rc}: {sign[:160]}")
                    print(f"{v} run {i + j + 1}: exit {rc}: {sign[:160]}", flush=True)
    for v in variants:
        print(f"{v}: {len(failed[v])} of {a.runs} runs failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
