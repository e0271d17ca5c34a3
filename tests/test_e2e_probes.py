"""`diagnose run` on the unmodified example script: real 2-rank gloo jobs, probes injected."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

from diagnose.pipeline import diagnose_paths
from tests.conftest import EXAMPLE, ROOT, _free_port, run_dir

FIXTURES = ROOT / "tests" / "fixtures"

pytestmark = pytest.mark.e2e
pytest.importorskip("torch")


def diagnose_run(out, *script_args, nproc=2, schedule="2,2,5"):
    cmd = [sys.executable, "-m", "diagnose.cli", "run", "--out", str(out), "--schedule", schedule, "--",
           sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={_free_port()}", str(EXAMPLE), *script_args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def verdict(out):
    return json.loads((run_dir(out) / "diagnosis.json").read_text())


@pytest.mark.parametrize("pathology, top, ranks, nproc", [
    ("dataloader", "dataloader_starvation", None, 2),
    ("straggler", "straggler", [1], 2),
    # Per-op overhead is each rank's own cost, so this one runs on one rank. With two, this 2-core
    # host drifts through phases of several steps where one rank runs ~30% slower (seen in the step
    # logs with the profiler off too): a real straggler, as large as the per-op overhead (24-28% of
    # the step), ranked above it in 1 of 4, 0 of 8 and 3 of 8 runs of 2 ranks (and once in CI).
    ("tiny-batch", "launch_overhead", [0], 1),
])
def test_injected_cause_ranks_first(tmp_path, pathology, top, ranks, nproc):
    res = diagnose_run(tmp_path, "--pathology", pathology, nproc=nproc)
    assert res.returncode == 0, res.stderr[-3000:]
    # the probes' own noise is silenced (kineto's per-window lines); the outputs are named
    assert "USDT" not in res.stderr + res.stdout, res.stderr[-2000:]
    assert f"wrote {run_dir(tmp_path) / 'diagnosis.json'}" in res.stdout
    d = verdict(tmp_path)
    assert d["findings"][0]["id"] == top, res.stdout
    # the step graph replays this real job's steps within 5% (#15 fidelity)
    assert d["extras"]["replay"]["fidelity_max_error"] <= 0.05
    if ranks:
        assert d["findings"][0]["ranks"] == ranks
    assert (run_dir(tmp_path) / "report.html").exists()
    sidecars = sorted(p.name for p in (run_dir(tmp_path) / "traces").glob("rank*.probe.json"))
    assert sidecars == [f"rank{r}.probe.json" for r in range(nproc)]
    # the launcher's hooks time garbage collections (gc_pause reads them over the run) and mark
    # the training iterator's first fetch (step 0 here: one epoch)
    meta = json.loads((run_dir(tmp_path) / "traces" / "rank0.probe.json").read_text())["meta"]
    assert meta["gc"]["timed"] is True
    assert next(c for c in d["checks"] if c["id"] == "gc_pause")["status"] != "not_measurable"
    first = json.loads((run_dir(tmp_path) / "traces" / "rank0.steps.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and 0 < first.get("first_batch_ms", 0) <= first["dataloader_ms"], first


def test_accumulation_without_no_sync_is_named(tmp_path):
    """4 micro-batches per step, each all-reduced (the loop forgets no_sync()): grad_sync flags it
    with the count as evidence (the same job with no_sync() is the recorded fixture
    tests/fixtures/cpu_accum_2rank, where it passes)."""
    res = diagnose_run(tmp_path, "--pathology", "accum-no-sync", "--steps", "9")
    assert res.returncode == 0, res.stderr[-3000:]
    d = verdict(tmp_path)
    f = next(f for f in d["findings"] if f["id"] == "grad_sync")
    m = f["metrics"]
    assert m["micro_batches_per_step"] == 4 and f["ranks"] == [0, 1], m
    assert m["allreduces_before_last_micro_batch"] == 0.75 * m["allreduces_per_step"], m
    assert "no_sync()" in f["fix"] and f["events"], f
    # the probes saw the same: every step record holds 4 bucket all-reduces per bucket
    steps = [json.loads(x) for x in (run_dir(tmp_path) / "traces" / "rank0.steps.jsonl").read_text().splitlines()]
    counts = {sum(c[0] == "ddp_bucket_allreduce" for c in s["collectives"]) for s in steps[1:]}
    assert len(counts) == 1 and counts.pop() % 4 == 0, steps[1]


def test_a_users_bf16_comm_hook_runs_under_the_probes_and_reads_as_bf16(tmp_path):
    """A bf16-autocast model whose gradients go through the user's own bf16 compression hook: the
    probes wrap that hook (the job runs, its all-reduce is timed) and reduce_dtype reads the
    reductions as bf16. Its fp32 twin is the recorded fixture tests/fixtures/cpu_reduce_fp32_2rank
    (tests/test_reduce_dtype.py), where on gloo the mismatch is named but not advised."""
    res = diagnose_run(tmp_path, "--pathology", "fp32-reduce", "--comm-hook", "bf16", "--steps", "9")
    assert res.returncode == 0, res.stderr[-3000:]
    d = verdict(tmp_path)
    c = next(c for c in d["checks"] if c["id"] == "reduce_dtype")
    assert c["status"] == "passed" and "reduced in bf16" in c["reason"], c
    steps = [json.loads(x) for x in (run_dir(tmp_path) / "traces" / "rank0.steps.jsonl").read_text().splitlines()]
    assert all(any(x[0] == "ddp_bucket_allreduce" for x in s["collectives"]) for s in steps[1:]), steps[1]


def test_healthy_run_flags_nothing(tmp_path):
    # On this two-core VM the two cores are not equal: a spin loop pinned to each ran 25.7M and
    # 21.5M iterations side by side (and 25.9M / 38.3M alone) on 2026-12-01, so one rank of a
    # healthy job can be steadily slower for a whole run (last at 80-100% of its collectives,
    # 12-45 ms a step, in 3 of 6 runs). That rank IS a straggler, made by the host, and naming it
    # (with where its time went) is right; it is the only cause host speed can make. So: a clean
    # verdict on one of two runs, or only a straggler that says what it is late from; any other
    # cause is the tool's false positive.
    runs = []
    for attempt in range(2):
        out = tmp_path / f"attempt{attempt}"
        res = diagnose_run(out, "--pathology", "none")
        assert res.returncode == 0, res.stderr[-3000:]
        d = verdict(out)
        runs.append((d["findings"], res.stdout))
        if not d["findings"]:
            assert "no significant cause" in res.stdout
            return
    for findings, stdout in runs:
        assert all(f["id"] == "straggler" and f["metrics"].get("late_from") for f in findings), stdout


def test_exit_code_passes_through(tmp_path):
    res = subprocess.run([sys.executable, "-m", "diagnose.cli", "run", "--out", str(tmp_path), "--",
                          sys.executable, "-c", "import torch, sys; sys.exit(3)"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 3


def test_a_job_profiling_itself_runs_to_its_end_under_the_probes(tmp_path):
    """Until 2026-12-06 both ranks died in their own `prof.step()`: "Profiler is already enabled
    on this thread" (the probe's profiler held torch's one slot). Now the probes' stands aside,
    and (since 2026-12-07) the launcher analyses the traces the job wrote in this run, which the
    probes saw it export, with their records; before, it said to run `diagnose analyze` by hand.
    A stale trace of an earlier run in the same directory is not one of them."""
    own = tmp_path / "own"
    own.mkdir()
    stale = next((FIXTURES / "cpu_straggler_2rank").glob("rank0.*.pt.trace.json.gz"))
    shutil.copy(stale, own / stale.name)
    res = diagnose_run(tmp_path / "run", "--steps", "12", "--trace-dir", str(own), schedule="1,1,2")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("the job ran its own torch.profiler") == 1, res.stderr[-3000:]
    assert "analysing the 2 trace(s) the job wrote in this run" in res.stderr, res.stderr[-3000:]
    d = verdict(tmp_path / "run")
    assert sorted(d["run"]["ranks_found"]) == [0, 1] and stale.name not in str(d["run"]["files"])
    assert set(d["run"]["metadata"]["probe_steps"]) == {"0", "1"}
    assert not any("stood aside" in w for w in d["warnings"]), d["warnings"]  # the job's traces are whole
    (own / stale.name).unlink()  # what follows reads the job's directory as a user would
    traces = run_dir(tmp_path / "run") / "traces"
    assert not list(traces.glob("*.pt.trace.json*"))
    for r in (0, 1):  # every step still timed by the probes
        assert len((traces / f"rank{r}.steps.jsonl").read_text().splitlines()) >= 12
    # the job's own traces are whole: they analyse as a 2-rank run
    assert sorted({p.name.split(".")[0] for p in own.glob("rank*.pt.trace.json.gz")}) == ["rank0", "rank1"]
    assert diagnose_paths([own]).run.ranks_found == (0, 1)
    # and with the probes' records, as the launcher's line says
    joined = diagnose_paths([own], probe_paths=[own, traces])
    steps = joined.run.metadata["probe_steps"]
    assert set(steps) == {0, 1} and min(steps.values()) >= 10


def test_a_job_torchelastic_restarts_is_diagnosed_from_its_last_attempt(tmp_path):
    """Until 2026-12-07 a job restarted by `torchrun --max-restarts` ran to its end, and then
    `diagnose run` said "could not analyse the run: two traces for rank 0 (mixed runs?)": the
    restarted ranks wrote beside the failed attempt's files and appended to its step logs. Each
    attempt now has its own directory; the last one is analysed, the restart named.

    c10d rendezvous with its own store: torch 2.13's store shared with the rendezvous gives a
    restarted gloo job the failed attempt's peer addresses (pytorch/pytorch#135712, #167288), and
    its restart fails without the probes too (2 of 5 here with the static rendezvous)."""
    cmd = [sys.executable, "-m", "diagnose.cli", "run", "--out", str(tmp_path), "--",
           sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{_free_port()}", str(EXAMPLE),
           "--steps", "16", "--straggler-rank", "1", "--straggler-ms", "120", "--crash-rank", "1",
           "--crash-at-step", "10"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, check=False,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    traces = run_dir(tmp_path) / "traces"
    assert sorted(p.name for p in traces.iterdir()) == ["attempt0", "attempt1"]
    for a in ("attempt0", "attempt1"):  # each attempt whole on its own: one trace and one step log a rank
        assert sorted(p.name.split(".")[0] for p in (traces / a).glob("*.pt.trace.json.gz")) == ["rank0", "rank1"]
    first = [json.loads(x)["step"] for x in (traces / "attempt1" / "rank0.steps.jsonl").read_text().splitlines()]
    assert first == list(range(16))
    d = verdict(tmp_path)
    assert all("/attempt1/" in f for f in d["run"]["files"].values()), d["run"]["files"]
    assert d["findings"][0]["id"] == "straggler" and d["findings"][0]["ranks"] == [1], res.stdout
    assert any("restarted by torchelastic (2 attempts)" in w and "attempt0" in w for w in d["warnings"])


def test_a_job_over_two_nodes_is_analysed_once_with_every_rank(tmp_path):
    """Two `diagnose run` launchers, one a "node" (here on one host), of one `torchrun --nnodes 2`
    job, rank 1 sleeping 100 ms a step. Each node's run directory alone reads the other's sleep
    as waiting (the caution beside each verdict); side by side in one --out, the launchers find
    each other's run (diagnose/multinode.py) and one of them analyses every rank: rank 1, a
    straggler."""
    port = _free_port()
    cmd = lambda node: [sys.executable, "-m", "diagnose.cli", "run", "--out", str(tmp_path), "--",
                        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                        "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}",
                        str(EXAMPLE), "--steps", "16", "--straggler-rank", "1", "--straggler-ms", "100"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(cmd(k), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
             for k in (0, 1)]
    outs = [p.communicate(timeout=240) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [e[-3000:] for _, e in outs]
    runs = sorted(d for d in tmp_path.iterdir() if d.is_dir())
    assert len(runs) == 2
    for r in runs:  # each node's own analysis, with what it cannot see said
        own = json.loads((r / "diagnosis.json").read_text())
        assert len(own["run"]["ranks_found"]) == 1 and len(own["run"]["ranks_missing"]) == 1
    together = [r / "all-nodes" for r in runs if (r / "all-nodes" / "diagnosis.json").exists()]
    assert len(together) == 1, [e[-2000:] for _, e in outs]
    d = json.loads((together[0] / "diagnosis.json").read_text())
    assert d["run"]["ranks_found"] == [0, 1] and not d["run"]["ranks_missing"]
    assert d["findings"][0]["id"] == "straggler" and d["findings"][0]["ranks"] == [1], d["findings"][:2]
    said = "".join(e for _, e in outs)
    assert said.count("every node's ranks together:") == 1, said[-3000:]
    assert f"analysed together by another node's launcher, into {together[0]}" in said, said[-3000:]


def test_single_process_script(tmp_path):
    res = subprocess.run([sys.executable, "-m", "diagnose.cli", "run", "--out", str(tmp_path), "--",
                          sys.executable, str(EXAMPLE), "--steps", "10"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    d = verdict(tmp_path)
    assert d["run"]["ranks_found"] == [0]


def test_unwritable_output_training_survives(tmp_path):
    """A probe that cannot write logs one warning; the job finishes with its own exit code."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the output directory should be")
    if os.access(tmp_path, os.W_OK) and os.geteuid() != 0:
        os.chmod(tmp_path, stat.S_IRUSR | stat.S_IXUSR)  # as non-root, a read-only parent as well
    from diagnose.launch import probe_env

    env = probe_env(blocker / "traces", "1,1,2")
    res = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "6"], env=env, capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stderr.count("training continues") == 1, res.stderr[-2000:]
    # and through the launcher: it warns once and runs the job without probes
    res = diagnose_run(blocker / "run", "--steps", "6")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("without probes") == 1, res.stderr[-3000:]


def test_rank_exiting_early_is_reported_missing(tmp_path):
    diagnose_run(tmp_path, "--exit-early-rank", "1", "--exit-early-step", "5", schedule="1,1,6")
    d = diagnose_paths([run_dir(tmp_path) / "traces"])
    assert d.run.ranks_missing == (1,)
    assert any("1 of 2 ranks" in w for w in d.warnings)


def test_disk_full_training_survives(tmp_path):
    """Writes fail with EFBIG past a 64 KB file-size limit (a full disk, as far as the probe can
    tell): the probes switch off what fails, training finishes, what was written stays readable."""
    import resource

    from diagnose.launch import probe_env
    from diagnose.probedata import load_probe_data

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    out = tmp_path / "traces"
    env = probe_env(out, "1,1,3")
    res = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "12", "--step-log", str(tmp_path / "ok")],
                         env=env, capture_output=True, text=True, timeout=120, cwd=ROOT, preexec_fn=limit)
    assert res.returncode == 0, res.stderr[-2000:]
    # the job itself ran every step (its own log is tiny)
    assert len((tmp_path / "ok.rank0").read_text().split()) == 12
    assert "trace export disabled after error" in res.stderr
    # no half-written trace is left under a trace name; the step log is whole lines or skipped ones
    assert not list(out.glob("rank0.*.pt.trace.json.gz"))
    probes = load_probe_data([out])
    assert 0 in probes and len(probes[0].steps) >= 1


def test_sigterm_during_trace_write_leaves_complete_or_no_trace(tmp_path):
    """SIGTERM while the profiler window is exported: every trace left is whole, the step log readable."""
    import signal
    import time

    from diagnose.ingest import load_trace
    from diagnose.launch import probe_env
    from diagnose.probedata import load_probe_data

    out = tmp_path / "traces"
    env = probe_env(out, "2,1,6")
    job = subprocess.Popen([sys.executable, str(EXAMPLE), "--steps", "400", "--batch-size", "64"], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + 90
    hit = False
    while time.monotonic() < deadline and job.poll() is None:
        # the exporter's temp directory appears in the probe directory while the trace is written
        # (`.rank0.<stamp>.pt.trace.json.gz.<hex>.tmp`; the sidecar's, `.rank0.probe.json...`, comes
        # at step 1, before any step but the excluded warm-up one is recorded: once caught here)
        if out.exists() and any(p.name.startswith(".rank0.") and ".pt.trace." in p.name for p in out.iterdir()):
            hit = True
            break
        time.sleep(0.002)
    job.send_signal(signal.SIGTERM)
    job.communicate(timeout=60)
    for trace in out.glob("rank0.*.pt.trace.json.gz"):
        t = load_trace(trace)
        assert not t.salvaged and len(t.events) > 0, trace
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temp files left behind"
    assert len(load_probe_data([out])[0].steps) >= 1
    if not hit:
        pytest.skip("the export finished before the test could catch it; checked a plain SIGTERM instead")
