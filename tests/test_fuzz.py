"""Fuzz the reader for a bounded time: random bytes and mutated real traces.

Only DiagnoseError may escape `load_trace` and `load_run`, and the reader's catch-all
("internal error") must never be what turned a crash into an error. The time budget is
DIAGNOSE_FUZZ_SECONDS (default 8 s in the suite; run it longer by hand); the seed is fixed unless DIAGNOSE_FUZZ_SEED is set,
and a failing input is written to the test's temporary directory to reproduce it.
"""
from __future__ import annotations

import gzip
import os
import random
import time

import pytest

from diagnose.errors import DiagnoseError
from diagnose.ingest.load import load_trace
from diagnose.analyzers import reduce_rank
from diagnose.ingest.assemble import INTERNAL_ERROR, ReduceFailed, load_run
from tests.conftest import SHARED

BUDGET_S = float(os.environ.get("DIAGNOSE_FUZZ_SECONDS", "8"))
SEED = int(os.environ.get("DIAGNOSE_FUZZ_SEED", "1234"))
SEEDS = ["edge_hta_cpu_only_gloo_rank34of300", "edge_hta_no_distributedinfo", "hta_sampled_2rank_of128"]
TOKENS = [b"{", b"}", b"[", b"]", b",", b":", b'"', b"\\", b"NaN", b"-Infinity", b"1e999", b"null", b"\xff",
          b"\xc3", b"\\ud800", b'"traceEvents"', b'"ph": "X"', b'"ts": ', b'"dur": -1', b"}, {", b"\x1f\x8b",
          b"[" * 600, b"{\"a\":" * 600, b" " * 1000, b"\x00"]


def seed_traces() -> list[bytes]:
    out = [
        b'{"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": [\n'
        b'  {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 10.0, "dur": 100.0,'
        b' "pid": 1, "tid": 1},\n'
        b'  {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 20.0, "dur": 30.0, "pid": 1, "tid": 1,'
        b' "args": {"External id": 3}},\n'
        b'  {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", "ts": 110.0, "dur": 100.0,'
        b' "pid": 1, "tid": 1}\n'
        b'  ],\n  "traceName": "t"}\n',
    ]
    for name in SEEDS:
        d = SHARED / name
        if d.exists():
            for f in sorted(d.glob("*.gz"))[:1]:
                raw = gzip.decompress(f.read_bytes())
                out.append(raw[:200_000] if len(raw) > 200_000 else raw)
    return out


def mutate(rnd: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rnd.randint(1, 6)):
        op = rnd.randrange(7)
        i = rnd.randrange(len(b) + 1)
        if op == 0 and b:  # flip bits
            j = min(i, len(b) - 1)
            b[j] ^= 1 << rnd.randrange(8)
        elif op == 1:  # insert a token
            b[i:i] = rnd.choice(TOKENS)
        elif op == 2:  # delete a span
            del b[i: i + rnd.randint(1, 200)]
        elif op == 3:  # truncate (a killed job)
            del b[i:]
        elif op == 4 and b:  # duplicate a span
            j = rnd.randrange(len(b))
            b[i:i] = b[j: j + rnd.randint(1, 500)]
        elif op == 5:  # random bytes
            b[i:i] = rnd.randbytes(rnd.randint(1, 64))
        else:  # swap a structural character
            for _ in range(3):
                j = rnd.randrange(len(b)) if b else 0
                if b and b[j: j + 1] in (b"{", b"}", b"[", b"]", b",", b":", b'"'):
                    b[j: j + 1] = rnd.choice([b"{", b"}", b"[", b"]", b",", b":", b'"', b""])
                    break
    return bytes(b)


def encode(rnd: random.Random, data: bytes) -> tuple[str, bytes]:
    choice = rnd.randrange(4)
    if choice == 0:
        return "rank0.pt.trace.json", data
    z = gzip.compress(data, 1)
    if choice == 1:
        return "rank0.pt.trace.json.gz", z
    if choice == 2:  # a cut or corrupted gzip stream
        cut = bytearray(z[: rnd.randrange(len(z) + 1)])
        if cut and rnd.random() < 0.5:
            cut[rnd.randrange(len(cut))] ^= 0xFF
        return "rank0.pt.trace.json.gz", bytes(cut)
    return "rank0.json", z  # gzip under a .json name


def test_fuzz_loader(tmp_path):
    rnd = random.Random(SEED)
    seeds = seed_traces()
    deadline = time.monotonic() + BUDGET_S
    runs = 0
    while time.monotonic() < deadline:
        runs += 1
        if rnd.random() < 0.05:
            data = rnd.randbytes(rnd.randint(0, 4096))
        else:
            data = rnd.choice(seeds)
            for _ in range(rnd.randint(1, 3)):
                data = mutate(rnd, data)
        name, blob = encode(rnd, data)
        path = tmp_path / name
        path.write_bytes(blob)
        try:
            load_trace(path, max_bytes=64 << 20)
            if runs % 10 == 0:
                run_dir = tmp_path / f"run{runs}"
                run_dir.mkdir()
                (run_dir / "rank0.pt.trace.json").write_bytes(seeds[0])
                (run_dir / "rank1.pt.trace.json").write_bytes(blob if name.endswith(".json") else data)
                run = load_run([run_dir], jobs=1, reduce=reduce_rank)
                assert not any(INTERNAL_ERROR in s for s in run.skipped + run.warnings), run.skipped
                failed = [f for fs in run.facts.values() for f in fs.values() if isinstance(f, ReduceFailed)]
                assert not failed, failed
        except DiagnoseError as exc:
            assert INTERNAL_ERROR not in str(exc), str(exc)
            assert "\n" not in str(exc)
        except BaseException:
            keep = tmp_path / f"failing-{runs}-{name}"
            keep.write_bytes(blob)
            pytest.fail(f"seed {SEED}, run {runs}: input kept at {keep}", pytrace=True)
        finally:
            path.unlink(missing_ok=True)
    assert runs > 50
