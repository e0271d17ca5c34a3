"""Time checkpoint writes: torch.save and torch.distributed.checkpoint.save / async_save.

Each call is timed where it blocks the training loop and recorded three ways:
- a `checkpoint` span in the step record (probe.on_span: path, bytes, rank, api, direct);
- a bounded list in `probe.meta["checkpoints"]` (the sidecar is rewritten after each save,
  atomically, so a job killed later still has it: saves are rare and already slow I/O);
- a `diagnose::checkpoint <api>` profiler range, so a save inside a profiled window shows
  in the trace where it happened.

`direct` is True when torch.save wrote straight to a final-looking file name (no temporary
name later renamed): a job killed mid-write leaves a truncated checkpoint under the name the
restart loads. torch.distributed.checkpoint commits by writing its metadata last (atomic by
design). A torch.save into memory (io.BytesIO) is not file I/O and is not recorded, nor is a
torch.save issued inside a torch.distributed.checkpoint call (counted once, as the DCP call).

torch.distributed.checkpoint costs about a second to import, so it is patched when the job
has imported it itself (checked at each step boundary), never imported here.
"""
from __future__ import annotations

import functools
import os
import re
import sys
import threading
import time

from .core import Probe

MAX_RECORDS = 256
_MARK = "__diagnose_checkpoint__"
DCP = "torch.distributed.checkpoint"
# Names that say "not the final file yet": a temp file that the job renames afterwards.
TEMP_NAME = re.compile(r"(^\.|^tmp|\.tmp|\.temp|\.partial|\.part$|\.incomplete|~$|\.swp$)", re.IGNORECASE)
_active = threading.local()


def _path_of(f) -> str | None:
    if isinstance(f, (str, os.PathLike)):
        return os.fspath(f)
    name = getattr(f, "name", None)
    return name if isinstance(name, str) else None


def _size(path: str | None) -> int | None:
    if not path:
        return None
    try:
        if os.path.isdir(path):
            return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
        return os.path.getsize(path)
    except OSError:
        return None


def _dcp_path(args, kwargs) -> str | None:
    cid = kwargs.get("checkpoint_id")
    if cid is None:
        writer = kwargs.get("storage_writer")
        cid = getattr(writer, "path", None) or getattr(writer, "checkpoint_id", None)
    return _path_of(cid) if cid is not None else None


def _record(probe: Probe, api: str, t0: float, t1: float, path: str | None, direct: bool | None) -> None:
    nbytes = None if api.endswith("async_save") else _size(path)
    info = {"api": api, "path": (path or "<file object>")[:300], "bytes": nbytes, "rank": probe.rank,
            "direct": direct}
    probe.on_span("checkpoint", api, t0, t1, **info)
    recs = probe.meta.setdefault("checkpoints", [])
    if len(recs) < MAX_RECORDS:
        recs.append({**info, "step": probe.step, "ms": round((t1 - t0) * 1000.0, 3)})
    probe.write_sidecar()


def _wrap(fn, api: str, probe: Probe, path_of):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if getattr(_active, "depth", 0):
            return fn(*args, **kwargs)  # nested (a torch.save inside DCP): the outer call is the checkpoint
        path = path_of(args, kwargs)
        if api == "torch.save" and path is None:
            return fn(*args, **kwargs)  # into memory: not file I/O
        try:
            from torch.profiler import record_function

            scope = record_function(f"diagnose::checkpoint {api}")
        except Exception:  # noqa: BLE001
            scope = None
        _active.depth = 1
        t0 = time.perf_counter()
        try:
            if scope is None:
                return fn(*args, **kwargs)
            with scope:
                return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            _active.depth = 0
            try:
                direct = None if api != "torch.save" else not TEMP_NAME.search(os.path.basename(path or ""))
                _record(probe, api, t0, t1, path, direct)
            except Exception as exc:  # noqa: BLE001 - a probe must never raise into training
                probe._fail("checkpoint timing", exc)

    setattr(wrapper, _MARK, True)
    return wrapper


def _save_path(args, kwargs) -> str | None:
    f = kwargs.get("f", args[1] if len(args) > 1 else None)
    return _path_of(f)


def install(probe: Probe):
    """Patch torch.save now and DCP once the job imports it; returns an undo callable."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    originals: list[tuple[object, str, object]] = []
    orig_save = torch.save
    if not getattr(orig_save, _MARK, False):
        torch.save = _wrap(orig_save, "torch.save", probe, _save_path)
        originals.append((torch, "save", orig_save))

    def patch_dcp(*_):
        mod = sys.modules.get(DCP)
        if mod is None or getattr(getattr(mod, "save", None), _MARK, False):
            return
        try:
            for name in ("save", "async_save"):
                fn = getattr(mod, name, None)
                if fn is not None and not getattr(fn, _MARK, False):
                    setattr(mod, name, _wrap(fn, f"dcp.{name}", probe, _dcp_path))
                    originals.append((mod, name, fn))
        except Exception as exc:  # noqa: BLE001
            probe._fail("checkpoint timing", exc)

    patch_dcp()
    handle = register_optimizer_step_post_hook(patch_dcp)

    def undo():
        handle.remove()
        for owner, name, fn in reversed(originals):
            setattr(owner, name, fn)

    return undo
