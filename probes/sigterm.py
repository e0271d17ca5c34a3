"""SIGTERM in a probed rank: flush what the probe has, then end as SIGTERM ends a process.

torchrun stops the surviving ranks with SIGTERM when one fails, and so do schedulers and people:
the probe flushes its files first (`flush_on_sigterm`). But Python runs a signal handler only
between the main thread's bytecodes, and a rank blocked inside one C++ call, a collective waiting
for a peer that never comes, would ignore SIGTERM until the call returned: a gloo rank waiting in
all_reduce for a peer 40 s late died 35.9 s after its SIGTERM under the probes, 0.03 s without
them (tests/test_probe_sigterm.py); a hung job's rank, not before the collective's timeout (30
min for gloo), and torchrun's teardown waits 30 s, then sends SIGKILL. The interpreter's C-level
handler writes the signal's number to the wakeup fd at once, so a thread of ours learns of it
even then (`_Watch`): when the handler has not begun within GRACE_S, the process ends by
SIGTERM's default action, as it would have without the probe (unflushed: the step logs are
flushed every step anyway). While the probe's own work holds the main thread (a window's stop and
export, whose flush is worth having), it waits for that first, up to BUSY_S.

The watch stands aside wherever it could do harm: when the job (or torchrun's agent, which
imports torch too) installs a SIGTERM handler of its own, when a wakeup fd is already set
(asyncio's), in a forked child (it inherits the pipe but not the thread: its signals must not
reach the parent's watch), and off the main thread.
"""
from __future__ import annotations

import os
import signal
import threading
import time

GRACE_S = 2.0
"""How long the main thread has to begin the handler: it runs within milliseconds between
bytecodes; only a call that does not return keeps it longer."""
BUSY_S = 20.0
"""How long the probe's own work (a window's stop and export: seconds for a large trace) may hold
the main thread before the flush: below torchrun's 30 s between SIGTERM and SIGKILL."""


def flush_on_sigterm(finish, busy=lambda: False) -> None:
    """On SIGTERM: `finish()`, then die by SIGTERM. Only when the job left SIGTERM at its default
    (a handler of the user's is never replaced), and only from the main thread. busy(): the
    probe's own work holds the main thread (its flush is worth waiting for, up to BUSY_S)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    began = threading.Event()

    def on_term(signum, frame):
        began.set()
        try:
            finish()
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, on_term)
    except (ValueError, OSError):
        return
    _Watch.start(on_term, began, busy)


class _Watch:
    """A daemon thread reading the interpreter's signal wakeup fd (see the module's docstring)."""

    def __init__(self, handler, began: threading.Event, busy, r: int, w: int) -> None:
        self.handler, self.began, self.busy, self.r, self.w = handler, began, busy, r, w
        self.paused = False
        self.retired = False
        """Set for good when a fork happens off the main thread (see `pause`)."""

    @classmethod
    def start(cls, handler, began: threading.Event, busy) -> None:
        r, w = os.pipe()
        try:
            os.set_blocking(w, False)
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(r)
            os.close(w)
            return
        if old != -1:  # the job's own wakeup fd (asyncio's): never displaced
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return
        watch = cls(handler, began, busy, r, w)
        os.register_at_fork(before=watch.pause, after_in_parent=watch.resume, after_in_child=watch.forget)
        threading.Thread(target=watch.run, name="diagnose-sigterm", daemon=True).start()

    def pause(self) -> None:
        """Before a fork: no wakeup fd while the child is made. A child signalled before its own
        `forget` ran would otherwise write into this pipe, and its SIGTERM read as the parent's
        (`pid = os.fork(); os.kill(pid, SIGTERM)` ended the parent 3 times in 3 here). The
        wakeup fd is the main thread's to set: a fork from another thread retires the watch."""
        if threading.current_thread() is not threading.main_thread():
            self.retired = True
            return
        try:
            old = signal.set_wakeup_fd(-1)
        except (ValueError, OSError):
            self.retired = True
            return
        if old == self.w:
            self.paused = True
        elif old != -1:
            signal.set_wakeup_fd(old)  # someone's set after ours: theirs is theirs

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            try:
                signal.set_wakeup_fd(self.w, warn_on_full_buffer=False)
            except (ValueError, OSError):
                self.retired = True

    def forget(self) -> None:
        """In a forked child (a DataLoader worker): the pipe is the parent's watch's, and the probe
        has nothing to flush there: SIGTERM ends it as it would without the probe."""
        try:
            if signal.getsignal(signal.SIGTERM) is self.handler:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except (ValueError, OSError):
            pass
        try:
            old = signal.set_wakeup_fd(-1)
            if old not in (self.w, -1):
                signal.set_wakeup_fd(old)  # someone's set after ours: theirs stays
        except (ValueError, OSError):
            pass
        for fd in (self.r, self.w):
            try:
                os.close(fd)
            except OSError:
                pass

    def run(self) -> None:
        while True:
            try:
                got = os.read(self.r, 64)
            except OSError:
                return
            if not got:
                return
            if signal.SIGTERM in got and not self.handler_begins() and not self.retired and self.still_ours():
                _die_by_sigterm()

    def handler_begins(self) -> bool:
        """The handler began within GRACE_S, or within GRACE_S of the end of the probe's own work
        on the main thread (waited for up to BUSY_S)."""
        deadline = time.monotonic() + BUSY_S
        quiet_since = time.monotonic()
        while not self.began.wait(0.1):
            now = time.monotonic()
            if self.probe_busy() and now < deadline:
                quiet_since = now
            elif now - quiet_since >= GRACE_S:
                return False
        return True

    def probe_busy(self) -> bool:
        try:
            return bool(self.busy())
        except Exception:  # noqa: BLE001 - a probe that cannot say is not busy
            return False

    def still_ours(self) -> bool:
        """The probe's handler is still SIGTERM's: no one (the job, torchrun's agent) took it over."""
        try:
            return signal.getsignal(signal.SIGTERM) is self.handler
        except (ValueError, OSError):
            return False


def _die_by_sigterm() -> None:
    """SIGTERM's default action, from a thread that is not the main one (signal.signal is the
    main thread's only): the C library's signal() resets it, then the process signals itself."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal(int(signal.SIGTERM), None)  # None: SIG_DFL (0)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)  # gone by now, unless the reset did not take
    except Exception:  # noqa: BLE001 - no libc to call
        pass
    os._exit(128 + int(signal.SIGTERM))  # the exit status a shell gives SIGTERM
