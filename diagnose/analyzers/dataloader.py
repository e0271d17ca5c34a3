"""1. Dataloader starvation, and input stalls outside the DataLoader.

Estimation (dataloader_starvation): per rank, the mean per-step time spent in
`enumerate(DataLoader)#...__next__` that is not hidden under device work (GPU
traces) or that blocks the training thread (CPU traces); the job-level figure is
the worst rank's, since every other rank waits for it at the next collective.

Where the wait comes at epoch starts: the probes mark each training iterator's first fetch
(probes/patches._TimedIter): a new iterator begins its workers' prefetch from nothing and one
worker loads that batch alone, so more workers, the usual fix, do not shorten it (measured:
`examples/train_ddp.py --epoch-steps 4 --num-workers 2 --slow-getitem-ms 1` waited ~300 ms at each
epoch's start with 2 or 4 workers, persistent or not; one iterator over every epoch,
`--sampler-spans-epochs`, took the run's mean step from 201 to 137 ms). Where most of the
every-step record's wait is such first batches, the finding says so, with the run's figures
beside the profiled window's (a window of a few steps holds one epoch start or two, by chance),
and leads its fix with keeping the prefetch running across epochs.

Estimation (input_stall): on GPU traces, per step, the time the device copies pageable host
memory with no kernel alongside (RankTimeline.input_copies: such a copy runs at the host's staging
speed and blocks the host), and, replayed, the idle gaps the device spends waiting on an input
copy (the idle model's input class).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import islice

import numpy as np

from diagnose.analyzers.common import (confidence_for, evaluation_marks, evaluation_spans, flag_or_pass,
                                      not_measurable)
from diagnose.context import Context
from diagnose.ingest.load import KIND_MEMCPY, RankTrace
from diagnose.model import Check, Finding
from diagnose.probedata import host_cores, ranks_on_host, signal_mean
from diagnose.step.breakdown import GC_IN_FETCH
from diagnose.step.cover import column
from diagnose.step.intervals import covered, intersect, union
from diagnose.step.timeline import DATALOADER, PAGEABLE_H2D, RankTimeline, _names_matching
from diagnose.step.window import window_mask
from diagnose.thresholds import Thresholds

TITLE = "Dataloader starvation"
TITLE_EVAL = "Dataloader starvation (an evaluation's batches, inside the training steps)"
TITLE_EPOCH = "Dataloader starvation (each epoch's first batch)"
TITLE_STALL = "Input stall outside the DataLoader (blocking host-to-device copies)"
FIX = ("Feed the step faster: DataLoader(num_workers=4..8 per GPU, pin_memory=True, "
       "prefetch_factor=2..4, persistent_workers=True); move decoding/augmentation off the "
       "training process or cache preprocessed samples.")
FIX_NO_CORES = ("This host has {cores} core(s) for {ranks} rank(s){and_workers}, and the training thread ran on a "
                "core {on_cpu:.0%} of the time: the loading is CPU work and no core is free for more workers, which "
                "would take the ranks' own. Make each sample cheaper (pre-process once and store the result; decode "
                "and augment on the GPU: torchvision.io.decode_jpeg(device='cuda'), NVIDIA DALI), or run on hosts "
                "with more cores per rank.")
ON_CPU = 0.8
"""The training thread on a core this share of the run or more (the probes' thread_cpu): its waits
for batches are work it does itself (num_workers=0) or waits on workers that are CPU-bound too."""
EVAL_NAMED = 0.25
"""From this share of the worst rank's DataLoader wait in an evaluation's batches, the
finding says so (and from half, leads its fix with the evaluation's loader)."""
GC_NAMED = 0.25
"""From this share of the window's DataLoader wait in garbage collections inside the fetches, the
reason says so; where the probes did not place them in their steps (step/pauses.py), the finding's
confidence is low too (the window caught a collection there, known by its sums only)."""
EPOCH_LEADS = 0.5
"""From this share of the every-step record's DataLoader wait in iterators' first batches (over
two epoch starts at least), the finding is about epoch starts: its fix leads with them."""
MIN_RECORD_STEPS = 10
"""Recorded steps, at the least, for the record's share to be read (a window is a few steps)."""
FIX_EPOCH = ("Keep the DataLoader's prefetch running across epochs: iterate one iterator over every epoch "
             "(a sampler that yields each epoch's indices in turn, reshuffled per epoch), or make an epoch's "
             "first batch cheaper (cached or preprocessed samples, a smaller batch). A new iterator starts its "
             "prefetch from nothing{restart} and one worker loads its first batch alone: more workers do not "
             "shorten that wait{persist}.")
FIX_STALL = ("Copy inputs asynchronously: pin_memory=True in the DataLoader and "
             "tensor.to(device, non_blocking=True); avoid pageable host tensors in the step.")


@dataclass(frozen=True, slots=True)
class RankInput:
    """One rank's summary: its longest DataLoader waits, and host-to-device copies that stall the device."""

    wait_rows: tuple[int, ...]
    h2d_exposed_ms: float
    """Mean per-step time a pageable host-to-device copy runs with no kernel alongside (0 without)."""
    h2d_rows: tuple[int, ...]
    wait_ms: float = 0.0
    """Mean per-step time in DataLoader fetches (hidden or not)."""
    no_grad_wait_ms: float = 0.0
    """... of it in fetches the probes marked as an evaluation's (patches.EVAL_BATCH)."""
    evaluation_ms: float = 0.0
    """Mean per-step time from the first marked fetch of a step to the end of its last (the fetch
    that ends the loop is marked too): an evaluation's whole loop, its forward passes included."""

    @property
    def rows(self) -> tuple[int, ...]:
        return self.wait_rows + self.h2d_rows


def reduce(trace: RankTrace, tl: RankTimeline) -> RankInput:
    ev = trace.events
    waits = ev[_names_matching(ev, DATALOADER)].nlargest(3, "dur")
    exposed_ms, h2d_rows = 0.0, ()
    cp = ev[(ev["kind"] == KIND_MEMCPY).to_numpy() & _names_matching(ev, PAGEABLE_H2D)]
    if len(cp) and len(tl.steps):
        exposed_ms = float(np.mean(covered(tl.input_copies, tl.steps.start, tl.steps.end))) / 1000
        h2d_rows = tuple(int(i) for i in cp.nlargest(2, "dur").index)
    wait_ms = no_grad_ms = eval_ms = 0.0
    marks = evaluation_marks(ev)
    if len(marks) and len(tl.steps):
        wait_ms = float(np.mean(covered(tl.dataloader, tl.steps.start, tl.steps.end))) / 1000
        no_grad = intersect(tl.dataloader, union(marks["ts"], marks["ts"] + marks["dur"]))
        no_grad_ms = float(np.mean(covered(no_grad, tl.steps.start, tl.steps.end))) / 1000
        first, last = evaluation_spans(marks, tl)  # the evaluation's whole loop, a step's
        eval_ms = float(np.nan_to_num(last - first).mean()) / 1000
    return RankInput(wait_rows=tuple(int(i) for i in waits.index), h2d_exposed_ms=exposed_ms, h2d_rows=h2d_rows,
                     wait_ms=wait_ms, no_grad_wait_ms=no_grad_ms, evaluation_ms=eval_ms)


@dataclass(frozen=True, slots=True)
class EpochStarts:
    """One rank's DataLoader wait over the probes' every-step record, and the part of it in
    training iterators' first batches (an epoch's start)."""

    rank: int
    steps: int
    """Steps recorded."""
    starts: int
    """... of them holding an iterator's first batch."""
    wait_ms: float
    """Mean DataLoader wait per recorded step."""
    first_ms: float
    """... of it in first batches."""
    each_ms: float
    """Median first-batch wait at an epoch start."""
    step_ms: float
    """Mean recorded step."""
    window: tuple[int, int] | None
    """(epoch starts, steps) among the profiled steps, where the trace's clock places them."""

    @property
    def share(self) -> float:
        return self.first_ms / self.wait_ms if self.wait_ms > 0 else 0.0


def epoch_starts(ctx: Context, rank: int) -> EpochStarts | None:
    """`rank`'s EpochStarts (None: no every-step record of MIN_RECORD_STEPS, or a probe that
    predates first batches' marking, whose record has none)."""
    p = ctx.probes.get(rank)
    if p is None or len(p.steps) < MIN_RECORD_STEPS or "first_batch_ms" not in p.steps:
        return None
    s = p.steps
    first = s["first_batch_ms"].fillna(0.0).to_numpy(dtype=float)
    wait = s["dataloader_ms"].fillna(0.0).to_numpy(dtype=float)
    is_start = first > 0
    if not is_start.any():
        return None
    window = None
    trace = ctx.run.traces.get(rank)
    inside = window_mask(trace, s) if trace is not None else None
    if inside is not None and inside.any():
        window = (int((inside & is_start).sum()), int(inside.sum()))
    return EpochStarts(rank=rank, steps=len(s), starts=int(is_start.sum()), wait_ms=float(wait.mean()),
                       first_ms=float(first.mean()), each_ms=float(np.median(first[is_start])),
                       step_ms=float(s["dur_ms"].mean()), window=window)


def collections_in_wait(ctx: Context, rank: int) -> float | None:
    """Mean per profiled step of the garbage collections that ran inside `rank`'s DataLoader
    fetches (the probes' record, its steps inside the trace's span); None where not known."""
    p, trace = ctx.probes.get(rank), ctx.run.traces.get(rank)
    if p is None or trace is None or "dataloader_gc_ms" not in p.steps:
        return None
    inside = window_mask(trace, p.steps)
    if inside is None or not inside.any():
        return None
    return float(p.steps["dataloader_gc_ms"].fillna(0.0).to_numpy(dtype=float)[inside].mean())


def _dataloader(ctx: Context, th: Thresholds) -> Check:
    run = ctx.run
    if all(tl.cover.n_dataloader == 0 for tl in run.timelines.values()):
        return not_measurable("dataloader_starvation", TITLE,
                              "no enumerate(DataLoader) events in the trace (custom input pipeline, or "
                              "the loop does not iterate a DataLoader inside the profiled steps)")
    # the wait as the trace shows it: the breakdown took the collections placed inside fetches out
    # of it (its gc part), and this check takes every collection the probes timed there off below
    per_rank = ctx.per_rank_mean("dataloader_ms") + ctx.per_rank_mean(GC_IN_FETCH)
    step = ctx.per_rank_mean("step_ms")
    share_by_rank = per_rank / step
    worst = int(per_rank.idxmax())
    ms = float(per_rank.max())
    share = ms / ctx.mean_step_ms
    ranks = tuple(int(r) for r in share_by_rank[share_by_rank >= th.input_bound].index) or (worst,)
    # the longest waits, as evidence a person can find in Perfetto
    facts = ctx.facts("dataloader")
    refs = [ctx.event_ref(r, i, "DataLoader wait") for r in ranks[:4] for i in facts[r].wait_rows]
    metrics: dict[str, float | int | str] = {
        "dataloader_ms_per_step": round(ms, 3),
        "share_of_step": round(share, 4),
        "worst_rank": worst,
    }
    for r, v in per_rank.items():
        metrics[f"rank{r}_dataloader_ms"] = round(float(v), 3)
    tl = run.timelines[worst]
    blocked_ms = float(column(tl, "dataloader").mean()) / 1000
    metrics["blocked_in_dataloader_ms"] = round(blocked_ms, 3)
    metrics["blocked_share_of_step"] = round(blocked_ms / float(step[worst]), 4)
    if ctx.probes:
        shares = [float((p.steps["dataloader_ms"] / p.steps["dur_ms"]).median()) for p in ctx.probes.values()
                  if not p.steps.empty]
        if shares:
            metrics["every_step_dataloader_share"] = round(max(shares), 4)
            metrics["every_step_steps"] = int(max(len(p.steps) for p in ctx.probes.values()))
    if run.is_gpu:
        # only the part of the wait the device also idles is lost: queued kernels run meanwhile
        metrics["device_idle_share_of_wait"] = round(ms / blocked_ms, 3) if blocked_ms else 0.0
    cfg, eval_cfg = ctx.probe_meta("dataloader"), ctx.probe_meta("dataloader_no_grad")
    fix = FIX
    if cfg:
        fix = f"{FIX} This run: {_loader(cfg)}."
    crowded = no_spare_cores(ctx, worst, cfg)
    if crowded:  # "more workers" would share the cores the ranks already fill
        fix = crowded + (f" This run: {_loader(cfg)}." if cfg else "")
        metrics["no_spare_cores"] = 1
    # an evaluation inside the profiled steps: its batches' wait is time the step loses too, but
    # the loader to feed faster (or the evaluation to run less often) is another one
    mine = facts[worst]
    eval_share = mine.no_grad_wait_ms / mine.wait_ms if mine.wait_ms > 0 else 0.0
    eval_note = ""
    if eval_share >= EVAL_NAMED:
        metrics["no_grad_share_of_wait"] = round(eval_share, 4)
        metrics["no_grad_dataloader_ms"] = round(ms * eval_share, 3)
        eval_note = (f"; {eval_share:.0%} of that wait is an evaluation's batches (a DataLoader iterated with "
                     "autograd off, or by a Trainer's evaluation loop, inside the profiled steps)")
        evaluation = (f"Of the wait, {eval_share:.0%} is an evaluation's batches (a DataLoader iterated "
                      "with autograd off, or by a Trainer's evaluation loop, inside the training steps): give "
                      "that loader workers, evaluate less "
                      "often or on fewer batches, or run the evaluation elsewhere"
                      + (f" (this run's evaluation loader: {_loader(eval_cfg)})" if eval_cfg else "") + ".")
        # mostly the evaluation's: the training loader's settings are beside the point
        fix = f"{evaluation} {FIX}" if eval_share >= 0.5 else f"{fix} {evaluation}"
    title = TITLE_EVAL if eval_share >= 0.5 else TITLE
    epoch = epoch_starts(ctx, worst) if eval_share < 0.5 else None
    epoch_note = ""
    if epoch is not None and epoch.starts >= 2 and epoch.share >= EPOCH_LEADS:
        metrics.update({"every_step_dataloader_ms": round(epoch.wait_ms, 3),
                        "every_step_first_batch_ms": round(epoch.first_ms, 3),
                        "first_batch_share_of_wait": round(epoch.share, 4),
                        "epoch_starts": epoch.starts, "first_batch_ms_each": round(epoch.each_ms, 3),
                        "every_step_step_ms": round(epoch.step_ms, 3)})
        title = TITLE_EPOCH
        epoch_note = (f"; most of it is each epoch's first batch: over the run's {epoch.steps} recorded steps rank "
                      f"{worst} waits {epoch.wait_ms:.1f} ms per step, {epoch.first_ms:.1f} of it ({epoch.share:.0%}) "
                      f"at {epoch.starts} epoch starts of {epoch.each_ms:.0f} ms each")
        if epoch.window is not None:
            metrics["window_epoch_starts"], metrics["window_steps"] = epoch.window
            epoch_note += (f" ({epoch.window[0]} of the {epoch.window[1]} profiled steps began an epoch, "
                           f"{epoch.starts} of {epoch.steps} over the run)")
        restart = persist = ""
        if cfg.get("persistent_workers") is False and cfg.get("num_workers", 0):
            restart = ", with new worker processes (persistent_workers=False here),"
            persist = ", and persistent_workers=True saves the workers' start, not the batch's loading"
        fix = FIX_EPOCH.format(restart=restart, persist=persist)
        steady = epoch.wait_ms - epoch.first_ms
        if epoch.step_ms > 0 and steady / epoch.step_ms >= th.input_bound:
            fix += f" Within epochs it falls behind too, {steady:.1f} ms per step over the run. {FIX}"
        if cfg:
            fix += f" This run: {_loader(cfg)}."
    f = Finding(
        id="dataloader_starvation", title=title, severity=th.severity(share),
        recoverable_ms=round(ms, 3),
        share_of_step=round(share, 4), ranks=ranks, metrics=metrics, events=tuple(refs), fix=fix,
        confidence=confidence_for(ctx), method="Mean per-step DataLoader wait not hidden under device work "
        "(GPU) or blocking the training thread (CPU), on the worst rank.")
    # a garbage collection that began inside a fetch reads as the DataLoader's wait in the trace
    # (and in the replay's DataLoader part): the probes know how much of the window's wait it was
    collected = collections_in_wait(ctx, worst)
    if collected is not None and collected >= th.healthy_floor_ms:
        collected = min(collected, ms)
        own = ms - collected
        metrics["gc_in_wait_ms"] = round(collected, 3)
        # the passes the probes placed are the step model's own part already (step/pauses.py): the
        # replay's DataLoader part is without them, and only the rest is taken off it
        pz = ctx.pauses.get(worst)
        placed = pz.in_fetch_ms_per_step if pz is not None else 0.0
        unplaced = max(collected - placed, 0.0)
        metrics["gc_in_wait_unplaced_ms"] = round(unplaced, 3)
        own_share = own / ctx.mean_step_ms if ctx.mean_step_ms > 0 else 0.0
        # its own figure and the replay's (whatif.finding_saving) both less the collections
        f = replace(f, recoverable_ms=round(own, 3), share_of_step=round(own_share, 4), severity=th.severity(own_share))
        if collected >= GC_NAMED * ms:  # a middle generation's few tenths of a ms now and then are not worth a word
            eval_note += (f"; {collected:.1f} ms per step of it was Python's garbage collection inside the fetches "
                          "(the probes' record; the gc_pause check)")
        if unplaced >= GC_NAMED * ms:
            # only the record's sums say how much: where the passes lay, and what the wait hid, is not known
            f = replace(f, confidence="low")
    level = "highly input-bound" if f.share_of_step >= th.input_bound_high else "input-bound"
    return flag_or_pass(f, th.input_bound, th, f"{level}: rank {worst} waits {ms:.1f} ms per step "
                        f"({share:.0%}) for the next batch{eval_note}{epoch_note}", ctx)


def no_spare_cores(ctx: Context, rank: int, cfg: dict) -> str:
    """FIX_NO_CORES where the rank's host has no free core for one more DataLoader worker a rank
    and the training thread ran on a core ON_CPU of the time or more over the run (the probes'
    telemetry): the loading is CPU work, so more workers cannot help; else ""."""
    p = ctx.probes.get(rank)
    if p is None:
        return ""
    share, cores = signal_mean(p, "thread_cpu"), host_cores(p)
    if not share >= ON_CPU or cores is None:  # NaN: not sampled
        return ""
    ranks = ranks_on_host(ctx.probes, rank)
    workers = cfg.get("num_workers") if isinstance(cfg.get("num_workers"), int) else 0
    if cores - ranks * (1 + workers) >= ranks:  # a free core for one more worker a rank
        return ""
    return FIX_NO_CORES.format(cores=cores, ranks=ranks, on_cpu=share,
                               and_workers=f" and {ranks * workers} worker(s)" if workers else "")


def _loader(cfg: dict) -> str:
    shown = ", ".join(f"{k}={cfg[k]}" for k in ("batch_size", "num_workers", "pin_memory", "prefetch_factor",
                                                  "persistent_workers") if k in cfg)
    return f"DataLoader({shown})"


def _input_stall(ctx: Context, th: Thresholds) -> Check:
    run = ctx.run
    if not run.is_gpu:
        return not_measurable("input_stall", TITLE_STALL, "CPU-only trace: no host-to-device copies to measure")
    facts = ctx.facts("dataloader")
    per_rank = {r: f.h2d_exposed_ms for r, f in facts.items()}
    # the finding cites the first 6: build no more
    refs = list(islice((ctx.event_ref(r, i, "host-to-device copy") for r, f in facts.items() for i in f.h2d_rows), 6))
    worst = max(per_rank, key=per_rank.get)
    ms = per_rank[worst]
    share = ms / ctx.mean_step_ms
    f = Finding(
        id="input_stall", title=TITLE_STALL, severity=th.severity(share), recoverable_ms=round(ms, 3),
        share_of_step=round(share, 4), ranks=(worst,),
        metrics={"exposed_h2d_ms_per_step": round(ms, 3), "share_of_step": round(share, 4)},
        events=tuple(refs[:6]), fix=FIX_STALL, confidence=confidence_for(ctx, "medium"),
        method="Mean per-step time the device copies pageable host memory with no kernel running, on the "
        "worst rank.")
    return flag_or_pass(f, th.input_stall, th, f"host-to-device copies stall the device {ms:.2f} ms per step", ctx)


def analyze(ctx: Context, th: Thresholds) -> list[Check]:
    return [_dataloader(ctx, th), _input_stall(ctx, th)]
