"""What torch.distributed's Flight Recorder (on under `diagnose run`, for `diagnose hang`) costs
per collective: a 2-rank gloo job times 3,000 all-reduces of 4 KB without it and with it as
`diagnose run --flight-recorder` sets it (diagnose.launch.FLIGHT_RECORDER_ENV), runs interleaved, and prints the
per-op times and their ratios. `--env TORCH_INCLUDE_STACK_TRACE=1` measures torch's default
(a Python stack recorded per collective).

    python benchmarks/bench_flight_recorder.py [--pairs 6] [--env VAR=VALUE ...]
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

JOB = '''
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1024)
for _ in range(200):
    dist.all_reduce(t)
dist.barrier()
t0 = time.perf_counter()
for _ in range(3000):
    dist.all_reduce(t)
if dist.get_rank() == 0:
    print(f"US_PER_OP {(time.perf_counter() - t0) / 3000 * 1e6:.2f}")
dist.destroy_process_group()
'''


EXTRA: dict[str, str] = {}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(script: Path, fr: bool) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_FR_BUFFER_SIZE", "TORCH_INCLUDE_STACK_TRACE")}
    env["OMP_NUM_THREADS"] = "1"
    if fr:
        from diagnose.launch import FLIGHT_RECORDER_ENV

        env.update(FLIGHT_RECORDER_ENV)
        env.update(EXTRA)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={_port()}", str(script)], env=env, capture_output=True, text=True,
                         timeout=300).stdout
    return float(re.search(r"US_PER_OP ([\d.]+)", out).group(1))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--env", action="append", default=[], help="extra VAR=VALUE for the Flight Recorder runs")
    a = ap.parse_args()
    EXTRA.update(kv.split("=", 1) for kv in a.env)
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "job.py"
        script.write_text(JOB)
        off, on = [], []
        for _ in range(a.pairs):
            off.append(run(script, False))
            on.append(run(script, True))
    print(f"without Flight Recorder: {', '.join(f'{x:.0f}' for x in off)} us per all-reduce")
    print(f"with it as diagnose run --flight-recorder sets it{' + ' + ' '.join(a.env) if a.env else ''}: "
          f"{', '.join(f'{x:.0f}' for x in on)} us per all-reduce")
    ratios = sorted(b / a for a, b in zip(off, on))
    print(f"ratio (best of each): x{min(on) / min(off):.3f}; per interleaved pair: "
          f"{', '.join(f'x{r:.2f}' for r in ratios)} (median x{ratios[len(ratios) // 2]:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
