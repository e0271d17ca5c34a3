"""How often a 2-rank gloo job aborts as its profiler window ends, probed or profiled by torch alone.

    python benchmarks/stress_window_end.py --runs 100 [--variants probe,torch,torch-hook]

Each run: `examples/train_ddp.py --steps 12`, profiled for steps 2-3 (wait 1, warmup 1, active 2),
one variant after the other in turn so that the machine's state is shared alike:
- probe       under `diagnose run --schedule 1,1,2` (the e2e Ctrl-C test's schedule)
- torch       torch.profiler alone (`--trace-dir`, the same window)
- torch-hook  the same with a Python DDP comm hook (`--comm-hook bf16`: a callback on gloo's thread)
Prints each variant's failed runs with the line glibc or torch left on stderr, and the counts. Set
`ulimit -c unlimited` first to keep a core of each abort (core_pattern decides where). Why: a rank
of such a job died of glibc's heap check at the window's end, 3 times in 237 probed runs here on
2026-12-06, none in 258 profiled by torch alone (README, Capture: the probes, Safety); at that
rate only hundreds of runs a variant tell the probes from torch.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
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
    if variant == "probe":
        return [sys.executable, "-m", "diagnose.cli", "run", "--out", str(out), "--schedule", "1,1,2", "--", *job]
    return [*job, "--trace-dir", str(out), *WINDOW, *(("--comm-hook", "bf16") if variant == "torch-hook" else ())]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=100, help="runs of each variant")
    ap.add_argument("--variants", default="probe,torch,torch-hook")
    ap.add_argument("--timeout", type=float, default=180)
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    failed: dict[str, list[str]] = {v: [] for v in variants}
    for i in range(a.runs):
        for v in variants:
            with tempfile.TemporaryDirectory(prefix="stress-window-") as tmp:
                try:
                    res = subprocess.run(command(v, Path(tmp) / "out"), cwd=ROOT, capture_output=True, text=True,
                                         timeout=a.timeout, check=False)
                    rc, err = res.returncode, res.stderr
                except subprocess.TimeoutExpired as exc:
                    # bytes even with text=True (what was read before the kill)
                    rc, err = "timeout", exc.stderr if isinstance(exc.stderr, str) else \
                        (exc.stderr or b"").decode(errors="replace")
            if rc != 0:
                sign = next((ln.strip() for ln in err.splitlines() if any(s in ln for s in SIGNS)), "")
                failed[v].append(f"run {i + 1}: exit {rc}: {sign[:160]}")
                print(f"{v} run {i + 1}: exit {rc}: {sign[:160]}", flush=True)
    for v in variants:
        print(f"{v}: {len(failed[v])} of {a.runs} runs failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
