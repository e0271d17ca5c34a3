"""Command line: thin click commands; the work lives in testable functions."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from diagnose import __version__
from diagnose.errors import DiagnoseError, one_line
from diagnose.units import rank_ranges

if TYPE_CHECKING:
    from diagnose.output import HtaOptions


def fail(msg: str) -> NoReturn:
    click.echo(f"diagnose: error: {one_line(msg)}", err=True)
    sys.exit(2)


def note(msg: str) -> None:
    click.echo(one_line(msg), err=True)


def check_schedule(text: str) -> None:
    """The profiler schedule, checked here with the probes' own parser: a bad one is one line and
    exit 2 before any job starts, not a warning from every rank."""
    from diagnose.probes.core import Schedule

    try:
        Schedule.parse(text)
    except ValueError as exc:
        fail(f"--schedule: {exc}")


CAPTURE_STALE_S, CAPTURE_STALE_STEPS = 60.0, 20
"""`capture` refuses a run none of whose ranks finished a step for this long (a checkpoint save or
an evaluation pass can take tens of seconds: only a clearly stale log is refused)."""


def refuse_finished(pdir: Path, what: str) -> None:
    """`capture` and `hang` talk to a running job: a finished run (its lock released) is refused
    at once instead of after the whole timeout."""
    from diagnose.rundir import run_is_live, run_of

    if run_is_live(pdir) is False:
        fail(f"{run_of(pdir)}: the run has finished (no process holds its lock); {what}")


@click.group()
@click.version_option(__version__, prog_name="diagnose")
def main() -> None:
    """Why is my distributed PyTorch job slow? Ranked causes from torch.profiler traces."""
    from diagnose.heap import keep_large_blocks_mapped  # light: ctypes alone

    keep_large_blocks_mapped()  # first, before any table is made (diagnose/heap.py: why)


LINK_HELP = ("The link's peak bus bandwidth in GB/s, within a host and between hosts (what nccl-tests' "
             "all_reduce_perf reaches on these machines): each process group's bandwidth is judged against it.")


def parse_link(text: str | None):
    """--link-gbps as a LinkSpec (None when not given); a bad one is one line and exit 2."""
    if text is None:
        return None
    from diagnose.step.link import LinkSpec  # light: no pandas behind it

    try:
        return LinkSpec.parse(text)
    except ValueError as exc:
        fail(f"--link-gbps: {exc}")


CLUSTER_HELP = ("Read the traces on the workers of a Dask cluster, where they lie: a scheduler's address "
                "(tcp://HOST:8786) or local:N for a LocalCluster of N worker processes here. Paths are listed on "
                "the workers ($VAR and ~ expanded there); only each rank's summary travels back. "
                "Needs pip install 'torch-diagnose[dask]' on the client and every worker.")
LOCAL_PATH_HELP = ("With --cluster: a directory on each worker's own disk holding some of the ranks' traces "
                   "(e.g. '$SLURM_TMPDIR/traces'); each worker reads what it sees there, each file once. Repeatable.")


def cluster_paths(paths: tuple[str, ...], cluster: str | None, local_path: tuple[str, ...], hta: bool = False) -> list[str]:
    """The paths to read, with --cluster's rules checked (one line and exit 2 otherwise)."""
    from diagnose.ingest.cluster import paths_to_read  # dask itself is imported only to connect

    try:
        return paths_to_read(paths, cluster, local_path, hta)
    except DiagnoseError as exc:
        fail(str(exc))


def analyze_and_write(paths: list[str], out: Path, max_trace_gb: float = 8.0, jobs: int | None = None,
                      hta: HtaOptions | None = None, link=None, cluster: str | None = None,
                      probe_paths: list[str] | None = None, window: int | None = None,
                      run_k: int | None = None) -> int:
    """Diagnose traces, write DIR/diagnosis.json and DIR/report.html, print the summary."""
    try:
        from diagnose.output import analyze_outputs  # lazily: the CLI starts light

        analyze_outputs(paths, out, max_trace_gb, jobs, hta=hta, link=link, cluster=cluster,
                        probe_paths=probe_paths, window=window, run_k=run_k)
    except DiagnoseError as exc:
        fail(str(exc))
    return 0


@main.command()
@click.argument("trace_dir", nargs=-1)
@click.option("--out", "out", default="diagnosis", show_default=True, type=click.Path(path_type=Path),
              help="Directory for diagnosis.json and report.html.")
@click.option("--max-trace-gb", default=8.0, show_default=True, help="Refuse traces that expand beyond this.")
@click.option("--jobs", default=None, type=int, help="Parallel parse processes (default: CPU count).")
@click.option("--hta/--no-hta", default=False, show_default=True,
              help="Add Holistic Trace Analysis as a second opinion on GPU traces (pip install 'torch-diagnose[hta]').")
@click.option("--hta-budget-mb", default=256.0, show_default=True,
              help="Largest expanded trace size (all ranks) HTA may load.")
@click.option("--hta-timeout", default=180.0, show_default=True, help="Seconds HTA may run before it is stopped.")
@click.option("--link-gbps", default=None, metavar="INTRA[,INTER]", help=LINK_HELP)
@click.option("--cluster", default=None, metavar="ADDRESS", help=CLUSTER_HELP)
@click.option("--local-path", "local_path", multiple=True, metavar="DIR", help=LOCAL_PATH_HELP)
@click.option("--probes", "probes", multiple=True, metavar="RUN_DIR",
              help="A `diagnose run` directory whose probe records (every step's time, the collectives, "
                   "input waits, run facts) go with these traces: for a job that ran its own profiler.")
@click.option("--window", "window", default=None, type=int, metavar="K",
              help="Traces of a profiler schedule that repeats (a trace a rank a window): analyse window K "
                   "(1 the first, -1 the last every rank wrote) instead of the last whole one.")
@click.option("--run", "run_k", default=None, type=int, metavar="K",
              help="A directory holding several runs' traces (a job rerun into it): analyse run K (1 the "
                   "first, -1 the newest); without it such a directory is refused, never guessed.")
def analyze(trace_dir: tuple[str, ...], out: Path, max_trace_gb: float, jobs: int | None, hta: bool,
            hta_budget_mb: float, hta_timeout: float, link_gbps: str | None, cluster: str | None,
            local_path: tuple[str, ...], probes: tuple[str, ...], window: int | None, run_k: int | None) -> None:
    """Diagnose saved per-rank traces (a directory, or files)."""
    from diagnose.output import HtaOptions

    link = parse_link(link_gbps)
    paths = cluster_paths(trace_dir, cluster, local_path, hta)
    opts = HtaOptions(hta_budget_mb, hta_timeout) if hta else None
    probe_paths = None
    if probes:  # besides the sidecars beside the traces, as without the option
        probe_paths = [p for p in paths if Path(p).exists()] + [str(probe_records(Path(p))) for p in probes]
    if window == 0:
        fail("--window 0: windows count from 1 (the first) or from -1 (the last every rank wrote)")
    if run_k == 0:
        fail("--run 0: runs count from 1 (the first) or from -1 (the newest)")
    sys.exit(analyze_and_write(paths, out, max_trace_gb, jobs, opts, link, cluster, probe_paths, window, run_k))


def probe_records(path: Path) -> Path:
    """The directory of a run's probe records: RUN_DIR/traces, or the directory given (of a job
    torchelastic restarted, its last attempt's)."""
    from diagnose.probedata import has_records
    from diagnose.rundir import last_attempt

    d = path / "traces" if (path / "traces").is_dir() else path
    d, restarted = last_attempt(d, has_records)
    try:
        next(d.iterdir(), None)
    except OSError as exc:
        fail(f"--probes {one_line(str(path))}: cannot read ({one_line(exc.strerror or str(exc))})")
    if not has_records(d):
        fail(f"--probes {one_line(str(path))}: no probe records (rank*.probe.json, rank*.steps.jsonl)")
    if restarted:
        click.echo(f"diagnose: {one_line(restarted)}", err=True)
    return d


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--out", "out", default="runs", show_default=True, type=click.Path(path_type=Path),
              help="Parent directory: each run writes into a fresh OUT/<YYYYmmdd-HHMMSS>/ holding traces/ "
                   "(per-rank traces and sidecars), diagnosis.json, report.html.")
@click.option("--schedule", default="2,2,5", show_default=True,
              help="Profiler schedule wait,warmup,active[,repeat] in steps; 'off' for timings only.")
@click.option("--flight-recorder", is_flag=True,
              help="Turn on torch.distributed's Flight Recorder so that `diagnose hang` can name a stuck rank "
                   "(TORCH_FR_BUFFER_SIZE=2000; off by default: torch 2.13 with it aborted a gloo job at exit "
                   "in 1 of 8 runs here).")
@click.option("--link-gbps", default=None, metavar="INTRA[,INTER]", help=LINK_HELP)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(out: Path, schedule: str, flight_recorder: bool, link_gbps: str | None, command: tuple[str, ...]) -> None:
    """Run an unmodified training command with the probes, then diagnose it.

    \b
    diagnose run --out runs/exp1 -- torchrun --nproc_per_node=4 train.py --lr 0.1
    diagnose run -- python train.py

    Ctrl-C, SIGTERM and SIGHUP are passed on to the job, which is then analysed as far as it got.
    Exits with the training command's exit code (128+N when a signal N ended it).
    """
    from diagnose.launch import run_with_probes

    check_schedule(schedule)
    link = parse_link(link_gbps)
    sys.exit(run_with_probes(list(command), out, schedule, flight_recorder=flight_recorder, link=link).code)


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--steps", default=5, show_default=True, help="How many steps every rank records.")
@click.option("--timeout", "timeout_s", default=120.0, show_default=True,
              help="Seconds to wait for every rank; then analyse what came.")
@click.option("--out", "out", default=None, type=click.Path(path_type=Path),
              help="Where to write the diagnosis (default: the capture's own directory).")
@click.option("--on-change", "on_change", default=None, type=float, metavar="SECONDS",
              help="First wait up to SECONDS for the job to get slower (a change `diagnose changes` would "
                   "report, not in the record yet), then profile right after it.")
def capture(run_dir: Path, steps: int, timeout_s: float, out: Path | None, on_change: float | None) -> None:
    """Profile the next STEPS steps on every rank of a RUNNING job (started with `diagnose run`), then diagnose.

    Coordination is one control file in the run directory; the job gets no collective, no barrier.
    With --on-change the capture waits for a slowdown first: it is seen once the job has run
    fail_slow_min_segment steps (20) at the new speed, and the steps profiled are the ones after.
    """
    from diagnose.oncall import check_capture_steps, live_tails, probe_dir, progress, request_capture, \
        wait_for_capture

    try:
        check_capture_steps(steps)
        if on_change is not None and not 0 < on_change <= 7 * 86400:
            raise DiagnoseError(f"--on-change {on_change:g}: the wait must be between 0 and a week (seconds)")
        pdir = probe_dir(run_dir, note)
        refuse_finished(pdir, "`capture` needs a running job (`diagnose analyze` reads what it wrote)")
        if on_change is not None:
            _wait_for_change(pdir, on_change)
        # without a lock to ask (probes.watch() runs), stale step logs tell a job that is gone
        p = progress(live_tails(pdir), min_s=CAPTURE_STALE_S, steps=CAPTURE_STALE_STEPS)
        if p.ages and len(p.quiet) == len(p.ages):
            fail(f"{pdir}: no rank has finished a step for {min(p.quiet.values()):.0f} s: the job has stopped or "
                 "is stuck, and a capture needs steps (`diagnose hang` if it is stuck; `diagnose analyze` reads "
                 "what it wrote)")
        req = request_capture(pdir, steps)
    except DiagnoseError as exc:
        fail(str(exc))
    click.echo(f"capture {req.id}: steps {req.start_step}..{req.start_step + steps - 1} on every rank; "
               f"waiting up to {timeout_s:.0f} s", err=True)
    res = wait_for_capture(pdir, req, timeout_s)
    for w in res.warnings:
        note(f"diagnose: warning: {w}")
    for r in res.missing:
        click.echo(f"rank {r} did not reach step {req.start_step} within {timeout_s:.0f} s: analysing without it",
                   err=True)
    for r, why in res.missed.items():
        click.echo(f"rank {r} missed the capture: {why}", err=True)
    if not res.done:
        fail(f"{res.directory}: no rank recorded the capture")
    try:
        # the run's sidecars and step logs (model, optimizer, checkpoints, every step) sit one level up
        from diagnose.output import analyze_outputs

        analyze_outputs([str(res.directory)], out or res.directory, probe_paths=[str(res.directory), str(pdir)])
    except DiagnoseError as exc:
        fail(str(exc))


def _wait_for_change(pdir: Path, wait_s: float) -> None:
    """capture --on-change: wait for a slowdown not yet in the record, or fail (nothing captured)."""
    from diagnose.analyzers.fail_slow import describe
    from diagnose.live import slowdowns, wait_for_change
    from diagnose.rundir import run_is_live, run_of

    known = slowdowns(pdir)
    if known:
        click.echo(f"already in the record, not waited for: {one_line(describe(known[-1]))}", err=True)
    click.echo(f"waiting up to {wait_s:g} s for the job to get slower", err=True)
    e = wait_for_change(pdir, wait_s, known=known, alive=lambda: run_is_live(pdir) is not False)
    if e is None and run_is_live(pdir) is False:
        fail(f"{run_of(pdir)}: the run finished while waiting for a slowdown: nothing captured")
    if e is None:
        fail(f"{pdir}: no slowdown within {wait_s:g} s: nothing captured (`diagnose changes` shows the record)")
    click.echo(f"change: {one_line(describe(e))}", err=True)


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--timeout", "timeout_s", default=20.0, show_default=True,
              help="Seconds to wait for every rank's Flight Recorder dump.")
@click.option("--force", is_flag=True, help="Ask for the dumps even when every rank is still finishing steps.")
def hang(run_dir: Path, timeout_s: float, force: bool) -> None:
    """Which rank is a HUNG job waiting for? Reads every rank's Flight Recorder (JSON only).

    RUN_DIR: a running job started with `diagnose run` (its ranks are asked for dumps, once its
    step logs show it is stuck), or a folder of rank{R}.fr.json dumps collected earlier.
    """
    from diagnose.hang import analyze_hang, read_dumps, render_hang, request_dumps, wait_for_dumps
    from diagnose.oncall import expected_ranks, live_tails, probe_dir, progress

    try:
        if run_dir.is_dir() and any(run_dir.glob("rank*.fr.json")):
            dumps, expected = read_dumps(run_dir), []
        else:
            pdir = probe_dir(run_dir, note)
            refuse_finished(pdir, "nothing of it can hang now (to read dumps collected earlier, pass their "
                                  "folder: RUN_DIR/traces/hang-ID)")
            warnings: list[str] = []
            tails = live_tails(pdir, warnings)
            expected = expected_ranks(pdir, set(tails), warnings)
            for w in warnings:
                note(f"diagnose: warning: {w}")
            moving = progress(tails)
            if moving.moving(expected) and not force:
                # a job whose every rank still finishes steps is not hung: say so, ask nothing
                newest = max(moving.ages.values())
                click.echo(f"NOT STUCK: every rank finished a step in the last {newest:.1f} s (steps "
                           f"{min(moving.steps.values())}-{max(moving.steps.values())}); nothing hangs. "
                           "Slow, not stuck? `diagnose watch` or `diagnose capture`. (--force asks for the "
                           "Flight Recorder dumps anyway.)")
                return
            if moving.quiet:
                note("diagnose: no finished step for " + ", ".join(
                    f"rank {r}: {a:.0f} s" for r, a in sorted(moving.quiet.items())[:8]))
            hid = request_dumps(pdir)
            click.echo(f"hang {hid}: asked {len(expected) or 'every'} rank(s) for their Flight Recorder; "
                       f"waiting up to {timeout_s:.0f} s", err=True)
            dumps = wait_for_dumps(pdir / f"hang-{hid}", expected, timeout_s)
    except DiagnoseError as exc:
        fail(str(exc))
    if not dumps:
        fail(f"{run_dir}: no rank answered within {timeout_s:.0f} s (is the job running under `diagnose run`?)")
    click.echo(render_hang(analyze_hang(dumps, expected)))


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--interval", default=3.0, show_default=True, help="Seconds between refreshes.")
@click.option("--window", default=20, show_default=True, help="Steps per rank the view summarises.")
@click.option("--once", is_flag=True, help="Print one view and exit.")
def watch(run_dir: Path, interval: float, window: int, once: bool) -> None:
    """Live view of a running job: per-rank step time, data wait, collectives, the slowest rank."""
    import time

    from diagnose.live import render, snapshot
    from diagnose.oncall import probe_dir
    from diagnose.rundir import run_is_live

    try:
        pdir = probe_dir(run_dir, note)
        while True:
            finished = run_is_live(pdir) is False  # None: no lock file to tell (probes.watch() runs)
            text = render(snapshot(pdir, window, ended=finished))
            if once:
                if finished:
                    note(f"diagnose: {pdir}: the run has finished; its last steps:")
                click.echo(text)
                return
            click.clear()
            state = ", run finished" if finished else ""
            click.echo(one_line(f"diagnose watch {run_dir}  (every {interval:g} s, Ctrl-C to stop{state})") + "\n")
            click.echo(text)
            try:
                time.sleep(interval)
            except KeyboardInterrupt:
                return
    except DiagnoseError as exc:
        fail(str(exc))


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
def changes(run_dir: Path) -> None:
    """When did the job get slow? Change points over the whole run, from every step of every rank.

    Reads only the probes' light-mode records (rank*.steps.jsonl, rank*.probe.json): no trace is
    needed, and it works on a running job.
    """
    from diagnose.analyzers.fail_slow import describe
    from diagnose.oncall import probe_dir
    from diagnose.probedata import load_probe_data
    from diagnose.step.changes import host_timed_gpu_ranks, run_changes
    from diagnose.thresholds import DEFAULT

    try:
        pdir = probe_dir(run_dir, note)
    except DiagnoseError as exc:
        fail(str(exc))
    probes = {r: p for r, p in load_probe_data([pdir]).items() if not p.steps.empty}
    for p in probes.values():
        for w in p.warnings:
            note(f"diagnose: warning: {w}")
    if not probes:
        fail(f"{pdir}: no step records to read")
    n = max(len(p.steps) for p in probes.values())
    events = run_changes(probes, DEFAULT.fail_slow_min_segment, DEFAULT.fail_slow_effect)
    click.echo(f"{len(probes)} rank(s), {n} steps recorded; changes of {DEFAULT.fail_slow_effect:.0%} of the step "
               f"or more lasting {DEFAULT.fail_slow_min_segment} steps:")
    if not events:
        click.echo("  none: the job ran at one speed")
    for e in events:
        click.echo(one_line("  " + describe(e)))
    untimed = host_timed_gpu_ranks(probes)
    if untimed and any(e.lost_ms > 0 for e in events):
        click.echo(one_line(f"  note: rank(s) {rank_ranges(untimed)} ran on CUDA and their record times the "
                            "host only (probes before device step timing): a host with no sync in its loop runs "
                            "ahead of its device until the launch queue fills, so a change to a slower step may be "
                            "that, not a slowdown (`diagnose analyze` of the run's traces tells)"))


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--nproc", default=None, help="World sizes to run, e.g. 1,2,4 (launches torchrun for each).")
@click.option("--runs", "runs", multiple=True, metavar="N=DIR",
              help="Saved run directories instead of launching, e.g. --runs 1=runs/n1 --runs 8=runs/n8.")
@click.option("--out", "out", default="scaling", show_default=True, type=click.Path(path_type=Path))
@click.option("--strong", is_flag=True, help="Strong scaling: the global batch stays fixed (see --batch-flag).")
@click.option("--batch-flag", default="--batch-size", show_default=True,
              help="With --strong and --nproc: the script's per-rank batch-size flag, set to global/N.")
@click.option("--global-batch", type=int, default=None, help="With --strong and --nproc: the global batch size.")
@click.option("--batch-size", type=int, default=None, help="Per-rank batch size, if the runs' sidecars lack it.")
@click.option("--schedule", default="2,2,5", show_default=True, help="Profiler schedule for each launched run.")
@click.option("--cluster", default=None, metavar="ADDRESS",
              help="With --runs: read the runs' traces on the workers of a Dask cluster (see analyze --help).")
@click.option("--run", "picks", multiple=True, metavar="N=K",
              help="With --runs: where N's directory holds several runs of the job (rerun into it), which one: "
                   "1 the first, -1 the newest (as analyze --run K).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def scale(nproc, runs, out, strong, batch_flag, global_batch, batch_size, schedule, cluster, picks, command) -> None:
    """Measure speedup across world sizes and explain the lost speedup, cause by cause.

    \b
    diagnose scale --nproc 1,2,4 -- python train.py --lr 0.1
    diagnose scale --runs 1=runs/n1 --runs 8=runs/n8
    diagnose scale --runs 1=traces/n1 --runs 8=traces/n8 --run 8=-1   # n8 rerun into one directory
    """
    from diagnose.scaling import analyze_scaling
    from diagnose.scaling import terminal_summary as scaling_summary

    mode = "strong" if strong else "weak"
    if cluster is not None:
        if not runs:
            fail("--cluster reads saved runs: give --runs N=DIR ... (launched runs are read here)")
        cluster_paths(("runs",), cluster, ())
    try:
        if runs:
            dirs = {}
            for item in runs:
                n, _, d = item.partition("=")
                if not n.isdigit() or not d:
                    raise DiagnoseError(f"--runs takes N=DIR, got {item!r}")
                dirs[int(n)] = Path(d)
            run_k = _picks(picks, dirs)
        else:
            if picks:
                raise DiagnoseError("--run N=K picks among the runs in a saved directory: give --runs N=DIR too")
            run_k = {}
            if not nproc or not command:
                raise DiagnoseError("give --nproc N1,N2,... and the training command after --, or --runs N=DIR ...")
            sizes = _sizes(nproc)
            check_schedule(schedule)
            if strong and not global_batch:
                raise DiagnoseError("--strong with --nproc needs --global-batch (and --batch-flag)")
            dirs = _launch_sizes(list(command), sizes, out, schedule, strong, batch_flag, global_batch)
        if cluster is not None:
            from diagnose.ingest.cluster import connect  # lazily: dask only with --cluster

            with connect(cluster) as reader:
                s, _ = analyze_scaling(dirs, mode, batch_size, reader, run_k=run_k)
            note(reader.stats.line())
        else:
            s, _ = analyze_scaling(dirs, mode, batch_size, run_k=run_k)
        from diagnose.scaling_output import write_scaling

        written = write_scaling(s, out)
    except DiagnoseError as exc:
        fail(str(exc))
    click.echo(scaling_summary(s))
    click.echo("")
    click.echo("wrote " + ", ".join(str(p) for p in written))


def _picks(picks: tuple[str, ...], dirs: dict[int, Path]) -> dict[int, int]:
    """`--run N=K` for each N given: {N: K}."""
    out = {}
    for item in picks:
        n, _, k = item.partition("=")
        try:
            n_, k_ = int(n), int(k)
        except ValueError:
            raise DiagnoseError(f"--run takes N=K (K: 1 the first run, -1 the newest), got {item!r}") from None
        if n_ not in dirs:
            raise DiagnoseError(f"--run {item}: no --runs {n_}=DIR to pick in")
        if k_ == 0:
            raise DiagnoseError(f"--run {item}: runs count from 1 (the first) or from -1 (the newest)")
        out[n_] = k_
    return out


def _launch_sizes(command: list[str], sizes: list[int], out: Path, schedule: str, strong: bool,
                  batch_flag: str, global_batch: int | None) -> dict[int, Path]:
    """Run the user's script at each world size under the probes; returns {N: run dir}."""
    from diagnose.launch import run_with_probes, script_args, with_batch

    script = script_args(command)
    dirs = {}
    for n in sizes:
        args = with_batch(script, batch_flag, max(1, global_batch // n)) if strong and global_batch else script
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
               f"--master_port={_free_port()}", *args]
        click.echo(f"diagnose scale: N={n}: {' '.join(cmd)}", err=True)
        outcome = run_with_probes(cmd, out / f"n{n}", schedule, quiet_job=True, echo=False)
        if outcome.code != 0 or outcome.run_dir is None:
            raise DiagnoseError(f"the run at N={n} failed (exit {outcome.code})", outcome.run_dir or out / f"n{n}")
        dirs[n] = outcome.run_dir
    return dirs


def _sizes(nproc: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in nproc.split(",") if x.strip()})
    except ValueError:
        raise DiagnoseError(f"--nproc {nproc!r}: expected world sizes like 1,2,4") from None
    if not sizes or sizes[0] < 1:
        raise DiagnoseError(f"--nproc {nproc!r}: world sizes must be >= 1")
    return sizes


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@main.command()
@click.option("--out", "out", default="diagnose-demo", show_default=True, type=click.Path(path_type=Path))
@click.option("--pathology", default="straggler", show_default=True,
              type=click.Choice(["none", "dataloader", "straggler", "tiny-batch", "tiny-buckets",
                                 "straggler-dataloader"]),
              help="Which fault the example job injects.")
@click.option("--nproc", default=2, show_default=True, help="Ranks (gloo on CPU, NCCL on GPUs).")
def demo(out: Path, pathology: str, nproc: int) -> None:
    """Run a short real DDP job with an injected fault through the probes, then diagnose it."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        fail("the demo runs a real training job and needs torch: pip install torch==2.13.0 (CPU) or see README")
    from diagnose.launch import run_with_probes
    from diagnose.examples import train_ddp

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={_free_port()}", train_ddp.__file__, "--pathology", pathology]
    click.echo(f"diagnose demo: {' '.join(cmd)}  (probes injected)", err=True)
    outcome = run_with_probes(cmd, out, "2,2,5", quiet_job=True)
    if outcome.code != 0:
        fail(f"the demo job failed (exit {outcome.code})")
    if not outcome.analysed:
        sys.exit(1)  # the launcher said why in one line; a demo without a diagnosis did not work
    sys.exit(0)


from diagnose.diff import diff_command  # noqa: E402 - registered after main is defined

main.add_command(diff_command)


if __name__ == "__main__":
    main()
