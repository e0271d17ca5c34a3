"""Typed results: what the analyzers return and what `diagnosis.json` serialises.

Frozen dataclasses: results are never mutated after they are built.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

SCHEMA_VERSION = "1.18"

FindingId = Literal[
    "dataloader_starvation",
    "input_stall",
    "exposed_communication",
    "straggler",
    "load_imbalance",
    "launch_overhead",
    "device_wait",
    "device_memory",
    "pipeline_bubble",
    "checkpoint_io",
    "host_sync",
    "gc_pause",
    "grad_sync",
    "reduce_dtype",
    "fail_slow",
]
Severity = Literal["high", "medium", "low"]
Confidence = Literal["high", "medium", "low"]
CheckStatus = Literal["flagged", "passed", "not_measurable"]

# The checklist in the field's order; reports show checks in this order.
CHECK_ORDER: tuple[str, ...] = (
    "dataloader_starvation",
    "input_stall",
    "exposed_communication",
    "straggler",
    "load_imbalance",
    "launch_overhead",
    "device_wait",
    # beyond the four classic causes: capacity, schedule, I/O and synchronisation
    "device_memory",
    "pipeline_bubble",
    "checkpoint_io",
    "host_sync",
    "gc_pause",
    "cpu_contention",
    # configuration mistakes behind the causes above
    "grad_sync",
    "reduce_dtype",
    # over the whole run, from the every-step record: when it got slow, where, and what moved
    "fail_slow",
)


@dataclass(frozen=True, slots=True)
class EventRef:
    """One trace event behind a finding, as a person would look it up in Perfetto."""

    rank: int
    file: str
    ts_us: float
    """Timestamp as written in the file (microseconds, before clock alignment)."""
    dur_us: float
    name: str
    step: int | None = None
    note: str = ""


@dataclass(frozen=True, slots=True)
class Finding:
    """One cause, with the time it costs and how to verify and fix it."""

    id: str
    title: str
    severity: Severity
    recoverable_ms: float
    """Estimated ms per step saved if this cause were removed (method in `method`)."""
    share_of_step: float
    ranks: tuple[int, ...]
    metrics: dict[str, float | int | str]
    """The numbers behind the verdict."""
    events: tuple[EventRef, ...]
    fix: str
    confidence: Confidence
    method: str
    """How recoverable_ms was estimated, in one sentence."""
    kind: Literal["time", "capacity"] = "time"
    """'capacity' findings (device memory) cost no step time: recoverable_ms is 0 and they
    rank after every time finding; their verdict is the check's reason."""
    over: Literal["window", "run"] = "window"
    """What recoverable_ms is a mean over: the profiled steps (the step graph's replay of them
    replaces the check's own figure), or the probes' every-step record of the run (kept; the
    replay's figure for the profiled steps, where it has one, is the metric beside it)."""


@dataclass(frozen=True, slots=True)
class Check:
    """One item of the checklist: whether it ran, what it found, and why."""

    id: str
    title: str
    status: CheckStatus
    reason: str
    finding: Finding | None = None
    measured_ms: float | None = None
    """The check's estimate of recoverable ms per step even when below its threshold
    (None when not measurable): the scaling waterfall compares it across runs."""


@dataclass(frozen=True, slots=True)
class StepBreakdown:
    """Where one rank's step went. Components are disjoint and sum to step_ms."""

    rank: int
    step: int
    start_us: float
    step_ms: float
    compute_ms: float
    exposed_comm_ms: float
    straggler_wait_ms: float
    dataloader_ms: float
    other_ms: float
    gc_ms: float = 0.0
    """CPU ranks: Python's garbage collections the probes placed in the step (step/pauses.py),
    out of the DataLoader wait where a pass began inside a fetch, else out of the host time (other,
    then compute: the process stood still, whatever the trace shows); 0 elsewhere."""
    other_by_cause_ms: dict[str, float] = field(default_factory=dict)
    """GPU ranks: other_ms (device idle outside DataLoader waits) split by the idle model's
    classes (diagnose/step/idle.py: latency, queued, sync, input, launch, unattributed); the
    values sum to other_ms. {} on CPU-only ranks, whose other_ms is host time outside ops."""


@dataclass(frozen=True, slots=True)
class RunFacts:
    world_size: int | None
    ranks_found: tuple[int, ...]
    ranks_missing: tuple[int, ...]
    backend: str | None
    device: str
    """'cuda', 'rocm' or 'cpu' (what the trace shows, not what the job asked for)."""
    device_name: str | None
    steps_analysed: int
    step_source: str
    """'ProfilerStep', 'optimizer_step' or 'probe'."""
    mean_step_ms: dict[int, float]
    clock_offsets_us: dict[int, float]
    files: dict[int, str]
    metadata: dict = field(default_factory=dict)
    """Run configuration recorded by the probes (DataLoader, model size, optimizer, env); {} without."""


@dataclass(frozen=True, slots=True)
class Diagnosis:
    run: RunFacts
    checks: tuple[Check, ...]
    findings: tuple[Finding, ...]
    """Flagged findings, most recoverable time first."""
    breakdown: Sequence[StepBreakdown]
    """Every rank's every step (the pipeline's: step/breakdown.BreakdownRows, its rows made when
    read; a tuple or list of rows compares equal to it)."""
    warnings: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    """Inputs that were not used, each 'file: reason'."""
    extras: dict = field(default_factory=dict)
    """Optional material for the report (timeline excerpts, lateness matrix)."""
    schema_version: str = SCHEMA_VERSION

    @property
    def top(self) -> Finding | None:
        return self.findings[0] if self.findings else None


class Grid:
    """A matrix of floats a Diagnosis holds as one array until it is written (output._clean writes
    it as lists of rows, NaN as null): a Python float a cell, held from the analysis to the end,
    grew with the ranks (#20). Equal to a Grid of the same cells, NaN to NaN; read-only."""

    __slots__ = ("values",)

    def __init__(self, values) -> None:
        import numpy as np  # here, not at the top: the CLI starts without numpy (tests/test_cli.py)

        v = np.array(values, dtype=float)
        v.setflags(write=False)
        self.values = v

    def __eq__(self, other) -> bool:
        import numpy as np

        return isinstance(other, Grid) and self.values.shape == other.values.shape and \
            bool(np.array_equal(self.values, other.values, equal_nan=True))

    __hash__ = None  # type: ignore[assignment]

    def tolist(self) -> list:
        return self.values.tolist()

    def __repr__(self) -> str:
        return f"Grid({self.values.shape[0]}x{self.values.shape[1] if self.values.ndim > 1 else 0})"


def to_dict(obj) -> dict:
    return asdict(obj)
