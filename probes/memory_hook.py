"""Memory facts for the device_memory check: what the model state measures, and device peaks.

- Once per optimizer, after its first step (when gradients and optimizer state exist):
  the bytes of its parameters, gradients and optimizer state, measured from the tensors
  themselves, on any device. Stored in `probe.meta["memory_tensors"]` (sidecar).
- On CUDA, before every optimizer step (the step's forward and backward are done):
  allocated, reserved and the running peaks (`torch.cuda.max_memory_*`; never reset, so a
  user's own peak statistics stay intact), as a `memory` span in the step record and as
  the running maximum in `probe.meta["device_memory"]`.
- An uncaught out-of-memory error is recorded in `probe.meta["oom"]` (the previous
  excepthook still runs).

Cost: a sum over the parameter list once, three allocator counters per step (no device
sync). Never raises into the job.
"""
from __future__ import annotations

import sys
import time

from .core import Probe

MAX_OPTIMIZERS = 16


def _tensor_bytes(tensors) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def optimizer_tensors(opt) -> dict:
    """Measured bytes of one optimizer's parameters, gradients and state."""
    import torch

    params = list({id(p): p for g in opt.param_groups for p in g["params"]}.values())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    devices = sorted({p.device.type for p in params})
    return {"optimizer": type(opt).__name__,
            "params": int(sum(p.numel() for p in params)),
            "param_bytes": _tensor_bytes(params),
            "grad_bytes": _tensor_bytes(p.grad for p in params),
            "state_bytes": _tensor_bytes(state),
            "state_dtypes": sorted({str(v.dtype).replace("torch.", "") for v in state if v.dim() > 0}),
            "param_dtypes": sorted({str(p.dtype).replace("torch.", "") for p in params}),
            "device": ",".join(devices)}


def install(probe: Probe):
    """Register the hooks; returns an undo callable (None if torch's optimizer hooks are missing)."""
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    except ImportError:
        return None
    import torch

    seen: set[int] = set()  # optimizers' numbers (probes/optimizers.py): ids are reused once one is freed
    cuda = torch.cuda.is_available()  # once: the per-step hook must cost nothing on CPU

    def after_step(opt, args, kwargs):
        try:
            n = probe.optimizers.number(opt)
            if n in seen or len(seen) >= MAX_OPTIMIZERS:
                return
            seen.add(n)
            facts = optimizer_tensors(opt)
            facts["measured_at_step"] = probe.step
            facts["number"] = n
            probe.meta.setdefault("memory_tensors", []).append(facts)
        except Exception as exc:  # noqa: BLE001 - a probe must never raise into training
            probe._fail("memory tensors", exc)

    def before_step(opt, args, kwargs):
        if not cuda or not torch.cuda.is_initialized() or not probe.ok("device memory"):
            return
        try:
            now = time.perf_counter()
            dev = torch.cuda.current_device()
            cur = {"allocated": int(torch.cuda.memory_allocated(dev)),
                   "reserved": int(torch.cuda.memory_reserved(dev)),
                   "peak_allocated": int(torch.cuda.max_memory_allocated(dev)),
                   "peak_reserved": int(torch.cuda.max_memory_reserved(dev))}
            probe.on_span("memory", "cuda", now, now, **cur)
            m = probe.meta.setdefault("device_memory", {})
            if "total_bytes" not in m:
                m["total_bytes"] = int(torch.cuda.get_device_properties(dev).total_memory)
                m["device_name"] = torch.cuda.get_device_name(dev)
            m["peak_allocated_bytes"] = max(m.get("peak_allocated_bytes", 0), cur["peak_allocated"])
            m["peak_reserved_bytes"] = max(m.get("peak_reserved_bytes", 0), cur["peak_reserved"])
            # model state that lives across steps: what is allocated before the update, at its largest
            m["before_update_allocated_bytes"] = max(m.get("before_update_allocated_bytes", 0), cur["allocated"])
            m["steps_sampled"] = m.get("steps_sampled", 0) + 1
        except Exception as exc:  # noqa: BLE001
            probe._fail("device memory", exc)

    post = register_optimizer_step_post_hook(after_step)
    pre = register_optimizer_step_pre_hook(before_step)
    prev_hook = sys.excepthook

    def excepthook(etype, value, tb):
        try:
            oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
            if oom is not None and isinstance(value, oom):
                probe.meta["oom"] = {"step": probe.step, "message": str(value)[:500]}
                probe.write_sidecar()
        except Exception:  # noqa: BLE001
            pass
        prev_hook(etype, value, tb)

    sys.excepthook = excepthook

    def undo():
        post.remove()
        pre.remove()
        if sys.excepthook is excepthook:
            sys.excepthook = prev_hook

    return undo
