"""Change points at the issue's scale: 1,024 ranks x 100,000 steps of every-step records.

The series are generated per rank on demand (seeded by rank: each pass sees the same numbers), so
the benchmark holds what the analysis holds, not the run: one rank's series, the changes found,
a median per rank and segment. Three ranks are slowed from a step in the middle (+30% compute);
the others wait for them at the collectives (their comm grows). Reported: the analysis time
(the time spent generating the series is measured and left out), the peak of memory allocated
during the analysis (tracemalloc: numpy reports its arrays to it) at each rank count, and whether
the injected change was found, where, and on which ranks; each size also steady (no fault: no
event may be found, one pass). Reading the records from disk is not
part of this figure: `diagnose changes` reads each rank's step log with the probes' reader
(diagnose/probedata.py, its own benchmark in tests/test_rundir.py's 89 MB case).

    python benchmarks/bench_changes.py [--ranks 256,1024] [--steps 100000]
"""
from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diagnose.step.changes import RankSeries, find_events  # noqa: E402

SLOW = (5, 300, 777)
STEP_MS, COMPUTE_MS, LOADER_MS = 400.0, 300.0, 20.0


class Source:
    """Each call yields every rank's series, generated on the spot; time in generation is counted."""

    def __init__(self, ranks: int, steps: int, fault_at: int | None):
        self.ranks, self.steps, self.fault_at = ranks, steps, fault_at
        self.gen_s = 0.0
        self.calls = 0

    def __call__(self):
        self.calls += 1
        for r in range(self.ranks):
            t = time.perf_counter()
            s = self._one(r)
            self.gen_s += time.perf_counter() - t
            yield s

    def _one(self, r: int) -> RankSeries:
        rng = np.random.default_rng(r)
        n = self.steps
        steps = np.arange(1, n + 1, dtype=np.int64)
        slow = np.zeros(n)
        if self.fault_at is not None:
            slow[self.fault_at - 1:] = 0.3 * COMPUTE_MS  # from step fault_at, the slowed ranks compute longer
        compute = COMPUTE_MS + rng.normal(0, 6, n) + (slow if r in SLOW else 0.0)
        loader = LOADER_MS + rng.gamma(2.0, 1.0, n)
        spikes = rng.random(n) < 0.001
        compute[spikes] += 2000  # a checkpoint or a GC pause now and then: one step, no change
        # every rank's step ends when the slowest rank's does: the others wait in their collectives
        step = STEP_MS + rng.normal(0, 4, n) + slow
        comm = np.clip(step - compute - loader, 1.0, None)
        step = compute + loader + comm
        late = slow * (r in SLOW) + rng.exponential(0.5, n)
        return RankSeries(rank=r, host=f"host-{r // 8}", steps=steps, start=1.7e9 + np.cumsum(step) / 1000,
                          values={"step_ms": step, "compute_ms": compute, "dataloader_ms": loader,
                                  "comm_ms": comm, "late_ms": late})


def measure(ranks: int, steps: int, fault: bool) -> dict:
    """One timed run (nothing else traced), then one under tracemalloc for the peak."""
    fault_at = steps // 2 + 137 if fault else None
    src = Source(ranks, steps, fault_at)
    t0 = time.perf_counter()
    events = find_events(src, 20, 0.2)
    total = time.perf_counter() - t0
    tracemalloc.start()
    find_events(Source(ranks, steps, fault_at), 20, 0.2)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"ranks": ranks, "steps": steps, "analysis_s": total - src.gen_s, "generate_s": src.gen_s,
            "passes": src.calls, "peak_mb": peak / 2**20, "fault_at": fault_at, "events": events}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="256,1024")
    ap.add_argument("--steps", type=int, default=100_000)
    args = ap.parse_args(argv)
    print("| ranks | steps | fault | analysis s | per rank ms | peak MB | passes | found |")
    print("|---:|---:|---|---:|---:|---:|---:|---|")
    for n in (int(x) for x in args.ranks.split(",")):
        for fault in (False, True):
            m = measure(n, args.steps, fault)
            what = "; ".join(f"step {e.step} ({e.step - m['fault_at']:+d} from the fault) {e.place}, {e.cause} "
                             f"{e.cause_delta_ms:+.1f} ms, job {e.step_before_ms:.1f} -> {e.step_after_ms:.1f} ms"
                             if m["fault_at"] else f"step {e.step} {e.place}" for e in m["events"]) or "nothing"
            where = f"ranks {', '.join(str(r) for r in SLOW if r < n)} from step {m['fault_at']}" if fault else "none"
            print(f"| {n:,} | {m['steps']:,} | {where} | {m['analysis_s']:.2f} | {1000 * m['analysis_s'] / n:.2f} | "
                  f"{m['peak_mb']:.1f} | {m['passes']} | {what} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
