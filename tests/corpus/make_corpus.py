"""Generate the corpus of hostile and broken trace inputs (one directory per case).

    python tests/corpus/make_corpus.py OUT_DIR [--pair DIR] [--gpu FILE]

--pair: a real 2-rank CPU trace pair with a straggler on rank 1, as recorded by
    torchrun --nproc_per_node=2 examples/train_ddp.py --trace-dir DIR --pathology straggler
  (default: the one kept in tests/fixtures/cpu_straggler_2rank; `--pair record` records a new one
  into OUT_DIR/_pair, which needs torch).
--gpu: a real GPU trace (default ../shared/traces/hta_nccl_data_rank0of2_a100/nccl_data.json.gz).

Only the recorded pair is committed: every case is derived here from those real traces (or,
for shapes no recorder produces, such as bombs and thousands of tiny steps, written
from scratch). The expected outcome of each case is asserted in tests/test_corpus.py
and documented in docs/bad-input.md.
"""
from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PAIR = ROOT / "tests" / "fixtures" / "cpu_straggler_2rank"
DEFAULT_GPU = ROOT.parent / "shared" / "traces" / "hta_nccl_data_rank0of2_a100" / "nccl_data.json.gz"
XSS = {
    "script": "<script>document.body.dataset.pwned='script'</script>",
    "img": "\"><img src=x onerror=\"document.body.dataset.pwned='img'\">",
    "svg": "'><svg onload=document.body.dataset.pwned='svg'>",
    "close": "</script><script>document.body.dataset.pwned='close'</script>",
}
SKEW_US = 250_000.0
DATALOADER = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"


# -- reading and writing -------------------------------------------------------------------

def read_raw(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def read_doc(path: Path) -> dict:
    return orjson.loads(read_raw(path))


def kineto_bytes(doc: dict) -> bytes:
    """Kineto's layout: metadata first, one event per line, traceName after the events."""
    head = {k: v for k, v in doc.items() if k not in ("traceEvents", "traceName")}
    lines = [b"{"]
    lines += [b'  "%s": %s,' % (k.encode(), orjson.dumps(v)) for k, v in head.items()]
    lines.append(b'  "traceEvents": [')
    lines.append(b",\n".join(b"  " + _dumps(e) for e in doc.get("traceEvents", [])))
    lines.append(b"  ],")
    lines.append(b'  "traceName": %s' % orjson.dumps(doc.get("traceName", "corpus")))
    lines.append(b"}")
    return b"\n".join(lines) + b"\n"


def _dumps(v) -> bytes:
    try:
        return orjson.dumps(v)
    except TypeError:  # integers beyond 64 bits: the stdlib writes them
        return json.dumps(v).encode()


def write(path: Path, data: bytes | dict | list, gz: bool | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, dict):
        data = kineto_bytes(data)
    elif isinstance(data, list):
        data = orjson.dumps(data)
    if gz if gz is not None else path.name.endswith(".gz"):
        data = gzip.compress(data, compresslevel=1)
    path.write_bytes(data)
    return path


def cut_mid_event(raw: bytes, fraction: float) -> bytes:
    """The bytes up to a point inside an event past `fraction` of the file (a killed writer)."""
    at = raw.index(b'"ts":', int(len(raw) * fraction))
    return raw[: at + 3]


def events_of(doc: dict) -> list:
    return doc["traceEvents"]


def shifted(doc: dict, dt: float) -> dict:
    out = orjson.loads(orjson.dumps(doc))
    for e in out["traceEvents"]:
        if isinstance(e.get("ts"), (int, float)):
            e["ts"] += dt
    return out


_PAIR_RAW: dict[Path, list[tuple[str, bytes]]] = {}


_PAIR_DOCS: dict[Path, list[tuple[str, dict]]] = {}


def pair_docs(pair: Path) -> list[tuple[str, dict]]:
    """Fresh copies of the pair's two documents (parsed once: parsing per case was most of the
    corpus's build time). Cases change events and their args in place, never deeper: events and
    the values inside them are copied, the args' own values are shared."""
    if pair not in _PAIR_DOCS:
        _PAIR_DOCS[pair] = [(name, orjson.loads(raw)) for name, raw in pair_raw(pair)]
    return [(name, _copy_doc(doc)) for name, doc in _PAIR_DOCS[pair]]


def _copy_doc(doc: dict) -> dict:
    out = {k: copy.deepcopy(v) for k, v in doc.items() if k != "traceEvents"}
    out["traceEvents"] = [{k: (v.copy() if isinstance(v, (dict, list)) else v) for k, v in e.items()}
                          if isinstance(e, dict) else copy.deepcopy(e) for e in doc.get("traceEvents", [])]
    return out


def pair_raw(pair: Path) -> list[tuple[str, bytes]]:
    """The pair's two files, decompressed, exactly as the profiler wrote them."""
    if pair not in _PAIR_RAW:
        files = sorted(p for p in pair.iterdir() if p.name.endswith((".json", ".json.gz")))
        if len(files) != 2:
            raise SystemExit(f"{pair}: expected 2 trace files, found {len(files)}")
        _PAIR_RAW[pair] = [(f.name, read_raw(f)) for f in files]
    return _PAIR_RAW[pair]


# -- cases ---------------------------------------------------------------------------------

def case_truncated_json(out: Path, pair: Path, gpu: Path | None) -> None:
    (n0, d0), (n1, _) = pair_docs(pair)
    write(out / "rank0.pt.trace.json", d0)
    raw = pair_raw(pair)[1][1]
    (out / "rank1.pt.trace.json").write_bytes(cut_mid_event(raw, 0.85))


def case_truncated_gz(out: Path, pair: Path, gpu: Path | None) -> None:
    (n0, raw0), (n1, raw1) = pair_raw(pair)
    write(out / (n0 if n0.endswith(".gz") else n0 + ".gz"), raw0)
    blob = gzip.compress(raw1, compresslevel=6)
    (out / (n1 if n1.endswith(".gz") else n1 + ".gz")).write_bytes(blob[: int(len(blob) * 0.85)])


def case_truncated_gpu_single(out: Path, pair: Path, gpu: Path | None) -> None:
    raw = read_raw(gpu) if gpu and gpu.exists() else pair_raw(pair)[0][1]
    (out / "rank0.trace.json").write_bytes(cut_mid_event(raw, 0.9))


def case_truncated_before_events(out: Path, pair: Path, gpu: Path | None) -> None:
    raw = pair_raw(pair)[0][1]
    (out / "rank0.json").write_bytes(raw[: raw.index(b'"traceEvents"') + 40])


def case_empty_file(out: Path, pair: Path, gpu: Path | None) -> None:
    (out / "rank0.pt.trace.json").write_bytes(b"")


def case_empty_beside_good(out: Path, pair: Path, gpu: Path | None) -> None:
    (n0, d0), _ = pair_docs(pair)
    write(out / "rank0.pt.trace.json", d0)
    (out / "rank1.pt.trace.json").write_bytes(b"")


def case_zero_events(out: Path, pair: Path, gpu: Path | None) -> None:
    (n0, d0), _ = pair_docs(pair)
    write(out / "rank0.pt.trace.json", {**d0, "traceEvents": []})


def case_only_metadata(out: Path, pair: Path, gpu: Path | None) -> None:
    (n0, d0), _ = pair_docs(pair)
    meta_only = [e for e in events_of(d0) if e.get("ph") in ("M", "i")]
    write(out / "rank0.pt.trace.json", {**d0, "traceEvents": meta_only})


def case_not_json(out: Path, pair: Path, gpu: Path | None) -> None:
    (out / "rank0.pt.trace.json").write_bytes(b"PK\x03\x04 this is a zip, not a trace\x00\xff")


def case_json_not_trace(out: Path, pair: Path, gpu: Path | None) -> None:
    (out / "rank0.pt.trace.json").write_bytes(orjson.dumps({"lr": 0.1, "traceEvents": "nope"}))


def case_list_form(out: Path, pair: Path, gpu: Path | None) -> None:
    for name, d in pair_docs(pair):
        write(out / name.replace(".json.gz", ".json"), events_of(d))


def case_gzip_named_json(out: Path, pair: Path, gpu: Path | None) -> None:
    for name, d in pair_docs(pair):
        write(out / name.replace(".json.gz", ".json"), d, gz=True)


BAD_EVENTS: list = [
    {"ph": "X", "cat": "cpu_op", "name": "ts_as_string", "ts": "5177669090000.0", "dur": 5.0},
    {"ph": "X", "cat": "cpu_op", "name": "negative_dur", "ts": 5177669090000.0, "dur": -5.0},
    {"ph": "X", "cat": "cpu_op", "name": "missing_ts", "dur": 5.0},
    {"ph": "X", "cat": "cpu_op", "name": "missing_dur", "ts": 5177669090000.0},
    {"ph": "X", "cat": "cpu_op", "name": 12345, "ts": 5177669090000.0, "dur": 5.0},
    {"ph": "X", "cat": "cpu_op", "name": "bool_ts", "ts": True, "dur": 5.0},
    {"ph": "X", "cat": "cpu_op", "name": "null_dur", "ts": 5177669090000.0, "dur": None},
    {"ph": "X", "cat": "cpu_op", "name": "huge_int_ts", "ts": 10**30, "dur": 10**400},
    42,
    "an event that is a string",
    None,
    [1, 2, 3],
]
N_BAD = len(BAD_EVENTS)
# Not malformed (kept): odd but usable field types.
ODD_EVENTS: list = [
    {"ph": "X", "cat": "cpu_op", "name": "tid_is_a_list", "ts": 5177669090000.0, "dur": 1.0, "tid": [1, 2],
     "pid": {"x": 1}, "args": ["not", "a", "dict"]},
    {"ph": "X", "cat": ["unhashable"], "name": "cat_is_a_list", "ts": 5177669090000.0, "dur": 1.0},
]


def case_bad_fields(out: Path, pair: Path, gpu: Path | None) -> None:
    for name, d in pair_docs(pair):
        d = {**d, "traceEvents": events_of(d) + BAD_EVENTS + ODD_EVENTS}
        raw = kineto_bytes(d)
        # NaN and Infinity as Python's json.dump writes them (not valid JSON, but seen in the wild)
        raw = raw.replace(b'"traceEvents": [\n', b'"traceEvents": [\n'
                          b'  {"ph": "X", "cat": "cpu_op", "name": "nan_ts", "ts": NaN, "dur": 1.0},\n'
                          b'  {"ph": "X", "cat": "cpu_op", "name": "inf_dur", "ts": 1.0, "dur": Infinity},\n', 1)
        (out / name.replace(".gz", "")).write_bytes(raw)


N_BAD_WITH_NAN = N_BAD + 2


def case_unknown_categories(out: Path, pair: Path, gpu: Path | None) -> None:
    extra = [{"ph": "X", "cat": "my_custom_category", "name": "x", "ts": 5177669090000.0, "dur": 1.0},
             {"ph": "X", "name": "no_category", "ts": 5177669090000.0, "dur": 1.0},
             {"ph": "X", "cat": "python_function", "name": "known_but_unused", "ts": 5177669090000.0, "dur": 1.0},
             {"ph": "Q", "cat": "cpu_op", "name": "unknown_phase", "ts": 5177669090000.0, "dur": 1.0}]
    for name, d in pair_docs(pair):
        write(out / name, {**d, "traceEvents": events_of(d) + extra})


def _without_steps(d: dict) -> dict:
    keep = [e for e in events_of(d) if not str(e.get("name", "")).startswith(("ProfilerStep#", "Optimizer.step#"))]
    return {**d, "traceEvents": keep}


def case_no_steps(out: Path, pair: Path, gpu: Path | None) -> None:
    for name, d in pair_docs(pair):
        write(out / name, _without_steps(d))


def case_no_steps_one_rank(out: Path, pair: Path, gpu: Path | None) -> None:
    (n0, d0), (n1, d1) = pair_docs(pair)
    write(out / n0, d0)
    write(out / n1, _without_steps(d1))


def case_single_step(out: Path, pair: Path, gpu: Path | None) -> None:
    for name, d in pair_docs(pair):
        steps = sorted({e["name"] for e in events_of(d) if str(e.get("name", "")).startswith("ProfilerStep#")})
        keep = steps[1]  # a full middle step: the last one may be partial
        evs = [e for e in events_of(d) if not str(e.get("name", "")).startswith("ProfilerStep#") or e["name"] == keep]
        write(out / name, {**d, "traceEvents": evs})


def case_thousands_of_steps(out: Path, pair: Path, gpu: Path | None, n_steps: int = 3000) -> None:
    """Tiny steps written from scratch: 2 ranks, DataLoader, ops, a gloo all-reduce per step."""
    for rank in (0, 1):
        evs: list = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "main"}}]
        t = 1_000_000.0
        for s in range(n_steps):
            late = 300.0 if rank == 1 else 0.0  # rank 1 arrives late: a straggler
            evs += [
                {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "ts": t, "dur": 1000.0,
                 "pid": 1, "tid": 1},
                {"ph": "X", "cat": "user_annotation", "name": DATALOADER, "ts": t + 10, "dur": 100.0,
                 "pid": 1, "tid": 1},
                {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": t + 120, "dur": 300.0 + late,
                 "pid": 1, "tid": 1},
                {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": t + 430 + late, "dur": 20.0,
                 "pid": 1, "tid": 1},
                {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "ts": t + 440 + late,
                 "dur": 760.0 - 440 - late + 200, "pid": 1, "tid": 2},
                {"ph": "X", "cat": "cpu_op", "name": "Optimizer.step#SGD.step", "ts": t + 900, "dur": 50.0,
                 "pid": 1, "tid": 1},
            ]
            t += 1000.0
        doc = {"schemaVersion": 1, "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 2},
               "host_name": "corpus", "traceEvents": evs}
        write(out / f"rank{rank}.pt.trace.json.gz", doc)


def case_mixed_world_sizes(out: Path, pair: Path, gpu: Path | None) -> None:
    (n0, d0), (n1, d1) = pair_docs(pair)
    write(out / n0, d0)
    d1 = d1
    d1["distributedInfo"]["world_size"] = 4
    write(out / n1, d1)


def case_mixed_runs(out: Path, pair: Path, gpu: Path | None) -> None:
    """Rank 0 of one run and rank 1 of a run an hour later (new trace ids, same world size)."""
    (n0, d0), (n1, d1) = pair_docs(pair)
    write(out / n0, d0)
    later = shifted(d1, 3600e6)
    later["trace_id"] = "0" * 32
    write(out / n1.replace("rank1.", "rank1.later."), later)


def case_duplicate_ranks(out: Path, pair: Path, gpu: Path | None) -> None:
    (n0, d0), (n1, d1) = pair_docs(pair)
    write(out / n0, d0)
    write(out / n1, d1)
    write(out / ("rank0.copy." + n0.split(".", 1)[1]), d0)


def case_missing_ranks(out: Path, pair: Path, gpu: Path | None) -> None:
    for name, d in pair_docs(pair):
        d["distributedInfo"]["world_size"] = 4
        write(out / name, d)


def case_clock_skew(out: Path, pair: Path, gpu: Path | None) -> None:
    """Rank 1 on another host whose clock runs SKEW_US ahead."""
    (n0, d0), (n1, d1) = pair_docs(pair)
    write(out / n0, {**d0, "host_name": "node-a"})
    write(out / n1, {**shifted(d1, SKEW_US), "host_name": "node-b"})


def case_recursion_bomb(out: Path, pair: Path, gpu: Path | None) -> None:
    (out / "rank0.pt.trace.json").write_bytes(b'{"traceEvents": [' + b"[" * 200_000 + b"]" * 200_000 + b"]}")


def case_recursion_bomb_in_event(out: Path, pair: Path, gpu: Path | None) -> None:
    (n0, d0), _ = pair_docs(pair)
    raw = kineto_bytes(d0)
    bomb = b'  {"ph": "X", "cat": "cpu_op", "name": "deep", "ts": 1.0, "dur": 1.0, "args": ' + \
        b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"},\n"
    at = raw.index(b'  {"ph"')
    write(out / "rank0.pt.trace.json.gz", raw[:at] + bomb + raw[at:])


def case_decompression_bomb(out: Path, pair: Path, gpu: Path | None) -> None:
    """A .gz that expands 1000x: 64 gzip members of 16 MiB of spaces each (1 GiB), ~1 MiB on disk."""
    member = gzip.compress(b" " * (16 << 20), compresslevel=9)
    with open(out / "rank0.pt.trace.json.gz", "wb") as f:
        f.write(gzip.compress(b'{"traceEvents": ['))
        for _ in range(64):
            f.write(member)
        f.write(gzip.compress(b"]}"))


def case_huge_strings(out: Path, pair: Path, gpu: Path | None) -> None:
    big = "x" * (8 << 20)
    for name, d in pair_docs(pair):
        evs = list(events_of(d))
        step = next(e for e in evs if str(e.get("name", "")).startswith("ProfilerStep#"))
        evs.append({"ph": "X", "cat": "cpu_op", "name": "aten::" + big, "ts": step["ts"] + 1, "dur": 1.0,
                    "pid": step.get("pid"), "tid": step.get("tid"), "args": {"Input Dims": [[1]], "note": big}})
        write(out / name, {**d, "traceEvents": evs, "traceName": big, "host_name": "h" * 100_000})


def case_non_utf8(out: Path, pair: Path, gpu: Path | None) -> None:
    for name, d in pair_docs(pair):
        raw = kineto_bytes({**d, "host_name": "host-\u00e9"})
        raw = raw.replace("host-\u00e9".encode(), b"host-\xff\xfe")  # invalid UTF-8 in metadata
        raw = raw.replace(b'"name": "aten::mm"', b'"name": "aten::mm\xc3\x28"', 3)  # ... and in op names
        raw = raw.replace(b'"aten::mm"', b'"aten::mm\xc3\x28"', 3)
        raw = raw.replace(b'"aten::addmm"', b'"aten::addmm\\ud800"', 3)  # a lone surrogate escape
        (out / name.replace(".gz", "")).write_bytes(raw)


def case_hostile_names(out: Path, pair: Path, gpu: Path | None) -> None:
    """Op, collective, DataLoader, host and device names carrying HTML/JS payloads."""
    rename = {
        "gloo:all_reduce": "gloo:all_reduce" + XSS["script"],
        "c10d::allreduce_": "c10d::allreduce_" + XSS["img"],
        "aten::mm": "aten::mm" + XSS["svg"],
    }
    for name, d in pair_docs(pair):
        for e in events_of(d):
            n = e.get("name")
            if n in rename:
                e["name"] = rename[n]
            elif isinstance(n, str) and n.startswith("enumerate(DataLoader)#"):
                e["name"] = "enumerate(DataLoader)#" + XSS["close"] + "__next__"
        d["host_name"] = XSS["img"]
        d["deviceProperties"] = []
        d["distributedInfo"]["backend"] = "gloo"
        write(out / name, d)


def case_stray_json_beside_traces(out: Path, pair: Path, gpu: Path | None) -> None:
    for name, d in pair_docs(pair):
        write(out / name, d)
    (out / "hparams.json").write_bytes(b'{"lr": 0.1}')
    (out / "notes.json").write_bytes(b"not json at all")


CASES: dict[str, Callable[[Path, Path, Path | None], None]] = {
    name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_") and callable(fn)
}


def record_pair(out: Path, timeout: float = 180) -> Path:
    """Record the real 2-rank straggler pair with torchrun (CPU, gloo)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           str(ROOT / "examples" / "train_ddp.py"), "--trace-dir", str(out), "--pathology", "straggler"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if res.returncode != 0:
        raise RuntimeError(f"recording the pair failed: {res.stderr[-2000:]}")
    return out


def make_corpus(out: Path, pair: Path, gpu: Path | None = DEFAULT_GPU,
                only: list[str] | None = None) -> dict[str, Path]:
    """Write every case (or `only` these) under out/<case>/; returns case -> directory."""
    made = {}
    for name, build in CASES.items():
        if only and name not in only:
            continue
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        build(d, pair, gpu)
        made[name] = d
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--pair", default=str(DEFAULT_PAIR),
                    help="real 2-rank straggler trace pair, or 'record' to record one")
    ap.add_argument("--gpu", type=Path, default=DEFAULT_GPU)
    ap.add_argument("--only", nargs="*", help="case names")
    args = ap.parse_args(argv)
    pair = record_pair(args.out / "_pair") if args.pair == "record" else Path(args.pair)
    for name, d in make_corpus(args.out, pair, args.gpu if args.gpu.exists() else None, args.only).items():
        print(f"{name:32s} {d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
