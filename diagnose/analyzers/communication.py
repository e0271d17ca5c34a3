"""2. Communication vs compute overlap.

Estimation: per rank, the mean per-step communication time not hidden under
compute, less the time spent waiting for the last-arriving rank. That waiting is never
booked here, whether the straggler check names a rank (its part) or finds arrival jitter
(no rank to fix; the straggler check reports its size): no bucket size or interconnect
change shortens a wait for a late peer. Job-level: the median rank, since a
collective ends at the same moment on every rank and the median is robust to one
rank's noise.
Also reports collectives per step, their sizes, and overlap. The fix is the stack's that moves
the collectives (`Stack`, per rank: DDP's, FSDP's, tensor parallelism's DTensor redistributions):
DDP's bucket advice read as nonsense beside an FSDP2 and tensor-parallel job's all-gathers.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from diagnose.analyzers.common import confidence_for, flag_or_pass, not_measurable, passed
from diagnose.analyzers.grad_sync import DDP_FORWARD
from diagnose.context import Context
from diagnose.ingest.load import KIND_ANNOTATION, KIND_CPU_OP, RankTrace
from diagnose.model import Check, Finding
from diagnose.step.bandwidth import SMALL_MESSAGE_BYTES
from diagnose.step.collectives import collectives_table
from diagnose.step.cover import column
from diagnose.step.timeline import RankTimeline, _names_matching
from diagnose.thresholds import Thresholds
from diagnose.units import rank_ranges

ID = "exposed_communication"
TITLE = "Exposed communication (collectives not overlapped with compute)"
FIX = ("Hide or shrink communication: let DDP overlap it (bucket_cap_mb=25..100, gradient_as_bucket_view=True, "
       "static_graph=True); accumulate gradients under model.no_sync() to all-reduce less often; "
       "compress gradients (bf16/fp16 comm hook); check the interconnect and NCCL topology (NCCL_DEBUG=INFO).")
FIX_TINY = ("Collectives are many and small: raise DDP bucket_cap_mb (default 25) so gradients travel "
            "in a few large buckets, and avoid per-parameter all-reduce calls.")
FIX_TINY_LOOP = ("Collectives are many and small, and the training loop issues them itself (no DDP or FSDP in the "
                 "trace): wrap the model in DistributedDataParallel, which all-reduces gradients in ~25 MB buckets "
                 "while the backward still runs, or flatten the gradients into one buffer and all-reduce it once "
                 "(torch._utils._flatten_dense_tensors), not a call per parameter.")
FIX_FSDP = ("Hide or shrink FSDP's communication: prefetch the next unit's all-gather (FSDP2: "
            "set_modules_to_forward_prefetch / set_modules_to_backward_prefetch; FSDP1: forward_prefetch=True, "
            "backward_prefetch=BackwardPrefetch.BACKWARD_PRE); shard fewer, larger units (fully_shard on blocks, "
            "not single layers); reduce gradients in bf16 (MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)); "
            "sync gradients on the last micro-batch only (set_requires_gradient_sync(False) before the others); "
            "keep the shard group within a node (HSDP: replicate across nodes); check the interconnect and NCCL "
            "topology (NCCL_DEBUG=INFO).")
FIX_TP = ("Tensor parallelism's all-reduces hold the forward and backward (its functional collectives, waited in "
          "wait_tensor): keep the tp group within a node (NVLink), lower the tp degree, or overlap them (async "
          "tensor parallelism under torch.compile: torch._inductor.config._micro_pipeline_tp = True, with "
          "sequence parallelism).")
STACK = "communication"  # the checklist entry's name: its per-rank phase's summaries (Context.facts)
FSDP_SPANS = re.compile(r"^FSDP::|FullyShardedDataParallel")
FUNCTIONAL = re.compile(r"^_?c10d_functional::")
REDISTRIBUTE = re.compile(r"^(Nested)?Redistribute(Backward)?$")


@dataclass(frozen=True, slots=True)
class Stack:
    """What moves a rank's collectives, from the names of its training threads' ops and spans."""

    ddp: bool
    """DistributedDataParallel.forward runs."""
    fsdp: bool
    """FSDP's spans (FSDP2's `FSDP::*`, FSDP1's FullyShardedDataParallel ops)."""
    tensor_parallel: bool
    """DTensor redistributions (`Redistribute` spans) moving data by functional collectives
    (`_c10d_functional::*`): tensor parallelism's all-reduces. Functional collectives alone are
    not enough: compiled DDP's Python reducer issues them too."""


def reduce(trace: RankTrace, tl: RankTimeline) -> Stack:
    ev = trace.events
    host = ev["kind"].isin([KIND_CPU_OP, KIND_ANNOTATION]).to_numpy()

    def runs(pattern: re.Pattern) -> bool:
        return bool((host & _names_matching(ev, pattern)).any())

    return Stack(ddp=runs(DDP_FORWARD), fsdp=runs(FSDP_SPANS), tensor_parallel=runs(FUNCTIONAL) and runs(REDISTRIBUTE))


def _stacks(ctx: Context) -> list[Stack] | None:
    """Each rank's Stack; None where the run was read without the per-rank phase, or it failed on a
    rank (the fix is all it costs)."""
    try:
        return list(ctx.facts(STACK).values())
    except RuntimeError:
        return None


def _loop_issued(ctx: Context) -> bool:
    """No rank runs DDP, FSDP or tensor parallelism: the training loop calls the collectives itself."""
    stacks = _stacks(ctx)
    return bool(stacks) and not any(s.ddp or s.fsdp or s.tensor_parallel for s in stacks)


def _fix(ctx: Context) -> str:
    """The fix for the stacks the ranks run (FIX, DDP's and the default, where none is seen, or
    where the run was read without the per-rank phase)."""
    stacks = _stacks(ctx)
    if stacks is None:
        return FIX
    parts = ([FIX_FSDP] if any(s.fsdp for s in stacks) else []) + \
        ([FIX_TP] if any(s.tensor_parallel for s in stacks) else [])
    return " ".join(parts + ([FIX] if any(s.ddp for s in stacks) or not parts else []))
# Hundreds of collectives per step under 1 MiB each: latency-bound, i.e. no bucketing.
MANY_COLLECTIVES = 50
SMALL_BYTES = SMALL_MESSAGE_BYTES  # one definition of a small collective (step/bandwidth.py: why 1 MiB)
# One all-reduce carrying most of a step's gradients, too big for DDP's default bucket: DDP
# all-reduces a bucket once every gradient in it is ready, so one bucket holding them all starts
# after the whole backward and nothing can overlap it. Over twice the default cap, the default
# would make at least two buckets, the first reduced while the backward still runs.
DDP_DEFAULT_CAP_BYTES = 25 * 1024**2
ONE_BUCKET_SHARE = 0.75
LITTLE_OVERLAP = 0.25
MIN_SPLIT = 4  # fewer all-reduces a step than this cost too little latency to name


def fix_one_bucket(cap_mb: float, largest_mb: float) -> str:
    return (f"One DDP bucket carries {largest_mb:.0f} MB of gradients (bucket_cap_mb={cap_mb:g}): DDP all-reduces "
            "a bucket only once every gradient in it is ready, so it starts after the whole backward and "
            "nothing overlaps it. Lower bucket_cap_mb to the default 25 (or about a quarter of the "
            "gradients) so the first buckets are reduced while the backward still runs; "
            "gradient_as_bucket_view=True saves the copy into them.")


def analyze(ctx: Context, th: Thresholds) -> list[Check]:
    run = ctx.run
    has_comm = any(tl.cover.n_comm for tl in run.timelines.values())
    if not has_comm:
        if (run.world_size or 1) <= 1:
            return [passed(ID, TITLE, "single process (world size 1): no communication")]
        return [not_measurable(ID, TITLE, "no collective events in the trace (NCCL kernels or gloo ops); "
                               "the profiler may not have recorded communication")]
    exposed = ctx.per_rank_mean("exposed_comm_ms")
    wait = ctx.per_rank_mean("straggler_wait_ms")
    wait_ms = float(np.median(wait.to_numpy()))
    ms = float(np.median(exposed.to_numpy()))
    share = ms / ctx.mean_step_ms
    totals = {r: float(np.mean(column(tl, "comm"))) / 1000 for r, tl in run.timelines.items()}
    # each rank's collectives per step and every recorded size, from one table of every rank's
    allc = collectives_table(run, ("rank", "step", "bytes"), aligned=False)
    counts = allc.groupby(["rank", "step"]).size().groupby(level="rank").mean().tolist() if len(allc) else []
    sizes = allc["bytes"].dropna().to_numpy() if len(allc) else np.empty(0)  # not a list: a float object each
    total_ms = float(np.median(list(totals.values())))
    hidden = max(total_ms - ms - wait_ms, 0.0)
    per_step = float(np.median(counts)) if counts else 0.0
    median_bytes = float(np.median(sizes)) if sizes.size else float("nan")
    tiny = per_step >= MANY_COLLECTIVES and (not sizes.size or median_bytes < SMALL_BYTES)
    largest, reduced, n_reduce = _all_reduces(run)
    cap_mb = ctx.probe_meta("model").get("ddp_bucket_cap_mb")
    if not isinstance(cap_mb, (int, float)) or isinstance(cap_mb, bool):
        cap_mb = None
    small = None if tiny else small_buckets(n_reduce, reduced, cap_mb)
    metrics: dict[str, float | int | str] = {
        "exposed_comm_ms_per_step": round(ms, 3),
        "comm_ms_per_step": round(total_ms, 3),
        "overlapped_share": round(hidden / total_ms, 4) if total_ms else 0.0,
        "collectives_per_step": round(per_step, 1),
        "median_collective_bytes": round(median_bytes) if sizes.size else "not recorded",
        "share_of_step": round(share, 4),
    }
    bucket = small or (None if tiny else one_bucket(largest, reduced, metrics["overlapped_share"], cap_mb,
                                                     run.is_gpu))
    if bucket:
        metrics["largest_all_reduce_bytes"] = round(largest)
        metrics["all_reduce_bytes_per_step"] = round(reduced)
        metrics["all_reduces_per_step"] = round(n_reduce, 1)
        if cap_mb is not None:
            metrics["ddp_bucket_cap_mb"] = cap_mb
    if wait_ms > 0:
        metrics["peer_wait_ms_per_step_not_counted"] = round(wait_ms, 3)
    # a rank whose trace is missing (another node's run directory, a rank that died) cannot be
    # matched: the wait for it stays in its peers' collectives, and a straggler there reads as
    # communication here (a 2-node job, each node's run alone: 137.7 ms "exposed" on rank 0 that
    # was rank 1's 100 ms sleep)
    missing = run.missing_ranks
    if missing:
        metrics["includes_waits_for_missing_ranks"] = rank_ranges(missing)
    for r in exposed.index:
        metrics[f"rank{r}_exposed_comm_ms"] = round(float(exposed[r]), 3)
    if run.is_gpu:
        kernel_ms = {r: float(np.mean(column(tl, "compute"))) / 1000
                     for r, tl in run.timelines.items()}
        comm_share = [totals[r] / (totals[r] + kernel_ms[r]) for r in totals if totals[r] + kernel_ms[r] > 0]
        if comm_share:
            metrics["comm_share_of_device_time"] = f"{min(comm_share):.0%}-{max(comm_share):.0%}"
    # evidence: the longest collectives on the rank with the most exposed communication
    loop = tiny and _loop_issued(ctx)
    if loop:
        metrics["issued_by"] = "the training loop (no DDP, FSDP or tensor parallelism)"
    worst = int(exposed.idxmax())
    c = run.timelines[worst].own_collectives()
    longest = c.assign(d=c["end"] - c["arrival"]).nlargest(5, "d")
    refs = tuple(ctx.event_ref(worst, int(row), "collective") for row in longest["row"])
    ranks = tuple(int(r) for r in exposed[exposed / ctx.per_rank_mean("step_ms") >= th.communication].index)
    f = Finding(
        id=ID, title=TITLE, severity=th.severity(share), recoverable_ms=round(ms, 3), share_of_step=round(share, 4),
        ranks=ranks or tuple(run.ranks), metrics=metrics, events=refs,
        fix=(FIX_TINY_LOOP if loop else FIX_TINY) if tiny else (bucket and bucket[1]) or _fix(ctx),
        confidence="low" if missing else confidence_for(ctx, "high" if len(run.ranks) > 1 else "medium"),
        method="Median over ranks of per-step communication not hidden under compute, excluding time "
               "spent waiting for the last-arriving rank (a late peer: the straggler check's).")
    reason = (f"communication is exposed {ms:.1f} ms per step ({share:.0%}); "
              f"{metrics['overlapped_share']:.0%} of it overlaps compute")
    if tiny:
        reason += (f"; {per_step:.0f} small collectives per step, issued by the training loop itself (no DDP or FSDP "
                   "in the trace)" if loop else f"; {per_step:.0f} small collectives per step (no bucketing?)")
    elif bucket:
        reason += bucket[0]
    if missing:
        reason += (f"; it includes any wait for the missing rank(s) {rank_ranges(missing)}, whose traces are not "
                   "here (a late rank there reads as communication here): analyse every rank's traces together")
    return [flag_or_pass(f, th.communication, th, reason, ctx)]


def one_bucket(largest: float, reduced: float, overlapped_share: float, cap_mb: float | None, gpu: bool
               ) -> tuple[str, str | None] | None:
    """Most of a step's all-reduced bytes in one all-reduce, too big for one default DDP bucket,
    and next to nothing of the communication overlapped: (the reason's note, the fix or None).
    The bucket cap the probes recorded says whether lowering it splits the bytes: a parameter
    larger than the cap gets a bucket of its own whatever the cap. The fix is given on GPU runs
    only: on a CPU-only job gloo's transfers run on the cores the backward uses, and overlapping
    them may not pay (measured on the 2-core development VM, `--pathology huge-bucket`: 171 ms a
    step with one bucket, 184 ms with 25 MB buckets, the backward slowed by the transfers beside it)."""
    if not (largest > 2 * DDP_DEFAULT_CAP_BYTES and largest >= ONE_BUCKET_SHARE * reduced
            and overlapped_share < LITTLE_OVERLAP):
        return None
    note = f"; one all-reduce carries {largest / 1e6:.1f} of the {reduced / 1e6:.1f} MB reduced per step, after the backward"
    if cap_mb is None:
        return note + (" (one DDP bucket, or one parameter larger than the bucket cap: the probes' record of "
                       "bucket_cap_mb would tell)"), None
    if cap_mb * 1024**2 < 0.9 * largest:
        return note + f" (one parameter larger than bucket_cap_mb={cap_mb:g}: no bucket setting splits it)", None
    if not gpu:
        return note + (f" (one bucket: bucket_cap_mb={cap_mb:g}; on a CPU-only job smaller buckets would send "
                       "while the backward computes, on the same cores: measure before changing it)"), None
    return note + f" (one bucket: bucket_cap_mb={cap_mb:g})", fix_one_bucket(cap_mb, largest / 1e6)


def small_buckets(n_per_step: float, reduced: float, cap_mb: float | None) -> tuple[str, str] | None:
    """A bucket cap set below DDP's default (the probes' record) splitting a step's gradients into
    at least twice the all-reduces that default buckets would take, and at least MIN_SPLIT: each
    pays the collective's fixed latency. (Without the record, a high count may also be gradient
    accumulation without no_sync(), grad_sync's finding: only the 50-a-step rule speaks then.)
    Measured on the 2-core VM, `--pathology tiny-buckets` (bucket_cap_mb=0.01): 6 all-reduces a
    step of 5.8 MB together, 48.2 ms a step; with 25 MB buckets one, 40.5 ms."""
    if cap_mb is None or cap_mb * 1024**2 >= DDP_DEFAULT_CAP_BYTES or reduced <= 0:
        return None
    default = max(1, math.ceil(reduced / DDP_DEFAULT_CAP_BYTES))
    if n_per_step < max(MIN_SPLIT, 2 * default):
        return None
    note = (f"; {n_per_step:.0f} all-reduces a step carry its {reduced / 1e6:.1f} MB of gradients "
            f"(bucket_cap_mb={cap_mb:g}), where DDP's default 25 MB buckets would take {default}")
    fix = (f"DDP splits this step's {reduced / 1e6:.1f} MB of gradients into {n_per_step:.0f} buckets "
           f"(bucket_cap_mb={cap_mb:g}); each all-reduce pays the collective's fixed latency, so raise "
           f"bucket_cap_mb to the default 25 (about {default} all-reduce(s) a step here), or higher for a "
           "large model on a fast link.")
    return note, fix


def _all_reduces(run) -> tuple[float, float, float]:
    """The median over ranks and steps of a step's largest all-reduce (bytes), of its all-reduced
    bytes together and of its all-reduce count; zeros where no all-reduce records its bytes."""
    # one table for every rank (per-rank string matching was 0.76 s of the client's 7.3 at 1,024 ranks)
    c = collectives_table(run, ("rank", "step", "name", "bytes"), aligned=False)
    if c.empty:
        return 0.0, 0.0, 0.0
    # matched once per distinct name (string methods over every row made a copy of each name, thrice)
    names = c["name"].astype(str)
    is_ar = {n: "allreduce" in n.lower().replace("_", "") for n in pd.unique(names)}
    c = c[names.map(is_ar).to_numpy(dtype=bool) & c["bytes"].notna().to_numpy()]
    if c.empty:
        return 0.0, 0.0, 0.0
    g = c.groupby(["rank", "step"])["bytes"]
    return float(np.median(g.max())), float(np.median(g.sum())), float(np.median(g.size()))
