"""Collectives a CPU backend is still finishing on its own thread, waited for before a profiler stops.

Why (torch 2.13, gloo): a gloo work completes its future, which wakes the training thread, and only
then calls `Work::finish()` on gloo's worker thread, which ends the work's `gloo:*` profiler event
(`ProcessGroupGloo::AsyncWork::finishWorkGloo`). A profiler stopped in between has already
collected and freed its event lists; the late end writes into freed heap, and the rank dies later:
glibc's heap check ("malloc(): unsorted double linked list corrupted", "free(): invalid pointer")
or a segfault in the trace's export or in its garbage collection. torch.profiler alone does it
too, more rarely (README, Capture: the probes, Safety: the counts). `Work.is_completed()` takes
the mutex `finish()` holds while it ends the event, so once it is true the write is done.

Only works on CPU tensors are kept: NCCL ends its events on the calling thread (its CUDA future's
callback), and waiting for a CUDA work to complete would be a device sync.
"""
from __future__ import annotations

import time
from collections import deque

# works issued between two windows' ends: a DDP step issues one per bucket; a bound, not a budget
LIMIT = 4096
# at the window's end the backend's thread has usually finished already (microseconds); a work
# still running this long is a collective still in flight, and the probe must not stall the job
SETTLE_S = 1.0


class InFlight:
    def __init__(self, limit: int = LIMIT) -> None:
        self._works: deque = deque(maxlen=limit)
        self.unsettled = 0  # windows stopped while a work still ran after SETTLE_S (see the sidecar)

    def add(self, work) -> None:
        if len(self._works) >= 64:  # keep it short: the finished ones go at each 64th
            self._works = deque((w for w in self._works if not w.is_completed()), maxlen=self._works.maxlen)
        self._works.append(work)

    def settle(self, timeout_s: float = SETTLE_S) -> bool:
        """Wait until every kept work has finished, at most `timeout_s`; forget them all."""
        works = list(self._works)
        self._works.clear()
        deadline = time.monotonic() + timeout_s
        for w in works:
            while not w.is_completed():
                if time.monotonic() >= deadline:
                    self.unsettled += 1
                    return False
                time.sleep(0.0002)
        return True
