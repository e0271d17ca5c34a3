"""Branches of the checks that no shared trace or recording reaches with default thresholds, each
pinned on a real trace (a threshold moved, a sidecar section added in the probe's own format) or on
the plain function that decides it. Found by mutation testing (benchmarks/mutation.py): a change
here that no test noticed is a claim the tool could get wrong unseen."""
from __future__ import annotations

import dataclasses
import functools
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from diagnose.analyzers import checkpoint, dataloader, host_sync
from diagnose.context import build_context
from diagnose.probedata import ProbeData
from diagnose.step.timeline import Steps
from diagnose.thresholds import DEFAULT
from tests.conftest import FLOORS, fixture_run, shared, shared_run, threshold_diagnosis

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _check(d, cid: str):
    return next(c for c in d.checks if c.id == cid)


def test_checkpoint_ranges_below_the_threshold_pass_and_keep_their_figures(tmp_path):
    """The checkpointing job seen from its traces alone (8.5 ms per profiled step, 28% of it):
    with the threshold above that share it passes, and the finding behind the figure is kept."""
    for f in (FIXTURES / "cpu_checkpoint_2rank").glob("*.pt.trace.json.gz"):
        shutil.copy(f, tmp_path / f.name)
    from diagnose.pipeline import diagnose_paths

    flagged = _check(diagnose_paths([tmp_path]), "checkpoint_io")
    share = flagged.finding.share_of_step
    c = _check(diagnose_paths([tmp_path], dataclasses.replace(DEFAULT, checkpoint=share + 0.01)), "checkpoint_io")
    assert c.status == "passed" and c.finding is not None
    assert c.finding.recoverable_ms == flagged.finding.recoverable_ms and c.finding.ranks == (0,)
    assert c.finding.metrics["source"] == "trace (profiled steps only)"


def test_the_dataloader_fix_quotes_this_runs_loader_settings():
    """The probe's `dataloader` section (what it read off the DataLoader) on a real starved trace:
    the fix names the settings the run used, only those recorded, in a fixed order."""
    run = shared_run("kineto_resnet50_dataloader_v100/nw0")
    cfg = {"num_workers": 0, "batch_size": 32, "pin_memory": False, "unrelated": "x"}
    ctx = build_context(run, {0: ProbeData(rank=0, meta={"dataloader": cfg}, steps=pd.DataFrame(),
                                           collectives=pd.DataFrame())})
    c = next(c for c in dataloader.analyze(ctx, DEFAULT) if c.id == "dataloader_starvation")
    assert c.status == "flagged"
    assert c.finding.fix.endswith(" This run: DataLoader(batch_size=32, num_workers=0, pin_memory=False).")
    bare = next(c for c in dataloader.analyze(build_context(run, {}), DEFAULT) if c.id == "dataloader_starvation")
    assert "This run:" not in bare.finding.fix


def test_a_sync_call_on_a_thread_without_ops_reads_none_and_the_next_still_gets_its_op():
    ev = pd.DataFrame({"kind": pd.Categorical(["cpu_op", "cpu_op"]), "tid": ["1", "1"], "ts": [0.0, 2.0],
                       "dur": [100.0, 10.0], "name": ["aten::to", "aten::_local_scalar_dense"]})
    calls = pd.DataFrame({"tid": ["7", "1", "1"], "ts": [5.0, 3.0, 50.0], "dur": [1.0, 2.0, 5.0]})
    ev["kind"] = ev["kind"].astype(str).map({"cpu_op": host_sync.KIND_CPU_OP})
    assert host_sync._innermost_ops(ev, calls) == [None, "aten::_local_scalar_dense", "aten::to"]


def test_host_syncs_name_the_ranks_at_or_above_the_threshold():
    """On param_dlrm_8rank_v100 each rank's sync idle is 0.73-0.81 ms per step: with the threshold
    between them, the ranks named are exactly those whose own idle reaches it."""
    base = _check(threshold_diagnosis(shared("param_dlrm_8rank_v100"), host_sync=0.0), "host_sync").finding
    step = base.recoverable_ms / base.share_of_step
    per = {r: base.metrics[f"rank{r}_sync_idle_ms"] for r in range(8)}
    values = sorted(per.values())
    cut = (values[4] + values[5]) / 2  # the three largest reach it
    c = _check(threshold_diagnosis(shared("param_dlrm_8rank_v100"), host_sync=cut / step), "host_sync")
    want = tuple(sorted(r for r, v in per.items() if v / step >= cut / step))
    assert len(want) == 3 and c.finding is not None and c.finding.ranks == want


def test_a_lower_missing_launch_threshold_lowers_confidence_with_its_note():
    """edge_hta_ddp_world1_v100: 235 of 6330 launch calls in the steps have no device event (3.7%),
    under the default 20%: no note. At 1% the idle model says device work is missing, and the checks
    that read idle classes drop to low confidence."""
    path = shared("edge_hta_ddp_world1_v100")
    floors = {f: 0.0 for f in FLOORS}
    quiet = _check(threshold_diagnosis(path, **floors), "launch_overhead").finding
    assert "no device event" not in str(quiet.metrics.get("note", ""))
    loud = _check(threshold_diagnosis(path, **floors, unmatched_launch_share=0.01), "launch_overhead").finding
    assert "4% of the launch calls in the steps have no device event" in loud.metrics["note"]
    assert loud.confidence == "low"
    # device_wait keeps its own note (all of its sliver of queued idle is same-stream) and adds this one
    wait = _check(threshold_diagnosis(path, **floors, unmatched_launch_share=0.01), "device_wait").finding
    first, second = wait.metrics["note"].split("; ", 1)
    assert first.startswith("100% of the queued idle is same-stream") and wait.confidence == "low"
    assert second.startswith("rank 0: 4% of the launch calls in the steps have no device event")


def test_the_checkpoint_trace_marks_reduce_counts_every_write_and_cites_the_first():
    """What the checkpoint check reads off one rank's trace: every marked write counted, the first
    three cited, and the figure per profiled step."""
    marks = checkpoint._trace_marks(build_context(fixture_run(FIXTURES / "cpu_checkpoint_2rank"), {}))
    assert marks and all(m.count >= len(m.first_rows) for m in marks.values())
    assert all(0 < len(m.first_rows) <= 3 for m in marks.values())


def test_accumulation_is_judged_by_the_majority_of_its_steps():
    """tests/fixtures/cpu_accum_nosync_2rank, every profiled step reducing before its last
    micro-batch: a rank is judged to reduce early when more than half of its steps do. Exactly
    half (a run that switched to no_sync() halfway) passes; one step more flags."""
    from diagnose.analyzers import grad_sync

    run = fixture_run(FIXTURES / "cpu_accum_nosync_2rank")
    facts = {r: run.facts[r]["grad_sync"] for r in run.ranks}
    assert all(f.steps >= 2 and f.syncing_steps == f.steps for f in facts.values())

    def judged(steps: int, syncing: int) -> str:
        edited = dataclasses.replace(run, facts={r: {**run.facts[r], "grad_sync": dataclasses.replace(
            facts[r], steps=steps, syncing_steps=syncing)} for r in run.ranks})
        (c,) = grad_sync.analyze(build_context(edited), DEFAULT)
        return c.status

    assert [judged(6, k) for k in (2, 3, 4)] == ["passed", "passed", "flagged"]
    assert [judged(5, k) for k in (2, 3)] == ["passed", "flagged"]


def test_checkpoint_with_probes_and_no_save_passes_and_says_so():
    """A run the probes watched that wrote no checkpoint (tests/fixtures/light_failslow/steady: 299
    recorded steps, no torch.save): passed, naming how many steps were watched, not 'not measurable'."""
    from diagnose.analyzers import checkpoint
    from diagnose.probedata import load_probe_data

    probes = load_probe_data([FIXTURES / "light_failslow" / "steady"])
    n = max(len(p.steps) for p in probes.values())
    (c,) = checkpoint.analyze(build_context(fixture_run(FIXTURES / "cpu_straggler_2rank"), probes), DEFAULT)
    assert (c.id, c.status) == ("checkpoint_io", "passed")
    assert c.reason == (f"no checkpoint written during the {n} probed steps (torch.save, "
                        "torch.distributed.checkpoint)")


# ---- the decision steps, on a real run's per-rank facts with one fact changed ----------------
# Each check decides from every rank's reduced summary (run.facts); changing one summary of a
# real run reaches the branches no recording does (rank 0 the slowest stage, a rank without the
# idle split, an NCCL job reducing in fp32 under bf16 compute) without a synthetic trace.

def _with_facts(run, name: str, change):
    """The run with check `name`'s per-rank summary replaced by change(rank, summary)."""
    facts = {r: {**f, name: change(r, f[name])} for r, f in run.facts.items()}
    return dataclasses.replace(run, facts=facts)


@functools.lru_cache(maxsize=None)
def _full(name: str):
    """A recorded run with every event kept (no per-rank reduction): for the reduce phases themselves."""
    from diagnose.ingest.assemble import load_run

    return load_run([FIXTURES / name], jobs=1)


def _pipeline(run, th=DEFAULT):
    from diagnose.analyzers import pipeline_bubbles

    (c,) = pipeline_bubbles.analyze(build_context(run, {}), th)
    return c


def test_the_slowest_stage_is_the_one_that_computes_most_whichever_rank_it_is():
    """Every recording has its last stage busiest; swap the two stages' busy times and rank 0 is named."""
    run = fixture_run(FIXTURES / "cpu_pipeline_2rank")
    busy = {r: run.facts[r]["pipeline_bubble"].busy_ms for r in run.ranks}
    assert busy[1] > busy[0]
    swapped = _with_facts(run, "pipeline_bubble", lambda r, s: dataclasses.replace(s, busy_ms=busy[1 - r]))
    f = _pipeline(swapped).finding
    assert f.metrics["slowest_stage_rank"] == 0
    assert f"3. Rebalance layers: stage rank 0 computes {busy[1]:.1f} ms per step" in f.fix


def test_pipeline_imbalance_and_excess_idle_decide_at_their_thresholds():
    """The rebalance advice from imbalance == threshold up; the latency advice only above it."""
    run = fixture_run(FIXTURES / "cpu_pipeline_2rank")
    stages = [run.facts[r]["pipeline_bubble"] for r in run.ranks]
    busy = [s.busy_ms for s in stages]
    imbalance = max(busy) / (sum(busy) / len(busy)) - 1
    at = _pipeline(run, dataclasses.replace(DEFAULT, pipeline_imbalance=imbalance))
    assert "Rebalance layers" in at.finding.fix and "computes" in at.reason
    above = _pipeline(run, dataclasses.replace(DEFAULT, pipeline_imbalance=float(np.nextafter(imbalance, 2.0))))
    assert "Rebalance layers" not in above.finding.fix and "more than the mean" not in above.reason
    from diagnose.analyzers.pipeline_bubbles import bubble_bound

    excess = sum(s.idle_fraction for s in stages) / len(stages) - bubble_bound(2, 4)  # p=2, m=4 (README)
    at = _pipeline(run, dataclasses.replace(DEFAULT, pipeline_bubble=excess))
    assert "beyond the schedule's bound" not in at.finding.fix
    below = _pipeline(run, dataclasses.replace(DEFAULT, pipeline_bubble=float(np.nextafter(excess, 0.0))))
    assert "beyond the schedule's bound" in below.finding.fix


def test_a_rank_without_point_to_point_is_no_pipeline_stage():
    run = fixture_run(FIXTURES / "cpu_pipeline_2rank")
    one = _with_facts(run, "pipeline_bubble", lambda r, s: dataclasses.replace(
        s, p2p_per_step=0.0, recvs_per_step=0.0, microbatches=None) if r == 1 else s)
    f = _pipeline(one).finding
    assert f.ranks == (0,) and f.metrics["stages"] == 1


def test_no_labels_and_no_receives_leave_the_micro_batches_unknown():
    run = fixture_run(FIXTURES / "cpu_pipeline_2rank")
    bare = _with_facts(run, "pipeline_bubble", lambda r, s: dataclasses.replace(s, microbatches=None, recvs_per_step=0.0))
    f = _pipeline(bare).finding
    assert (f.metrics["microbatches"], f.metrics["microbatches_source"], f.metrics["bound_fraction"]) == \
        ("unknown", "unknown", "unknown")
    assert "the fill-drain bound is (p - 1) / (m + p - 1)" in f.fix


def test_a_micro_batch_label_at_the_steps_first_microsecond_is_in_that_step():
    """Steps are half-open [start, end): a forward label starting exactly at a step's start counts."""
    from diagnose.analyzers import pipeline_bubbles

    run = _full("cpu_pipelining_2rank")
    trace, tl = run.traces[0], run.timelines[0]
    ev = trace.events.copy()
    parts = ev["name"].astype(str).str.extract(pipeline_bubbles.MICROBATCH.pattern)
    fwd = (parts[0] == "Forward") | (parts[3] == "F")
    moved_steps = 0
    for s in tl.steps.frame().itertuples():
        inside = ev.index[fwd & (ev["ts"] >= s.start) & (ev["ts"] < s.end)]
        if len(inside):
            ev.loc[ev.loc[inside, "ts"].idxmin(), "ts"] = s.start
            moved_steps += 1
    assert moved_steps == len(tl.steps)
    moved = pipeline_bubbles.reduce(dataclasses.replace(trace, events=ev), tl)
    assert moved.microbatches == pipeline_bubbles.reduce(trace, tl).microbatches == 4


def test_a_device_side_copy_of_a_receive_is_not_a_second_receive():
    """NCCL traces repeat a record_function on the device (gpu_user_annotation): only host events count."""
    from diagnose.analyzers import pipeline_bubbles
    from diagnose.ingest.columns import KIND_GPU_ANNOTATION

    run = _full("cpu_pipeline_2rank")
    trace, tl = run.traces[0], run.timelines[0]
    ev = trace.events
    recv = ev[ev["name"].astype(str).str.match(pipeline_bubbles.RECV_TRANSFER.pattern)].copy()
    assert len(recv)
    recv["kind"] = KIND_GPU_ANNOTATION
    recv["name"] = "nccl:recv"
    both = pd.concat([ev, recv], ignore_index=True)
    for col in ("kind", "name"):  # the loader's columns are categorical
        both[col] = both[col].astype(str).astype("category")
    got = pipeline_bubbles.reduce(dataclasses.replace(trace, events=both), tl)
    assert got.recvs_per_step == pipeline_bubbles.reduce(trace, tl).recvs_per_step == 4


def _launch(run):
    from diagnose.analyzers import launch

    (c,) = launch.analyze(build_context(run, {}), DEFAULT)
    return c


def test_host_ops_behind_long_gaps_are_named_only_when_long_gaps_cost_something():
    run = shared_run("hta_nccl_data_rank0of2_a100")
    gpu = run.facts[0]["launch_overhead"].gpu
    assert gpu.long_ms > 0 and gpu.host_ops
    # the innermost op inside the outermost user annotation open then (idle._long_gap_ops)
    assert "host ops behind the long gaps: ## forward ## > aten::add_" in _launch(run).reason
    none_long = _with_facts(run, "launch_overhead", lambda r, f: dataclasses.replace(
        f, gpu=dataclasses.replace(f.gpu, long_ms=0.0)))
    assert "host ops behind the long gaps" not in _launch(none_long).reason


def test_a_host_running_ahead_says_launch_overhead_is_not_the_main_wait():
    """Launch delay at the threshold and more queued idle than launch idle: confidence low, the note
    and the reason say to look at device_wait."""
    run = shared_run("hta_nccl_data_rank0of2_a100")
    gpu = run.facts[0]["launch_overhead"].gpu
    ahead = _with_facts(run, "launch_overhead", lambda r, f: dataclasses.replace(f, gpu=dataclasses.replace(
        f.gpu, median_launch_delay_us=DEFAULT.host_ahead_delay_us, queued_ms=gpu.ms + 1.0)))
    c = _launch(ahead)
    assert c.status == "flagged" and c.finding.confidence == "low"
    assert ("median launch delay 1.0 ms: the host runs ahead of the device, so launch overhead is not what "
            "the device mostly waits for") in c.finding.metrics["note"]
    assert c.reason.endswith(f"and queued idle is larger ({gpu.ms + 1.0:.1f} ms): see device_wait")


def test_a_cpu_rank_without_host_ops_in_its_steps_has_no_op_overhead():
    from diagnose.analyzers import launch

    run = _full("cpu_straggler_2rank")
    trace, tl = run.traces[0], run.timelines[0]
    got = launch._op_overhead(trace.events.iloc[:0], tl)
    assert (got.ms, got.ops_per_step, got.typical_rows) == (0.0, None, ())


def test_a_byte_count_is_a_positive_number_or_missing():
    from diagnose.analyzers import memory

    assert memory._num(1) == 1.0 and memory._num(0.5) == 0.5
    assert memory._num(0) is None and memory._num(-3) is None and memory._num("12") is None


def test_an_optimizer_of_unknown_state_counts_weights_and_gradients_only():
    from diagnose.analyzers import memory
    from diagnose.probedata import ProbeData

    run = shared_run("hta_nccl_data_rank0of2_a100")
    p = 1_000_000
    meta = {"optimizers": [{"optimizer": "HomeMadeOptimizer", "params": p, "param_bytes": 4 * p, "state_tensors_per_param": None}],
            "model": {"params": p, "param_bytes": 4 * p, "wrapper": "DistributedDataParallel"}}
    ctx = build_context(run, {0: ProbeData(rank=0, meta=meta, steps=pd.DataFrame(), collectives=pd.DataFrame())})
    (c,) = memory.analyze(ctx, DEFAULT)
    m = c.finding.metrics
    assert m["optimizer_state_tensors_per_param"] == "unknown"
    assert m["arithmetic_bytes_per_param"] == 8  # fp32 weights 4 + gradients 4; the state is not guessed


def test_a_gpu_rank_without_steps_has_no_queued_idle_rather_than_nan():
    from diagnose.analyzers import device_wait
    from diagnose.ingest.assemble import load_run

    full = load_run([next(shared("hta_nccl_data_rank0of2_a100").glob("*.json*"))], jobs=1)
    tl = full.timelines[0]
    got = device_wait.reduce(full.traces[0], dataclasses.replace(tl, steps=Steps.of(tl.steps.frame().iloc[:0])))
    assert got.ms == 0.0 and got.by_sub_ms and all(v == 0.0 for _, v in got.by_sub_ms)


def test_a_reduction_starting_as_the_last_forward_starts_belongs_to_that_pass():
    """With no_sync() the gradient all-reduce runs in the last backward pass; one that starts at the
    very microsecond the last micro-batch's forward starts is not an early one (steps and passes
    are half-open intervals)."""
    from diagnose.analyzers import grad_sync
    from diagnose.step.timeline import _names_matching

    run = _full("cpu_accum_2rank")
    trace, tl = run.traces[0], run.timelines[0]
    assert grad_sync.reduce(trace, tl).syncing_steps == 0
    ev = trace.events
    fw = ev[_names_matching(ev, grad_sync.DDP_FORWARD)]
    coll = tl.collectives.copy()
    moved = 0
    for s in tl.steps.frame().itertuples():
        starts = fw["ts"][(fw["ts"] >= s.start) & (fw["ts"] < s.end)]
        mine = coll.index[coll["step"] == s.step]
        if len(starts) >= 2 and len(mine):
            coll.loc[mine[0], "arrival"] = float(starts.max())
            moved += 1
    assert moved >= 2
    got = grad_sync.reduce(trace, dataclasses.replace(tl, collectives=coll))
    assert (got.syncing_steps, got.early_allreduces) == (0, 0.0)


def _reduce_dtype(run, th=DEFAULT):
    from diagnose.analyzers import reduce_dtype

    (c,) = reduce_dtype.analyze(build_context(run, {}), th)
    return c


def test_an_nccl_job_computing_in_bf16_and_reducing_in_fp32_is_flagged_with_its_figures():
    """The A100 NCCL job (fp32 compute, fp32 reductions: passes) with its compute made bf16: the
    NCCL path's verdict, whose own figure is half the exposed time inside the fp32 reductions. (The
    replay gives back less there, 0.3% of the step: other waits take its place; the threshold is
    lowered to see the flagged wording.)"""
    from diagnose.analyzers.reduce_dtype import Precision

    run = shared_run("hta_nccl_data_rank0of2_a100")
    assert _reduce_dtype(run).status == "passed"
    p = run.facts[0]["reduce_dtype"]
    bf16 = _with_facts(run, "reduce_dtype", lambda r, f: dataclasses.replace(
        f, matrix_us=(("bf16", 900.0), ("fp32", 100.0))))
    assert isinstance(p, Precision) and p.fp32_exposed_ms > 0
    c = _reduce_dtype(bf16)
    assert c.status == "passed" and c.measured_ms == pytest.approx(0.5 * p.fp32_exposed_ms, abs=1e-3)
    c = _reduce_dtype(bf16, dataclasses.replace(DEFAULT, reduce_dtype=0.001))
    assert c.status == "flagged" and c.finding.metrics["exposed_ms_in_fp32_reductions"] == round(p.fp32_exposed_ms, 3)
    f = c.finding
    assert c.reason.startswith("90% of matrix-op time in bf16/fp16 but 100% of the reduced gradient bytes in fp32: "
                               f"about {f.recoverable_ms:.1f} ms per step ({f.share_of_step:.0%}) to gain by "
                               "reducing in bf16")
    # the fp32 reductions per step (15 in 3 steps), a float to two decimals
    n_fp32 = {d: n for d, n, _ in p.reduced}["fp32"]
    per = f.metrics["fp32_reductions_per_step"]
    assert isinstance(per, float) and per == round(n_fp32 / len(run.timelines[0].steps), 2) == 5.0


def test_the_precision_a_model_computes_in_is_the_one_with_most_matrix_time():
    run = shared_run("hta_nccl_data_rank0of2_a100")
    mostly = _with_facts(run, "reduce_dtype", lambda r, f: dataclasses.replace(
        f, matrix_us=(("fp32", 900.0), ("fp64", 100.0))))
    c = _reduce_dtype(mostly)
    assert c.status == "passed" and c.reason.startswith("the model computes in fp32 (100% of matrix-op time)")


def test_a_rank_without_steps_cites_no_event():
    from diagnose.analyzers import reduce_dtype

    run = _full("cpu_reduce_fp32_2rank")
    tl = run.timelines[0]
    got = reduce_dtype.reduce(run.traces[0], dataclasses.replace(tl, steps=Steps.of(tl.steps.frame().iloc[:0])))
    assert got.matrix_row < 0 and got.fp32_rows == () and got.matrix_us == ()


def test_a_rank_without_an_idle_split_is_left_out_of_the_late_ranks_comparison():
    """DLRM's rank 7 is late from device idle, mostly waiting for host launches. With the idle model
    of ranks 1-3 failed, their split is unknown: the comparison is with the median of the ranks
    that have one (counting the unknown as zero idle would make rank 7's excess look larger)."""
    import statistics

    from diagnose.analyzers import why_late
    from diagnose.ingest.assemble import ReduceFailed
    from diagnose.step.breakdown import cause_column

    run = shared_run("param_dlrm_8rank_v100")
    failed = dataclasses.replace(run, idle={**run.idle, **{r: ReduceFailed("idle model failed") for r in (1, 2, 3)}})
    ctx = build_context(failed, {})
    t = ctx.table
    launch = {r: statistics.fmean(t[t["rank"] == r][cause_column("launch")])
              for r in run.ranks if r not in (1, 2, 3)}
    want = launch[7] - statistics.median(v for r, v in launch.items() if r != 7)
    w = why_late.why_late(ctx, 7)
    assert w.source == "host gaps or device idle"
    assert w.detail == f", mostly the device waiting for host launches (+{want:.1f} ms)"


def test_an_op_the_late_rank_spends_exactly_the_floor_more_in_is_named():
    """The op diff names ops from MIN_OP_EXCESS_MS more per step (the healthy floor) up."""
    from diagnose.analyzers import why_late

    run = fixture_run(FIXTURES / "cpu_straggler_2rank")
    base = run.facts[0]["straggler"].ops
    floor = why_late.MIN_OP_EXCESS_MS
    same = _with_facts(run, "straggler", lambda r, f: why_late.RankOps.of(
        base + ((("aten::tiny_op", floor, 1),) if r == 1 else ())))
    assert why_late.why_late(build_context(same, {}), 1).ops == f"aten::tiny_op +{floor:.2f} ms/step (+1 calls)"
    below = _with_facts(run, "straggler", lambda r, f: why_late.RankOps.of(
        base + ((("aten::tiny_op", float(np.nextafter(floor, 0.0)), 1),) if r == 1 else ())))
    assert why_late.why_late(build_context(below, {}), 1).ops == ""


def test_without_a_step_model_the_straggler_is_decided_by_its_wait():
    """No replay (the step model could not be built): the finding keeps the wait it imposes, and the
    reason says who is last and how long the others wait, with no replayed figure."""
    from diagnose.analyzers import straggler

    run = fixture_run(FIXTURES / "cpu_straggler_2rank")
    ctx = dataclasses.replace(build_context(run, {}), model=None)
    c, _ = straggler.analyze(ctx, DEFAULT)
    assert c.status == "flagged" and c.finding.ranks == (1,)
    assert c.reason.startswith("rank 1 is last to arrive at ") and "(replayed)" not in c.reason
    assert f"the others wait {c.finding.metrics['wait_imposed_ms_per_step']:.1f} ms per step for it" in c.reason


def test_one_matched_collective_is_too_few_to_be_sure():
    from diagnose.analyzers import straggler

    run = fixture_run(FIXTURES / "cpu_straggler_2rank")
    ctx = build_context(run, {})
    m = ctx.matched
    first = m.per_collective.iloc[:1]
    key = ["step", "pg", "seq"]
    rows = m.frame().merge(first[key], on=key)
    one = dataclasses.replace(ctx, matched=dataclasses.replace(m, per_collective=first, per_rank=rows), model=None)
    c, _ = straggler.analyze(one, DEFAULT)
    assert c.finding.metrics["collectives_matched"] == 1
    assert c.finding.metrics["note"] == "one collective only: too few to tell a straggler from jitter"
    assert c.finding.confidence == "low"


def test_the_every_step_dataloader_share_is_the_worst_ranks_median_over_the_record():
    """With the probes' every-step record beside the traces, the DataLoader check quotes the
    largest per-rank median of DataLoader wait / step time over the whole record (raw JSON lines;
    step 0 is the warm-up the probes leave out)."""
    import json
    import statistics

    from diagnose.probedata import load_probe_data

    rec = FIXTURES / "light_failslow" / "loader"
    run = fixture_run(FIXTURES / "cpu_straggler_dataloader_2rank")
    c = next(c for c in dataloader.analyze(build_context(run, load_probe_data([rec])), DEFAULT)
             if c.id == "dataloader_starvation")
    shares, counts = [], []
    for r in (0, 1):
        rows = [json.loads(x) for x in (rec / f"rank{r}.steps.jsonl").read_text().splitlines()]
        rows = [x for x in rows if x["step"] >= 1]
        shares.append(statistics.median(x["dataloader_ms"] / x["dur_ms"] for x in rows))
        counts.append(len(rows))
    assert c.finding.metrics["every_step_dataloader_share"] == pytest.approx(max(shares), abs=5e-5)
    assert c.finding.metrics["every_step_steps"] == max(counts)


# ---- gaps of the seed-4 mutation sample (docs/mutation.md) ----

def test_gpu_checks_name_only_the_ranks_over_their_threshold():
    """DLRM's eight ranks all wait for launches and all queue a little; with rank 0's figure set to
    zero, the launch finding names the other seven, not every rank; device_wait with its floor at
    zero likewise leaves out the rank whose queued idle is zero."""
    from diagnose.analyzers import device_wait

    run = shared_run("param_dlrm_8rank_v100")
    low0 = _with_facts(run, "launch_overhead", lambda r, f: dataclasses.replace(
        f, gpu=dataclasses.replace(f.gpu, ms=0.0)) if r == 0 else f)
    assert _launch(low0).finding.ranks == tuple(range(1, 8))
    q0 = _with_facts(run, "device_wait", lambda r, f: dataclasses.replace(f, ms=0.0 if r == 0 else 5.0))
    (c,) = device_wait.analyze(build_context(q0, {}), dataclasses.replace(DEFAULT, device_wait=0.0001))
    assert c.finding is not None and 0 not in c.finding.ranks and len(c.finding.ranks) == 7



def test_exposed_communication_names_the_ranks_over_its_threshold():
    """hta_sampled's two ranks expose communication unequally (95.7 and 99.1 ms per step); decided
    on the check's own figure (no step model) with the threshold between their shares of their
    own steps, only the rank above it is named, not every rank."""
    from diagnose.analyzers import communication

    ctx = dataclasses.replace(build_context(shared_run("hta_sampled_2rank_of128"), {}), model=None)
    exposed, step = ctx.per_rank_mean("exposed_comm_ms"), ctx.per_rank_mean("step_ms")
    share = exposed / step
    assert abs(share[0] - share[1]) > 0.002
    # above the lower rank's share, below the higher's and below the check's own (their median)
    floor = float(share.min() + 0.25 * (share.max() - share.min()))
    (c,) = communication.analyze(ctx, dataclasses.replace(DEFAULT, communication=floor))
    assert c.status == "flagged" and c.finding.ranks == (int(share.idxmax()),)


def test_the_checkpoint_apis_are_listed_sorted_and_comma_separated():
    """Saves through two APIs on the recorded checkpointing job (one of its four saves relabelled
    as a distributed checkpoint, in the probe's sidecar format): the metric lists both."""
    from diagnose.probedata import load_probe_data

    probes = load_probe_data([FIXTURES / "cpu_checkpoint_2rank"])
    saves = [dict(c) for c in probes[0].meta["checkpoints"]]
    saves[1]["api"] = "torch.distributed.checkpoint.save"
    probes = {**probes, 0: dataclasses.replace(probes[0], meta={**probes[0].meta, "checkpoints": saves})}
    (c,) = checkpoint.analyze(build_context(fixture_run(FIXTURES / "cpu_checkpoint_2rank"), probes), DEFAULT)
    assert c.finding.metrics["apis"] == "torch.distributed.checkpoint.save, torch.save"


def test_an_op_and_its_child_starting_together_share_the_parents_time_correctly():
    """Two ops opening at the same microsecond on one thread: the longer is the parent (it is
    sorted first), so the parent keeps its duration less the child's and the child its own."""
    from diagnose.analyzers import common

    tl = _full("cpu_straggler_2rank").timelines[0]
    t0 = float(tl.steps.start[0])
    ev = pd.DataFrame({"kind": pd.Categorical(["cpu_op", "cpu_op"]), "tid": ["1", "1"], "ts": [t0 + 10, t0 + 10],
                       "dur": [4.0, 10.0], "name": pd.Categorical(["aten::mm", "aten::linear"]),
                       "corr": [-1, -1]})
    got = common.host_self_times(ev, tl)
    assert dict(zip(got["name"].astype(str), got["self_us"])) == {"aten::linear": 6.0, "aten::mm": 4.0}


def test_an_op_opening_at_a_steps_first_microsecond_counts_in_that_step():
    """Per-op overhead: an op that starts exactly when a step starts is that step's (not the one
    before, and not outside every step when it is the first)."""
    from diagnose.analyzers import launch

    tl = _full("cpu_straggler_2rank").timelines[0]
    starts = tl.steps.start
    ev = pd.DataFrame({"kind": pd.Categorical(["cpu_op"] * 2), "tid": ["1", "1"],
                       "ts": [starts[0], starts[1]], "dur": [5.0, 5.0],
                       "name": pd.Categorical(["aten::add", "aten::add"]), "corr": [-1, -1]})
    got = launch._op_overhead(ev, dataclasses.replace(tl, dataloader=type(tl.dataloader).empty()))
    assert got.ops_per_step == pytest.approx(2 / len(starts))


def test_a_low_precision_model_with_no_gradient_reduction_passes_under_its_own_title():
    """The A100 job with its compute made bf16 and no reduction recorded: passes, saying so, under
    the check's title."""
    from diagnose.analyzers import reduce_dtype

    run = _with_facts(shared_run("hta_nccl_data_rank0of2_a100"), "reduce_dtype", lambda r, f: dataclasses.replace(
        f, matrix_us=(("bf16", 900.0), ("fp32", 100.0)), reduced=()))
    c = _reduce_dtype(run)
    assert c.status == "passed" and c.title == reduce_dtype.TITLE
    assert c.reason == ("the model computes in low precision (90% of matrix-op time) and no gradient all-reduce "
                        "or reduce-scatter ran in the profiled steps")


def test_collectives_whose_names_disagree_across_ranks_are_counted():
    """The recorded straggler job with two of its matched collectives' names marked as differing
    between ranks (as a sampled or mismatched trace has them): the count is a metric."""
    from diagnose.analyzers import straggler

    ctx = build_context(fixture_run(FIXTURES / "cpu_straggler_2rank"), {})
    pc = ctx.matched.per_collective.copy()
    pc.loc[pc.index[:2], "names_agree"] = False
    ctx = dataclasses.replace(ctx, matched=dataclasses.replace(ctx.matched, per_collective=pc))
    c, _ = straggler.analyze(ctx, DEFAULT)
    assert c.finding is not None and c.finding.metrics["collectives_with_mismatched_names"] == 2


def test_ten_every_step_collectives_decide_the_straggler_verdicts_confidence():
    """DLRM with the straggler threshold at 2% names rank 7 alone (its effect 4.8% of the step, the
    next rank's 1.3%; last in 62.5% of the profiled collectives but holding 92% of their waits for a
    last rank: high, lowered one level for its one step: medium). An every-step record in which
    another rank (0) arrives last at every collective lowers it to medium (then low), from 10 such
    collectives on: 9 are too few; one in which rank 7 does keeps it."""
    from diagnose.analyzers import straggler

    run = shared_run("param_dlrm_8rank_v100")
    th = dataclasses.replace(DEFAULT, straggler=0.02, healthy_floor_ms=0.0)

    def probes(n, late):
        steps = pd.DataFrame({"step": range(1, n + 1), "start": [1000.0 + s for s in range(1, n + 1)],
                              "dur_ms": 1.0, "dataloader_ms": 0.0, "comm_ms": 1.0, "device_ms": np.nan})
        return {r: ProbeData(rank=r, meta={}, steps=steps, collectives=pd.DataFrame(
            [{"step": s, "seq": 0, "name": "all_reduce", "arrival": 1000.0 + s + (0.01 if r == late else 0.0),
              "dur_ms": 1.0, "bytes": 4.0, "group": "default"} for s in range(1, n + 1)])) for r in range(8)}

    confidence, doubt = {}, {}
    for n, late in ((9, 0), (10, 0), (10, 7)):
        c, _ = straggler.analyze(build_context(run, probes(n, late)), th)
        assert c.finding.ranks == (7,) and c.finding.metrics["every_step_collectives"] == n
        assert c.finding.metrics["held_share_of_last_waits"] > 0.9
        confidence[n, late] = c.finding.confidence
        doubt[n, late] = "but over the probes' every-step record" in c.reason
    assert confidence == {(9, 0): "medium", (10, 0): "low", (10, 7): "medium"}
    # the reason says so where the record decides against the window
    assert doubt == {(9, 0): False, (10, 0): True, (10, 7): False}


def test_an_op_run_at_one_size_only_is_work_not_overhead():
    """Per-op overhead: 40 views of 1 us and one 500 us tanh a step (an activation-sized op at its
    one size, whose fastest instance is all work). Its fixed cost is at most launch.FIXED_MOST
    typical ops' (the median op's fastest instance: 1 us), not its 500 us, which a larger
    micro-batch would not amortise (it grows with the batch)."""
    from diagnose.analyzers import launch

    tl = _full("cpu_straggler_2rank").timelines[0]
    steps = tl.steps.start[:2]
    ts, names, durs = [], [], []
    for s in steps:
        ts += [s + 10 + 2 * i for i in range(40)] + [s + 200]
        names += ["aten::view"] * 40 + ["aten::tanh"]
        durs += [1.0] * 40 + [500.0]
    n = len(ts)
    ev = pd.DataFrame({"kind": pd.Categorical(["cpu_op"] * n), "tid": ["1"] * n, "ts": ts, "dur": durs,
                       "name": pd.Categorical(names), "corr": [-1] * n})
    got = launch._op_overhead(ev, dataclasses.replace(tl, dataloader=type(tl.dataloader).empty()))
    assert got.fixed_cost_us == 1.0
    per_step = (40 * 1.0 + launch.FIXED_MOST * 1.0) / 1000  # ms, on the two steps that hold the ops
    assert got.ms == pytest.approx(per_step * 2 / len(tl.steps.start))


@pytest.mark.parametrize("name", ["cpu_2d_4rank", "cpu_fsdp2_straggler_2rank", "cpu_checkpoint_2rank",
                                  "cpu_interleaved_2rank"])
def test_framework_spans_are_not_per_op_overhead(name):
    """Recorded jobs whose FSDP spans (post_backward_reduce, all_gather), optimizer step, pipeline
    stage spans (PP:0B1) and checkpoint save held 6.8-40.6 ms a step of self time that is not in
    any op: counted whole as fixed cost, they read as "micro-batch too small" until 2026-12-07."""
    from tests.conftest import fixture_diagnosis

    d = fixture_diagnosis(FIXTURES / name)
    c = next(c for c in d.checks if c.id == "launch_overhead")
    step = sum(d.run.mean_step_ms.values()) / len(d.run.mean_step_ms)
    assert c.status == "passed" and c.measured_ms < 0.05 * step, c.reason
