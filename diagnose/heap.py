"""The analysing process's C heap (glibc's malloc): what the client does so that its resident
memory follows what it holds, not how many ranks passed through it (#20).

Elsewhere than glibc (macOS, musl) both are no-ops: nothing to call, nothing lost.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

M_MMAP_THRESHOLD = -3
"""mallopt's parameter number (malloc.h)."""
MMAP_THRESHOLD_BYTES = 128 * 1024
"""glibc's own default threshold, pinned (keep_large_blocks_mapped): not a value tuned here."""


def _libc(name: str, argtypes: list) -> Callable[..., int] | None:
    try:
        f = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    f.argtypes, f.restype = argtypes, ctypes.c_int
    return f


_MALLOC_TRIM = _libc("malloc_trim", [ctypes.c_size_t])
_MALLOPT = _libc("mallopt", [ctypes.c_int, ctypes.c_int])


def give_back_freed() -> None:
    """Return the heap's free pages to the system between the analysis's phases (malloc_trim).
    Each phase's short-lived arrays and tables are freed, but the C heap keeps their pages while a
    long-lived object sits above them, so the client's resident memory only grew, phase after
    phase (measured at 1,024 DLRM ranks: a peak 2.5 MB lower with it). Dask trims its workers the
    same way."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def keep_large_blocks_mapped() -> None:
    """Pin malloc's mmap threshold at glibc's default (128 KiB) for the rest of this process
    (`diagnose` does it first: cli.main; load_run too, for callers of the Python API). glibc
    raises the threshold each time a mapped block is freed, up to 32 MiB: after the first few,
    every column and pickled result of the analysis (tens of KiB to a few MiB, freed within a
    phase) comes from the heap instead, between the small objects each rank leaves there for the
    whole run, and the heap cannot shrink below the highest of those.
    Measured on 1,024 replicated DLRM ranks (`python benchmarks/bench_cluster.py --measure local
    --target DIR`, two runs each, this 2-core machine): peak 88.0 / 88.6 MB with the climbing
    threshold, 87.1 / 87.0 pinned from the process's start (MALLOC_MMAP_THRESHOLD_), 87.5 / 86.9
    pinned first thing in Python, 88.2 / 88.3 pinned only when load_run starts (hence the CLI's
    call); 256 ranks 82.9 against 82.7. Wall times within the run-to-run noise."""
    if _MALLOPT is not None:
        _MALLOPT(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
