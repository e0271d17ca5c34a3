"""A probe's background thread: a daemon that its owner can stop and join (hang watch, telemetry)."""
from __future__ import annotations

import threading


class Periodic:
    """Subclasses define _run(), looping on `while not self._stop.wait(seconds)`."""

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self, join_s: float = 2.0) -> bool:
        """Stop the loop; True once the thread has finished (then what it uses may be closed)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(join_s)
        return not self._thread.is_alive()
