"""Property-based tests: random small traces through the whole pipeline.

Pipeline: Hypothesis draws the shape of a run (1-3 ranks, 0-6 steps, GPU or CPU/gloo,
which activity exists, how much it overlaps and spills outside the steps, malformed
events) and a seed from which the events are laid out. Invariants, on every example:
- nothing but DiagnoseError escapes `diagnose_paths`, and no reader or check fails inside;
- each step's breakdown components are non-negative and sum to the step time;
- every finding's recoverable time is at most the longest step, its share in [0, 1];
- the same input gives the same diagnosis.
A pipeline example costs about 0.1 s (pandas per-call overhead in the timeline and the
checks), so these run about a hundred examples.

Reader: lists of valid and malformed events, written in every layout the reader accepts,
must load to exactly the events an independent oracle keeps; cut anywhere (a killed job),
to exactly the complete events before the cut. These run hundreds of examples.

The example counts keep the fast suite under its 3-minute budget; DIAGNOSE_PROPERTY_SCALE=4
(or more) runs the deeper search by hand (examples are derandomised: the same ones each run).
"""
from __future__ import annotations

import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diagnose.errors import DiagnoseError
from diagnose.output import diagnosis_dict
from diagnose.pipeline import diagnose_paths

SCALE = float(os.environ.get("DIAGNOSE_PROPERTY_SCALE", "1"))


def examples(n: int) -> int:
    return max(1, round(n * SCALE))

DL = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
CPU_OPS = ["aten::mm", "aten::addmm", "aten::relu", "aten::add_", "Optimizer.step#SGD.step", "aten::copy_"]
KERNELS = ["void gemm_kernel<float>", "elementwise_kernel", "Memcpy HtoD (Pageable -> Device)"]
NCCL = ["ncclKernel_AllReduce_RING_LL_Sum_float", "ncclDevKernel_AllGather_RING_LL"]


@dataclass(frozen=True)
class Shape:
    ranks: int
    steps: int
    gpu: bool
    dataloader: bool
    ops: int
    kernels: int
    collectives: int
    spill: bool
    """Events that start before or end after their step (and steps that touch)."""
    malformed: int
    straggler: float
    seed: int


shapes = st.builds(
    Shape,
    ranks=st.integers(1, 3),
    steps=st.integers(0, 6),
    gpu=st.booleans(),
    dataloader=st.booleans(),
    ops=st.integers(0, 8),
    kernels=st.integers(0, 8),
    collectives=st.integers(0, 4),
    spill=st.booleans(),
    malformed=st.integers(0, 3),
    straggler=st.sampled_from([0.0, 0.0, 50.0, 400.0]),
    seed=st.integers(0, 2**32 - 1),
)


def _x(cat: str, name: str, ts: float, dur: float, tid, **args) -> dict:
    e = {"ph": "X", "cat": cat, "name": name, "ts": round(ts, 3), "dur": round(dur, 3), "pid": 1, "tid": tid}
    if args:
        e["args"] = args
    return e


def rank_events(shape: Shape, rank: int) -> list:
    rnd = random.Random(shape.seed * 7 + rank)
    evs: list = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "main"}}]
    t = 1_000_000.0 + rnd.uniform(0, 20)
    late = shape.straggler if rank == shape.ranks - 1 and shape.ranks > 1 else 0.0
    corr = 0
    for s in range(shape.steps):
        length = rnd.uniform(200, 3000) + late
        evs.append(_x("user_annotation", f"ProfilerStep#{s + 3}", t, length, 1))
        lo, hi = (t - 50, t + length + 50) if shape.spill else (t, t + length)

        def span(max_frac: float = 0.4) -> tuple[float, float]:
            a = rnd.uniform(lo, hi)
            return a, rnd.choice([0.0, rnd.uniform(0, length * max_frac)])

        if shape.dataloader:
            a, d = span(0.5)
            evs.append(_x("user_annotation", DL, a, d, 1))
        for _ in range(shape.ops):
            a, d = span()
            evs.append(_x("cpu_op", rnd.choice(CPU_OPS), a, d, rnd.choice([1, 1, 2]), **{"External id": corr}))
            corr += 1
        if shape.gpu:
            for _ in range(shape.kernels):
                a, d = span(0.2)
                evs.append(_x("cuda_runtime", "cudaLaunchKernel", a, 5.0, 1, correlation=corr))
                cat = "gpu_memcpy" if rnd.random() < 0.2 else "kernel"
                evs.append(_x(cat, rnd.choice(KERNELS), a + rnd.uniform(0, 30), d, 7, correlation=corr))
                corr += 1
            for c in range(shape.collectives):
                a = t + length * (c + 1) / (shape.collectives + 2) + late * 0.5
                evs.append(_x("kernel", rnd.choice(NCCL), a, rnd.uniform(1, length * 0.3), 20,
                              **{"Collective name": "allreduce", "In msg nelems": rnd.randint(1, 10**6),
                                 "dtype": "Float", "Process Group Name": "0"}))
        else:
            for c in range(shape.collectives):
                a = t + length * (c + 1) / (shape.collectives + 2) + late * 0.5
                evs.append(_x("cpu_op", "c10d::allreduce_", a, rnd.uniform(1, 20), 1,
                              **{"Input Dims": [[rnd.randint(1, 4096)]], "Input type": ["float"]}))
                evs.append(_x("user_annotation", "gloo:all_reduce", a + 2, rnd.uniform(1, length * 0.3), 3))
        t += length + rnd.choice([0.0, rnd.uniform(1, 500)])
    bad = [{"ph": "X", "cat": "cpu_op", "name": "bad", "ts": "1", "dur": 1},
           {"ph": "X", "cat": "cpu_op", "name": "bad", "ts": 1.0, "dur": -1.0},
           {"ph": "X", "cat": "kernel", "name": None, "ts": 1.0, "dur": 1.0}]
    evs += bad[: shape.malformed]
    rnd.shuffle(evs)  # file order carries no meaning the analysis may rely on
    return evs


def write_run(shape: Shape, directory: Path) -> None:
    for r in range(shape.ranks):
        doc = {"schemaVersion": 1, "deviceProperties": [{"name": "GPU"}] if shape.gpu else [],
               "distributedInfo": {"backend": "nccl" if shape.gpu else "gloo", "rank": r,
                                   "world_size": shape.ranks},
               "host_name": "node", "traceEvents": rank_events(shape, r)}
        (directory / f"rank{r}.pt.trace.json").write_bytes(orjson.dumps(doc))


def diagnose_shape(shape: Shape):
    with tempfile.TemporaryDirectory() as d:
        write_run(shape, Path(d))
        try:
            return diagnose_paths([d], jobs=1)
        except DiagnoseError:
            return None


@settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(shapes)
def test_invariants(shape):
    d = diagnose_shape(shape)
    if d is None:
        return  # a clear refusal is an allowed outcome (no steps, no usable events)
    said = " ".join(d.warnings + d.skipped)
    assert "internal error" not in said, said
    assert "failed on this input" not in said, said
    max_step = 0.0
    for b in d.breakdown:
        parts = [b.compute_ms, b.exposed_comm_ms, b.straggler_wait_ms, b.dataloader_ms, b.other_ms]
        assert min(parts) >= -1e-9, b
        assert abs(sum(parts) - b.step_ms) <= 1e-6 * max(b.step_ms, 1.0), b
        max_step = max(max_step, b.step_ms)
    for f in d.findings:
        assert 0 <= f.recoverable_ms <= max_step + 1e-6, f
        assert 0 <= f.share_of_step <= 1, f
    assert {c.status for c in d.checks} <= {"flagged", "passed", "not_measurable"}


@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(shapes)
def test_deterministic(shape):
    a, b = diagnose_shape(shape), diagnose_shape(shape)
    assert (a is None) == (b is None)
    if a is not None:
        da, db = diagnosis_dict(a), diagnosis_dict(b)
        da["run"].pop("files"), db["run"].pop("files")  # temporary directories differ
        opt = orjson.OPT_SERIALIZE_NUMPY
        assert orjson.dumps(da, option=opt) == orjson.dumps(db, option=opt)


# -- the reader ----------------------------------------------------------------------------

CATS = ["cpu_op", "kernel", "cuda_runtime", "user_annotation", "gpu_memcpy", "Operator", "python_function",
        "weird", None]
numbers = st.one_of(st.floats(allow_nan=False, allow_infinity=False, width=64), st.integers(-2**53, 2**53))
events = st.one_of(
    st.fixed_dictionaries({
        "ph": st.sampled_from(["X", "X", "X", "M", "i", "s", "f"]),
        "cat": st.sampled_from(CATS),
        "name": st.one_of(st.text(max_size=12), st.sampled_from(["aten::mm", "ncclKernel_AllReduce", "gloo:all_reduce",
                                                                  "c10d::allreduce_", "<script>x</script>"]),
                          st.none(), st.integers()),
        "ts": st.one_of(numbers, st.text(max_size=4), st.none(), st.booleans()),
        "dur": st.one_of(numbers, st.none()),
        "tid": st.one_of(st.integers(0, 3), st.text(max_size=3), st.lists(st.integers(), max_size=2)),
        "pid": st.one_of(st.integers(0, 2), st.just("Traces")),
        "args": st.one_of(st.none(), st.fixed_dictionaries({"correlation": st.integers(-5, 2**70),
                                                            "External id": st.integers(0, 100)})),
    }),
    st.integers(), st.text(max_size=5), st.none(), st.lists(st.integers(), max_size=3),
)


def kept(e) -> bool:
    """The oracle: what the reader must keep, stated independently of its code."""
    from diagnose.ingest.columns import CATEGORY_KIND

    def num(v):
        return type(v) in (int, float) and abs(v) < float("inf")

    return (isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") in CATEGORY_KIND
            and isinstance(e.get("name"), str) and num(e.get("ts")) and num(e.get("dur")) and e["dur"] >= 0)


def _dumps(v) -> bytes:
    try:
        return orjson.dumps(v)
    except TypeError:  # integers beyond 64 bits
        import json

        return json.dumps(v).encode()


def serialise(evs: list, layout: str) -> tuple[bytes, list[int]]:
    """The file's bytes and, per event, the offset just past it."""
    head = {"object": b'{"schemaVersion": 1, "traceEvents": [\n', "list": b"[\n", "compact": b'{"traceEvents":['}
    sep = b"," if layout == "compact" else b",\n  "
    out, ends = bytearray(head[layout]), []
    for i, e in enumerate(evs):
        if i:
            out += sep
        out += _dumps(e)
        ends.append(len(out))
    out += {"object": b'\n],\n"traceName": "x"}\n', "list": b"\n]\n", "compact": b"]}"}[layout]
    return bytes(out), ends


def load(data: bytes, gz: bool):
    import gzip

    from diagnose.ingest.load import load_trace

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / ("rank0.json.gz" if gz else "rank0.json")
        p.write_bytes(gzip.compress(data, 1) if gz else data)
        return load_trace(p)


def _names(trace) -> list[str]:
    return trace.events["name"].astype(str).tolist()


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(st.lists(events, max_size=30), st.sampled_from(["object", "list", "compact"]), st.booleans())
def test_reader_keeps_exactly_the_valid_events(evs, layout, gz):
    from diagnose.ingest.jsonsafe import clean_str

    data, _ = serialise(evs, layout)
    want = [clean_str(e["name"]) for e in evs if kept(e)]
    try:
        t = load(data, gz)
    except DiagnoseError:
        assert not want
        return
    assert _names(t) == want
    assert not t.salvaged
    x = t.events
    assert (x["dur"] >= 0).all() and x["ts"].notna().all()


@settings(max_examples=examples(250), deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(st.lists(events, min_size=1, max_size=20), st.sampled_from(["object", "list", "compact"]), st.booleans(),
       st.floats(0, 1))
def test_cut_anywhere_keeps_exactly_the_complete_events(evs, layout, gz, where):
    from diagnose.ingest.jsonsafe import clean_str

    data, ends = serialise(evs, layout)
    cut = int(len(data) * where)
    want = [clean_str(e["name"]) for e, end in zip(evs, ends) if end <= cut and kept(e)]
    try:
        t = load(data[:cut], gz)
    except DiagnoseError:
        assert not want
        return
    assert _names(t) == want
