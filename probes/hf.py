"""Hugging Face Trainer integration, for users who prefer code to `diagnose run`::

    from diagnose.probes.hf import DiagnoseCallback
    trainer = Trainer(..., callbacks=[DiagnoseCallback("runs/exp1")])
    # then: diagnose analyze runs/exp1

The same probes as `diagnose run` (profiler schedule, every-step timings, DataLoader waits,
collectives, metadata), started when training begins; a step is the Trainer's optimizer step.
Imports transformers, so import this module only where it is installed.
"""
from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from . import Schedule, Session, start


class DiagnoseCallback(TrainerCallback):
    def __init__(self, out_dir: str | Path, schedule: str | Schedule | None = None) -> None:
        self.out_dir = out_dir
        self.schedule = schedule
        self.session: Session | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.session is None:
            self.session = start(self.out_dir, self.schedule, dataloaders=True)

    def on_step_end(self, args, state, control, **kwargs):  # after each optimizer step
        if self.session is not None:
            self.session.step()

    def on_train_end(self, args, state, control, **kwargs):
        if self.session is not None:
            self.session.close()
            self.session = None
