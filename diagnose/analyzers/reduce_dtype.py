"""Gradients reduced in fp32 while the model computes in bf16/fp16.

Mixed precision (autocast, FSDP's param_dtype) computes in bf16 or fp16 but keeps fp32
parameters, so DDP's gradient buckets and FSDP's reduce-scatters travel in fp32 by default:
twice the bytes the compute needs. A bf16 compression hook (DDP) or `reduce_dtype=bfloat16`
(FSDP) halves them.

Measured from the trace alone: the compute's precision is the share of matrix-op time whose
first input is bf16/fp16/fp8 (the ops' recorded input types, ingest/columns.MATRIX_OPS; on GPU
that is the ops' host time, a proxy for their kernels of the same types; without input types,
the gemm and convolution kernels' time by the precision their names spell); the gradient reductions are the
all-reduces and reduce-scatters in the profiled steps, with their element type (step/timeline.py)
and bytes. Flagged when the compute is mostly low precision and most reduced bytes are fp32.
What it costs: a bandwidth-bound transfer (from SMALL_MESSAGE_BYTES up) takes about half the time
with half the bytes, so the step graph's replay with those transfers halved (diagnose/whatif.py)
gives the saving; the check's own figure is half the exposed communication during those
reductions, per step, median rank (an upper bound: it includes waits for late peers).
Latency-bound reductions are left out: halving a small message saves almost nothing.

On gloo (CPU jobs) the check passes and says why: there the CPU sums bf16 in software, and on the
recorded twins (tests/fixtures/cpu_reduce_*_2rank) the 51 MB all-reduce took as long in bf16 as in
fp32 while the hook's casts made the step slower: advising the hook there would be wrong.
`mismatch` builds the finding on any backend, so its figures are tested on those recordings.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from diagnose.analyzers.common import confidence_for, flag_or_pass, not_measurable, passed
from diagnose.context import Context
from diagnose.ingest.columns import KIND_CPU_OP, KIND_KERNEL, MATRIX_OPS
from diagnose.ingest.load import RankTrace
from diagnose.model import Check, Finding
from diagnose.step.bandwidth import SMALL_MESSAGE_BYTES, collective_kind
from diagnose.step.graph import large_fp32_reductions
from diagnose.step.intervals import covered, intersect, subtract, union
from diagnose.step.timeline import LOW_PRECISION, RankTimeline, _assign_steps, _names_matching, precision
from diagnose.thresholds import Thresholds

ID = "reduce_dtype"
TITLE = "Gradients reduced in fp32 while the model computes in bf16/fp16"
FIX = ("Reduce gradients in bf16: DDP `model.register_comm_hook(None, torch.distributed.algorithms."
       "ddp_comm_hooks.default_hooks.bf16_compress_hook)` (NCCL); FSDP2 `fully_shard(..., mp_policy="
       "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))`; FSDP1 "
       "`MixedPrecision(reduce_dtype=torch.bfloat16)`; DeepSpeed `\"communication_data_type\": \"bf16\"`. "
       "It halves the bytes on the wire; a bf16 sum is less exact than an fp32 one, so compare the loss "
       "curve over a few hundred steps before keeping it.")
REDUCTIONS = ("all_reduce", "reduce_scatter")
# gemm and convolution kernels (GPU traces recorded without input types) and the precision their
# names spell: bf16/fp16/fp8 tokens first (ampere_bf16_s16816gemm_bf16...), else fp32 (sgemm, tf32,
# the s1688/s884 tensor-op kernels that CUTLASS names by their fp32 accumulators)
MATRIX_KERNEL = re.compile(r"gemm|conv|xmma|wgrad|dgrad|fprop|fmha|flash", re.IGNORECASE)
KERNEL_LOW = re.compile(r"bf16|fp16|f16|half|h884|h1688|h16816|e4m3|e5m2|fp8", re.IGNORECASE)
KERNEL_FP32 = re.compile(r"sgemm|tf32|f32|fp32|s1688|s884|s16816|float", re.IGNORECASE)
TOP = 3  # fp32 reductions cited per rank


@dataclass(frozen=True, slots=True)
class Precision:
    """One rank's compute precision and gradient reductions over its profiled steps."""

    matrix_us: tuple[tuple[str, float], ...]
    """Time in matrix ops (or their kernels) by the precision of their first input."""
    source: str
    """Where the compute's precision was read: "ops" (input types), "kernels" (names) or ""."""
    reduced: tuple[tuple[str, int, float], ...]
    """Gradient reductions by element type: (precision, count, bytes recorded)."""
    fp32_exposed_ms: float
    """Mean per step: exposed communication during this rank's bandwidth-bound fp32 reductions."""
    fp32_rows: tuple[int, ...]
    """Evidence: the first few bandwidth-bound fp32 reductions."""
    matrix_row: int
    """Evidence: the longest low-precision matrix op (-1: none)."""

    @property
    def rows(self) -> tuple[int, ...]:
        return self.fp32_rows + ((self.matrix_row,) if self.matrix_row >= 0 else ())


def _in_steps(ts: np.ndarray, tl: RankTimeline) -> np.ndarray:
    return _assign_steps(ts, tl.steps) >= 0


def _matrix_time(trace: RankTrace, tl: RankTimeline) -> tuple[dict[str, float], str, int | None]:
    """Matrix-op time by precision, its source, and the longest low-precision op's row."""
    ev, args = trace.events, trace.comm_args
    ops = ev[(ev["kind"] == KIND_CPU_OP).to_numpy() & _names_matching(ev, MATRIX_OPS)]
    ops = ops[_in_steps(ops["ts"].to_numpy(), tl)]
    if len(ops) and "Input type" in args:
        types = args["Input type"].reindex(ops.index)
        prec = np.array([precision(t[0]) if isinstance(t, list) and t else "" for t in types], dtype=object)
        known = prec != ""
        if known.any():
            dur = ops["dur"].to_numpy()
            out: dict[str, float] = {}
            for p, d in zip(prec[known], dur[known]):
                out[p] = out.get(p, 0.0) + float(d)
            low = known & np.isin(prec, list(LOW_PRECISION))
            row = int(ops.index[low][np.argmax(dur[low])]) if low.any() else None
            return out, "ops", row
    k = ev[(ev["kind"] == KIND_KERNEL).to_numpy() & _names_matching(ev, MATRIX_KERNEL)]
    k = k[_in_steps(k["ts"].to_numpy(), tl)]
    out = {}
    low_rows: list[tuple[float, int]] = []
    for row, name, d in zip(k.index, k["name"].astype(str), k["dur"].to_numpy()):
        p = "bf16/fp16" if KERNEL_LOW.search(name) else "fp32" if KERNEL_FP32.search(name) else ""
        if p:
            out[p] = out.get(p, 0.0) + float(d)
            if p != "fp32":
                low_rows.append((float(d), int(row)))
    return out, ("kernels" if out else ""), (max(low_rows)[1] if low_rows else None)


def reduce(trace: RankTrace, tl: RankTimeline) -> Precision:
    if not len(tl.steps):
        return Precision(matrix_us=(), source="", reduced=(), fp32_exposed_ms=0.0, fp32_rows=(), matrix_row=-1)
    matrix, source, low_row = _matrix_time(trace, tl)
    c = tl.collectives
    red = c[(c["step"] >= 0).to_numpy() & np.array([collective_kind(str(n)) in REDUCTIONS for n in c["name"]],
                                                     dtype=bool)]
    reduced: dict[str, list] = {}
    for p, b in zip(red["dtype"].astype(str), red["bytes"].to_numpy(dtype=float)):
        e = reduced.setdefault(p, [0, 0.0])
        e[0] += 1
        e[1] += 0.0 if np.isnan(b) else float(b)
    big = red[large_fp32_reductions(red)]  # the ones the replay halves
    spans = union(big["arrival"].to_numpy(dtype=float), big["end"].to_numpy(dtype=float))
    during = intersect(subtract(tl.comm, tl.compute), spans)  # exposed time inside those reductions
    lo, hi = tl.steps.start, tl.steps.end
    ms = float(np.mean(covered(during, lo, hi))) / 1000
    return Precision(matrix_us=tuple(sorted(matrix.items())), source=source,
                     reduced=tuple((p, int(n), float(b)) for p, (n, b) in sorted(reduced.items())),
                     fp32_exposed_ms=ms, fp32_rows=tuple(int(r) for r in big["row"].iloc[:TOP]),
                     matrix_row=-1 if low_row is None else low_row)


def _share(by: dict[str, float], keys) -> float:
    total = sum(by.values())
    return sum(v for k, v in by.items() if k in keys) / total if total > 0 else 0.0


def analyze(ctx: Context, th: Thresholds) -> list[Check]:
    got = mismatch(ctx, th)
    if isinstance(got, Check):
        return [got]
    if ctx.run.backend == "gloo" or not ctx.run.is_gpu:
        # measured on this project's CPU machine (tests/fixtures/cpu_reduce_*_2rank): gloo all-reduced
        # the same 51 MB of gradients no faster in bf16 than in fp32, and the bf16 hook's casts made
        # the step slower. Halving the bytes pays where the transfer is bandwidth-bound (NCCL).
        return [passed(ID, TITLE, f"{got.metrics['compute_low_precision_share']:.0%} of matrix-op time in bf16/fp16 "
                       f"but the gradients are reduced in fp32; on gloo that is no cause: gloo sums bf16 on "
                       "the CPU, no faster than fp32 (measured), so a bf16 hook would not shorten the step. "
                       "On NCCL it would halve the bytes")]
    return [flag_or_pass(got, th.reduce_dtype, th,
                         f"{got.metrics['compute_low_precision_share']:.0%} of matrix-op time in bf16/fp16 but "
                         f"{got.metrics['reduced_fp32_share_of_bytes']:.0%} of the reduced gradient bytes in fp32: "
                         f"about {got.recoverable_ms:.1f} ms per step ({got.share_of_step:.0%}) to gain by "
                         "reducing in bf16", ctx)]


def mismatch(ctx: Context, th: Thresholds) -> Finding | Check:
    """The finding for low-precision compute with fp32 gradient reductions, on any backend (the
    backend rule is analyze's), or the Check that says why there is none."""
    run = ctx.run
    if (run.world_size or len(run.ranks)) <= 1:
        return passed(ID, TITLE, "single process (world size 1): no gradient reduction")
    facts: dict[int, Precision] = ctx.facts(ID)
    matrix: dict[str, float] = {}
    for f in facts.values():
        for p, us in f.matrix_us:
            matrix[p] = matrix.get(p, 0.0) + us
    if not matrix:
        return not_measurable(ID, TITLE, "the trace does not say in which precision the model computes: no "
                              "matrix op carries its input types (profile with record_shapes=True) and no "
                              "gemm or convolution kernel names one")
    low = _share(matrix, LOW_PRECISION | {"bf16/fp16"})
    if low < 0.5:
        main = max(matrix, key=matrix.get)
        return passed(ID, TITLE, f"the model computes in {main} ({1 - low:.0%} of matrix-op time): its gradients "
                      "have no lower precision to be reduced in")
    count: dict[str, int] = {}
    nbytes: dict[str, float] = {}
    for f in facts.values():
        for p, n, b in f.reduced:
            count[p] = count.get(p, 0) + n
            nbytes[p] = nbytes.get(p, 0.0) + b
    if not count:
        return passed(ID, TITLE, f"the model computes in low precision ({low:.0%} of matrix-op time) and no "
                      "gradient all-reduce or reduce-scatter ran in the profiled steps")
    by = nbytes if sum(nbytes.values()) > 0 else {p: float(n) for p, n in count.items()}
    fp32 = _share(by, {"fp32"})
    if not count.get("fp32") or fp32 < 0.5:
        main = max(by, key=by.get) or "an unrecorded type"
        return passed(ID, TITLE, f"the model computes in low precision ({low:.0%} of matrix-op time) and its "
                      f"gradients are reduced in {main} ({1 - fp32:.0%} of reduced bytes)")
    ms = float(np.median([0.5 * f.fp32_exposed_ms for f in facts.values()]))
    share = ms / ctx.mean_step_ms if ctx.mean_step_ms > 0 else 0.0
    steps = max(int(ctx.table.groupby("rank")["step"].nunique().min()), 1)
    ranks = tuple(sorted(r for r, f in facts.items() if any(p == "fp32" for p, _, _ in f.reduced)))
    metrics: dict[str, float | int | str] = {
        "compute_low_precision_share": round(low, 4),
        "compute_precision_from": "/".join(sorted({f.source for f in facts.values() if f.source})),
        "reduced_fp32_share_of_bytes": round(fp32, 4),
        "fp32_reductions_per_step": round(count["fp32"] / len(facts) / steps, 2),
        "fp32_reduced_mb_per_step": round(nbytes.get("fp32", 0.0) / len(facts) / steps / 1e6, 3),
        "exposed_ms_in_fp32_reductions": round(2 * ms, 3),
        "share_of_step": round(share, 4),
    }
    refs = [ctx.event_ref(r, i, "a gradient reduction in fp32: half the bytes in bf16")
            for r, f in sorted(facts.items()) for i in f.fp32_rows][:TOP]
    refs += [ctx.event_ref(r, f.matrix_row, "a matrix op computing in low precision")
             for r, f in sorted(facts.items()) if f.matrix_row >= 0][:1]
    return Finding(
        id=ID, title=TITLE, severity=th.severity(share), recoverable_ms=round(ms, 3), share_of_step=round(share, 4),
        ranks=ranks, metrics=metrics, events=tuple(refs), fix=FIX, confidence=confidence_for(ctx, "medium"),
        method="Compute precision: matrix-op time by the type of its first input (else the gemm/convolution "
               "kernels' names); gradient reductions: all-reduces and reduce-scatters in the steps by element "
               "type and bytes. Own estimate: half the exposed communication during the fp32 reductions of "
               f"{SMALL_MESSAGE_BYTES / 2**20:.0f} MiB or more (a bandwidth-bound transfer halves with its "
               "bytes), mean per step, median rank. Medium confidence: the halving is NCCL's bandwidth "
               "arithmetic, not yet checked against a recorded NCCL job.")
