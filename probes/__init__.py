"""Capture what the profiler misses, around a real training loop.

Python API::

    from diagnose import probes
    with probes.watch("runs/exp1", schedule="2,2,5") as w:
        for batch in w.loader(dataloader):
            loss = model(batch).sum(); loss.backward(); opt.step(); opt.zero_grad()
            w.step()

Frameworks that own the loop: `start(out_dir)` returns a Session (`step()` per optimizer step,
`close()` at the end); probes.hf and probes.lightning wrap it as callbacks.

Zero code change: `diagnose run --out DIR -- torchrun --nproc_per_node=N train.py ARGS`
(the launcher puts `probes/bootstrap` on PYTHONPATH; its sitecustomize loads this
package by absolute path and calls `install_from_env`). Both write per-rank traces, every-step timings and a metadata
sidecar; see probes.core for the files and the safety contract.
"""
from __future__ import annotations

import atexit
import os
from contextlib import contextmanager
from pathlib import Path

from .core import Probe, Schedule
from .sigterm import flush_on_sigterm

__all__ = ["watch", "Watch", "start", "Session", "Probe", "Schedule", "install_from_env"]

ENV_OUT = "DIAGNOSE_PROBE_DIR"
ENV_SCHEDULE = "DIAGNOSE_PROBE_SCHEDULE"


class Watch:
    """Handle returned by `watch`: wrap the loader, mark steps."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def loader(self, iterable):
        from .patches import timed_loader

        try:
            return timed_loader(self.probe, iterable, iter(iterable))
        except Exception as exc:  # noqa: BLE001
            self.probe._fail("dataloader timing", exc)
            return iter(iterable)

    def step(self) -> None:
        self.probe.start_profiler()
        self.probe.on_step()

    def describe(self, model=None, optimizer=None) -> None:
        """Optional: record model/optimizer facts (parameter count, dtype, optimizer) for the memory check."""
        from .meta import model_facts, optimizer_facts

        try:
            if model is not None:
                self.probe.meta["model"] = model_facts(model)
            if optimizer is not None:
                self.probe.meta.setdefault("optimizers", []).append(optimizer_facts(optimizer))
        except Exception as exc:  # noqa: BLE001
            self.probe._fail("metadata", exc)


class Session:
    """Probes started by code (`start`): mark each step, close at the end. What the framework
    callbacks (probes.hf, probes.lightning) hold; `watch` is the same as a context manager."""

    def __init__(self, probe: Probe, undo: list) -> None:
        self.probe = probe
        self._undo = undo
        self._closed = False

    def step(self) -> None:
        self.probe.start_profiler()
        self.probe.on_step()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _record_facts(self.probe)
        self.probe.close()
        for u in self._undo:
            try:
                u()
            except Exception:  # noqa: BLE001
                pass


def start(out_dir: str | Path, schedule: str | Schedule | None = None, *, collectives: bool = True,
          dataloaders: bool = False) -> Session:
    """Start the probes writing under out_dir; the caller marks steps (`Session.step`) and closes.

    dataloaders: time every DataLoader's batches (for frameworks that own the loop and its loader;
    `watch` users wrap theirs with `Watch.loader`). The optimizer-step hook of `diagnose run` is
    not installed: the caller's `step()` is the step boundary."""
    sch = schedule if isinstance(schedule, Schedule) else Schedule.parse(schedule)
    probe = Probe(out_dir, schedule=sch, strict_dir=False)
    undo = []
    from .patches import _checkpoint, _collectives, _dataloader, _ddp, _job_profiler, _memory

    parts = (_collectives, _ddp, _memory, _checkpoint) if collectives else (_memory, _checkpoint)
    parts = (_job_profiler, *parts)
    for part in ((_dataloader,) if dataloaders else ()) + parts:
        try:
            u = part(probe)
            if u:
                undo.append(u)
        except Exception as exc:  # noqa: BLE001
            probe._fail("hooks", exc)
    _record_facts(probe)
    return Session(probe, undo)


@contextmanager
def watch(out_dir: str | Path, schedule: str | Schedule | None = None, collectives: bool = True):
    """Probe the loop inside the `with` block; rank and world size come from torch.distributed, else
    the environment, when the first file is written. out_dir is yours: it may be a symlink you made."""
    session = start(out_dir, schedule, collectives=collectives)
    try:
        yield Watch(session.probe)
    finally:
        session.close()


def _record_facts(probe: Probe) -> None:
    try:
        from .meta import environment, memory_facts, torch_facts

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
    try:
        schedule = Schedule.parse(os.environ.get(ENV_SCHEDULE))
    except ValueError:
        schedule = Schedule()  # the launcher validates it; a hand-set bad value must not stop the job
    # rank: resolved when the first file is named (the process group may not exist yet)
    probe = Probe(out, schedule=schedule, strict_dir=True)
    from .patches import install

    install(probe)
    pid = os.getpid()

    def finish() -> None:
        if os.getpid() != pid or probe.step == 0:
            return  # a forked worker, or a process that never trained
        _record_facts(probe)
        probe.close()

    atexit.register(finish)

    def flush() -> None:
        finish()
        probe.remove_temp_files()

    flush_on_sigterm(flush, probe.busy)
    return probe


