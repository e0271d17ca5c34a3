"""Sizes as a person writes them, in powers of 1000 (as device memory and GB/s are quoted).

One formatter for the verdicts, the terminal and the report; a light module (nothing but the
standard library), so the CLI can import what prints sizes without loading the analysis."""
from __future__ import annotations


def human(n: float | None) -> str:
    if n is None:
        return "not measured"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
