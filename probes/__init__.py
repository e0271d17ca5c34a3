"""Capture what the profiler misses, around a real training loop.

Python API::

    import probes
    with probes.watch("runs/exp1", schedule="2,2,5") as w:
        for batch in w.loader(dataloader):
            loss = model(batch).sum(); loss.backward(); opt.step(); opt.zero_grad()
            w.step()

Zero code change: `diagnose run --out DIR -- torchrun --nproc_per_node=N train.py ARGS`
(the launcher puts `probes/bootstrap` on PYTHONPATH; its sitecustomize calls
`install_from_env`). Both write per-rank traces, every-step timings and a metadata
sidecar; see probes.core for the files and the safety contract.
"""
from __future__ import annotations

import atexit
import os
from contextlib import contextmanager
from pathlib import Path

from probes.core import Probe, Schedule

__all__ = ["watch", "Watch", "Probe", "Schedule", "install_from_env"]

ENV_OUT = "DIAGNOSE_PROBE_DIR"
ENV_SCHEDULE = "DIAGNOSE_PROBE_SCHEDULE"


def _rank_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001
        pass
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class Watch:
    """Handle returned by `watch`: wrap the loader, mark steps."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def loader(self, iterable):
        from probes.patches import _TimedIter

        try:
            from probes.meta import loader_facts

            self.probe.meta.setdefault("dataloader", {}).update(loader_facts(iterable))
            return _TimedIter(iter(iterable), self.probe)
        except Exception as exc:  # noqa: BLE001
            self.probe._fail("dataloader timing", exc)
            return iter(iterable)

    def step(self) -> None:
        self.probe.start_profiler()
        self.probe.on_step()

    def describe(self, model=None, optimizer=None) -> None:
        """Optional: record model/optimizer facts (parameter count, dtype, optimizer) for the memory check."""
        from probes.meta import model_facts, optimizer_facts

        try:
            if model is not None:
                self.probe.meta["model"] = model_facts(model)
            if optimizer is not None:
                self.probe.meta.setdefault("optimizers", []).append(optimizer_facts(optimizer))
        except Exception as exc:  # noqa: BLE001
            self.probe._fail("metadata", exc)


@contextmanager
def watch(out_dir: str | Path, schedule: str | Schedule | None = None, collectives: bool = True):
    """Probe the loop inside the `with` block; rank and world size come from torch.distributed or env."""
    rank, world = _rank_world()
    sch = schedule if isinstance(schedule, Schedule) else Schedule.parse(schedule)
    probe = Probe(out_dir, rank, world, sch)
    undo = []
    from probes.patches import _checkpoint, _collectives, _ddp, _memory

    for part in ((_collectives, _ddp, _memory, _checkpoint) if collectives else (_memory, _checkpoint)):
        try:
            u = part(probe)
            if u:
                undo.append(u)
        except Exception as exc:  # noqa: BLE001
            probe._fail("hooks", exc)
    _record_facts(probe)
    try:
        yield Watch(probe)
    finally:
        _record_facts(probe)
        probe.close()
        for u in undo:
            try:
                u()
            except Exception:  # noqa: BLE001
                pass


def _record_facts(probe: Probe) -> None:
    try:
        from probes.meta import environment, memory_facts, torch_facts

        probe.meta.update(torch_facts())
        probe.meta["env"] = environment()
        probe.meta["memory"] = memory_facts()
    except Exception as exc:  # noqa: BLE001
        probe._fail("metadata", exc)
    probe.write_sidecar()


def install_from_env() -> Probe | None:
    """Called by the bootstrap sitecustomize in every Python process of the job.

    Hooks are installed at once (they cost nothing until used); the profiler starts at
    the first step boundary, so processes that never train (the torchrun launcher,
    DataLoader workers) never profile or write anything.
    """
    out = os.environ.get(ENV_OUT)
    if not out:
        return None
    rank, world = _rank_world()
    probe = Probe(out, rank, world, Schedule.parse(os.environ.get(ENV_SCHEDULE)))
    from probes.patches import install

    install(probe)
    pid = os.getpid()

    def finish() -> None:
        if os.getpid() != pid or probe.step == 0:
            return  # a forked worker, or a process that never trained
        # rank may only be known now that the process group exists
        r, w = _rank_world()
        probe.rank, probe.world_size = r, w
        _record_facts(probe)
        probe.close()

    atexit.register(finish)
    _flush_on_sigterm(finish, probe)
    return probe


def _remove_temp_files(probe: Probe) -> None:
    """A write interrupted by the signal never reaches its rename: drop its temp files."""
    for d in (probe.out_dir, *probe.out_dir.glob("capture-*")):
        for p in d.glob(f".rank{probe.rank}.*"):
            try:
                p.unlink()
            except OSError:
                pass


def _flush_on_sigterm(finish, probe: Probe) -> None:
    """torchrun stops surviving ranks with SIGTERM when one fails: flush what we have first.

    Only when the job left SIGTERM at its default (we never replace a handler of the user's).
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_term(signum, frame):
        try:
            finish()
            _remove_temp_files(probe)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, on_term)
    except (ValueError, OSError):
        pass
