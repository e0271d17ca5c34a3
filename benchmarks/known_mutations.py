"""Apply one-line mutations the fast suite once let through (issue 21), one at a time, to a copy of
the repository, and run the fast suite (no e2e, no browser) against each: every one must fail
at least one test. Prints one line per mutation: caught (and by which test) or SURVIVED.

    python benchmarks/known_mutations.py [--tests tests/test_claims.py ...]

Not part of CI's time budget (a surviving mutant runs the whole fast suite).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MAPPED = ("probes", "reports", "examples")
"""Folders installed as diagnose.<name> (pyproject's package-dir)."""

# (file, text, replacement, what it breaks)
MUTATIONS = [
    ("diagnose/analyzers/launch.py", 'return HostBound(ms=m.class_ms("launch")',
     'return HostBound(ms=m.class_ms("launch") / 2', "GPU launch-overhead estimate halved"),
    ("diagnose/thresholds.py", "severity_high: float = 0.20", "severity_high: float = 0.50",
     "severity_high raised from 0.20 to 0.50"),
    ("diagnose/analyzers/dataloader.py", "return flag_or_pass(f, th.input_stall, th,",
     "return flag_or_pass(f, 99.0, th,", "input_stall never flags"),
    ("diagnose/analyzers/common.py", "len(run.ranks) < 0.5 * run.world_size:\n        level -= 1",
     "len(run.ranks) < 0.5 * run.world_size:\n        pass", "confidence not lowered for a subset of ranks"),
    ("diagnose/analyzers/straggler.py",
     'return not_measurable(ID, TITLE, f"only rank {run.ranks[0]}\'s trace: lateness needs at least two ranks")',
     'return Check(id=ID, title=TITLE, status="passed", reason="one rank")',
     "a single-rank trace's straggler check passed instead of not_measurable"),
    ("diagnose/context.py", "return EventRef(rank=rank, file=trace.path.name, ts_us=ts,",
     "return EventRef(rank=rank, file=trace.path.name, ts_us=ts + 1.0,", "every evidence event's ts_us shifted"),
    ("diagnose/analyzers/straggler.py", 'others = wait.drop(index=named, errors="ignore")', "others = wait",
     "the straggler's imposed wait counted including the rank's own"),
    # 2026-12-07 (the 2-D job): each of these read as a right answer on every fixture before it
    ("diagnose/step/timeline.py", 'r"|^_?c10d_functional::wait_tensor$")', 'r"")',
     "a wait in a functional collective's wait_tensor counted as compute"),
    ("diagnose/step/timeline.py", "unnamed = not named and", "unnamed = False and",
     "several unnamed gloo process groups matched as one without a word"),
    ("diagnose/analyzers/straggler.py", "steady = max(consistent, late.held)", "steady = consistent",
     "straggler confidence by how often last only, not by the waiting it held"),
    ("diagnose/analyzers/straggler.py", 'steady = max(steady, metrics["effect_share_of_all_ranks"])', "pass",
     "straggler confidence without the rank's share of the replay's effects"),
    ("diagnose/analyzers/straggler.py", 'base = "medium"  # several process groups', 'pass  # several process groups',
     "straggler confidence not capped where gloo groups were matched as one"),
    ("diagnose/analyzers/communication.py", "or _fix(ctx),", "or FIX,",
     "DDP's communication fix whatever the stack"),
    # 2026-12-07 (uneven work across ranks, analyzers/imbalance.py)
    ("diagnose/analyzers/imbalance.py", "own = float(wait.mean()) if len(wait) else 0.0",
     "own = float(wait.max()) if len(wait) else 0.0", "uneven work's own estimate the longest wait, not the mean"),
    ("diagnose/analyzers/imbalance.py", "if top_share >= th.imbalance_same_rank:", "if False:",
     "uneven work flagged when one rank is slowest at every step"),
    ("diagnose/analyzers/imbalance.py", "use_every = len(by_every) >= MIN_EVERY_STEPS", "use_every = False",
     "the every-step record never read for the turns"),
    ("diagnose/analyzers/imbalance.py", "key = max(extra, key=extra.get)", "key = min(extra, key=extra.get)",
     "the uneven part read from the smallest difference"),
    ("diagnose/whatif.py", 'ONLY_WHEN_FLAGGED = frozenset({"reduce_dtype", "load_imbalance"})',
     'ONLY_WHEN_FLAGGED = frozenset({"reduce_dtype"})', "every rank at the median in the clean step beside a named straggler"),
    ("diagnose/analyzers/launch.py", "np.minimum(fixed_cost, FIXED_MOST * floor))", "fixed_cost)",
     "CPU per-op overhead counting an op at its one size whole (work read as overhead)"),
    # 2026-12-07 (DataLoader waits at epoch starts, analyzers/dataloader.py, probes/patches.py)
    ("probes/patches.py", "self._first = mark is None", "self._first = True",
     "an evaluation loader's first fetch marked as a training epoch's start"),
    ("probes/patches.py", "first, self._first = self._first, False", "first = self._first",
     "every fetch of a training iterator marked as its first"),
    ("diagnose/analyzers/dataloader.py", "epoch.share >= EPOCH_LEADS:", "epoch.share >= 0.0:",
     "epoch starts named whatever share of the wait they hold"),
    ("diagnose/analyzers/dataloader.py", "first_ms=float(first.mean())", "first_ms=float(first.sum())",
     "the first batches' wait per step summed over the run, not averaged"),
    ("diagnose/analyzers/dataloader.py", "window = (int((inside & is_start).sum()), int(inside.sum()))",
     "window = (int(is_start.sum()), int(inside.sum()))", "the window's epoch starts counted over the run"),
    # 2026-12-07 (Python garbage collection pauses, analyzers/gc_pause.py, probes/patches._gc)
    ("diagnose/analyzers/gc_pause.py", 'per_step = float(frame.groupby("step")["gc_full_ms"].max().sum()) / n',
     'per_step = float(frame.groupby("step")["gc_ms"].max().sum()) / n',
     "the young generations' collections counted as recoverable"),
    ("diagnose/analyzers/gc_pause.py", 'per_step = float(frame.groupby("step")["gc_full_ms"].max().sum()) / n',
     'per_step = float(frame.groupby("step")["gc_full_ms"].sum().sum()) / n',
     "ranks pausing at the same step counted one after the other"),
    ("probes/core.py", "        if generation >= 2:\n            self._gc_full += 1",
     "        if generation >= 1:\n            self._gc_full += 1", "a middle generation's collection counted as a full pass"),
    ("diagnose/analyzers/gc_pause.py", 'alone = int((hits.groupby("step").size() == 1).sum())',
     'alone = int((hits.groupby("step").size() >= 1).sum())', "ranks collecting together said to collect alone"),
    ("diagnose/whatif.py",
     'return None if ms is None else max(ms - float(f.metrics.get("gc_in_wait_unplaced_ms", 0.0)), 0.0)',
     "return ms", "collections inside DataLoader fetches left in the DataLoader's replayed figure"),
    ("diagnose/pipeline.py", 'if window is not None and "collections" in window.kinds and not window.collections_placed:',
     "if False:", "window figures carrying full collections keep their confidence"),
    ("probes/patches.py", "self._probe.on_data_wait(time.perf_counter() - t, first, self._probe.gc_clock_ms - gc0)",
     "self._probe.on_data_wait(time.perf_counter() - t, first)", "collections inside fetches not timed"),
    # 2026-12-07 evening (collections placed in their steps: step/pauses.py, the graph's part "gc")
    ("diagnose/step/graph.py", "paused = _cells_at(g.lane_parts.part(GC), at_h, w)", "paused = np.zeros(at_h.size)",
     "a rank's garbage collections brought to the median rank as if work"),
    ("diagnose/step/graph.py",
     "parts[:, DL] -= np.minimum(covered(subtract(pz.in_fetch, lane_blocked), a, b), parts[:, DL])", "pass",
     "a collection inside a fetch counted twice: the DataLoader's part and its own"),
    ("diagnose/step/graph.py", "floor = max(floor, float(rep.time[node[(kind == STEP_END) & (step == before.max())]].max()))",
     "pass", "consecutive steps' critical paths overlapping where ranks are out of step"),
    ("diagnose/step/pauses.py", 'a = g["start"].to_numpy(dtype=float) * 1e6 + off - base',
     'a = g["start"].to_numpy(dtype=float) * 1e6 + off - base + 5e5',
     "collections placed half a second off their steps"),
    ("diagnose/diff.py", 'if fixed and every_step is not None and all(f.over == "run"', "if False and all(f.over == \"run\"",
     "a fix sized over the run measured by the few profiled steps"),
    ("diagnose/analyzers/cpu_contention.py", "lost = {r: share[r] * step_ms[r]", "lost = {r: share[r] * 0.5 * step_ms[r]",
     "the training thread's wait for a core counted at half"),
    ("diagnose/analyzers/dataloader.py", "    crowded = no_spare_cores(ctx, worst, cfg)", '    crowded = ""',
     "a host with no core to spare told to add DataLoader workers"),
    ("probes/telemetry.py", 'line["run_wait"] = round((sched[1] - last[4][1]) / 1e9 / dt, 4)',
     'line["run_wait"] = round((sched[0] - last[4][0]) / 1e9 / dt, 4)', "time on a core sampled as the wait for one"),
    ("diagnose/analyzers/common.py", "    if replayed_ms is None or replayed_ms >= 0.5 * wait_ms:",
     "    if replayed_ms is None:", "waits the median edit gives back put on the collections"),
    ("diagnose/step/breakdown.py", "            dl, other, compute = dl - gc_dl, other - gc_other, compute - gc_compute",
     "            pass", "placed collections booked twice: in their gc part and where the trace showed them"),
    ("diagnose/analyzers/dataloader.py", 'per_rank = ctx.per_rank_mean("dataloader_ms") + ctx.per_rank_mean(GC_IN_FETCH)',
     'per_rank = ctx.per_rank_mean("dataloader_ms")', "collections inside fetches taken off the DataLoader wait twice"),
    ("diagnose/analyzers/why_late.py", '    top = max((k for k in excess if k != "gc_ms"), key=excess.get)',
     "    top = max(excess, key=excess.get)", "a late rank's collections given the straggler's fix"),
    ("diagnose/scaling.py", "            compute -= causes[\"cpu_contention\"]", "            pass",
     "the wait for a core counted twice in scaling: its bar and compute inflation"),
    ("diagnose/scaling.py", '            causes["cpu_contention"] = min(waited * trace_ms, max(compute, 0.0))',
     '            causes["cpu_contention"] = min(0.5 * waited * trace_ms, max(compute, 0.0))',
     "the wait for a core halved in scaling"),
    ("diagnose/analyzers/imbalance.py", '    contended = _contended(ctx, th) if (key or "compute_ms") in SLOWED_BY else None',
     "    contended = None", "turns of the slowest rank on a contended host told to rebalance batches"),
    ("diagnose/diff.py", "        predicted = float(combined) + sum(fixed[c] for c in alone)",
     "        predicted = float(combined)", "a fixed cause no replay expresses left out of the combined prediction"),
    ("diagnose/live.py", "                              cpu_wait=_cpu_wait(pdir, recorded[r], warnings)))",
     "                              cpu_wait=None))", "the live view blind to a contended host"),
    ("diagnose/analyzers/straggler.py", "        if starved:  # the same ops run slower for want of a core",
     "        if False:  #", "a straggler slowed by a busy neighbour on its core told to balance its work"),
    ("probes/core.py", '        run_wait = self._run_wait() if self.ok("run wait") else None',
     "        run_wait = None", "the training thread's wait for a core not read at step ends"),
    ("diagnose/probedata.py", "        if ok.sum() >= RUN_WAIT_STEPS and dur[ok].sum() > 0:",
     "        if False:", "the steps' wait for a core ignored for the telemetry's few samples"),
    ("diagnose/analyzers/imbalance.py", "    starved = _starved(ctx, held) if contended is not None and use_every else None",
     "    starved = None", "the every-step record's wait for a core not read against each step's slowest rank"),
    ("diagnose/analyzers/imbalance.py", "        if starved[1] > 0 and starved[0] >= STARVED_EXPLAINS * starved[1]:",
     "        if starved[1] > 0:", "uneven work called the contention's whatever the steps say"),
    ("diagnose/analyzers/straggler.py", "                   and w.cpu_wait_ms >= CPU_WAIT_EXPLAINS * w.excess[w.key])",
     "                   )", "a late rank told to get its cores back for any wait above the median rank's"),
    ("probes/core.py", "                                       tid=threading.get_native_id()), f)", "), f)",
     "the process's main thread sampled where another thread runs the loop"),
    ("diagnose/analyzers/straggler.py", "        if w.evaluates_alone:  # what it is late from", "        if False:  #",
     "a rank late from an evaluation it runs alone told to feed its DataLoader faster"),
    ("diagnose/analyzers/communication.py", "loop = tiny and _loop_issued(ctx)", "loop = False",
     "a loop's own per-parameter all-reduces told to raise a DDP bucket size it does not have"),
    ("diagnose/whatif.py", 'sorted(causes.items(), key=lambda c: c[0] == "gc_pause")', "causes.items()",
     "the collections removed before the median edit that sets them apart"),
    ("probes/core.py", "self._gc_passes.append((start, ms, generation, self.fetching > 0))",
     "self._gc_passes.append((start, ms, generation, False))", "no collection marked inside a fetch"),
    ("diagnose/analyzers/dataloader.py", "        if unplaced >= GC_NAMED * ms:", "        if collected >= GC_NAMED * ms:",
     "a DataLoader figure the step model cleaned of placed collections still called low confidence"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tests", nargs="*", default=["tests"], help="test paths (default: the whole fast suite)")
    args = ap.parse_args()
    survived = 0
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        if (ROOT.parent / "shared").exists():  # the tests read ../shared/traces beside the repository
            (Path(tmp) / "shared").symlink_to(ROOT.parent / "shared")
        for path, old, new, what in MUTATIONS:
            copy = Path(tmp) / "repo"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache",
                                                                        ".hypothesis", "runs", "diagnosis", "mutants"))
            target = copy / path
            text = target.read_text()
            if text.count(old) != 1:
                print(f"STALE    {what}: the line to mutate is not in {path} once (update this script)")
                survived += 1
                continue
            target.write_text(text.replace(old, new))
            for name in MAPPED:
                # the editable install maps diagnose.probes (.reports, .examples) to the repository's
                # own folders: without these links the copy's tests imported the unmutated ones
                (copy / "diagnose" / name).symlink_to(Path("..") / name, target_is_directory=True)
            # the copy's packages first: its `diagnose` is the one imported by the tests
            res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                  "-m", "not e2e and not browser", *args.tests], cwd=copy, capture_output=True,
                                 text=True, env={**os.environ, "PYTHONPATH": str(copy)})
            failed = re.findall(r"^FAILED (\S+)", res.stdout, re.MULTILINE)
            if res.returncode == 1 and failed:
                print(f"caught   {what}: {failed[0]}")
            else:
                survived += 1
                print(f"SURVIVED {what} (pytest exit {res.returncode})")
    print(f"{len(MUTATIONS) - survived} of {len(MUTATIONS)} caught")
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
