"""Split a Chrome-trace JSON byte stream into parsed event chunks; salvage truncated files.

Layouts read as a stream: `{..., "traceEvents": [ev, ev, ...], ...}` (Kineto writes
its metadata first and `traceName` after the events) and the bare array `[ev, ...]`.
Anything else is parsed as one document (bounded by the reader's size limit), which is
also where "not JSON" and "JSON but not a trace" are told apart.

Events are cut into ~512 KiB chunks at `}, {` boundaries and parsed with orjson: faster
than one whole-document parse (a chunk's objects die young and their memory is reused)
and memory stays flat. A `}, {` inside a string or nested args is a false boundary: that
chunk then fails to parse and is re-read event by event with the stdlib decoder, which
knows exactly where each event ends. The same slow path finds the end of the array,
skips (and counts) corrupt events, and salvages a truncated file (a killed job): every
event up to the last complete one is kept. Only the final chunk is always read slowly.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from diagnose.errors import DiagnoseError
from diagnose.ingest.jsonsafe import (TooDeep, byte_offset, clean, decode_text, loads, raw_decode)

CHUNK = 512 << 10
HEAD_LIMIT = 64 << 20
"""Metadata before `traceEvents` beyond this: not Kineto's layout; parse the whole document."""
MAX_EVENT = 64 << 20
"""No event boundary within this many bytes: not a trace (and memory stays bounded)."""
SLICE = 50_000
"""Events per sink call on the whole-document path (keeps the sink's batches small)."""

SEP = re.compile(rb"\}\s*,\s*\{")
SEP_TEXT = re.compile(r"\}\s*,\s*\{")
START = re.compile(rb'"traceEvents"\s*:\s*\[')
NONWS = re.compile(rb"[^ \t\r\n]")
NONWS_TEXT = re.compile(r"[^ \t\r\n]")
BOM = b"\xef\xbb\xbf"

Sink = Callable[[list], None]
RawSink = Callable[[bytes], "int | None"]


@dataclass(slots=True)
class StreamResult:
    meta: dict = field(default_factory=dict)
    """Top-level keys other than traceEvents, strings cleaned, nesting bounded."""
    values: int = 0
    """Values handed to the sink (events, before any validation)."""
    bad: int = 0
    """Stretches that could not be parsed as an event, skipped."""
    lenient: bool = False
    """Some events needed the stdlib reader (NaN/Infinity, invalid UTF-8, bad escapes)."""
    invalid_utf8: bool = False
    salvaged: bool = False
    """The event array never closed: the file was cut; events up to the cut are kept."""
    notes: list[str] = field(default_factory=list)


class _Buffer:
    """Bytes not yet parsed, refilled from the block iterator; tracks the file offset."""

    def __init__(self, blocks: Iterator[bytes]) -> None:
        self.blocks = blocks
        self.buf = bytearray()
        self.offset = 0  # file offset of buf[0]
        self.eof = False

    def fill(self) -> bool:
        if self.eof:
            return False
        for block in self.blocks:
            self.buf += block
            return True
        self.eof = True
        return False

    def consume(self, n: int) -> None:
        del self.buf[:n]
        self.offset += n

    def read_all(self) -> bytes:
        while self.fill():
            pass
        return bytes(self.buf)


def parse_stream(blocks: Iterator[bytes], sink: Sink, path: Path, raw_sink: RawSink | None = None) -> StreamResult:
    """Parse a trace's bytes, handing lists of parsed events to sink. Raises DiagnoseError.

    raw_sink, if given, is offered each whole chunk's bytes first; it returns how many events
    it read, or None to have the chunk parsed here and handed to sink."""
    b = _Buffer(blocks)
    try:
        layout, head, start = _find_start(b, path)
        if layout == "other":
            return _whole_document(b, sink, path)
        res = StreamResult()
        b.consume(start)
        _stream_events(b, sink, res, path, raw_sink)
        b.read_all()  # what follows the events: the last chunk and the metadata after them
        _finish(b, head, sink, res, raw_sink)
        return res
    except TooDeep as exc:
        raise DiagnoseError(str(exc), path) from None


def _find_start(b: _Buffer, path: Path) -> tuple[str, bytes | None, int]:
    """('array', None, i) / ('object', head, i) with i just after the '[', or ('other', None, 0)."""
    searched = 0
    while len(b.buf) < len(BOM) and b.fill():
        pass  # a byte order mark must be whole before it can be recognised
    while True:
        skip = len(BOM) if b.buf.startswith(BOM) else 0
        m = NONWS.search(b.buf, skip)
        if m is None:
            if b.fill():
                continue
            raise DiagnoseError("empty file", path)
        c = b.buf[m.start()]
        if c == ord("["):
            return "array", None, m.start() + 1
        if c != ord("{"):
            return "other", None, 0
        s = START.search(b.buf, max(m.start(), searched - 32))
        if s:
            return "object", bytes(b.buf[: s.end() - 1]), s.end()
        searched = len(b.buf)
        if len(b.buf) > HEAD_LIMIT or not b.fill():
            return "other", None, 0


def _split_point(buf: bytearray) -> re.Match | None:
    """The first event boundary after CHUNK bytes, else the last one before."""
    m = SEP.search(buf, CHUNK) if len(buf) > CHUNK else None
    return m if m is not None else _last_sep(buf)


def _last_sep(buf: bytearray) -> re.Match | None:
    lo = max(0, len(buf) - (64 << 10))
    while True:
        last = None
        for last in SEP.finditer(buf, lo):
            pass
        if last is not None or lo == 0:
            return last
        lo = max(0, lo - (1 << 20))


def _fast(chunk: bytes) -> list | None:
    try:
        v = loads(b"[" + chunk + b"]")
    except orjson.JSONDecodeError:
        return None
    return v if isinstance(v, list) else None


def _stream_events(b: _Buffer, sink: Sink, res: StreamResult, path: Path, raw_sink: RawSink | None) -> None:
    """Parse whole chunks until the end of the array (or of the input, less its last chunk,
    which _finish reads exactly)."""
    want = CHUNK
    while True:
        if len(b.buf) < want and b.fill():
            continue
        if b.eof and (len(b.buf) <= CHUNK or want > CHUNK):
            return
        first = NONWS.search(b.buf)
        if first is None:  # whitespace between events: valid, and never worth keeping
            b.consume(len(b.buf))
            continue
        if b.buf[first.start()] == ord("]"):
            return
        m = _split_point(b.buf)
        if m is None:
            _check_event_size(b, path)
            want = len(b.buf) * 2  # one event larger than the buffer: read on
            continue
        chunk = bytes(b.buf[: m.start() + 1])
        n = raw_sink(chunk) if raw_sink is not None else None
        if n is not None:
            res.values += n
            b.consume(m.end() - 1)
            want = CHUNK
            continue
        evs = _fast(chunk)
        if evs is not None:
            _emit(sink, res, evs)
            b.consume(m.end() - 1)
            want = CHUNK
            continue
        if b.eof:
            return
        done, closed = _slow(chunk, sink, res)
        if closed:
            b.consume(done)
            return
        if done == 0:  # the only piece is incomplete (a false boundary): wait for more data
            _check_event_size(b, path)
            want = len(b.buf) * 2
            continue
        b.consume(m.end() - 1 if done == len(chunk) else done)
        want = CHUNK


def _check_event_size(b: _Buffer, path: Path) -> None:
    if len(b.buf) > MAX_EVENT:
        raise DiagnoseError(f"not valid JSON: nothing parseable as an event in {len(b.buf) >> 20} MiB "
                            f"after byte {b.offset} (not a Chrome trace?)", path)


def _emit(sink: Sink, res: StreamResult, evs: list) -> None:
    if evs:
        res.values += len(evs)
        sink(evs)


def _slow(chunk: bytes, sink: Sink, res: StreamResult) -> tuple[int, bool]:
    """Read a chunk event by event: (bytes consumed, whether the event array closed there)."""
    text, bad_utf8 = decode_text(chunk)
    evs, bad, stop, closed = _scan(text)
    res.lenient = True
    res.invalid_utf8 |= bad_utf8
    res.bad += bad
    _emit(sink, res, evs)
    if closed is not None:
        return byte_offset(text, closed), True
    return (len(chunk) if stop is None else byte_offset(text, stop)), False


def _scan(text: str) -> tuple[list, int, int | None, int | None]:
    """Events of text, read one by one: (events, bad, stop, closed).

    stop: index of a trailing piece that does not parse (incomplete), or None.
    closed: index of the ']' closing the event array, or None.
    """
    events: list = []
    bad = 0
    n = len(text)
    m0 = NONWS_TEXT.search(text)
    i = m0.start() if m0 else n
    while i < n:
        if text[i] == "]":
            return events, bad, None, i
        try:
            v, j = raw_decode(text, i)
        except TooDeep:
            raise
        except ValueError as exc:
            nxt = SEP_TEXT.search(text, max(getattr(exc, "pos", i), i))
            if nxt is None:
                return events, bad, i, None
            bad += 1
            i = nxt.end() - 1
            continue
        events.append(v)
        m = NONWS_TEXT.search(text, j)
        i = m.start() if m else n
        if i < n and text[i] == ",":
            m = NONWS_TEXT.search(text, i + 1)
            i = m.start() if m else n
        elif i < n and text[i] not in "{]":
            nxt = SEP_TEXT.search(text, i)
            if nxt is None:
                return events, bad, i, None
            bad += 1
            i = nxt.end() - 1
    return events, bad, None, None


def _finish(b: _Buffer, head: bytes | None, sink: Sink, res: StreamResult, raw_sink: RawSink | None) -> None:
    """The last chunk: its events, the end of the array and the metadata after it."""
    first = NONWS.search(b.buf)
    m = _last_sep(b.buf) if first is not None and b.buf[first.start()] != ord("]") else None
    if m is not None:  # all but the last event the fast way
        chunk = bytes(b.buf[: m.start() + 1])
        n = raw_sink(chunk) if raw_sink is not None else None
        if n is not None:
            res.values += n
            b.consume(m.end() - 1)
        else:
            evs = _fast(chunk)
            if evs is not None:
                _emit(sink, res, evs)
                b.consume(m.end() - 1)
    text, bad_utf8 = decode_text(bytes(b.buf))
    evs, bad, stop, closed = _scan(text)
    res.invalid_utf8 |= bad_utf8
    res.lenient |= bad > 0 or bad_utf8
    res.bad += bad
    _emit(sink, res, evs)
    if closed is None:
        res.salvaged = True
        cut_at = b.offset + (byte_offset(text, stop) if stop is not None else len(b.buf))
        res.notes.append(f"truncated at byte {b.offset + len(b.buf)} (killed job?): events up to byte "
                         f"{cut_at} salvaged")
        res.meta = _meta(head, "}") or {}
        return
    tail = text[closed + 1:]
    if head is None:
        if tail.strip():
            res.notes.append("data after the event array ignored")
        return
    meta = _meta(head, tail)
    if meta is None:
        res.notes.append("metadata after the events is damaged or truncated (ignored)")
        meta = _meta(head, "}") or {}
    res.meta = meta


def _meta(head: bytes | None, tail: str) -> dict | None:
    """The top-level object without its events, or None if head + tail is not one."""
    if head is None:
        return {}
    doc = head + b"[]" + tail.encode("utf-8", "surrogateescape")
    try:
        obj = loads(doc)
    except orjson.JSONDecodeError:
        text, _ = decode_text(doc)
        try:
            obj, end = raw_decode(text, NONWS_TEXT.search(text).start())
        except ValueError:
            return None
        if text[end:].strip():
            return None
    if not isinstance(obj, dict):
        return None
    obj.pop("traceEvents", None)
    return clean(obj)


_JSON_START = frozenset(b'{["-0123456789tfn')


def _whole_document(b: _Buffer, sink: Sink, path: Path) -> StreamResult:
    data = b.read_all()
    if data.startswith(BOM):
        data = data[len(BOM):]
    res = StreamResult()
    first = NONWS.search(data)
    if first is not None and data[first.start()] not in _JSON_START:
        raise DiagnoseError(f"not JSON (begins {data[first.start(): first.start() + 16]!r})", path)
    try:
        obj = loads(data)
    except orjson.JSONDecodeError as exc:
        text, bad_utf8 = decode_text(data)
        try:
            m = NONWS_TEXT.search(text)
            obj, end = raw_decode(text, m.start() if m else 0)
            if text[end:].strip():
                raise ValueError("extra data")
        except TooDeep:
            raise
        except ValueError:
            raise DiagnoseError(f"not valid JSON ({exc.msg} at byte {exc.pos})", path) from None
        res.lenient, res.invalid_utf8 = True, bad_utf8
    if isinstance(obj, list):
        events = obj
    elif isinstance(obj, dict) and isinstance(obj.get("traceEvents"), list):
        events = obj.pop("traceEvents")
        res.meta = clean(obj)
    else:
        raise DiagnoseError("JSON but not a trace (no traceEvents list)", path)
    for i in range(0, len(events), SLICE):
        _emit(sink, res, events[i: i + SLICE])
    return res


def peek(data: bytes) -> tuple[dict, list] | None:
    """The metadata before the events and the whole events among the first bytes of a Kineto
    trace (`data`: its start, cut anywhere), or None where they are not in Kineto's layout.
    For telling files apart before reading them (ingest/windows.py), never for analysis."""
    first, start = NONWS.search(data), START.search(data)
    if first is None or start is None or data[first.start()] != ord("{"):
        return None
    try:
        meta = _meta(data[: start.end() - 1], "}")
    except TooDeep:
        return None
    if meta is None:
        return None
    body = data[start.end():]
    m = _last_sep(bytearray(body))
    if m is None:
        return meta, []
    evs = _fast(body[: m.start() + 1])
    if evs is None:  # a false boundary or a lenient event: read them one by one
        try:
            evs = _scan(decode_text(body[: m.start() + 1])[0])[0]
        except TooDeep:
            return None
    return meta, evs
