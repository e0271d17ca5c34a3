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

    straggler_alpha: float = 0.05
    """...and only if being last that often is unlikely by chance: with n ranks each is last
    at 1/n of the collectives under jitter alone, so with two ranks "last at 60% of 5" is a
    coin toss. One-sided tests (binomial on being last, t on how late; in the profiled steps and
    in the every-step record) together at the usual 5% level, each at 5% over the number run
    (collectives taken as independent: lenient, since one slow step makes a rank last at all its
    collectives)."""

    load_imbalance: float = 0.10
    """Flag uneven work across ranks (the slowest rank changing from step to step) when spreading
    it evenly gives back 10% of the step or more: the share this module asks of causes that are not
    one rank's to fix (exposed communication, launch overhead). Below it, ranks sharing a busy host
    wait for each other's jitter (healthy 2-rank gloo jobs on the 2-core machine the tests run on:
    1.4-6.3% replayed; four ranks on its two cores, `cpu_2d_4rank`: 7.3% replayed, 9.5% by the check's
    own estimate, which it uses there: that replay misses a step by 6.6%)."""

    imbalance_same_rank: float = 0.8
    """...and only while the rank slowest most often is slowest in fewer than 80% of the steps;
    from there it is one rank's pattern, the straggler check's (the level its confidence calls
    high)."""

    launch_overhead: float = 0.10
    """Flag launch/host overhead when the device idles (outside DataLoader waits) for
    >= 10% of the step; HTA's idle-time view treats 10%+ idle as worth acting on."""

    cpu_op_overhead: float = 0.10
    """CPU-only traces: flag per-op overhead (op count x the floor cost of a trivial op,
    plus host gaps between ops) from 10% of the step."""

    link_near_peak: float = 0.70
    """A bandwidth-bound group's bus bandwidth is "near the link's peak" from 70% of the figure the
    user gives (--link-gbps: what nccl-tests' all_reduce_perf reaches on the same machines, itself a
    collective's best case): with under a third of it left, a faster link or better topology gains
    little, and only sending fewer bytes helps (diagnose/step/link.py)."""

    link_far_below: float = 0.30
    """...and "far below" it under 30%: more than 3x slower than the machines' own benchmark is a
    structural cause (a transport fallback, e.g. NVLink or InfiniBand to PCIe or TCP sockets, costs
    3-10x), not a tuning margin."""

    fail_slow: float = 0.05
    """Flag a slowdown found over the run from 5% of the step since the change (the input-bound
    floor: what the field's tools call worth acting on)."""

    fail_slow_effect: float = 0.20
    """A change of level over the run counts from 20% of the rank's median step (whichever component
    moved): this 2-core host drifts through phases of 10-20 steps where one rank runs ~30% slower in
    compute, a few percent of its step; fleet studies' fail-slow events (a throttling GPU, a degraded
    link, a slow mount) slow the step by tens of percent (diagnose/step/changes.py)."""

    fail_slow_min_segment: int = 20
    """...lasting at least 20 steps on either side: shorter runs of slow steps are the phases above, a
    checkpoint, an evaluation; the change's step is still found to within a few steps."""

    severity_high: float = 0.20
    """Any finding at >= 20% of the step is high severity."""

    severity_medium: float = 0.10
    """>= 10% is medium; below that, low."""

    memory_headroom: float = 0.10
    """Device memory is "tight" when the peak reserved by the caching allocator leaves
    under 10% of the device free. Arithmetic, not a fit: the smallest change anyone tries
    (a 10% larger micro-batch or sequence) grows activations by about 10%, and activations
    are usually the largest share of the peak, so below 10% free that change runs out of
    memory; the allocator's fragmentation takes a few percent more."""

    pipeline_bubble: float = 0.10
    """Flag pipeline idle (bubble) from 10% of the step: the same level at which idle
    device time is worth acting on elsewhere in the checklist (HTA's idle-time view). With
    p stages the GPipe bound (p - 1) / (m + p - 1) falls under 10% only for m >= 9 (p - 1)
    micro-batches, so most real schedules sit above it and the check says how far."""

    pipeline_imbalance: float = 0.10
    """Name unbalanced stages when the slowest stage computes >= 10% more per step than the
    mean stage: every micro-batch then waits for it, costing about that share of the step
    (step ~ (m + p - 1) x slowest stage's micro-batch time)."""

    checkpoint: float = 0.05
    """Flag checkpoint writes that block the loop from 5% of wall time (amortised per step):
    checkpoint-frequency tuners (CheckFreq, FAST '21) hold the overhead to a few percent,
    and 5% is the floor the checklist already uses for input stalls."""

    grad_sync: float = 0.05
    """Flag gradients all-reduced on every micro-batch from 5% of the step: the cost is pure waste
    removed by one context manager, like a blocking input copy (the same 5% floor as input)."""

    reduce_dtype: float = 0.05
    """Flag gradients reduced in fp32 under bf16/fp16 compute from 5% of the step: one line (a comm
    hook, FSDP's reduce_dtype) removes it, as with grad_sync; but it trades some precision of the
    sum, so not below the input-stall floor."""

    host_sync: float = 0.05
    """Flag host-device synchronisation when the device idle it causes reaches 5% of the
    step: a blocking sync stalls the device queue exactly like a blocking host-to-device
    copy, so it takes the input-stall floor."""

    sched_latency_us: float = 5.0
    """Device idle gaps up to 5 us are scheduling latency, not a cause: a kernel queued behind
    another on the same stream starts about 1-5 us after it ends on V100/A100/H100 (the
    device's own dispatch; CUDA-graph replays shave it to about 1-2 us), so no host or
    schedule change removes them. Also the slack when matching a gap start to a host call:
    host and device clocks in these traces agree within about 10 us."""

    launch_gap_long_us: float = 100.0
    """A launch gap over 100 us is a host-op stall, not launch rate: eager PyTorch spends about
    10-30 us per op between kernel launches (dispatch plus cudaLaunchKernel), so a gap several
    times that means the host was doing other work (Python, a slow op's CPU side) before it
    launched the next kernel."""

    device_wait: float = 0.10
    """Flag queued device idle (work launched, waiting on another stream, a collective or a
    graph) from 10% of the step: the same level as launch overhead, since both are device idle."""

    host_ahead_delay_us: float = 1000.0
    """A median launch delay (kernel start minus its launch call's end) of 1 ms or more means
    the host runs far ahead of the device: launches are not what the device waits for, so
    launch overhead cannot be the top cause unless the host-launch idle class itself is large."""

    same_stream_suspect: float = 0.5
    """When over half of the queued idle is same-stream (impossible in a complete trace: a stream
    runs queued work at once), events are missing and the queued figure is a bound."""

    min_linked_share: float = 0.5
    """Under half of the device events linked to their launch call: the launch links cannot
    attribute the idle time (sampled or filtered trace)."""

    unmatched_launch_share: float = 0.2
    """Over a fifth of the launch calls in the steps without a device event: device work is missing
    from the trace (a buffer overflow or filtered activities), so its idle time is overstated.
    Healthy traces stay near zero (a few percent of zero-byte memsets have no device record)."""

    empty_graph_share: float = 0.5
    """Over half of the CUDA graph launches without a recorded kernel: the graphs' kernels were not
    traced (older CUPTI, or graph tracing off), and their run time reads as idle."""

    clock_skew_us: float = 20.0
    """A device event starting over 20 us before its own launch call proves host and device clocks
    disagree by that much (causality); past it, gaps near that size can be misfiled between the
    queued and host-launch classes (gaps that matter for a finding are tens of us and up)."""

    gc_pause: float = 0.05
    """Flag Python's garbage collection pauses from 5% of the step over the run: the floor asked of
    other waits the whole job sits through (input, a straggler's), a pause on one rank being a wait
    for every other."""

    cpu_contention: float = 0.10
    """Flag the training thread's wait for a core from 10% of the step over the run: a figure of the
    kernel's accounting (or, from older probes, one sample per 2 s), held to the communication
    check's floor rather than input's 5%."""

    healthy_floor_ms: float = 0.05
    """Ignore causes under 50 us per step: below timer and alignment noise."""

    def straggler_floor_ms(self, step_ms: float) -> float:
        """The least a straggler (a rank or ranks brought to the median) must give back per step."""
        return max(self.healthy_floor_ms, self.straggler * step_ms)

    def severity(self, share: float) -> str:
        if share >= self.severity_high:
            return "high"
        if share >= self.severity_medium:
            return "medium"
        return "low"


DEFAULT = Thresholds()
