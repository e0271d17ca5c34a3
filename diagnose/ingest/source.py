"""Read a trace file as a stream of decompressed blocks, bounded in size.

The whole file is never held in memory: the parser consumes it block by block, so a
200 MB trace costs a few blocks plus its parsed columns. gzip is recognised by its
magic bytes, not the suffix (a renamed `.json` that is really gzip still reads),
and concatenated gzip members are read in turn. A gzip stream that ends early or
turns corrupt (a job killed while writing) yields what decompressed cleanly and
marks the read as cut; the parser then salvages up to the last complete event.
"""
from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from diagnose.errors import DiagnoseError

READ_BLOCK = 1 << 20
# Output per decompress call: a 1000x bomb must not expand in one step.
OUT_BLOCK = 4 << 20
GZIP_MAGIC = b"\x1f\x8b"


@dataclass(slots=True)
class ReadState:
    """What the reader learned while streaming; read after the iterator is exhausted."""

    path: Path
    max_bytes: int
    total: int = 0
    """Decompressed bytes handed out so far."""
    cut: str | None = None
    """Why the byte stream ended early (truncated or corrupt gzip), or None."""
    notes: list[str] = field(default_factory=list)
    """Harmless oddities worth a warning (bytes after the gzip data)."""


def human_size(n: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def iter_blocks(state: ReadState) -> Iterator[bytes]:
    """Decompressed blocks of the file; DiagnoseError names the file on any read problem."""
    path = state.path
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below; the generator owns it)
    except OSError as exc:
        raise DiagnoseError(f"cannot read ({exc.strerror or exc})", path) from None
    try:
        with f:
            first = f.read(READ_BLOCK)
            if first[:2] == GZIP_MAGIC:
                yield from _gunzip(f, first, state)
            else:
                yield from _plain(f, first, state)
    except OSError as exc:
        raise DiagnoseError(f"cannot read ({exc.strerror or exc})", path) from None


def _count(state: ReadState, n: int, compressed: bool) -> None:
    state.total += n
    if state.total > state.max_bytes:
        limit = human_size(state.max_bytes)
        if compressed:
            raise DiagnoseError(f"expands beyond the {limit} limit (decompression bomb?); "
                                "raise --max-trace-gb if it is genuine", state.path)
        raise DiagnoseError(f"is larger than the {limit} limit (raise --max-trace-gb)", state.path)


def _plain(f: BinaryIO, first: bytes, state: ReadState) -> Iterator[bytes]:
    block = first
    while block:
        _count(state, len(block), compressed=False)
        yield block
        block = f.read(READ_BLOCK)


def _gunzip(f: BinaryIO, first: bytes, state: ReadState) -> Iterator[bytes]:
    d = zlib.decompressobj(wbits=31)
    pending = first
    while True:
        if not pending:
            pending = f.read(READ_BLOCK)
            if not pending:
                if not d.eof:
                    tail = d.flush()
                    if tail:
                        _count(state, len(tail), compressed=True)
                        yield tail
                    state.cut = "gzip stream ends early (file truncated)"
                return
        try:
            out = d.decompress(pending, OUT_BLOCK)
        except zlib.error as exc:
            if state.total == 0:
                raise DiagnoseError(f"not a valid gzip file ({exc})", state.path) from None
            state.cut = f"gzip data corrupt after {state.total} decompressed bytes ({exc})"
            return
        pending = d.unconsumed_tail
        if out:
            _count(state, len(out), compressed=True)
            yield out
        if d.eof:
            rest = d.unused_data + f.read(READ_BLOCK)
            if not rest.strip(b"\0"):
                return  # padding after the last member is harmless
            if rest[:2] != GZIP_MAGIC:
                state.notes.append("bytes after the end of the gzip data ignored")
                return
            # concatenated members (e.g. appended writes) form one stream
            d = zlib.decompressobj(wbits=31)
            pending = rest
