"""The one-way pipeline: traces -> Run -> Context -> checklist -> ranked Diagnosis."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from diagnose.analyzers import CHECKLIST, reduce_rank
from diagnose.context import Context, build_context, prune_dead_views
from diagnose.errors import DiagnoseError, one_line
from diagnose.extras import report_extras
from diagnose.heap import give_back_freed
from diagnose.ingest.assemble import Progress, Reader, Run, load_run
from diagnose.ingest.discover import has_traces
from diagnose.ingest.load import DEFAULT_MAX_BYTES
from diagnose.ingest.runs import choose_run
from diagnose.ingest.windows import Choice, choose_window
from diagnose.model import CHECK_ORDER, Check, Diagnosis, Finding, RunFacts
from diagnose.probedata import ProbeData, has_records, load_probe_data
from diagnose.rundir import last_attempt
from diagnose.step.breakdown import BreakdownRows, unnamed_wait
from diagnose.step.link import LinkSpec
from diagnose.step.window import window_against_run
from diagnose.thresholds import DEFAULT, Thresholds
from diagnose.units import rank_ranges
from diagnose.whatif import StepModel, annotate

_ORDER = {cid: i for i, cid in enumerate(CHECK_ORDER)}
"""A check's place in the checklist's order (CHECK_ORDER)."""


def _device(run: Run) -> tuple[str, str | None]:
    names = set()
    for t in run.traces.values():
        for p in t.meta.get("deviceProperties") or []:
            if isinstance(p, dict) and isinstance(p.get("name"), str):
                names.add(p["name"][:100])
    name = ", ".join(sorted(names)) or None
    if not run.is_gpu:
        return "cpu", name
    hip = any(t.hip for t in run.traces.values())
    return ("rocm" if hip else "cuda"), name


def run_facts(run: Run, ctx: Context) -> RunFacts:
    device, device_name = _device(run)
    sources = {tl.step_source for tl in run.timelines.values()}
    mean = ctx.table.groupby("rank")["step_ms"].mean()
    return RunFacts(
        world_size=run.world_size,
        ranks_found=tuple(run.ranks),
        ranks_missing=tuple(run.missing_ranks),
        backend=run.backend,
        device=device,
        device_name=device_name,
        steps_analysed=int(ctx.table.groupby("rank")["step"].nunique().min()),
        step_source="/".join(sorted(sources)),
        mean_step_ms={int(r): round(float(v), 3) for r, v in mean.items()},
        clock_offsets_us={int(r): round(v, 3) for r, v in run.clock_offsets_us.items() if v},
        files={r: str(run.traces[r].path) for r in run.ranks},
        metadata=_metadata(ctx),
    )


def _metadata(ctx: Context) -> dict:
    """Run configuration from the probes' sidecars (empty for bare traces)."""
    out = {k: ctx.probe_meta(k) for k in ("dataloader", "dataloader_no_grad", "model", "memory", "env")}
    for r in sorted(ctx.probes):
        m = ctx.probes[r].meta
        for k in ("torch", "device_name", "nccl", "cuda", "host", "cpu_count"):
            if k in m and k not in out:
                out[k] = m[k]
        if m.get("optimizers") and "optimizers" not in out:
            out["optimizers"] = m["optimizers"]
    out["probe_steps"] = {int(r): int(len(p.steps)) for r, p in ctx.probes.items()}
    return {k: v for k, v in out.items() if v}


def run_checklist(ctx: Context, th: Thresholds) -> tuple[list[Check], list[str]]:
    checks: list[Check] = []
    warnings: list[str] = []
    for entry in CHECKLIST:
        try:
            checks += entry.analyze(ctx, th)
        except Exception as exc:  # an analyzer bug must not cost the user the other verdicts
            warnings.append(f"check '{entry.name}' failed on this input ({type(exc).__name__}: {exc}); skipped")
    checks.sort(key=lambda c: _ORDER.get(c.id, len(_ORDER)))
    return checks, warnings


def diagnose_run(run: Run, th: Thresholds = DEFAULT, probes: dict[int, ProbeData] | None = None, *,
                 link: LinkSpec | None = None) -> Diagnosis:
    """link: the link's peak bus bandwidth as the user gives it (--link-gbps), for the
    communication table's verdict on each group (diagnose/step/link.py)."""
    ctx = build_context(run, probes, th)
    checks, warnings = run_checklist(ctx, th)
    prune_dead_views(run)  # once: after every check, before the extras (context.prune_dead_views: why)
    give_back_freed()
    findings = _ranked(c.finding for c in checks if c.status == "flagged" and c.finding)
    model, model_error = ctx.model, ctx.model_error
    replayed = _replay(findings, checks, model, th, warnings) if model is not None else None
    if model is None and model_error:
        warnings.append(model_error + "; findings keep their own estimates")
    # the extras after the replays: each of the two reaches the client's height at 1,024 ranks
    # (#20), the replays on top of what the extras keep for the report had they gone first. The
    # extras see the findings as the checks gave them, as the report's choice of ranks always has.
    extras = report_extras(ctx, checks, findings, th, link)
    window = window_against_run(run.traces, probes or {}, frozenset(ctx.pauses))
    if window is not None:
        extras["window"] = window.as_dict()
        if window.unlike:
            warnings.append(window.text())
    facts, table = run_facts(run, ctx), ctx.table
    del ctx, model
    give_back_freed()
    if replayed is not None:
        findings, checks, extras["replay"] = replayed
    if window is not None and "collections" in window.kinds and not window.collections_placed:
        findings, checks = _window_collected(findings, checks)
    if not findings and (waited := unnamed_wait(table, th.straggler)) is not None:
        extras["unnamed_wait"] = waited
    return Diagnosis(run=facts, checks=tuple(checks), findings=tuple(findings),
                     breakdown=BreakdownRows(table), warnings=tuple(run.warnings + warnings),
                     skipped=tuple(run.skipped), extras=extras)


def _window_collected(findings: list[Finding], checks: list[Check]) -> tuple[list[Finding], list[Check]]:
    """Full garbage collections ran inside the profiled steps (step/window.py) that the step model
    does not carry as its own part: every figure measured there carries them as whatever the
    process was doing when each began, so those findings' confidence is low (the caution beside
    the verdict says why); capacity findings (device memory) cost no time and keep theirs."""
    low = {f.id: replace(f, confidence="low") for f in findings if f.over == "window" and f.kind != "capacity"}
    out = [low.get(f.id, f) for f in findings]
    return out, [replace(c, finding=low[c.id]) if c.finding is not None and c.id in low else c for c in checks]


def _ranked(findings) -> list[Finding]:
    """Most recoverable time first, capacity findings (no time lost) last, ties in checklist order."""
    return sorted(findings, key=lambda f: (f.kind == "capacity", -f.recoverable_ms, _ORDER.get(f.id, 99)))


def _replay(findings: list[Finding], checks: list[Check], model: StepModel, th: Thresholds,
            warnings: list[str]) -> tuple[list[Finding], list[Check], dict] | None:
    """The findings and checks with each cause's ms from the one model of the step (the replay
    with the cause removed: diagnose/whatif.py) and the replay's summary; None where the replay
    failed (said in `warnings`: the findings keep their own estimates)."""
    try:
        named = next((c.finding.ranks for c in checks if c.id == "straggler" and c.finding), ())
        wi = annotate(tuple(findings), model, th, tuple(named))
    except Exception as exc:  # noqa: BLE001 - the replay is extra evidence; the verdict stands without it
        warnings.append(one_line(f"replay of the step graph failed ({type(exc).__name__}: {exc}); findings "
                                 "keep their own estimates")[:300])
        return None
    out = _ranked(wi.findings)
    by_id = {f.id: f for f in out}
    checks = [replace(c, finding=by_id[c.id]) if c.finding is not None and c.id in by_id else c for c in checks]
    if not model.trusted:
        warnings.append(f"the step graph's replay reproduces the measured steps only within "
                        f"{model.fidelity:.0%} (missing or sampled events): findings keep their own "
                        "estimates, the replayed figures are metrics beside them")
    return out, checks, wi.summary


def last_attempts(paths: list[str | Path]) -> tuple[list[str | Path], list[str]]:
    """Each directory of a job torchelastic restarted replaced by its last attempt with traces
    (rundir.last_attempt: one attempt's traces and step logs, never two mixed), with a line for
    each; a path this machine does not see (a cluster worker's) is left to the workers."""
    out, notes = [], []
    for p in paths:
        q, note = last_attempt(Path(p), has_traces) if Path(p).is_dir() else (p, None)
        out.append(q)
        notes += [note] if note else []
    return out, notes


def last_windows(paths: list[str | Path], window: int | None = None) -> tuple[list[str | Path], Choice | None]:
    """The paths narrowed to one trace a rank where they hold one run's repeated profiler windows
    (ingest/windows.py), with which; else as they are. window: `--window K`."""
    choice = choose_window(paths, window)
    if choice is None and window is not None:
        raise DiagnoseError(f"--window {window}: no repeated profiler windows of one run here (one trace a rank, "
                            "or files of two runs)", Path(paths[0]))
    return (list(paths), None) if choice is None else (list(choice.files), choice)


def one_run(paths: list[str | Path], run_k: int, probes_given: bool) -> tuple[list[str | Path], str]:
    """The files of run K among several written into the paths (ingest/runs.py), with the line
    that says so. The probes' records beside them are not read unless given (`--probes`): a
    rerun overwrote them, so they are one run's at most, maybe another's."""
    picked = choose_run(paths, run_k)
    beside = [] if probes_given else [d for d in dict.fromkeys(f.parent for f in picked.files) if has_records(d)]
    return list(picked.files), picked.note + (f"; the probes' records in {', '.join(map(str, beside))} are not read "
                                              "(they may be another run's: --probes RUN_DIR adds them)" if beside else "")


def diagnose_paths(paths: list[str | Path], th: Thresholds = DEFAULT, *, max_bytes: int = DEFAULT_MAX_BYTES,
                   jobs: int | None = None, progress: Progress | None = None,
                   probe_paths: list[str | Path] | None = None, link: LinkSpec | None = None,
                   reader: Reader | None = None, window: int | None = None, run_k: int | None = None) -> Diagnosis:
    """probe_paths: where the probes' sidecars and step logs are, when not beside the traces (a
    capture's traces sit in a subdirectory of the run's probe directory). link: see diagnose_run.
    reader: where the traces are read (a Dask cluster's workers); the probes' small files are read
    here, from those of the paths that this machine sees too. window: which of one run's repeated
    profiler windows (`--window K`; default the last whole one). run_k: which of several runs written
    into one directory (`--run K`, ingest/runs.py; without it they are refused, never guessed)."""
    paths, notes = last_attempts(paths)  # and which run, which window: said as warnings
    here = reader is None or all(Path(p).exists() for p in paths)  # else the workers choose the window
    if run_k is not None:
        if not here:
            raise DiagnoseError(f"--run {run_k}: runs are told apart on this machine; with --cluster pass one run's "
                                "directory", Path(paths[0]))
        paths, note = one_run(paths, run_k, probes_given=probe_paths is not None)
        notes.append(note)
        probe_paths = [] if probe_paths is None else probe_paths
    paths, windows = last_windows(paths, window) if here else (paths, None)
    if probe_paths is None and windows and reader is None:
        probe_paths = list(dict.fromkeys(p if Path(p).is_dir() else Path(p).parent for p in paths))
    run = load_run(paths, max_bytes=max_bytes, jobs=jobs, reduce=reduce_rank, progress=progress, reader=reader,
                   window=None if here else window)
    if not here:
        windows = getattr(reader, "windows", None)
        if window is not None and windows is None:
            raise DiagnoseError(f"--window {window}: no repeated profiler windows of one run on the workers")
    run.warnings.extend(notes + ([windows.note] if windows else []))
    if probe_paths is None:
        probe_paths = paths if reader is None else [p for p in paths if Path(p).exists()]
    probes = load_probe_data(probe_paths) if probe_paths else {}
    for p in probes.values():
        run.warnings.extend(p.warnings)
    # probes/core.py on_job_profiler: one profiler at a time, the job's first. Said of the ranks whose
    # analysed trace is the probes' own (a window cut short); the job's own traces are whole
    aside = [r for r, p in sorted(probes.items()) if p.meta.get("job_profiler") is True
             and (r not in run.traces or has_records(run.traces[r].path.parent))]
    if aside:
        run.warnings.append(f"rank(s) {rank_ranges(aside)}: the job ran its own torch.profiler there, so the "
                            "probes' profiler stood aside (its window cut short, or none)")
    d = diagnose_run(run, th, probes, link=link)
    if windows is not None and windows.written > 1:
        d.extras["profiled_windows"] = windows.as_dict()
    return d
