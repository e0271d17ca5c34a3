"""Validate the what-if estimates: predict the step time after a fix, then measure it.

For each injected cause, a 2-rank gloo job runs with the cause (under the probes);
the prediction is its step time without the cause, as `diagnose scale` gives it (the step
graph replayed with the cause removed: diagnose.scaling.what_if_step). The same job then
runs with the cause removed; its measured step time is the truth.

Two ranks on a 2-core machine contend for the cores only while both compute: a rank whose peer
sleeps (a straggler, a slow loader) computes alone and faster (measured once: 76 ms of compute
per step in the two-cause job against 86 ms in the healthy one), a speed no replay of the faulty
run can know it will lose. Pinning each rank to its own core (`--pin-cores`) was tried: it evened
the compute (81 against 82 ms) but put gloo's threads on the busy core, and the tiny-buckets
pairs then spread from -49% to -4%; not used.

    python benchmarks/bench_whatif.py [--repeats 2] [--cases straggler,combined]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [
    # (cause id, injected args, fixed args)
    ("straggler", ["--pathology", "straggler"], ["--pathology", "none"]),
    ("dataloader_starvation", ["--pathology", "dataloader"], ["--pathology", "none"]),
    ("exposed_communication", ["--pathology", "tiny-buckets"], ["--pathology", "tiny-buckets", "--bucket-cap-mb", "25"]),
    # two causes on one rank, both fixed: the combined what-if (not the sum of the single ones)
    ("combined", ["--pathology", "straggler-dataloader"], ["--pathology", "none"]),
]


def run(out: Path, args: list[str]):
    """The job's measured point (diagnose.scaling.ScalePoint) and its diagnosis."""
    from diagnose.cli import _free_port
    from diagnose.launch import run_with_probes
    from diagnose.scaling import measure_point

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           str(ROOT / "examples" / "train_ddp.py"), "--steps", "20", *args]
    outcome = run_with_probes(cmd, out, "2,2,5", quiet_job=True, echo=False)
    if outcome.code or outcome.run_dir is None:
        raise SystemExit(f"job failed: {' '.join(args)}")
    return measure_point(2, outcome.run_dir)


def predict_and_measure(tmp: Path, cause: str, bad: list[str], good: list[str], i: int) -> tuple[float, float]:
    from diagnose.scaling import step_without, what_if_step

    p, d = run(tmp / f"{cause}-bad-{i}", bad)
    if cause == "combined":  # every flagged cause removed together, replayed
        rep = d.extras.get("replay") or {}
        base = rep.get("replayed_step_ms") or p.step_ms
        predicted = step_without(p.step_ms, base, rep.get("combined_what_if_ms", 0.0))
        singles = {f.id: f.recoverable_ms for f in d.findings}
        print(f"  combined #{i}: findings {singles}, combined {rep.get('combined_what_if_ms')} ms", flush=True)
    else:
        predicted = what_if_step(p, cause) or p.step_ms
    measured = run(tmp / f"{cause}-good-{i}", good)[0].step_ms
    print(f"  {cause} #{i}: step {p.step_ms:.1f} ms, causes from {p.causes_from}, predicted {predicted:.1f}, "
          f"measured {measured:.1f}", flush=True)
    return predicted, measured


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cases", default=",".join(c for c, _, _ in CASES),
                    help="comma-separated cause ids to run (default: all), e.g. to split them across cores")
    a = ap.parse_args()
    wanted = a.cases.split(",")
    unknown = set(wanted) - {c for c, _, _ in CASES}
    if unknown:
        raise SystemExit(f"unknown case(s): {', '.join(sorted(unknown))}")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for cause, bad, good in (c for c in CASES if c[0] in wanted):
            pairs = [predict_and_measure(Path(d), cause, bad, good, i) for i in range(a.repeats)]
            pred = statistics.median(p for p, _ in pairs)
            meas = statistics.median(m for _, m in pairs)
            errs = [(p - m) / m for p, m in pairs]
            rows.append((cause, " ".join(bad), pred, meas, (pred - meas) / meas, min(errs), max(errs)))
            print(f"{cause}: predicted {pred:.1f} ms, measured {meas:.1f} ms, error {(pred - meas) / meas:+.1%}",
                  flush=True)
    print("\n| cause | injected | predicted step after fix (ms) | measured after fix (ms) | error (medians) "
          "| each pair's error |")
    print("|---|---|---|---|---|---|")
    for cause, bad, pred, meas, err, lo, hi in rows:
        print(f"| {cause} | `{bad}` | {pred:.1f} | {meas:.1f} | {err:+.1%} | {lo:+.1%} .. {hi:+.1%} |")


if __name__ == "__main__":
    main()
