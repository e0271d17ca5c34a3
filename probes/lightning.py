"""PyTorch Lightning integration, for users who prefer code to `diagnose run`::

    from diagnose.probes.lightning import DiagnoseCallback
    trainer = L.Trainer(..., callbacks=[DiagnoseCallback("runs/exp1")])
    # then: diagnose analyze runs/exp1

The same probes as `diagnose run` (profiler schedule, every-step timings, DataLoader waits,
collectives, metadata), started with fitting; a step is an optimizer step (`trainer.global_step`
moving on), so gradient accumulation's micro-batches are one step. Imports lightning (or
pytorch_lightning), so import this module only where it is installed.
"""
from __future__ import annotations

from pathlib import Path

try:
    from lightning.pytorch import Callback
except ImportError:  # the older package name
    from pytorch_lightning import Callback

from . import Schedule, Session, start


class DiagnoseCallback(Callback):
    def __init__(self, out_dir: str | Path, schedule: str | Schedule | None = None) -> None:
        self.out_dir = out_dir
        self.schedule = schedule
        self.session: Session | None = None
        self._global_step = 0

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.session is None:
            self.session = start(self.out_dir, self.schedule, dataloaders=True)
            self._global_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.session is not None and trainer.global_step != self._global_step:
            self._global_step = trainer.global_step
            self.session.step()

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.on_fit_end(trainer, pl_module)  # keep what was recorded; Lightning re-raises the error
