"""The checklist: analyzers in the field's order. Each module has one pure entry point,
`analyze(ctx, thresholds) -> list[Check]`; adding a check means adding it here."""
from __future__ import annotations

from collections.abc import Callable

from diagnose.analyzers import (checkpoint, communication, dataloader, host_sync, launch, memory,
                                pipeline_bubbles, straggler)
from diagnose.context import Context
from diagnose.model import Check
from diagnose.thresholds import Thresholds

Analyzer = Callable[[Context, Thresholds], list[Check]]

CHECKLIST: tuple[tuple[str, Analyzer], ...] = (
    ("dataloader", dataloader.analyze),
    ("communication", communication.analyze),
    ("straggler", straggler.analyze),
    ("launch_overhead", launch.analyze),
    # after the four classic checks: capacity, schedule, I/O, synchronisation
    ("device_memory", memory.analyze),
    ("pipeline_bubble", pipeline_bubbles.analyze),
    ("checkpoint_io", checkpoint.analyze),
    ("host_sync", host_sync.analyze),
)
