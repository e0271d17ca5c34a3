"""Every threshold the verdicts use, in one place, each with its justification.

Shares are fractions of the mean step time. They are deliberately round numbers
taken from the field's tools and practice, not fitted to any trace.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Thresholds:
    input_bound: float = 0.05
    """Flag DataLoader wait from 5% of the step: the TensorBoard profiler plugin's
    "input-bound" recommendation starts at 5%."""

    input_bound_high: float = 0.20
    """High severity from 20%: the plugin's "highly input-bound" level."""

    input_stall: float = 0.05
    """Blocking host-to-device copies outside the DataLoader: same 5% floor as input."""

    communication: float = 0.10
    """Flag exposed (non-overlapped) communication from about 10% of the step, the
    level at which HTA's and the plugin's overlap views call a job communication-bound."""

    straggler: float = 0.05
    """Flag a straggler when the wait it imposes at collectives is >= 5% of the step."""

    straggler_consistency: float = 0.5
    """A rank is named a straggler only if it is last to arrive at >= half of the
    collectives it takes part in (or its mean lateness dominates); random jitter spreads
    'last' roughly evenly over ranks."""

    launch_overhead: float = 0.10
    """Flag launch/host overhead when the device idles (outside DataLoader waits) for
    >= 10% of the step; HTA's idle-time view treats 10%+ idle as worth acting on."""

    cpu_op_overhead: float = 0.10
    """CPU-only traces: flag per-op overhead (op count x the floor cost of a trivial op,
    plus host gaps between ops) from 10% of the step."""

    severity_high: float = 0.20
    """Any finding at >= 20% of the step is high severity."""

    severity_medium: float = 0.10
    """>= 10% is medium; below that, low."""

    healthy_floor_ms: float = 0.05
    """Ignore causes under 50 us per step: below timer and alignment noise."""

    def severity(self, share: float) -> str:
        if share >= self.severity_high:
            return "high"
        if share >= self.severity_medium:
            return "medium"
        return "low"


DEFAULT = Thresholds()
