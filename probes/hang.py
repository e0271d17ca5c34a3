"""Hang hints: dump torch.distributed's Flight Recorder when asked, even while the rank is stuck.

`diagnose hang RUN_DIR` writes `hang.json` ({"id", "time"}; one older than 2 minutes is left over
from an earlier run and ignored) into the probe directory. A daemon thread in each rank checks for
it once a second (one `os.stat`) and writes `hang-{id}/rank{R}.fr.json`: the Flight Recorder's
JSON dump (never pickle), or
`{"diagnose_error": reason}` when there is none. A rank waiting in a collective, or sleeping,
has released the GIL, so the thread runs while the training thread is stuck; it takes no lock
the training loop takes. The Flight Recorder records only if TORCH_FR_BUFFER_SIZE is set before
the process group starts: `diagnose run --flight-recorder` sets it unless the job sets its own.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

CONTROL = "hang.json"
POLL_S = 1.0
STALE_S = 120.0
_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _rank(default: int) -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else default
    except Exception:  # noqa: BLE001
        return default


def flight_recorder_json() -> bytes:
    """This process's Flight Recorder ring buffer as JSON bytes; raises if torch has none."""
    from torch._C import _distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
    if dump is None:
        raise RuntimeError("this torch build has no Flight Recorder JSON dump")
    out = dump()
    return out.encode() if isinstance(out, str) else bytes(out)


class HangWatcher:
    def __init__(self, out_dir: Path, rank: int, on_error) -> None:
        self.out_dir = out_dir
        self.rank = rank
        self.on_error = on_error
        self.control = out_dir / CONTROL
        self._mtime: int | None = None
        self._done: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="diagnose-hang-watch", daemon=True)

    def start(self) -> None:
        self.rank = _rank(self.rank)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - a probe must never disturb the job
                self.on_error(exc)
                return

    def poll(self) -> None:
        try:
            st = os.stat(self.control)
        except FileNotFoundError:
            return
        if st.st_mtime_ns == self._mtime:
            return
        self._mtime = st.st_mtime_ns
        req = json.loads(self.control.read_text())
        hid = req.get("id") if isinstance(req, dict) else None
        if not isinstance(hid, str) or not _ID.match(hid) or hid in self._done:
            return
        asked = req.get("time")
        if not isinstance(asked, (int, float)) or time.time() - asked > STALE_S:
            return  # left by an earlier run in this directory: nobody is waiting for it
        self._done.add(hid)
        try:
            body = flight_recorder_json()
        except Exception as exc:  # noqa: BLE001
            body = json.dumps({"diagnose_error": f"{type(exc).__name__}: {exc}"[:300]}).encode()
        from probes.core import atomic_write

        d = self.out_dir / f"hang-{hid}"
        d.mkdir(parents=True, exist_ok=True)
        atomic_write(d / f"rank{self.rank}.fr.json", body)
