"""Scaling: measure speedup across world sizes and account for the lost speedup, cause by cause.

Two questions kept apart:
- the waterfall: what got worse as N grew (lost speedup, ideal N -> observed);
- the baseline panel: what is slow already at the smallest N (costs throughput at
  every N, not speedup).

Method. Per-rank work per step is w times the baseline's (weak scaling: w = 1, the
DDP default; strong scaling: w = N0/N). With T the step time, observed speedup is
S = (N/N0) * w * T0 / T. The lost speedup (N/N0) - S = (N/N0) * (T - w T0) / T
splits over per-step time increases: each cause c contributes
(N/N0) * (c_N - w c_0) / T, where c is what the step graph's replay gives back with
the cause removed at that N (diagnose/whatif.py; every cause, flagged or not; a
straggler with no rank named is every rank brought to the median: the cost of waiting for
whichever rank is slowest). Compute inflation is the growth of the replayed step with every
cause removed (the work itself got slower per rank). Replayed costs do not add up (removing
two causes is not the sum of removing each), so the remainder, with profiler overhead and
noise, is an explicit unexplained bar, never hidden. Where a run's replay does not reproduce
its steps, or cannot express a cause (CPU per-op overhead), the check's own measured estimate
stands in, and `causes_from` says so. CPU contention (the training thread waiting for a core:
the probes' samples of its run-queue delay over the run, a share of the traced step) is taken out
of compute on CPU ranks: more ranks and workers on the same cores lose speedup that would
otherwise read as compute inflation.

What-if per cause: the step less what the replay gives back without the cause (a wait lasts
as long outside the profiler's window as in it; the host's own op time is scaled instead, and
never to zero or below: step_without), and every cause removed together.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from diagnose.errors import DiagnoseError, one_line
from diagnose.model import Diagnosis
from diagnose.ingest.assemble import Reader
from diagnose.ingest.discover import has_traces
from diagnose.pipeline import diagnose_paths
from diagnose.probedata import RUN_WAIT_SAMPLES, job_step_ms, load_probe_data, run_wait_shares
from diagnose.rundir import last_attempt, resolve_run
from diagnose.units import rank_ranges

CAUSES = ("dataloader_starvation", "input_stall", "exposed_communication", "straggler", "launch_overhead",
          "cpu_contention")
SCHEMA_VERSION = "1.1"


@dataclass(frozen=True, slots=True)
class ScalePoint:
    nproc: int
    step_ms: float
    """Median step time (every probed step outside profiler windows; else the traced steps)."""
    step_source: str
    per_rank_batch: int | None
    throughput: float | None
    """Samples per second (None when the batch size is unknown)."""
    speedup: float
    efficiency: float
    run_dir: str
    trace_step_ms: float
    """Mean traced step time: the basis of the per-cause breakdown."""
    causes_ms: dict[str, float]
    compute_ms: float
    """The rest of the step: replayed with every cause removed (or, without a replay, the
    breakdown's compute)."""
    replayed_step_ms: float | None = None
    """The unedited replay's mean step: the basis of the what-ifs (None: no trusted replay)."""
    causes_from: str = "checks"
    """"replay" (the step graph) or "checks" (each check's own estimate)."""


@dataclass(frozen=True, slots=True)
class Bar:
    id: str
    lost_speedup: float
    delta_ms: float


@dataclass(frozen=True, slots=True)
class WhatIf:
    id: str
    step_ms: float
    speedup: float


@dataclass(frozen=True, slots=True)
class Scaling:
    mode: str
    points: tuple[ScalePoint, ...]
    waterfall: tuple[Bar, ...]
    """Largest loss first; includes compute_inflation and unexplained."""
    ideal_speedup: float
    observed_speedup: float
    baseline: tuple[dict, ...]
    what_if: tuple[WhatIf, ...]
    assumptions: tuple[str, ...]
    warnings: tuple[str, ...] = field(default_factory=tuple)
    verdict: str = ""
    """One sentence: the largest loss, the rank(s) it is on, and the step without it."""
    schema_version: str = SCHEMA_VERSION


def _probe_step_ms(run_dir: Path) -> tuple[float | None, int | None, float | None]:
    """Median every-step time across ranks outside profiler windows, the per-rank batch size, and
    the largest share of wall time a rank's training thread waited for a core (None: not sampled)."""
    probes = load_probe_data([run_dir])
    per_rank, batch = [], None
    waited = max(run_wait_shares(probes).values(), default=None)
    for p in probes.values():
        if p.steps.empty:
            continue
        sch = p.meta.get("schedule") or {}
        skip = 2
        if sch.get("enabled"):
            # the profiled window and its trace export are slower than ordinary steps
            skip = (sch.get("wait", 0) + sch.get("warmup", 0) + sch.get("active", 0)) * max(sch.get("repeat", 1), 1) + 2
        ms = job_step_ms(p.steps)  # on the whole record: whether the device timed the rank's steps
        keep = p.steps["step"].to_numpy() > skip
        if keep.sum() < 3:
            keep[:] = True
        ms = ms[keep & np.isfinite(ms)]
        if ms.size:
            per_rank.append(float(np.median(ms)))
        b = (p.meta.get("dataloader") or {}).get("batch_size")
        batch = b if isinstance(b, int) else batch
    return (statistics.median(per_rank) if per_rank else None), batch, waited


def measure_point(nproc: int, run_dir: Path, batch_size: int | None = None,
                  reader: Reader | None = None, run_k: int | None = None) -> tuple[ScalePoint, Diagnosis]:
    """reader: a Dask cluster's (`--cluster`); a run this machine does not see is listed on its workers.
    run_k: which of several runs written into the directory (`--run N=K`; pipeline.one_run)."""
    if reader is None or run_dir.exists():
        run_dir = resolve_run(run_dir)  # a run's `--out` parent stands for its newest run
        traces = run_dir / "traces" if (run_dir / "traces").is_dir() else run_dir
    else:
        traces = run_dir  # the workers' listing finds DIR/traces/ as a local one would
    d = diagnose_paths([traces], reader=reader, run_k=run_k)
    # a job torchelastic restarted: the every-step record of the attempt its traces came from; none
    # where one of several runs was picked (a rerun overwrote the records: another run's, maybe)
    probe_ms, probe_batch, waited = (None, None, None) if run_k is not None else \
        _probe_step_ms(last_attempt(traces, has_traces)[0])
    trace_ms = statistics.fmean(d.run.mean_step_ms.values())
    step_ms, source = (probe_ms, "probe steps") if probe_ms else (trace_ms, "traced steps")
    batch = batch_size or probe_batch
    # not-measurable checks (None) stay out: absent from a run is not the same as zero
    causes = {c.id: float(c.measured_ms) for c in d.checks if c.id in CAUSES and c.measured_ms is not None}
    compute = statistics.fmean(s.compute_ms for s in d.breakdown)
    rep = d.extras.get("replay") or {}
    replayed, source = None, "checks"
    if rep.get("replaces_estimates") and rep.get("replayed_step_ms"):
        replayed, source = float(rep["replayed_step_ms"]), "replay"
        causes.update({c: float(v) for c, v in rep["by_cause_ms"].items() if c in CAUSES})
        compute = float(rep["clean_step_ms"])
    if not d.run.device.startswith(("cuda", "rocm")):
        # on CPU the per-op overhead is inside the compute lane (and the replay cannot remove it):
        # count it once
        compute -= causes.get("launch_overhead", 0.0)
        if waited is not None:
            # the training thread's wait for a core (the probes' samples over the run, a share of wall
            # time) stretches its ops and gaps alike: in the traced step's terms, and out of compute,
            # which holds it (no replay removes it). More ranks and workers on the same cores is a
            # loss of speedup the waterfall otherwise books as compute inflation. Not on GPU ranks,
            # where the device runs queued work while the host waits (cpu_contention's upper bound).
            causes["cpu_contention"] = min(waited * trace_ms, max(compute, 0.0))
            compute -= causes["cpu_contention"]
    point = ScalePoint(nproc=nproc, step_ms=step_ms, step_source=source, per_rank_batch=batch,
                       throughput=(nproc * batch / step_ms * 1000) if batch else None, speedup=1.0,
                       efficiency=1.0, run_dir=str(run_dir), trace_step_ms=trace_ms, causes_ms=causes,
                       compute_ms=compute, replayed_step_ms=replayed, causes_from=source)
    return point, d


def analyze_scaling(runs: dict[int, Path], mode: str = "weak", batch_size: int | None = None,
                    reader: Reader | None = None, run_k: dict[int, int] | None = None
                    ) -> tuple[Scaling, dict[int, Diagnosis]]:
    """Measure each run directory, then account for the speedup (see `account`). run_k: {N: K},
    which of several runs in N's directory (`--run N=K`)."""
    if len(runs) < 2:
        raise DiagnoseError("scaling needs runs at two or more world sizes")
    measured = {n: measure_point(n, Path(p), batch_size, reader, (run_k or {}).get(n)) for n, p in sorted(runs.items())}
    # the wait for a core, read at some sizes and not others (older probes' samples, too few in a
    # run of a few seconds): counted as none there, which the bar between them then carries
    cpu = [n for n, (_, d) in measured.items() if not d.run.device.startswith(("cuda", "rocm"))]
    unsampled = [n for n in cpu if "cpu_contention" not in measured[n][0].causes_ms]
    contention = [f"N={n}: the training threads' wait for a core was not read (older probes that sampled it "
                  f"every few seconds, a run under {RUN_WAIT_SAMPLES * 2} s, or not Linux): its CPU contention "
                  "counted as none"
                  for n in unsampled] if len(unsampled) < len(cpu) else []
    baseline = measured[min(measured)][1].findings
    top = measured[max(measured)][1]
    ranks = {f.id: tuple(f.ranks) for f in top.findings}
    s = account({n: pt for n, (pt, _) in measured.items()}, mode, baseline, ranks)
    picked = tuple(f"N={n}: run {k} of the runs written into {runs[n]} (--run {n}={k}); its step time from its traces"
                   for n, k in sorted((run_k or {}).items()))
    return replace(s, warnings=s.warnings + picked + tuple(contention)), {n: d for n, (_, d) in measured.items()}


def what_if_step(p: ScalePoint, cause: str) -> float | None:
    """The point's step (ms) without the cause ("every_cause": all of them, replay only). None when
    nothing would be given back, or the estimate is as long as the step (a check's own figure, not a
    what-if)."""
    basis = p.replayed_step_ms or p.trace_step_ms
    if cause == "every_cause":
        left = p.compute_ms if p.causes_from == "replay" else 0.0
    else:
        left = basis - p.causes_ms.get(cause, 0.0)
    if not 0 < left < basis:
        return None
    return step_without(p.step_ms, basis, basis - left, scales=cause in SCALES_WITH_PROFILER)


SCALES_WITH_PROFILER = ("launch_overhead", "cpu_contention")
"""Causes made of the host's own op time, which the profiler's per-op overhead lengthens in the
profiled steps, or a share of it (the wait for a core); the others are waits: for a batch, a late
peer, a transfer, a drained queue."""


def step_without(step_ms: float, basis_ms: float, removed_ms: float, scales: bool = False) -> float:
    """An ordinary step (`step_ms`, e.g. the probes' steps outside the profiler's window) without the
    `removed_ms` that the profiled steps (`basis_ms`, as replayed) give back.

    A wait lasts as long in an ordinary step as in a profiled one, while the profiler's overhead
    (per op, on the host) lengthens only the profiled steps' own work: so a wait comes off as it is.
    Scaling it by step_ms / basis_ms instead kept part of it: a 410 ms DataLoader wait in a 509 ms
    profiled step (490 ms unprofiled) predicted 96 ms where the fixed job ran 80 ms (the subtraction
    says 80). Time that is the host's own op time (`scales`) is scaled; so is a wait larger than the
    ordinary step, where the profiled window was not like the rest of the run."""
    if scales or removed_ms >= step_ms:
        return step_ms * (basis_ms - removed_ms) / basis_ms
    return step_ms - removed_ms


def account(measured: dict[int, ScalePoint], mode: str = "weak", baseline_findings=(),
            ranks_by_cause: dict[str, tuple[int, ...]] | None = None) -> Scaling:
    """Speedup per N, the lost-speedup waterfall, what-ifs, the verdict. Pure arithmetic on
    measured points. ranks_by_cause: the ranks each flagged cause is on at the largest N."""
    if mode not in ("weak", "strong"):
        raise DiagnoseError(f"unknown scaling mode {mode!r} (weak or strong)")
    n0 = min(measured)
    base = measured[n0]
    warnings: list[str] = []
    points = []
    for n, pt in sorted(measured.items()):
        w = 1.0 if mode == "weak" else n0 / n
        speedup = (n / n0) * w * base.step_ms / pt.step_ms
        if pt.throughput and base.throughput:
            speedup = pt.throughput / base.throughput
        elif pt.per_rank_batch is None:
            warnings.append(f"N={n}: batch size unknown; speedup from step times assuming {mode} scaling")
        points.append(replace(pt, speedup=round(speedup, 4), efficiency=round(speedup / (n / n0), 4)))
    top = measured[max(measured)]
    w = 1.0 if mode == "weak" else n0 / top.nproc
    ideal = top.nproc / n0
    observed = points[-1].speedup
    T = top.trace_step_ms
    bars = []
    for cid in CAUSES:
        if cid not in top.causes_ms and cid not in base.causes_ms:
            continue
        delta = top.causes_ms.get(cid, 0.0) - w * base.causes_ms.get(cid, 0.0)
        bars.append(Bar(cid, round(ideal * delta / T, 4), round(delta, 3)))
    dc = top.compute_ms - w * base.compute_ms
    bars.append(Bar("compute_inflation", round(ideal * dc / T, 4), round(dc, 3)))
    explained = sum(b.lost_speedup for b in bars)
    bars.append(Bar("unexplained", round((ideal - observed) - explained, 4),
                    round(T - w * base.trace_step_ms - sum(b.delta_ms for b in bars), 3)))
    bars.sort(key=lambda b: -b.lost_speedup)
    what_if = []
    for cid in CAUSES + ("every_cause",):
        step = what_if_step(top, cid)
        if step is not None:
            what_if.append(WhatIf(cid, round(step, 3), round(observed * top.step_ms / step, 4)))
    what_if.sort(key=lambda x: x.step_ms)
    baseline = tuple({"id": f.id, "recoverable_ms": f.recoverable_ms, "share_of_step": f.share_of_step,
                      "ranks": list(f.ranks)} for f in baseline_findings)
    sources = {p.causes_from for p in measured.values()}
    assumptions = (
        f"{mode} scaling: per-rank work at N is {'the same as' if mode == 'weak' else 'N0/N times'} at N0={n0}",
        "causes: what the replay of each run's step graph gives back with the cause removed, measured "
        "whether or not it was flagged" if sources == {"replay"} else
        "causes: " + ("the replay's figures where a run's replay reproduces its steps, elsewhere " if "replay" in
                      sources else "") + "the same per-step estimates `diagnose analyze` reports for each run",
        "lost speedup per cause = (N/N0) x (increase in its ms per step) / traced step time; compute inflation "
        "= the growth of the step with every cause removed (on CPU ranks less the training thread's wait for a "
        "core, CPU contention: the probes' share of wall time, times the traced step); replayed causes do not "
        "add up, so the remainder, "
        "with profiler overhead and noise, is shown as unexplained",
        "what-if: the step less what the replay gives back without the cause (the host's own op time, "
        "launch overhead, scaled by the step over the replayed step instead); every other wait stays in place",
    )
    verdict = _verdict(points[-1], bars, what_if, ideal, observed, ranks_by_cause or {})
    return Scaling(mode=mode, points=tuple(points), waterfall=tuple(bars), ideal_speedup=ideal,
                   observed_speedup=observed, baseline=baseline, what_if=tuple(what_if),
                   assumptions=assumptions, warnings=tuple(warnings), verdict=verdict)


LABELS = {"dataloader_starvation": "DataLoader starvation", "input_stall": "blocking input copies",
          "exposed_communication": "exposed communication", "straggler": "waiting for a straggler",
          "launch_overhead": "launch / per-op overhead",
          "cpu_contention": "CPU contention, the training threads waiting for a core",
          "compute_inflation": "compute inflation",
          "unexplained": "unexplained", "every_cause": "every cause together"}


def _verdict(top: ScalePoint, bars: list[Bar], what_if: list[WhatIf], ideal: float, observed: float,
             ranks: dict[str, tuple[int, ...]]) -> str:
    """The page's first sentence: the largest loss, on which ranks, and the step without it."""
    head = f"{observed:.2f}x of an ideal {ideal:.2f}x at N={top.nproc}"
    lost = [b for b in bars if b.lost_speedup > 0]
    if not lost:
        return head + ": nothing lost to any cause."
    b = lost[0]
    on = ranks.get(b.id, ())
    where = f" on rank {rank_ranges(on)}" if on and len(on) < top.nproc else ""
    label = LABELS.get(b.id, b.id)
    if b.id == "straggler" and not on and "load_imbalance" in ranks:
        # the same replay (every rank to the median) where no rank is named: the top run's check
        # called it uneven work, and so does the page
        label = "uneven work across ranks (waiting for each step's slowest rank)"
    out = f"{head}: the largest loss is {label}{where} ({b.lost_speedup:.2f}x, " \
          f"{b.delta_ms:+.1f} ms per step)"
    w = next((x for x in what_if if x.id == b.id), None)
    if w is not None:
        out += f"; without it a step would take {w.step_ms:.1f} ms ({w.speedup:.2f}x)"
    return out + "."


def terminal_summary(s: Scaling) -> str:
    lines = [f"SCALING ({s.mode}): {s.verdict or f'{s.observed_speedup:.2f}x at N={s.points[-1].nproc}'}"]
    lines.append(f"{'N':>4} {'step ms':>9} {'samples/s':>10} {'speedup':>8} {'efficiency':>10}")
    for p in s.points:
        tput = f"{p.throughput:10.1f}" if p.throughput else f"{'?':>10}"
        lines.append(f"{p.nproc:>4} {p.step_ms:>9.1f} {tput} {p.speedup:>8.2f} {p.efficiency:>10.0%}")
    lines.append("")
    lines.append("lost speedup, by cause (what got worse as N grew):")
    for b in s.waterfall:
        lines.append(f"  {b.id:<24} {b.lost_speedup:+7.3f}x  ({b.delta_ms:+.1f} ms/step)")
    lines.append("")
    lines.append(f"slow already at N={s.points[0].nproc} (baseline, costs throughput at every N):")
    if not s.baseline:
        lines.append("  nothing flagged")
    for f in s.baseline:
        lines.append(f"  {f['id']:<24} {f['recoverable_ms']:.1f} ms/step ({f['share_of_step']:.0%})")
    if s.what_if:
        lines.append("")
        lines.append(f"what if, at N={s.points[-1].nproc}:")
        for w in s.what_if:
            lines.append(f"  without {w.id:<24} step {w.step_ms:.1f} ms, speedup {w.speedup:.2f}x")
    if s.warnings:  # said in scaling.json and the page, and here too: which run was read, what was assumed
        lines.append("")
        lines.extend(f"warning: {one_line(w)}" for w in s.warnings)
    return "\n".join(lines)
