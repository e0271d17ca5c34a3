"""5. Device memory: what fills it, how much room is left, and what each remedy would free.

Capacity, not time: the finding's recoverable_ms is always 0 (it is ranked last among
flagged causes) and its metrics carry bytes.

Estimation, per rank, from the probes' sidecars (the trace alone does not say):
- weights, gradients, optimizer state: measured from the tensors themselves after the
  first optimizer step (probes.memory_hook, `meta["memory_tensors"]`); without it, the
  arithmetic P x bytes-per-element for weights and gradients and P x state tensors per
  parameter x bytes for the optimizer (fp32 + Adam: 4 + 4 + 8 = 16 B/param; autocast
  keeps fp32 weights, so mixed precision is still about 16). Each figure says which.
- activations (and temporaries): on CUDA, the peak allocated minus the model state
  (a residual, measured); not measurable on CPU.
- other: the peak reserved minus the peak allocated (allocator cache and fragmentation).
Remedies in the field's order, each with the bytes it frees for this model: precision
(bf16 autocast halves activations), micro-batch / 2 with 2x gradient accumulation
(halves activations), activation checkpointing (frees up to the activations), sharding
over the N data-parallel ranks (ZeRO-1: state x (1 - 1/N); ZeRO-2: + gradients; ZeRO-3 /
FSDP: + weights), tensor/pipeline parallel of degree 2 (halves the model state).
Flagged when the peak reserved leaves under `memory_headroom` of the device free, or an
out-of-memory error was recorded; when launch_overhead also fires, the micro-batch is
called small because memory is tight.
"""
from __future__ import annotations

from dataclasses import dataclass

from diagnose.analyzers import launch
from diagnose.analyzers.common import confidence_for, not_measurable
from diagnose.context import Context
from diagnose.model import Check, Finding
from diagnose.thresholds import Thresholds
from diagnose.units import human

ID = "device_memory"
TITLE = "Device memory (capacity: what fills it, what would free it)"
# Optimizer state tensors per parameter when the probes could not count them.
STATE_PER_PARAM = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "FusedAdam": 2, "Lamb": 2,
                   "LAMB": 2, "Adagrad": 1, "RMSprop": 1, "Adadelta": 2, "Rprop": 2, "ASGD": 2, "Adafactor": 0}
FULLY_SHARDED = ("FullyShardedDataParallel", "FSDPModule")


@dataclass(frozen=True, slots=True)
class RankMemory:
    """One rank's memory picture: model state (measured or arithmetic), device peaks when measured."""

    rank: int
    params: int
    optimizer: str
    elem_bytes: float
    state_per_param: int | None
    weights: float
    grads: float
    state: float | None
    source: str
    """'measured' (tensor sizes from the probes) or 'arithmetic' (parameter count x bytes)."""
    device: str
    peak_allocated: float | None = None
    peak_reserved: float | None = None
    total: float | None = None
    oom: str | None = None

    @property
    def model_state(self) -> float:
        return self.weights + self.grads + (self.state or 0.0)

    @property
    def activations(self) -> float | None:
        if self.peak_allocated is None:
            return None
        return max(self.peak_allocated - self.model_state, 0.0)

    @property
    def headroom(self) -> float | None:
        if not self.total or self.peak_reserved is None:
            return None
        return 1.0 - self.peak_reserved / self.total


def _rank_memory(rank: int, meta: dict) -> RankMemory | None:
    # an optimizer the job replaced part way is no longer its memory (probes/optimizers.py)
    opts = [o for o in meta.get("optimizers") or [] if isinstance(o, dict) and o.get("params")
            and "retired_at_step" not in o]
    model = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    measured = [m for m in meta.get("memory_tensors") or [] if isinstance(m, dict) and m.get("params")
                and "retired_at_step" not in m]
    params = sum(int(o["params"]) for o in opts) or int(model.get("params") or 0)
    if not params and measured:
        params = sum(int(m["params"]) for m in measured)
    if not params:
        return None
    param_bytes = sum(int(o.get("param_bytes") or 0) for o in opts) or int(model.get("param_bytes") or 0)
    elem = param_bytes / params if param_bytes else 4.0
    names = sorted({str(o.get("optimizer")) for o in opts} | {str(m.get("optimizer")) for m in measured}) or ["?"]
    per_param = None
    counts = [o.get("state_tensors_per_param") for o in opts]
    if counts and all(isinstance(c, int) for c in counts):
        per_param = max(counts)
    elif len(names) == 1 and names[0] in STATE_PER_PARAM:
        per_param = STATE_PER_PARAM[names[0]]
    elif names == ["SGD"] and all(c is None for c in counts):
        per_param = 0  # plain SGD keeps no state (momentum would have shown one tensor per parameter)
    dev = meta.get("device_memory") if isinstance(meta.get("device_memory"), dict) else {}
    mem = meta.get("memory") if isinstance(meta.get("memory"), dict) else {}
    peak_alloc = dev.get("peak_allocated_bytes", mem.get("max_allocated_bytes"))
    peak_res = dev.get("peak_reserved_bytes", mem.get("max_reserved_bytes"))
    total = dev.get("total_bytes", mem.get("device_total_bytes"))
    oom = meta.get("oom", {}).get("message") if isinstance(meta.get("oom"), dict) else None
    device = "cuda" if total else str(meta.get("device") or "cpu")
    common = dict(rank=rank, params=params, optimizer="+".join(names), elem_bytes=elem, state_per_param=per_param,
                  device=device, peak_allocated=_num(peak_alloc), peak_reserved=_num(peak_res), total=_num(total),
                  oom=oom)
    if measured:
        return RankMemory(weights=float(sum(m["param_bytes"] for m in measured)),
                          grads=float(sum(m.get("grad_bytes") or 0 for m in measured)),
                          state=float(sum(m.get("state_bytes") or 0 for m in measured)), source="measured", **common)
    return RankMemory(weights=params * elem, grads=params * elem,
                      state=params * elem * per_param if per_param is not None else None, source="arithmetic",
                      **common)


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and x > 0 else None


def _dp_size(ctx: Context, per: dict[int, RankMemory]) -> int:
    """Data-parallel replicas: DDP wraps the model, or every rank holds the same parameter count."""
    model = ctx.probe_meta("model")
    world = ctx.run.world_size or len(per)
    if str(model.get("wrapper", "")) == "DistributedDataParallel":
        return world
    counts = {m.params for m in per.values()}
    return world if len(per) == world and len(counts) == 1 else 1


def _advice(m: RankMemory, dp: int, sharded: bool) -> list[tuple[str, float | None, str]]:
    """(remedy, bytes it frees for this model or None when not measurable, how) in the field's order."""
    act = m.activations
    half_act = act / 2 if act is not None else None
    st = m.state or 0.0
    low_precision = m.elem_bytes <= 2
    act_txt = f"the activations ({human(act)})" if act is not None else "the activations (not measurable here)"
    half_txt = f"halves the activations ({human(half_act)})" if act is not None else "halves the activations"
    out = [
        ("precision", None if low_precision else half_act,
         "already 16-bit weights" if low_precision else
         f"bf16 autocast {half_txt}; weights, gradients and optimizer state stay fp32 (about "
         f"{m.model_state / m.params:.0f} B/param), so it does not shrink the model state"),
        ("micro-batch", half_act, f"halve the micro-batch and double gradient accumulation: {half_txt}, the "
         "global batch is unchanged"),
        ("activation checkpointing", act, f"recompute activations in backward: frees up to {act_txt}, all but "
         "each checkpointed block's input, for about a third more compute"),
    ]
    if sharded:
        out.append(("sharding", 0.0, "already fully sharded (FSDP): the figures above are this rank's shard"))
    elif dp <= 1:
        out.append(("sharding", 0.0, "one data-parallel replica: nothing to shard across"))
    else:
        keep = 1 - 1 / dp
        z1, z2, z3 = st * keep, (st + m.grads) * keep, m.model_state * keep
        out.append(("sharding", z3, f"over {dp} data-parallel ranks: ZeRO-1 (optimizer state) frees {human(z1)}, "
                    f"ZeRO-2 (+ gradients) {human(z2)}, ZeRO-3 / FSDP (+ weights) {human(z3)}"))
    out.append(("tensor/pipeline parallel", m.model_state / 2,
                f"degree 2 halves the model state per rank ({human(m.model_state / 2)}); tensor parallel also "
                "splits activations"))
    return out


def analyze(ctx: Context, th: Thresholds) -> list[Check]:
    per = {r: rm for r, p in sorted(ctx.probes.items()) if (rm := _rank_memory(r, p.meta)) is not None}
    if not per:
        return [not_measurable(ID, TITLE, "no model or optimizer facts: run under `diagnose run` (its probes record "
                               "the parameter count, optimizer and device memory peaks) or call "
                               "probes.watch(...).describe(model, optimizer); the trace's [memory] events "
                               "(profile_memory=True) are not read")]
    worst = max(per.values(), key=lambda m: (m.peak_reserved or 0.0, m.model_state))
    sharded = any(w in str(ctx.probe_meta("model").get("wrapper", "")) for w in FULLY_SHARDED)
    dp = _dp_size(ctx, per)
    m = worst
    bpp = m.model_state / m.params
    if m.state is not None:
        state_txt = f"{m.state / m.params:.0f} B optimizer state"
        if m.state_per_param is not None:
            state_txt += f": {m.state_per_param} tensor(s)/param"
    else:
        state_txt = "optimizer state unknown"
    metrics: dict[str, float | int | str] = {
        "rank": m.rank,
        "params": m.params,
        "optimizer": m.optimizer,
        "bytes_per_element": round(m.elem_bytes, 2),
        "optimizer_state_tensors_per_param": m.state_per_param if m.state_per_param is not None else "unknown",
        "weights_bytes": int(m.weights),
        "grads_bytes": int(m.grads),
        "optimizer_state_bytes": int(m.state) if m.state is not None else "unknown",
        "model_state_bytes": int(m.model_state),
        "model_state_bytes_per_param": round(bpp, 2),
        "model_state_source": m.source,
        "arithmetic_bytes_per_param": round(m.elem_bytes * (2 + (m.state_per_param or 0)), 2),
        "data_parallel_size": dp,
        "device": m.device,
    }
    if m.peak_allocated is not None:
        metrics.update({"peak_allocated_bytes": int(m.peak_allocated),
                        "activations_bytes": int(m.activations or 0), "activations_source": "measured residual",
                        "other_bytes": int(max((m.peak_reserved or m.peak_allocated) - m.peak_allocated, 0)),
                        "other_source": "reserved minus allocated (allocator cache, fragmentation)",
                        "peak_reserved_bytes": int(m.peak_reserved or m.peak_allocated)})
    else:
        metrics["activations_bytes"] = "not measurable (no device peaks)"
    if m.total:
        metrics["device_total_bytes"] = int(m.total)
    if m.headroom is not None:
        metrics["headroom"] = round(m.headroom, 4)
    for r, rm in per.items():
        metrics[f"rank{r}_model_state_bytes"] = int(rm.model_state)
    advice = _advice(m, dp, sharded)
    for i, (name, saves, _) in enumerate(advice, 1):
        metrics[f"advice{i}_{name.replace(' ', '_').replace('/', '_')}_frees_bytes"] = (
            int(saves) if saves is not None else "not measurable")
    fix = " ".join(f"{i}. {name}: {how}." for i, (name, _, how) in enumerate(advice, 1))
    model_txt = (f"{m.params:,} params x {bpp:.1f} B ({m.elem_bytes:.0f} B weights + {m.elem_bytes:.0f} B grads + "
                 f"{state_txt}) = {human(m.model_state)} model state per rank "
                 f"({'measured from the tensors' if m.source == 'measured' else 'by arithmetic'})")
    tight = m.headroom is not None and m.headroom < th.memory_headroom
    base = dict(id=ID, title=TITLE, recoverable_ms=0.0, share_of_step=0.0, ranks=(m.rank,), events=(), kind="capacity",
                method="Capacity, not time (recoverable_ms 0): weights, gradients and optimizer state "
                       f"{'measured from the tensors' if m.source == 'measured' else 'from parameter count x bytes'}"
                       "; activations = peak allocated minus that model state; other = reserved minus allocated.")
    if m.peak_allocated is None and not m.oom:
        f = Finding(severity="low", metrics=metrics, fix=fix, confidence="medium", **base)
        return [Check(id=ID, title=TITLE, status="not_measurable", finding=f,
                      reason=f"device memory not measurable on {m.device.upper()} (no device peaks); "
                             f"model state: {model_txt}")]
    if not (tight or m.oom):
        f = Finding(severity="low", metrics=metrics, fix=fix, confidence=confidence_for(ctx), **base)
        room = (f"peak {human(m.peak_reserved)} reserved of {human(m.total)} ({m.headroom:.0%} free)"
                if m.headroom is not None else f"peak {human(m.peak_allocated)} allocated (device size unknown)")
        return [Check(id=ID, title=TITLE, status="passed", finding=f,
                      reason=f"{room}; {model_txt}, activations {human(m.activations)}")]
    # launch_overhead's verdict, from the same per-rank summaries (only when memory is tight)
    small_batch = any(c.status == "flagged" for c in launch.analyze(ctx, th))
    reason = (f"out of memory at step {ctx.probes[m.rank].meta['oom'].get('step')}" if m.oom else
              f"memory is tight: peak {human(m.peak_reserved)} reserved of {human(m.total)} "
              f"({m.headroom:.1%} free)")
    reason += f"; {model_txt}, activations {human(m.activations)}"
    if small_batch:
        metrics["micro_batch_limited_by_memory"] = "yes"
        reason += "; the micro-batch is small because memory is tight (launch overhead also flagged)"
        fix = ("The micro-batch is small because memory is tight: free memory first, then raise the micro-batch. "
               + fix)
    f = Finding(severity="high" if m.oom else "medium", metrics=metrics, fix=fix,
                confidence=confidence_for(ctx), **base)
    return [Check(id=ID, title=TITLE, status="flagged", reason=reason, finding=f)]
