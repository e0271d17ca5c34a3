"""JSON parsing that survives hostile input: nesting bombs, invalid UTF-8, NaN.

- orjson before 3.9.15 recurses without a limit and overflows the C stack on deeply
  nested input (CVE-2024-27454: a segfault, not an exception). Where that orjson is
  installed, a document is depth-checked first unless it cannot nest deep enough to
  overflow: its count of '[' and '{' bounds its depth, and orjson 3.8 uses at most
  ~160 bytes of stack per level (measured: 8 MiB overflows past ~50,000 nested objects),
  so a count under stack/512 is safe with a 3x margin. The exact check is vectorised
  (numpy over the structural characters only).
- The lenient reader (stdlib json, per event) accepts what Python's own `json.dump`
  writes but orjson refuses: NaN/Infinity, and invalid UTF-8 bytes (read via
  surrogateescape, then replaced by U+FFFD so no lone surrogate reaches an output
  encoder).
"""
from __future__ import annotations

import json
import re
import threading

import numpy as np
import orjson

MAX_DEPTH = 512
"""Deeper than any trace (Kineto nests about 6 levels); a recursion bomb beyond."""


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


ORJSON_BOUNDS_DEPTH = _version(getattr(orjson, "__version__", "0")) >= (3, 9, 15)

_STRUCTURAL = b'"[]{}'
_NOT_STRUCTURAL = bytes(sorted(set(range(256)) - set(_STRUCTURAL)))
_STEP = np.zeros(256, dtype=np.int8)
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1
_SURROGATE = re.compile("[\ud800-\udfff]")
_DECODER = json.JSONDecoder()


class TooDeep(ValueError):
    """The document nests deeper than MAX_DEPTH."""


def max_depth(data: bytes) -> int:
    """Deepest bracket nesting outside strings (exact; escapes honoured)."""
    if b"\\" in data:
        # an escaped backslash, then an escaped quote, cannot open or close a string
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    s = np.frombuffer(data.translate(None, _NOT_STRUCTURAL), dtype=np.uint8)
    if s.size == 0:
        return 0
    inside = (np.cumsum(s == 34, dtype=np.int64) & 1).astype(bool)
    step = np.where(inside, 0, _STEP[s]).astype(np.int32)
    return int(np.cumsum(step).max(initial=0))


def _safe_openers() -> int:
    """How many '[' and '{' orjson < 3.9.15 can nest on this thread's stack, with margin."""
    if threading.current_thread() is not threading.main_thread():
        return (256 << 10) // 512  # a thread's stack size is not known here: assume a small one
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
        if soft == resource.RLIM_INFINITY or soft <= 0:
            soft = 8 << 20  # grows on demand: Linux's usual limit is the least it can count on
    except (ImportError, OSError, ValueError):
        soft = 1 << 20  # Windows: the main thread gets 1 MiB
    return soft // 512


def check_depth(data: bytes) -> None:
    if ORJSON_BOUNDS_DEPTH:
        return  # orjson refuses deep nesting itself
    openers = data.count(b"[") + data.count(b"{")
    if openers <= MAX_DEPTH or openers <= _safe_openers():
        return  # cannot nest deep enough to hurt orjson; deep values are cut where kept (`clean`)
    if max_depth(data) > MAX_DEPTH:
        raise TooDeep(f"JSON nested deeper than {MAX_DEPTH} levels (not a trace; a recursion bomb?)")


def loads(data: bytes):
    """orjson.loads behind the depth check. Raises TooDeep or orjson.JSONDecodeError."""
    check_depth(data)
    return orjson.loads(data)


def clean_str(s: str) -> str:
    """Lone surrogates (from invalid UTF-8 or `\\udXXX` escapes) become U+FFFD."""
    if _SURROGATE.search(s) is None:
        return s
    return s.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


KEEP_DEPTH = 32
"""Values kept from a trace (metadata, collective args) are cut below this depth, so
that pickling them to and from worker processes can never hit the recursion limit."""


def clean(obj, depth: int = 0):
    """A copy of a parsed value with every string cleaned and nesting cut at KEEP_DEPTH."""
    if isinstance(obj, str):
        return clean_str(obj)
    if depth >= KEEP_DEPTH:
        return None
    if isinstance(obj, dict):
        return {clean_str(k): clean(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clean(v, depth + 1) for v in obj]
    return obj


def decode_text(data: bytes) -> tuple[str, bool]:
    """Text of the bytes, and whether any byte was invalid UTF-8 (kept as surrogates)."""
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", "surrogateescape"), True


def byte_offset(text: str, i: int) -> int:
    """Offset in the original bytes of character i of a decode_text result."""
    return len(text[:i].encode("utf-8", "surrogateescape"))


def raw_decode(text: str, i: int):
    """One JSON value at text[i:] with the stdlib decoder: (value, end).

    Raises ValueError (including RecursionError's replacement TooDeep) on bad input.
    """
    try:
        return _DECODER.raw_decode(text, i)
    except RecursionError:
        raise TooDeep("JSON nested deeper than the parser allows (not a trace; a recursion bomb?)") from None
