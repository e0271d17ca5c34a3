"""The checks beyond the classic four: device memory, pipeline bubbles, checkpoint I/O, host syncs.

Arithmetic and classification on small hand-built inputs; host syncs on the real shared
GPU traces (recomputed independently from the raw JSON for one rank).
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from diagnose.analyzers import CHECKLIST, host_sync, memory, pipeline_bubbles, reduce_rank
from diagnose.context import build_context
from diagnose.model import CHECK_ORDER
from diagnose.ingest.assemble import load_run
from diagnose.thresholds import DEFAULT
from tests.conftest import shared, shared_run

NEW = ("device_memory", "pipeline_bubble", "checkpoint_io", "host_sync", "gc_pause", "cpu_contention")


def test_new_checks_follow_the_classic_four():
    assert CHECK_ORDER[-9:-3] == NEW
    names = [e.name for e in CHECKLIST]
    assert names[:4] == ["dataloader", "communication", "straggler", "launch_overhead"]
    assert names[4] == "device_wait"  # launch_overhead's complement: queued device idle
    assert names[5:-3] == list(NEW)
    # then configuration mistakes
    assert names[-3:-1] == list(CHECK_ORDER[-3:-1]) == ["grad_sync", "reduce_dtype"]
    assert names[-1] == CHECK_ORDER[-1] == "fail_slow"  # and last, the whole run over time


# ---- device memory: the arithmetic engineers do -------------------------------------

def _meta(optimizer: str, params: int, elem: int, state: int | None, wrapper: str = "DistributedDataParallel"):
    return {"optimizers": [{"optimizer": optimizer, "params": params, "param_bytes": params * elem,
                            "dtypes": ["float32" if elem == 4 else "bfloat16"], "state_tensors_per_param": state}],
            "model": {"params": params, "param_bytes": params * elem, "wrapper": wrapper}}


@pytest.mark.parametrize("optimizer, elem, state, per_param", [
    ("Adam", 4, 2, 16),     # fp32 weights 4 + grads 4 + two moments 8
    ("AdamW", 2, 2, 8),     # pure bf16 training: everything in 2 bytes
    ("SGD", 4, 1, 12),      # momentum: one buffer per parameter
    ("SGD", 4, None, 8),    # plain SGD: no state at all
    ("Adam", 4, None, 16),  # state not counted by the probe: known from the optimizer's name
])
def test_model_state_bytes_per_param(optimizer, elem, state, per_param):
    m = memory._rank_memory(0, _meta(optimizer, 1_000_000, elem, state))
    assert m.source == "arithmetic"
    assert m.model_state / m.params == per_param


def test_measured_tensors_take_precedence():
    meta = {**_meta("Adam", 1000, 4, 2),
            "memory_tensors": [{"optimizer": "Adam", "params": 1000, "param_bytes": 4000, "grad_bytes": 4000,
                                "state_bytes": 8024}]}
    m = memory._rank_memory(0, meta)
    assert m.source == "measured" and m.state == 8024 and m.model_state == 16024


def test_sharding_advice_in_bytes_for_this_model():
    p = 10_000_000
    m = memory._rank_memory(0, {**_meta("Adam", p, 4, 2), "device_memory": {
        "peak_allocated_bytes": 16 * p + 200_000_000, "peak_reserved_bytes": 16 * p + 260_000_000,
        "total_bytes": 16 * p + 270_000_000}})
    assert m.activations == 200_000_000
    advice = dict((name, saves) for name, saves, _ in memory._advice(m, dp=4, sharded=False))
    assert list(advice) == ["precision", "micro-batch", "activation checkpointing", "sharding",
                            "tensor/pipeline parallel"]
    assert advice["precision"] == advice["micro-batch"] == 100_000_000  # half the activations
    assert advice["activation checkpointing"] == 200_000_000
    assert advice["sharding"] == pytest.approx(16 * p * 3 / 4)  # ZeRO-3 over 4 ranks
    assert advice["tensor/pipeline parallel"] == 8 * p
    _, _, halve = memory._advice(m, dp=4, sharded=False)[1]
    assert halve.startswith("halve the micro-batch and double gradient accumulation: halves the activations (")
    assert halve.endswith("), the global batch is unchanged")
    _, _, how = memory._advice(m, dp=4, sharded=False)[3]
    assert "ZeRO-1 (optimizer state) frees 60.00 MB" in how  # 8 B/param x 10 M x 3/4
    assert dict((n, s) for n, s, _ in memory._advice(m, dp=1, sharded=False))["sharding"] == 0


# ---- pipeline bubbles -----------------------------------------------------------------

@pytest.mark.parametrize("p, m, v, bound", [(2, 1, 1, 0.5), (2, 4, 1, 0.2), (4, 8, 1, 3 / 11), (4, 8, 2, 3 / 19)])
def test_bubble_bound(p, m, v, bound):
    assert pipeline_bubbles.bubble_bound(p, m, v) == pytest.approx(bound)


def test_microbatch_labels_of_torch_pipelining():
    pat = pipeline_bubbles.MICROBATCH
    assert pat.match("Forward 3").groups()[:2] == ("Forward", "3")
    assert pat.match("PP:1F0").groups()[2:] == ("1", "F", "0")
    assert not pat.match("Forward") and not pat.match("PP:1RECV_F0")


# ---- checkpoint: atomic-write detection -------------------------------------------------


def test_an_interleaved_schedule_is_read_from_its_labels():
    """tests/fixtures/cpu_interleaved_2rank (ScheduleInterleaved1F1B, 4 stages on 2 ranks): the stage
    count, the stages per rank and the micro-batches counted here from the raw PP: labels; the bound
    is the interleaved one, and the advice is more interleaving, not to start."""
    import re

    from tests.conftest import fixture_diagnosis

    path = Path(__file__).parent / "fixtures" / "cpu_interleaved_2rank"
    stages, forwards = {}, set()
    for f in sorted(path.glob("rank*.pt.trace.json.gz")):
        rank = int(f.name[4])
        for e in json.loads(gzip.decompress(f.read_bytes()))["traceEvents"]:
            hit = re.fullmatch(r"PP:(\d+)([FB])(\d+)", str(e.get("name", "")))
            if hit:
                stages.setdefault(rank, set()).add(int(hit[1]))
                if hit[2] == "F":
                    forwards.add(int(hit[3]))
    assert stages == {0: {0, 2}, 1: {1, 3}}  # stage s on rank s mod 2
    v, p, m = 2, 2, len(forwards)
    assert m == 4
    d = fixture_diagnosis(path)
    f = d.findings[0]
    assert f.id == "pipeline_bubble" and f.ranks == (0, 1) and f.confidence == "high"
    mt = f.metrics
    assert (mt["stages"], mt["virtual_stages_per_rank"], mt["microbatches"]) == (p, v, m)
    assert mt["stages_source"] == "stage indices in the PP: labels" and mt["microbatches_source"] == "micro-batch labels"
    assert mt["bound_fraction"] == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-4)
    assert "vs the bound 11% for p=2, m=4" in next(c for c in d.checks if c.id == "pipeline_bubble").reason
    assert "already interleaved (v=2 stages per rank); v=4 would bring the bound to 6%" in f.fix
    assert "An interleaved schedule (torch.distributed.pipelining" not in f.fix
    # stage rank 1 holds 4 of the 6 layers: the slower stage
    assert mt["slowest_stage_rank"] == 1 and mt["rank1_busy_ms"] > mt["rank0_busy_ms"]

@pytest.mark.parametrize("name, temp", [("ckpt_step3.pt", False), ("model.safetensors", False),
                                        ("ckpt_step3.pt.tmp", True), (".ckpt.pt.x1y2", True),
                                        ("tmpab12cd", True), ("ckpt.partial", True)])
def test_temp_names(name, temp):
    from diagnose.probes.checkpoint_hook import TEMP_NAME

    assert bool(TEMP_NAME.search(name)) == temp


# ---- host syncs on real GPU traces ------------------------------------------------------

def _check(ctx, analyze):
    (c,) = analyze(ctx, DEFAULT)
    return c


def _raw_sync_idle_ms(path) -> float:
    """Independent of the analyzer: from the raw JSON, per cudaStreamSynchronize (or cudaMemcpyAsync
    whose copy has a pageable side: it blocks the host the same way) that found the device busy,
    the device idle from its last activity to its next one; summed, in ms."""
    with gzip.open(path) as f:
        ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    dev = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    step = next(e for e in ev if str(e.get("name", "")).startswith("ProfilerStep#"))
    pageable = {(e.get("args") or {}).get("correlation") for e in ev
                if e.get("cat") == "gpu_memcpy" and "Pageable" in str(e.get("name"))}
    total = 0.0
    for s in (e for e in ev if e.get("name") == "cudaStreamSynchronize" or (
            e.get("name") == "cudaMemcpyAsync" and (e.get("args") or {}).get("correlation") in pageable)):
        s0, s1 = s["ts"], s["ts"] + s["dur"]
        if not step["ts"] <= s0 < step["ts"] + step["dur"]:
            continue
        before = [(a, b) for a, b in dev if a <= s1]
        if any(b > s1 for _, b in before):
            continue  # still busy when the call returned
        last = max(b for _, b in before)
        nxt = [a for a, _ in dev if a > s1]
        if last >= s0 and nxt:
            total += min(nxt) - last
    return total / 1000


def test_host_syncs_on_dlrm():
    path = shared("param_dlrm_8rank_v100")
    ctx = build_context(load_run([path], reduce=reduce_rank))
    c = _check(ctx, host_sync.analyze)
    f = c.finding
    assert c.status in ("passed", "flagged") and f is not None
    m = f.metrics
    # every rank: 10 cudaStreamSynchronize and 10 pageable cudaMemcpyAsync per step
    assert m["sync_calls_per_step"] == 20
    assert m["calls_by_name_all_ranks"] == "cudaMemcpyAsync x80, cudaStreamSynchronize x80"
    assert m["calls_by_cause_all_ranks"].startswith(".cpu() / .to()")  # all under aten::to / _to_copy / copy_
    raw = _raw_sync_idle_ms(sorted(path.glob("worker0_*.json.gz"))[0])
    assert m["rank0_sync_idle_ms"] == pytest.approx(raw, abs=1e-3)
    assert 0 < f.recoverable_ms < 0.05 * ctx.mean_step_ms  # a few tenths of a ms on a 14-20 ms step
    assert c.status == "passed"
    ev = f.events[0]
    assert ev.name in ("cudaStreamSynchronize", "cudaMemcpyAsync") and ev.step is not None
    assert "device then idle" in ev.note


def test_host_syncs_on_other_gpu_traces():
    ctx = build_context(shared_run("kineto_resnet50_dataloader_v100/nw0"))
    f = _check(ctx, host_sync.analyze).finding
    assert f.metrics["sync_calls_per_step"] == 4  # the blocking input copies and their pageable cudaMemcpyAsync
    assert f.metrics["calls_by_cause_all_ranks"].startswith(".cpu() / .to() / copy_")
    ctx = build_context(shared_run("hta_nccl_data_rank0of2_a100"))
    f = _check(ctx, host_sync.analyze).finding
    assert "cudaEventSynchronize" in f.metrics["calls_by_name_all_ranks"]
    ctx = build_context(shared_run("edge_hta_ddp_world1_v100"))
    assert _check(ctx, host_sync.analyze).status == "passed"


def test_host_syncs_not_measurable_on_cpu_trace():
    ctx = build_context(shared_run("edge_hta_cpu_only_gloo_rank34of300"))
    c = _check(ctx, host_sync.analyze)
    assert c.status == "not_measurable" and "not measurable on CPU" in c.reason


def test_new_checks_on_bare_gpu_traces_say_what_they_cannot_see():
    ctx = build_context(shared_run("param_dlrm_8rank_v100"))
    checks = {c.id: c for e in CHECKLIST[4:] for c in e.analyze(ctx, DEFAULT)}
    assert checks["device_memory"].status == "not_measurable"  # no probes: no parameter count
    assert checks["checkpoint_io"].status == "not_measurable"
    assert checks["pipeline_bubble"].status == "passed"  # collectives only, no send/recv


def test_small_micro_batch_blamed_on_tight_memory():
    """A host-bound real GPU trace (launch_overhead fires) plus a sidecar saying memory is nearly full."""
    import pandas as pd

    from diagnose.analyzers import launch
    from diagnose.probedata import ProbeData

    run = shared_run("hta_nccl_data_rank0of2_a100")
    p, total = 50_000_000, 40 * 10**9
    meta = {**_meta("AdamW", p, 4, 2), "device_memory": {
        "peak_allocated_bytes": int(0.93 * total), "peak_reserved_bytes": int(0.96 * total), "total_bytes": total}}
    ctx = build_context(run, {0: ProbeData(rank=0, meta=meta, steps=pd.DataFrame(), collectives=pd.DataFrame())})
    assert [c.status for c in launch.analyze(ctx, DEFAULT)] == ["flagged"]
    (c,) = memory.analyze(ctx, DEFAULT)
    assert c.status == "flagged" and c.reason.endswith(
        "; the micro-batch is small because memory is tight (launch overhead also flagged)")
    f = c.finding
    assert f.recoverable_ms == 0 and f.metrics["headroom"] == pytest.approx(0.04)
    assert f.metrics["activations_bytes"] == int(0.93 * total) - 16 * p
    assert f.fix.startswith("The micro-batch is small because memory is tight")
    assert f.metrics["micro_batch_limited_by_memory"] == "yes" and f.severity == "medium"
    assert (f.share_of_step, f.kind) == (0.0, "capacity")
    assert f.metrics["other_source"] == "reserved minus allocated (allocator cache, fragmentation)"
    assert "weights, gradients and optimizer state from parameter count x bytes;" in f.method
    # the same memory with room to spare is a pass, with the breakdown kept
    roomy = {**meta, "device_memory": {**meta["device_memory"], "total_bytes": 4 * total}}
    ctx = build_context(run, {0: ProbeData(rank=0, meta=roomy, steps=pd.DataFrame(), collectives=pd.DataFrame())})
    (c,) = memory.analyze(ctx, DEFAULT)
    assert c.status == "passed" and c.finding.metrics["headroom"] == pytest.approx(0.76)
    assert "micro_batch_limited_by_memory" not in c.finding.metrics
    # an out-of-memory recorded by the probe: flagged high, with its step, whatever the headroom
    oom = {**roomy, "oom": {"message": "CUDA out of memory. Tried to allocate 2.00 GiB", "step": 17}}
    ctx = build_context(run, {0: ProbeData(rank=0, meta=oom, steps=pd.DataFrame(), collectives=pd.DataFrame())})
    (c,) = memory.analyze(ctx, DEFAULT)
    assert (c.status, c.finding.severity) == ("flagged", "high") and c.reason.startswith("out of memory at step 17; ")
    # measured tensors: said so in the method and the reason
    measured = {**meta, "memory_tensors": [{"optimizer": "AdamW", "params": p, "param_bytes": 4 * p,
                                            "grad_bytes": 4 * p, "state_bytes": 8 * p}]}
    ctx = build_context(run, {0: ProbeData(rank=0, meta=measured, steps=pd.DataFrame(), collectives=pd.DataFrame())})
    (c,) = memory.analyze(ctx, DEFAULT)
    assert "state measured from the tensors;" in c.finding.method and "(measured from the tensors)" in c.reason


def test_a_child_that_outlives_its_parent_is_taken_from_the_ancestors():
    """gloo's async recv starts inside c10d::recv_ and ends long after it: its time beyond
    recv_'s end is the enclosing annotation's, not the annotation's own."""
    import pandas as pd

    from diagnose.analyzers.common import self_times

    ops = pd.DataFrame({"tid": ["1"] * 4, "ts": [0.0, 1.0, 2.0, 95.0], "dur": [100.0, 3.0, 88.0, 4.0]})
    # Backward 0 [0,100]; c10d::recv_ [1,4]; gloo:recv [2,90] (outlives recv_); aten::mm [95,99]
    assert self_times(ops).tolist() == [100 - 3 - 86 - 4, 3 - 2, 88, 4]


def test_a_pipeline_stage_waiting_for_its_peer_is_not_per_op_overhead():
    """tests/fixtures/cpu_pipeline_2rank: rank 0 waits ~88 ms per backward in gloo:recv for the
    slow stage, and rank 1's four-layer stage multiplies equal-sized matrices; neither is the
    fixed cost of an op. The verdict is the pipeline bubble, and per-op overhead passes."""
    from pathlib import Path

    from tests.conftest import fixture_diagnosis

    d = fixture_diagnosis(Path(__file__).parent / "fixtures" / "cpu_pipeline_2rank")
    assert d.findings[0].id == "pipeline_bubble"
    launch = next(c for c in d.checks if c.id == "launch_overhead")
    assert launch.status == "passed" and launch.measured_ms < 0.05 * d.run.mean_step_ms[0]
    heaviest = {o["name"]: o["ms_per_step"] for o in d.extras["top_ops"]["ranks"][0]["top"]}
    assert heaviest.get("Backward 0", 0.0) < 5.0  # its recv is not its own time


def test_memory_sizes_read_as_a_person_writes_them():
    assert [memory.human(x) for x in (None, 999, 1_000, 2_500_000, 1_000_000, 3.2e9)] == [
        "not measured", "999 B", "1.00 kB", "2.50 MB", "1.00 MB", "3.20 GB"]


def test_older_probe_sidecars_and_an_out_of_memory_are_read():
    """Sidecars from before `device_memory`: the peaks under `memory`; an OOM's message kept."""
    meta = {**_meta("Adam", 1000, 4, 2), "device": "cuda",
            "memory": {"max_allocated_bytes": 9_000, "max_reserved_bytes": 12_000, "device_total_bytes": 16_000},
            "oom": {"message": "CUDA out of memory. Tried to allocate 2.00 GiB"}}
    m = memory._rank_memory(3, meta)
    assert (m.peak_allocated, m.peak_reserved, m.total) == (9_000, 12_000, 16_000)
    assert m.device == "cuda" and m.oom.startswith("CUDA out of memory") and m.optimizer == "Adam"
    # the model's own count when no optimizer was described
    m = memory._rank_memory(0, {"model": {"params": 500, "param_bytes": 1000}, "device": "cpu"})
    assert m.params == 500 and m.elem_bytes == 2 and m.device == "cpu" and m.total is None
    # parameters counted but not their bytes: fp32 assumed, never a guess from nothing
    assert memory._rank_memory(0, {"model": {"params": 500}}).elem_bytes == 4
    # an "oom" that is not the probe's record (a crafted or older sidecar): ignored, not a crash
    assert memory._rank_memory(0, {**_meta("Adam", 1000, 4, 2), "oom": "out of memory"}).oom is None
    # two optimizers: both named
    two = {"optimizers": [{"optimizer": "SGD", "params": 10, "param_bytes": 40, "state_tensors_per_param": 1},
                          {"optimizer": "Adam", "params": 10, "param_bytes": 40, "state_tensors_per_param": 2}]}
    assert memory._rank_memory(0, two).optimizer == "Adam+SGD"
    # an optimizer the tool does not know, its state uncounted: unknown, never guessed
    assert memory._rank_memory(0, _meta("Shampoo", 100, 4, None)).state is None


def test_memory_advice_in_16_bit_and_on_one_replica():
    p = 1_000_000
    m = memory._rank_memory(0, {**_meta("AdamW", p, 2, 2), "device_memory": {
        "peak_allocated_bytes": 8 * p + 100_000_000, "peak_reserved_bytes": 8 * p + 120_000_000,
        "total_bytes": 8 * p + 130_000_000}})
    advice = {name: (saves, how) for name, saves, how in memory._advice(m, dp=1, sharded=False)}
    assert advice["precision"] == (None, "already 16-bit weights")
    assert advice["sharding"] == (0.0, "one data-parallel replica: nothing to shard across")
    assert "each checkpointed block's input, for about a third more compute" in advice["activation checkpointing"][1]
    assert memory._advice(m, dp=4, sharded=True)[3] == (
        "sharding", 0.0, "already fully sharded (FSDP): the figures above are this rank's shard")
    # fp32 weights: autocast halves the activations
    m4 = memory._rank_memory(0, {**_meta("AdamW", p, 4, 2), "device_memory": {
        "peak_allocated_bytes": 16 * p + 100_000_000, "peak_reserved_bytes": 16 * p + 120_000_000,
        "total_bytes": 16 * p + 130_000_000}})
    saves, how = memory._advice(m4, dp=1, sharded=False)[0][1:]
    assert saves == 50_000_000 and how.startswith("bf16 autocast halves the activations (50.00 MB)")


def test_data_parallel_replicas_from_the_wrapper_or_equal_parameter_counts():
    from types import SimpleNamespace

    per = {r: memory._rank_memory(r, _meta("Adam", 1000 + r, 4, 2)) for r in range(4)}

    def ctx(wrapper, world=4):
        return SimpleNamespace(probe_meta=lambda key: {"wrapper": wrapper} if key == "model" else {},
                               run=SimpleNamespace(world_size=world))

    assert memory._dp_size(ctx("DistributedDataParallel"), per) == 4
    assert memory._dp_size(ctx("FullyShardedDataParallel"), per) == 1  # counts differ: not replicas
    same = {r: memory._rank_memory(r, _meta("Adam", 1000, 4, 2)) for r in range(4)}
    assert memory._dp_size(ctx(""), same) == 4
    assert memory._dp_size(ctx("", world=8), same) == 1  # only 4 of 8 ranks seen


def _memory_check(meta: dict):
    """device_memory on a real GPU trace with one rank's probe sidecar (the probe's own format)."""
    import pandas as pd

    from diagnose.probedata import ProbeData

    ctx = build_context(shared_run("hta_nccl_data_rank0of2_a100"),
                        {0: ProbeData(rank=0, meta=meta, steps=pd.DataFrame(), collectives=pd.DataFrame())})
    (c,) = memory.analyze(ctx, DEFAULT)
    return c


def test_memory_with_room_on_a_gpu_names_every_part_of_the_peak():
    """A GPU rank's peaks split into model state (arithmetic), activations (the residual) and the
    allocator's cache (reserved minus allocated), with the headroom said in the reason."""
    p, gb = 10_000_000, 10**9
    meta = {**_meta("Adam", p, 4, 2), "device_memory": {
        "peak_allocated_bytes": 16 * p + 300_000_000, "peak_reserved_bytes": 16 * p + 400_000_000,
        "total_bytes": 8 * gb}}
    c = _memory_check(meta)
    assert (c.status, c.title) == ("passed", memory.TITLE)
    f = c.finding
    assert (f.kind, f.recoverable_ms, f.ranks) == ("capacity", 0.0, (0,))
    m = f.metrics
    assert m["optimizer_state_tensors_per_param"] == 2 and m["optimizer_state_bytes"] == 8 * p
    assert (m["activations_bytes"], m["activations_source"]) == (300_000_000, "measured residual")
    assert (m["peak_reserved_bytes"], m["other_bytes"]) == (16 * p + 400_000_000, 100_000_000)
    assert m["device"] == "cuda" and m["headroom"] == pytest.approx(1 - 0.56 / 8, abs=1e-4)
    assert c.reason == ("peak 560.00 MB reserved of 8.00 GB (93% free); 10,000,000 params x 16.0 B (4 B weights "
                        "+ 4 B grads + 8 B optimizer state: 2 tensor(s)/param) = 160.00 MB model state per rank "
                        "(by arithmetic), activations 300.00 MB")
    # the device's size unknown: the peak alone, never a made-up headroom
    no_total = {**meta, "device": "cuda", "device_memory": {k: v for k, v in meta["device_memory"].items()
                                                             if k != "total_bytes"}}
    c = _memory_check(no_total)
    assert c.status == "passed" and "headroom" not in c.finding.metrics
    assert c.reason.startswith("peak 460.00 MB allocated (device size unknown); ")


def test_memory_without_device_peaks_gives_the_model_state_and_says_what_it_cannot():
    c = _memory_check({**_meta("Shampoo", 1000, 4, None), "device": "cpu"})
    assert c.status == "not_measurable" and c.title == memory.TITLE
    assert c.reason.startswith("device memory not measurable on CPU (no device peaks); model state: 1,000 params")
    f = c.finding
    assert f.confidence == "medium" and f.kind == "capacity"
    # an optimizer the tool does not know: its state is said to be unknown, not guessed
    assert f.metrics["optimizer_state_bytes"] == "unknown" and f.metrics["optimizer_state_tensors_per_param"] == "unknown"
    assert f.metrics["activations_bytes"] == "not measurable (no device peaks)"
    assert "frees up to the activations (not measurable here)" in f.fix


def test_plain_sgd_keeps_no_optimizer_state_and_fsdp_is_not_told_to_shard():
    p = 1_000_000
    m = memory._rank_memory(0, _meta("SGD", p, 4, None))
    assert (m.state_per_param, m.state) == (0, 0)
    c = _memory_check({**_meta("SGD", p, 4, None, wrapper="FullyShardedDataParallel"), "device_memory": {
        "peak_allocated_bytes": 8 * p + 1_000_000, "peak_reserved_bytes": 8 * p + 2_000_000, "total_bytes": 10**9}})
    assert c.finding.metrics["optimizer_state_tensors_per_param"] == 0
    assert "4. sharding: already fully sharded (FSDP)" in c.finding.fix


def test_host_syncs_cannot_be_seen_when_the_runtime_events_were_filtered_out(tmp_path):
    """A real GPU trace with its CUDA runtime/driver events removed (a filtered export): kernels
    are there, the calls that block on them are not, so the check says it cannot see them."""
    from diagnose.pipeline import diagnose_paths

    src = shared("hta_nccl_data_rank0of2_a100") / "nccl_data.json.gz"
    doc = json.loads(gzip.decompress(src.read_bytes()))
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") not in ("cuda_runtime", "cuda_driver")]
    (tmp_path / "rank0.json").write_text(json.dumps(doc))
    d = diagnose_paths([tmp_path])
    c = next(c for c in d.checks if c.id == host_sync.ID)
    assert c.status == "not_measurable"
    assert c.reason == ("no CUDA/HIP runtime events in the trace (sampled or filtered): synchronising calls "
                        "cannot be seen")


def test_a_distributed_trace_without_its_collectives_says_communication_was_not_recorded(tmp_path):
    """rank 0 of 2 (distributedInfo says so) with every NCCL kernel and c10d op removed: no
    collective to time is not 'no communication' (that is only true of a single process)."""
    import re

    from diagnose.pipeline import diagnose_paths

    src = shared("hta_nccl_data_rank0of2_a100") / "nccl_data.json.gz"
    doc = json.loads(gzip.decompress(src.read_bytes()))
    comm = re.compile(r"nccl|c10d|record_param_comms|all_?reduce|gloo", re.I)
    doc["traceEvents"] = [e for e in doc["traceEvents"] if not comm.search(str(e.get("name", "")))]
    (tmp_path / "rank0.json").write_text(json.dumps(doc))
    c = next(c for c in diagnose_paths([tmp_path]).checks if c.id == "exposed_communication")
    assert (c.status, c.reason) == ("not_measurable", "no collective events in the trace (NCCL kernels or gloo "
                                    "ops); the profiler may not have recorded communication")


# ---- checkpoint I/O: the risks and the cadence, on the recorded job's steps ---------------------
CKPT = Path(__file__).resolve().parent / "fixtures" / "cpu_checkpoint_2rank"


def _checkpoint_check(saves: dict[int, list[dict]]):
    """checkpoint_io on the recorded 2-rank job (its traces and every-step logs) with the saves
    its probes would record for another checkpointing scheme."""
    from dataclasses import replace

    from diagnose.analyzers import checkpoint
    from diagnose.probedata import load_probe_data
    from tests.conftest import fixture_run

    probes = {r: replace(p, meta={**p.meta, "checkpoints": saves.get(r, [])})
              for r, p in load_probe_data([CKPT]).items()}
    (c,) = checkpoint.analyze(build_context(fixture_run(CKPT), probes), DEFAULT)
    return c, probes


def test_a_sharded_atomic_save_on_every_rank_raises_no_risk_but_its_cost():
    saves = {r: [{"api": "dcp.save", "step": s, "ms": 30.0, "bytes": 2_000_000, "rank": r, "direct": False}
                 for s in (4, 8)] for r in (0, 1)}
    c, probes = _checkpoint_check(saves)
    m = c.finding.metrics
    assert m["writing_ranks"] == "0, 1" and m["risk_single_writer"] == "no" and m["risk_direct_writes"] == "none"
    assert m["risk_synchronous"] == "4 of 4 saves block the loop (torch.save / dcp.save)"
    assert (m["every_n_steps"], m["checkpoints"], m["write_mb_per_s"]) == (4, 2, 66.7)  # 2 MB in 30 ms
    n = len(probes[0].steps)
    assert c.finding.recoverable_ms == pytest.approx(60.0 / n, abs=1e-3)
    assert "shard the write" not in c.finding.fix and "write atomically" not in c.finding.fix
    assert "or checkpoint less often: every 4 steps" in c.finding.fix
    assert c.reason.endswith("; risks: synchronous")


def test_one_asynchronous_save_has_no_cadence_and_no_write_speed():
    c, _ = _checkpoint_check({0: [{"api": "dcp.async_save", "step": 5, "ms": 0.0, "rank": 0, "direct": False,
                                   "bytes": 2_000_000}]})
    m = c.finding.metrics
    assert m["every_n_steps"] == "once" and "checkpoint less often" not in c.finding.fix
    assert m["risk_synchronous"] == "none (async_save)" and "write_mb_per_s" not in m  # 0 ms: no speed
    assert m["risk_single_writer"] == "rank 0 writes every checkpoint alone"
    assert c.status == "passed" and c.reason.endswith("; risks: rank 0 writes alone")
