"""Real jobs for the checks beyond the classic four.

- pipeline_bubble: a real 2-stage GPipe pipeline over gloo (examples/pipeline_parallel.py, hand-written
  and through torch.distributed.pipelining's ScheduleGPipe); the measured stage idle must track the
  fill-drain bound (p - 1) / (m + p - 1).
- checkpoint_io, device_memory, host_sync: `diagnose run` on a real 2-rank DDP job with Adam
  that saves every 3 steps (examples/train_checkpoint.py).
- On a CUDA machine, a one-process run with .item() every step: device peaks and syncs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diagnose.pipeline import diagnose_paths
from tests.conftest import ROOT, _free_port, run_dir

pytestmark = pytest.mark.e2e
torch = pytest.importorskip("torch")

PIPELINE = ROOT / "examples" / "pipeline_parallel.py"
CHECKPOINT = ROOT / "examples" / "train_checkpoint.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# Measured idle vs the GPipe bound, absolute: the bound assumes every stage has a core of its own
# and free hand-offs. Here Python time between ops counts as idle, each send/recv hand-off costs
# a scheduler wake-up, and two ranks share a 2-core host, so the idle lies above the bound, by
# more the more hand-offs (measured 0.45-0.55 at m=1, 0.20-0.35 at m=4 with other jobs running
# beside them; on a quiet machine, 4 runs of each, 2026-12-05: 0.518-0.522 at m=1, 0.265-0.297 at
# m=4 hand-written and through ScheduleGPipe; once in CI, 0.353 at m=4). Below the bound only by
# the noise of timing one step: a bubble reported much smaller than fill and drain allow is wrong.
BELOW_BOUND, ABOVE_BOUND = 0.05, 0.2
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the example runs on CUDA here; CPU behaviour")


def torchrun(script: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={_free_port()}", str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=ENV, cwd=ROOT)


def diagnose_run(out: Path, *command: str, schedule: str = "2,2,5") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "diagnose.cli", "run", "--out", str(out), "--schedule", schedule, "--", *command]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=ENV, cwd=ROOT)


def checks(path: Path) -> dict:
    return {c.id: c for c in diagnose_paths([path]).checks}


# ---- pipeline bubbles ---------------------------------------------------------------

@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """pipeline(m, library) -> the pipeline_bubble check of that run (each run once per module)."""
    runs: dict[tuple[int, bool], object] = {}

    def get(m: int, library: bool = False):
        if (m, library) not in runs:
            d = tmp_path_factory.mktemp(f"pp_m{m}{'_lib' if library else ''}")
            res = torchrun(PIPELINE, "--microbatches", str(m), "--trace-dir", str(d), *(["--library"] * library))
            assert res.returncode == 0, res.stderr[-3000:]
            runs[m, library] = checks(d)["pipeline_bubble"]
        return runs[m, library]

    return get


@cpu_only
@pytest.mark.parametrize("m, library", [(1, False), (4, False), (4, True)],
                         ids=["hand-m1", "hand-m4", "ScheduleGPipe-m4"])
def test_bubble_tracks_gpipe_bound(pipeline, m, library):
    c = pipeline(m, library)
    f = c.finding
    assert f is not None and f.metrics["stages"] == 2 and f.metrics["microbatches"] == m
    assert f.metrics["microbatches_source"] == "micro-batch labels"  # "Forward {i}", as ScheduleGPipe writes
    bound = 1 / (m + 1)
    assert f.metrics["bound_fraction"] == pytest.approx(bound, abs=1e-4)
    measured = f.metrics["idle_fraction"]
    print(f"p=2 m={m} {'ScheduleGPipe' if library else 'hand-written'}: measured idle {measured:.3f} "
          f"vs bound {bound:.3f}")
    assert -BELOW_BOUND <= measured - bound <= ABOVE_BOUND, f.metrics
    assert c.status == "flagged"  # 20% and 50% idle: above the 10% line either way
    assert f.events and all(e.name in ("gloo:recv", "c10d::recv_") for e in f.events)


@cpu_only
def test_more_microbatches_shrink_the_bubble(pipeline):
    assert pipeline(4).finding.metrics["idle_fraction"] < pipeline(1).finding.metrics["idle_fraction"] - 0.1


@cpu_only
def test_unbalanced_stage_is_named(tmp_path):
    res = torchrun(PIPELINE, "--microbatches", "4", "--stage-layers", "1,4", "--trace-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    f = checks(tmp_path)["pipeline_bubble"].finding
    assert f.metrics["slowest_stage_rank"] == 1 and f.metrics["stage_imbalance"] >= 0.2, f.metrics
    assert "Rebalance layers: stage rank 1" in f.fix


# ---- checkpoint I/O, memory arithmetic, host syncs on one real DDP job ----------------

@pytest.fixture(scope="module")
def ddp_ckpt(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("ckpt_direct")
    res = diagnose_run(out, sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                       f"--master_port={_free_port()}", str(CHECKPOINT), "--steps", "12", "--save-every", "3",
                       "--save-mode", "direct", "--save-dir", str(out / "ckpt"))
    assert res.returncode == 0, res.stderr[-3000:]
    out = run_dir(out)  # `diagnose run` wrote into a fresh OUT/<time>/
    return out, checks(out / "traces")


@cpu_only
def test_checkpoint_every_n_steps(ddp_ckpt):
    out, c = ddp_ckpt
    ck = c["checkpoint_io"]
    m = ck.finding.metrics
    assert m["every_n_steps"] == 3 and m["checkpoints"] == 3  # steps 3, 6, 9 inside the loop
    assert m["saves_outside_steps"] == 1  # step 12: after the last optimizer step
    assert m["writing_ranks"] == "0" and "rank 0 writes every checkpoint alone" == m["risk_single_writer"]
    assert m["risk_direct_writes"].startswith("4 of 4")
    assert m["bytes_per_checkpoint"] > 32 * 1024**2  # the 32 MiB extra buffer + model + Adam state
    # independent of the analyzer: the sidecar's save times, spread over the probed steps
    side = json.loads((out / "traces" / "rank0.probe.json").read_text())["meta"]
    probed = [json.loads(line) for line in (out / "traces" / "rank0.steps.jsonl").read_text().splitlines()]
    probed = [r for r in probed if r["step"] > 0]
    inside = sum(s["ms"] for s in side["checkpoints"] if 1 <= s["step"] <= probed[-1]["step"])
    assert ck.finding.recoverable_ms == pytest.approx(inside / len(probed), rel=1e-3)
    # the steps that saved are longer than the others by about the save time
    saved = {s["step"] for s in side["checkpoints"]}
    slow = sorted(r["dur_ms"] for r in probed if r["step"] in saved)
    fast = sorted(r["dur_ms"] for r in probed if r["step"] not in saved)
    assert slow[len(slow) // 2] - fast[len(fast) // 2] > 0.5 * m["ms_per_checkpoint"]
    assert ck.status == "flagged", ck.reason
    assert any(e.name == "diagnose::checkpoint torch.save" for e in ck.finding.events)


@cpu_only
def test_memory_arithmetic_on_cpu_run(ddp_ckpt):
    _, c = ddp_ckpt
    mem = c["device_memory"]
    assert mem.status == "not_measurable" and "not measurable on CPU" in mem.reason
    m = mem.finding.metrics
    p = 256 * 512 + 512 + 512 * 512 + 512 + 512 + 1  # the example's three Linear layers
    assert m["params"] == p and m["optimizer"] == "Adam"
    assert m["arithmetic_bytes_per_param"] == 16  # fp32: weights 4 + grads 4 + Adam moments 8
    assert m["model_state_source"] == "measured"
    assert m["weights_bytes"] == 4 * p and m["grads_bytes"] == 4 * p
    assert 8 * p <= m["optimizer_state_bytes"] <= 8 * p + 6 * 8  # + Adam's scalar step per tensor
    assert m["model_state_bytes_per_param"] == pytest.approx(16, abs=0.01)
    assert m["data_parallel_size"] == 2
    assert m["advice4_sharding_frees_bytes"] == m["model_state_bytes"] // 2  # ZeRO-3 over 2 ranks
    assert mem.finding.recoverable_ms == 0  # capacity, not time


@cpu_only
def test_host_sync_and_pipeline_on_cpu_ddp_run(ddp_ckpt):
    _, c = ddp_ckpt
    assert c["host_sync"].status == "not_measurable" and "not measurable on CPU" in c["host_sync"].reason
    assert c["pipeline_bubble"].status == "passed"


@cpu_only
def test_atomic_saves_are_not_direct_writes(tmp_path):
    res = diagnose_run(tmp_path, sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                       f"--master_port={_free_port()}", str(CHECKPOINT), "--steps", "7", "--save-every", "3",
                       "--save-mode", "atomic", "--save-dir", str(tmp_path / "ckpt"))
    assert res.returncode == 0, res.stderr[-3000:]
    m = checks(run_dir(tmp_path) / "traces")["checkpoint_io"].finding.metrics
    assert m["risk_direct_writes"] == "none" and m["checkpoints"] == 2


# ---- CUDA: device peaks and .item() syncs ----------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_memory_peaks_and_item_syncs(tmp_path):
    res = diagnose_run(tmp_path, sys.executable, str(CHECKPOINT), "--steps", "12", "--save-every", "0",
                       "--log-every", "1", "--batch-size", "4096")
    assert res.returncode == 0, res.stderr[-3000:]
    c = checks(run_dir(tmp_path) / "traces")
    mem = c["device_memory"]
    m = mem.finding.metrics
    assert mem.status in ("passed", "flagged") and m["device"] == "cuda"
    assert m["model_state_bytes_per_param"] == pytest.approx(16, abs=0.01)
    assert m["peak_allocated_bytes"] >= m["model_state_bytes"] and m["activations_bytes"] > 0
    assert 0 < m["headroom"] < 1
    hs = c["host_sync"]
    assert hs.status in ("passed", "flagged") and hs.finding.metrics["sync_calls_per_step"] >= 1
    assert ".item()" in hs.finding.metrics["calls_by_cause_all_ranks"], hs.finding.metrics
