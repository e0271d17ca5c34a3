"""Which optimizer's step ends a training step, when a job has several or replaces one.

`diagnose run` marks a step after `optimizer.step()`. A job may step several optimizers an
iteration (a GAN's generator and discriminator, a sparse and a dense optimizer): one of them, the
marker, ends the step. A job may also replace its optimizer part way (a second stage that unfreezes
the backbone with a new Adam): the old one never steps again, and a marker fixed at the first
optimizer recorded nothing after the switch (measured before this module: 40 steps run, 10
recorded, the old optimizer freed or not). So the marker passes on when it is freed, or when another
optimizer steps TAKEOVER times while the marker steps none: in an iteration that steps each
optimizer once no other reaches two; a critic stepped five times for each generator step takes the
mark once and keeps it (the generator then steps once between its steps). A replaced marker is
*retired*: the facts recorded of it (parameters, state bytes) no longer describe the job's memory.

Optimizers are held by weak reference only: a probe must not keep a job's optimizer state alive.
"""
from __future__ import annotations

import weakref

TAKEOVER = 2
"""Steps of one other optimizer, with none of the marker's between, that make it the marker."""


class StepMarker:
    def __init__(self) -> None:
        self._numbers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._next = 0
        self._marker: weakref.ref | None = None
        self._marker_number: int | None = None
        self._since: dict[int, int] = {}  # other optimizers' steps since the marker's last one

    def known(self, opt) -> bool:
        return opt in self._numbers

    def number(self, opt) -> int:
        """A number for each optimizer the job steps, in the order they first step (ids are reused
        once an optimizer is freed; numbers are not)."""
        n = self._numbers.get(opt)
        if n is None:
            n = self._numbers[opt] = self._next
            self._next += 1
        return n

    def on_step(self, opt) -> tuple[bool, int | None]:
        """(this optimizer step ends a training step, the number of the marker it retired or None)."""
        n = self.number(opt)
        marker = self._marker() if self._marker is not None else None
        if marker is opt:
            self._since.clear()
            return True, None
        if marker is not None:
            self._since[n] = self._since.get(n, 0) + 1
            if self._since[n] < TAKEOVER:
                return False, None
        retired = self._marker_number  # freed, or no longer stepping; None for the first
        self._marker, self._marker_number = weakref.ref(opt), n
        self._since.clear()
        return True, retired
