"""Hang hints: dump torch.distributed's Flight Recorder when asked, even while the rank is stuck.

`diagnose hang RUN_DIR` writes `hang.json` ({"id", "time"}; one older than 2 minutes is left over
from an earlier run and ignored) into the probe directory. A daemon thread in each rank checks for
it once a second (one `os.stat`) and writes `hang-{id}/rank{R}.fr.json`: the Flight Recorder's
JSON dump (never pickle), or
`{"diagnose_error": reason}` when there is none. A rank waiting in a collective, or sleeping,
has released the GIL, so the thread runs while the training thread is stuck; it takes no lock
the training loop takes. The Flight Recorder records only if TORCH_FR_BUFFER_SIZE is set before
the process group starts: `diagnose run --flight-recorder` sets it unless the job sets its own.

The request file is untrusted (shared run directories): read as `capture.json` is (regular file,
small, non-blocking, bounded); a bad one is ignored and the thread keeps polling; each rank
dumps at most once per MIN_INTERVAL_S whatever the number of requests.
"""
from __future__ import annotations

import json
import time

from .capture import ID, read_control, signature
from .periodic import Periodic
from .safefs import SafeDir

CONTROL = "hang.json"
POLL_S = 1.0
STALE_S = 120.0
MIN_INTERVAL_S = 10.0


def flight_recorder_json() -> bytes:
    """This process's Flight Recorder ring buffer as JSON bytes; raises if torch has none."""
    from torch._C import _distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
    if dump is None:
        raise RuntimeError("this torch build has no Flight Recorder JSON dump")
    out = dump()
    return out.encode() if isinstance(out, str) else bytes(out)


class HangWatcher(Periodic):
    def __init__(self, out_dir: SafeDir, rank: int, on_error) -> None:
        """out_dir: the probe's open directory; rank: already claimed by the probe."""
        self.out_dir = out_dir
        self.rank = rank
        self.on_error = on_error
        self._seen = None
        self._next_ok = 0.0
        self._done: set[str] = set()
        super().__init__("diagnose-hang-watch")

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - a probe must never disturb the job
                self.on_error(exc)  # logged once; polling goes on (a later request may succeed)

    def poll(self) -> None:
        if time.monotonic() < self._next_ok:
            return
        sig = signature(self.out_dir.lstat(CONTROL))
        if sig is None or sig == self._seen:
            return
        self._seen = sig
        req = read_control(self.out_dir, CONTROL)
        hid = req.get("id") if req is not None else None
        if not isinstance(hid, str) or not ID.fullmatch(hid) or hid in self._done:
            return
        asked = req.get("time")
        if not isinstance(asked, (int, float)) or time.time() - asked > STALE_S:
            return  # left by an earlier run in this directory: nobody is waiting for it
        self._done.add(hid)
        self._next_ok = time.monotonic() + MIN_INTERVAL_S
        try:
            body = flight_recorder_json()
        except Exception as exc:  # noqa: BLE001
            body = json.dumps({"diagnose_error": f"{type(exc).__name__}: {exc}"[:300]}).encode()
        with self.out_dir.subdir(f"hang-{hid}") as d:
            d.write_atomic(f"rank{self.rank}.fr.json", body)
