"""diagnose/heap.py: the client's C heap. Each case in a fresh interpreter: the threshold
is the process's, and what it was before is part of what is checked."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

# a freed 8 MiB mapped block raises glibc's threshold past it; then a 512 KiB block: mapped or not?
PROBE = """
import ctypes, sys
import numpy as np
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                  "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "pinned":
    from diagnose.heap import keep_large_blocks_mapped
    keep_large_blocks_mapped()
if sys.argv[1] == "cli":  # any command: the group pins it first (here its help alone: no analysis)
    from click.testing import CliRunner
    from diagnose.cli import main
    assert CliRunner().invoke(main, ["analyze", "--help"]).exit_code == 0
a = np.ones(1 << 20)
del a
before = libc.mallinfo2().hblkhd
b = np.ones(1 << 16)
print(libc.mallinfo2().hblkhd - before)
"""


def _mapped_bytes(case: str) -> int:
    # glibc's MALLOC_* variables (Dask sets one for its workers) fix the threshold by themselves
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE, case], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc 2.33+ only (mallinfo2)")
def test_large_blocks_stay_mapped_after_a_bigger_one_was_freed():
    assert _mapped_bytes("climbing") == 0  # glibc's own behaviour: the heap takes it (what the pin is for)
    assert _mapped_bytes("pinned") >= 512 * 1024  # mapped, so freeing it gives it back whole
    assert _mapped_bytes("cli") >= 512 * 1024  # `diagnose` pins it at its start


def test_without_glibc_nothing_is_called(monkeypatch):
    import diagnose.heap as heap

    monkeypatch.setattr(heap, "_MALLOPT", None)
    monkeypatch.setattr(heap, "_MALLOC_TRIM", None)
    heap.keep_large_blocks_mapped()
    heap.give_back_freed()
