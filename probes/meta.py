"""Run metadata for the sidecar: what the profiler does not record but a diagnosis needs."""
from __future__ import annotations

import os
import platform

ENV_KEYS_PREFIX = ("NCCL_", "TORCH_NCCL_", "GLOO_", "CUDA_", "OMP_", "MKL_", "TORCH_DISTRIBUTED_", "PYTORCH_CUDA_ALLOC")
ENV_KEYS = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
            # which job, node and attempt a rank belongs to: each node's run directory of one multi-node
            # job carries the same rendezvous, and a restarted job its attempt (probes/core.py)
            "GROUP_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
            "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NODEID")


def environment() -> dict[str, str]:
    return {k: v[:200] for k, v in sorted(os.environ.items()) if k in ENV_KEYS or k.startswith(ENV_KEYS_PREFIX)}


def torch_facts() -> dict:
    import torch

    facts: dict = {"torch": torch.__version__, "host": platform.node(), "python": platform.python_version(),
                   "cpu_count": os.cpu_count()}
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            facts["backend"] = str(dist.get_backend())
            facts["world_size"] = dist.get_world_size()
    except Exception:  # noqa: BLE001 - metadata is best effort
        pass
    if torch.cuda.is_available():
        try:
            facts["device"] = "cuda"
            facts["device_name"] = torch.cuda.get_device_name()
            facts["cuda"] = torch.version.cuda
            nccl = torch.cuda.nccl.version()
            facts["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except Exception:  # noqa: BLE001
            pass
    else:
        facts["device"] = "cpu"
    return facts


def loader_facts(loader) -> dict:
    out = {}
    for k in ("batch_size", "num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "drop_last"):
        v = getattr(loader, k, None)
        if isinstance(v, (int, float, bool)) or v is None:
            out[k] = v
    return out


def model_facts(module) -> dict:
    """Parameter count and bytes, dtypes, and DDP settings of a (possibly wrapped) model."""
    out: dict = {}
    try:
        params = list(module.parameters())
        out["params"] = int(sum(p.numel() for p in params))
        out["param_bytes"] = int(sum(p.numel() * p.element_size() for p in params))
        out["trainable_params"] = int(sum(p.numel() for p in params if p.requires_grad))
        out["dtypes"] = sorted({str(p.dtype).replace("torch.", "") for p in params})
        cap = getattr(module, "bucket_bytes_cap", None)
        if isinstance(cap, int):
            out["ddp_bucket_cap_mb"] = round(cap / 1024**2, 3)
        out["wrapper"] = type(module).__name__
    except Exception:  # noqa: BLE001
        pass
    return out


def optimizer_facts(opt) -> dict:
    try:
        params = [p for g in opt.param_groups for p in g["params"]]
        return {"optimizer": type(opt).__name__,
                "params": int(sum(p.numel() for p in params)),
                "param_bytes": int(sum(p.numel() * p.element_size() for p in params)),
                "dtypes": sorted({str(p.dtype).replace("torch.", "") for p in params}),
                "state_tensors_per_param": _state_tensors(opt)}
    except Exception:  # noqa: BLE001
        return {}


def _state_tensors(opt) -> int | None:
    for state in getattr(opt, "state", {}).values():
        import torch

        return sum(1 for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return None


def memory_facts() -> dict:
    try:
        import torch

        if torch.cuda.is_available():
            return {"max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
                    "max_reserved_bytes": int(torch.cuda.max_memory_reserved()),
                    "device_total_bytes": int(torch.cuda.get_device_properties(0).total_memory)}
        import resource

        return {"host_max_rss_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}
    except Exception:  # noqa: BLE001
        return {}
