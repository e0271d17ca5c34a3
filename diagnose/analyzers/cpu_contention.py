"""Host CPU contention: the training thread ready to run and waiting for a core.

A host with too few cores for its ranks and their DataLoader workers (CPU-heavy transforms: image
decoding, augmentation) stretches every step while the trace shows nothing: the DataLoader keeps
up, so its wait is short, and the ops themselves take longer, each waiting for a core between
time slices. Measured (2026-12-07, this 2-core machine, `examples/train_ddp.py --cpu-getitem-ms 0.5
--num-workers 2`): the median step went from 105.5 ms (no transforms) to 232 ms with a DataLoader wait of 4 ms, the host
100% busy, and the tool said "no significant cause found".

The probes read the kernel's run-queue delay of the training thread (its time runnable but not
running) at every step end (`run_wait_ms` in the step record), and older probes sampled it every
few seconds (probes/telemetry.py `run_wait`): that time is lost to the step on a CPU rank. Per step
the job waits for its slowest rank, so the cost is the largest rank's share of its mean step (an
upper bound where ranks wait at different times). On a GPU rank the device runs queued work meanwhile: the figure is an upper bound there,
confidence medium. Over the run (every recorded step), like gc_pause: no replay of the profiled
steps expresses it.
"""
from __future__ import annotations

import numpy as np

from diagnose.analyzers.common import flag_or_pass, not_measurable
from diagnose.context import Context
from diagnose.model import Check, Finding
from diagnose.probedata import RUN_WAIT_STEPS, host_cores, job_step_ms, ranks_on_host, run_wait_basis, signal_mean
from diagnose.thresholds import Thresholds
from diagnose.units import rank_ranges

ID = "cpu_contention"
TITLE = "Host CPU contention (the training thread waits for a core)"
FIX_WORKERS = ("This host runs {ranks} rank(s) and {workers} DataLoader worker process(es) on {cores} core(s), {busy}: "
               "the training threads wait for a core, and more workers cannot load faster when none is free. Make each sample cheaper (pre-process once and store the result; decode and augment on the "
               "GPU: torchvision.io.decode_jpeg(device='cuda'), NVIDIA DALI), leave each rank a core of its own "
               "(num_workers about cores / ranks - 1, here {fit}), or run on hosts with more cores per rank.")
FIX_OTHER = ("Other work on this host takes the training threads' cores ({cores} core(s), {busy}): find it (top -H, "
             "or pidstat -t 2), keep other jobs off the host, and pin each rank to cores of its own (numactl "
             "--physcpubind or taskset per rank).")


def analyze(ctx: Context, th: Thresholds) -> list[Check]:
    share: dict[int, float] = {}
    over: dict[int, str] = {}
    busy: dict[int, float] = {}
    on_cpu: dict[int, float] = {}
    step_ms: dict[int, float] = {}
    for r, p in sorted(ctx.probes.items()):
        basis = run_wait_basis(p)
        if basis is None or p.steps.empty:
            continue
        share[r], over[r] = basis
        busy[r], on_cpu[r] = signal_mean(p, "cpu_busy"), signal_mean(p, "thread_cpu")
        ms = job_step_ms(p.steps)
        step_ms[r] = float(np.nanmean(ms)) if np.isfinite(ms).any() else np.nan
    if not share:
        return [not_measurable(ID, TITLE, "the probes did not read the training thread's wait for a CPU (no "
                               f"run_wait_ms in {RUN_WAIT_STEPS} recorded steps nor run_wait in the telemetry: "
                               "older probes, or not Linux)")]
    lost = {r: share[r] * step_ms[r] for r in share if np.isfinite(step_ms[r])}
    if not lost:
        return [not_measurable(ID, TITLE, "no recorded step times beside the telemetry")]
    worst = max(lost, key=lost.get)
    ms = lost[worst]
    mean_step = step_ms[worst]
    frac = ms / mean_step if mean_step > 0 else 0.0
    ranks = tuple(r for r in sorted(share) if share[r] >= th.cpu_contention) or (worst,)
    cfg = ctx.probe_meta("dataloader")
    workers = cfg.get("num_workers") if isinstance(cfg.get("num_workers"), int) else None
    cores, on_host = host_cores(ctx.probes[worst]), ranks_on_host(ctx.probes, worst)
    metrics: dict[str, float | int | str] = {
        "run_wait_share": round(share[worst], 4), "cpu_lost_ms_per_step": round(ms, 3),
        "every_step_step_ms": round(mean_step, 3), "worst_rank": worst, "ranks_on_host": on_host,
    }
    if np.isfinite(busy[worst]):
        metrics["host_cpu_busy"] = round(busy[worst], 4)
    if np.isfinite(on_cpu[worst]):
        metrics["thread_on_cpu_share"] = round(on_cpu[worst], 4)
    if cores:
        metrics["host_cores"] = cores
    if workers is not None:
        metrics["dataloader_workers_per_rank"] = workers
    for r in sorted(share):
        metrics[f"rank{r}_run_wait_share"] = round(share[r], 4)
    said = (f"{busy[worst]:.0%} busy over the run" if np.isfinite(busy[worst]) else "its load not read")
    if workers and cores:
        fix = FIX_WORKERS.format(ranks=on_host, workers=on_host * workers, cores=cores, busy=said,
                                 fit=max(cores // max(on_host, 1) - 1, 0))
    else:
        fix = FIX_OTHER.format(cores=cores or "its", busy=said)
    on_device = ctx.run.is_gpu
    f = Finding(id=ID, title=TITLE, severity=th.severity(frac), recoverable_ms=round(ms, 3),
                share_of_step=round(frac, 4), ranks=ranks, metrics=metrics, events=(), fix=fix,
                confidence="medium" if on_device else "high", over="run",
                method="The training thread's run-queue delay (ready, waiting for a core; /proc schedstat, read by "
                       "the probes at every step end, or sampled every few seconds by older ones) as a share of "
                       "wall time, times the rank's mean recorded step, on the rank that loses most" + (": an upper bound where the device has work queued."
                                                        if on_device else "."))
    who = ("its DataLoader's workers among them: " + f"{on_host} rank(s) and {on_host * workers} worker(s) on "
           f"{cores} core(s)") if workers and cores else f"{cores or 'its'} core(s)"
    host_busy = f"the host {busy[worst]:.0%} busy" if np.isfinite(busy[worst]) else "the host's load not read"
    reason = (f"rank {worst}'s training thread waited for a CPU {share[worst]:.0%} of the time over the run's "
              f"{over[worst]}, {ms:.1f} ms of its {mean_step:.1f} ms step, {host_busy} "
              f"({who}); rank(s) {rank_ranges(ranks)} from {th.cpu_contention:.0%} up")
    return [flag_or_pass(f, th.cpu_contention, th, reason)]
