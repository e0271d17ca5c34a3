"""Every step's time as the device ran it, on ranks that use CUDA.

The host's step (optimizer step to optimizer step) measures how fast the host launches work. A
host with no sync in its loop runs ahead of the device until the launch queue fills, and again
after anything drains it (recorded on an H200: host steps of 1.7-3.8 ms while the device ran
12.6 ms of work per step, until step 33, when the host's steps became 12.6 ms); read as the
job's speed, that looks like a job slowing down. So at each step boundary the probe records a CUDA event on the current
stream, and the time between two consecutive events, once both have run, is that step on the
device. Never a sync: events are only queried, so a step's figure arrives a few steps later, in
the record of the step during which it was read (`device_ms`: [[step, ms], ...]).
"""
from __future__ import annotations

import sys
import time
from collections import deque

MAX_PENDING = 4096
"""Events kept while the device is behind; older ones are dropped (their steps stay untimed)."""
DRAIN_S = 2.0
"""At close, how long the probe waits (polling) for the device to finish the steps still queued."""


def pair_completed(pending: deque, done) -> list[list]:
    """Pop every leading event whose successor has also run, returning [step, ms] for the
    successor's step (`a.elapsed_time(b)`, CUDA's milliseconds between two events): events run in
    stream order, so only a prefix of `pending` can be done. `pending` holds (step, event) in
    order; `done(e)` says whether e has run. The last completed event stays: it starts the next
    pair."""
    out = []
    while len(pending) >= 2 and done(pending[0][1]) and done(pending[1][1]):
        _, a = pending.popleft()
        step, b = pending[0]
        out.append([step, round(float(a.elapsed_time(b)), 4)])
    return out


class DeviceSteps:
    """One rank's step events: `mark(step)` at the end of each step, `resolved()` the steps timed
    since. Off CUDA (no torch, or CUDA not initialised by the job) nothing is recorded, and the
    probe never initialises CUDA itself."""

    def __init__(self) -> None:
        self._pending: deque = deque()

    def mark(self, step: int) -> None:
        if not _cuda_usable():
            return
        import torch

        e = torch.cuda.Event(enable_timing=True)
        e.record()
        if len(self._pending) >= MAX_PENDING:
            self._pending.clear()  # the device is far behind: start again rather than grow
        self._pending.append((step, e))

    def resolved(self) -> list[list]:
        if not self._pending or not _cuda_usable():
            return []
        return pair_completed(self._pending, lambda e: e.query())

    def drain(self, timeout_s: float = DRAIN_S) -> list[list]:
        """At the probe's close: the steps still in flight, as the device finishes them, polled
        (never a sync) for at most timeout_s. A host that runs ahead ends the job with its last
        steps queued (recorded on an H200: 25 of 300 steps, 0.3 s of work), which would otherwise
        never be timed."""
        return drain(self._pending, lambda e: e.query(), timeout_s) if _cuda_usable() else []


def drain(pending: deque, done, timeout_s: float, poll_s: float = 0.002) -> list[list]:
    """pair_completed until one event is left or timeout_s has passed."""
    out = pair_completed(pending, done)
    deadline = time.monotonic() + timeout_s
    while len(pending) >= 2 and time.monotonic() < deadline:
        time.sleep(poll_s)
        out += pair_completed(pending, done)
    return out


def _cuda_usable() -> bool:
    """CUDA is in use by the job and no graph is being captured (below)."""
    torch = sys.modules.get("torch")  # the job's torch, if it has one: never imported here
    return torch is not None and torch.cuda.is_initialized() and not capturing()


def capturing() -> bool:
    """A CUDA graph is being captured on this thread's stream: an event recorded or queried now
    would break the user's capture, so the probes touch no event until it ends."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())
