"""`diagnose diff BEFORE AFTER`: what changed between two runs (before/after a fix, two machines).

`diff_diagnoses(before, after) -> dict` is pure: two Diagnosis objects in, the plain-JSON
diff (written as diff.json, schema in DIFF_VERSION) out. Per check: status before and
after, recoverable ms per step where flagged, and the matching step-breakdown component
(measured on both sides whether flagged or not); which findings disappeared, appeared or
changed; the step time change. The command writes DIR/diff.json and DIR/report.html
(BEFORE and AFTER side by side) and prints a summary. It computes no new verdicts: every
number comes from the two diagnoses (and, with --hta, HTA's temporal breakdown of each).
"""
from __future__ import annotations

import statistics
import sys
from array import array
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import click

from diagnose import __version__
from diagnose.model import CHECK_ORDER, Diagnosis

DIFF_VERSION = "1.6"  # 1.1: "prediction" (the before run's predicted saving against the measured one);
# 1.2: "every_step_ms" (both runs' every recorded step outside their windows: extras.window);
# 1.3: a side's "run_in_directory" (--before-run/--after-run K) where it was one of several runs there;
# 1.4: a side's "unnamed_wait" (its extras.unnamed_wait: nothing named, yet a rank waited for a peer);
# 1.5: the prediction's "measured_over" ("profiled steps", or "every recorded step" where every
# fixed cause was sized over the run: Finding.over); 1.6: "gc_ms" in breakdown_ms (StepBreakdown.gc_ms,
# schema 1.18)
COMPONENTS = ("compute_ms", "exposed_comm_ms", "straggler_wait_ms", "dataloader_ms", "gc_ms", "other_ms")
# The breakdown component each check's cause lands in; measured on both sides even when a
# check passes, so a cause that disappeared still has an "after" number.
CHECK_COMPONENT = {
    "dataloader_starvation": "dataloader_ms",
    "exposed_communication": "exposed_comm_ms",
    "straggler": "straggler_wait_ms",
    "load_imbalance": "straggler_wait_ms",
    "gc_pause": "gc_ms",
}
UNCHANGED_MS = 0.5
"""A flagged-in-both cause whose recoverable time moved less than this is 'unchanged'."""


def _mean_over_ranks(d: Diagnosis) -> dict[str, float]:
    """Mean per-step breakdown: per rank over steps, then over ranks (each rank counts once).
    Each rank's values a typed array (8 bytes a value, not a Python float in a list: a 1,024-rank
    run of ten profiled steps was ~3 MB of lists a side; fmean reads either to the same bits)."""
    acc: dict[int, dict[str, array]] = defaultdict(lambda: defaultdict(lambda: array("d")))
    for s in d.breakdown:
        for k in ("step_ms", *COMPONENTS):
            acc[s.rank][k].append(getattr(s, k))
    if not acc:
        return {}
    per_rank = [{k: statistics.fmean(v) for k, v in comps.items()} for comps in acc.values()]
    return {k: round(statistics.fmean(p[k] for p in per_rank), 3) for k in ("step_ms", *COMPONENTS)}


def _side(d: Diagnosis, label: str, path: str) -> dict:
    r = d.run
    means = _mean_over_ranks(d)
    hta = d.extras.get("hta") or {}
    side = {
        "label": label, "path": path,
        "run": {"world_size": r.world_size, "ranks_found": list(r.ranks_found), "backend": r.backend,
                "device": r.device, "device_name": r.device_name, "steps_analysed": r.steps_analysed,
                "step_source": r.step_source},
        "step_ms": means.get("step_ms"),
        "breakdown_ms": {k: means.get(k) for k in COMPONENTS},
        "findings": [{"id": f.id, "title": f.title, "severity": f.severity, "recoverable_ms": f.recoverable_ms,
                      "share_of_step": f.share_of_step, "ranks": list(f.ranks), "confidence": f.confidence}
                     for f in d.findings],
        "checks": [{"id": c.id, "title": c.title, "status": c.status, "reason": c.reason} for c in d.checks],
        "top": d.findings[0].id if d.findings else None,
    }
    if not d.findings and d.extras.get("unnamed_wait"):
        # "top cause: none" is not said alone over a rank's waiting: a cause gone after a fix may
        # only be one the straggler check could not tell from jitter on that run
        side["unnamed_wait"] = d.extras["unnamed_wait"]
    if hta:
        side["hta"] = {"status": hta.get("status"), "reason": hta.get("reason"),
                       "run": {k: (hta.get("run") or {}).get(k)
                               for k in ("idle_share", "compute_share", "non_compute_share", "hta_says")}}
    return side


def _pct_change(before: float | None, after: float | None) -> float | None:
    if before is None or after is None or before == 0:
        return None
    return round((after - before) / before, 4)


def _cause_rows(before: Diagnosis, after: Diagnosis, bm: dict, am: dict) -> list[dict]:
    bc, ac = {c.id: c for c in before.checks}, {c.id: c for c in after.checks}
    ids = [i for i in CHECK_ORDER if i in bc or i in ac] + sorted((set(bc) | set(ac)) - set(CHECK_ORDER))
    rows = []
    for cid in ids:
        b, a = bc.get(cid), ac.get(cid)
        bf = b.finding if b is not None and b.status == "flagged" else None
        af = a.finding if a is not None and a.status == "flagged" else None
        change = ("gone" if bf and not af else "appeared" if af and not bf else
                  "changed" if bf and af and abs(af.recoverable_ms - bf.recoverable_ms) >= UNCHANGED_MS else
                  "unchanged" if bf and af else "not_flagged")
        row = {"id": cid, "title": (b or a).title, "change": change,
               "before_status": b.status if b else "absent", "after_status": a.status if a else "absent",
               "before_reason": b.reason if b else "", "after_reason": a.reason if a else "",
               "before_ms": bf.recoverable_ms if bf else None, "after_ms": af.recoverable_ms if af else None,
               "change_ms": round(af.recoverable_ms - bf.recoverable_ms, 3) if bf and af else None}
        comp = CHECK_COMPONENT.get(cid)
        if comp and bm.get(comp) is not None and am.get(comp) is not None:
            row.update(component=comp, component_before_ms=bm[comp], component_after_ms=am[comp],
                       component_change_ms=round(am[comp] - bm[comp], 3))
        rows.append(row)
    return rows


def _comparability(before: Diagnosis, after: Diagnosis) -> list[str]:
    notes = []
    b, a = before.run, after.run
    bw, aw = b.world_size or len(b.ranks_found), a.world_size or len(a.ranks_found)
    if bw != aw:
        notes.append(f"world size differs ({bw} -> {aw}): per-step times are not like for like")
    if b.device != a.device or (b.device_name or "") != (a.device_name or ""):
        bd, ad = (" ".join(x for x in (r.device, r.device_name) if x) for r in (b, a))
        notes.append(f"device differs ({bd} -> {ad})")
    if b.step_source != a.step_source:
        notes.append(f"steps found differently ({b.step_source} -> {a.step_source})")
    if len(b.ranks_found) != len(a.ranks_found):
        notes.append(f"ranks found differ ({len(b.ranks_found)} -> {len(a.ranks_found)})")
    for side, d in (("before", before), ("after", after)):
        pw = d.extras.get("profiled_windows") or {}
        if pw.get("written", 1) > 1:  # a schedule that repeats: say which window stands for the run
            notes.append(f"the {side} run: profiled window {pw.get('analysed')} of {pw.get('written')} read")
        w = d.extras.get("window") or {}
        if w.get("unlike"):
            from diagnose.step.window import caution

            notes.append(f"the {side} run: {caution(w)}")
    return notes


def _every_step(before: Diagnosis, after: Diagnosis) -> dict | None:
    """Both runs' mean step over every step the probes recorded outside the profiled window
    (diagnose/step/window.py), where both have one: steadier than a few profiled steps."""
    wb, wa = (d.extras.get("window") or {} for d in (before, after))
    b, a = wb.get("run_step_ms"), wa.get("run_step_ms")
    if b is None or a is None:
        return None
    return {"before": b, "after": a, "change_ms": round(a - b, 3), "change_pct": _pct_change(b, a),
            "steps": [wb.get("run_steps"), wa.get("run_steps")]}


def _prediction(before: Diagnosis, causes: list[dict], measured_ms: float | None,
                every_step: dict | None = None) -> dict | None:
    """What the BEFORE run predicted the fix would give back, against what the step time gave.

    The fixed causes are those gone or reduced. One cause: its replayed recoverable time. All the
    flagged causes: the before run's combined what-if (not the sum: removing one wait can expose
    another). Some of several: the sum of their single what-ifs, an upper bound, and said so.
    Causes sized over the run (Finding.over: a garbage collection every few dozen steps, CPU
    contention) are measured against both runs' every recorded step where the probes kept one: a
    few profiled steps that held a pause or not made a 5 ms gain read as 96 ms."""
    fixed = {c["id"]: c["before_ms"] - (c["after_ms"] or 0.0) for c in causes
             if c["before_ms"] is not None and (c["change"] == "gone" or (c["change"] == "changed"
                                                                         and c["after_ms"] < c["before_ms"]))}
    over = "profiled steps"
    if fixed and every_step is not None and all(f.over == "run" for f in before.findings if f.id in fixed):
        measured_ms, over = -float(every_step["change_ms"]), "every recorded step"
    if not fixed or measured_ms is None:
        return None
    combined = (before.extras.get("replay") or {}).get("combined_what_if_ms")
    every = {f.id for f in before.findings}
    if len(fixed) > 1 and set(fixed) == every and combined is not None and all(
            c["change"] == "gone" for c in causes if c["id"] in fixed):
        # a cause no replay expresses (CPU contention: the probes' samples, no edit of the graph) is
        # not in the combined what-if: its own figure comes on top (fixing contention and the uneven
        # turns it caused was predicted at the turns' 28.1 ms, measured 131.3)
        alone = sorted(f.id for f in before.findings if f.id in fixed and "replay_recoverable_ms" not in f.metrics)
        predicted = float(combined) + sum(fixed[c] for c in alone)
        how = "every flagged cause removed together, replayed" + (
            f", plus {', '.join(alone)}'s own figure (no replay expresses {'it' if len(alone) == 1 else 'them'})"
            if alone else "")
    else:
        predicted = sum(fixed.values())
        how = ("the cause's replayed recoverable time" if len(fixed) == 1 else
               "the sum of each cause's own what-if (an upper bound: causes overlap)")
    return {"causes": sorted(fixed, key=lambda i: -fixed[i]), "predicted_saving_ms": round(predicted, 3),
            "measured_saving_ms": round(measured_ms, 3), "measured_over": over, "method": how,
            "error": round((predicted - measured_ms) / measured_ms, 4) if measured_ms > 0 else None}


def diff_diagnoses(before: Diagnosis, after: Diagnosis, *, before_label: str = "before",
                   after_label: str = "after", before_path: str = "", after_path: str = "") -> dict:
    """The diff as a plain JSON-able dict (see the module docstring and README for the fields)."""
    bm, am = _mean_over_ranks(before), _mean_over_ranks(after)
    causes = _cause_rows(before, after, bm, am)
    bs, as_ = bm.get("step_ms"), am.get("step_ms")
    every = _every_step(before, after)
    return {
        "diff_version": DIFF_VERSION,
        "tool": {"name": "torch-diagnose", "version": __version__},
        "before": _side(before, before_label, before_path),
        "after": _side(after, after_label, after_path),
        "step_ms": {"before": bs, "after": as_,
                    "change_ms": round(as_ - bs, 3) if bs is not None and as_ is not None else None,
                    "change_pct": _pct_change(bs, as_)},
        "breakdown_change_ms": {k: round(am[k] - bm[k], 3) for k in COMPONENTS if k in bm and k in am},
        "causes": causes,
        "findings_gone": [c["id"] for c in causes if c["change"] == "gone"],
        "findings_appeared": [c["id"] for c in causes if c["change"] == "appeared"],
        "findings_changed": [c["id"] for c in causes if c["change"] == "changed"],
        "findings_unchanged": [c["id"] for c in causes if c["change"] == "unchanged"],
        "every_step_ms": every,
        "comparability": _comparability(before, after),
        "prediction": _prediction(before, causes, bs - as_ if bs is not None and as_ is not None else None, every),
    }


def _ms(x) -> str:
    return "—" if x is None else f"{x:,.1f} ms"


def _share(x) -> str:
    return "—" if not isinstance(x, (int, float)) else f"{x:.0%}"


def _dict_get(d: dict, key: str) -> dict:
    v = d.get(key) if isinstance(d, dict) else None
    return v if isinstance(v, dict) else {}


def _printable(s) -> str:
    return "".join(ch if ch.isprintable() else "?" for ch in str(s))


def diff_summary(diff: dict) -> str:
    """The terminal summary: step time first, then what disappeared, appeared, changed."""
    st = diff.get("step_ms") or {}
    pct = st.get("change_pct")
    lines = [f"STEP TIME: {_ms(st.get('before'))} -> {_ms(st.get('after'))}"
             + (f" ({pct:+.1%})" if pct is not None else "")]
    every = diff.get("every_step_ms")
    if isinstance(every, dict):
        pct = every.get("change_pct")
        lines.append(f"EVERY STEP (the probes' record, outside the profiled steps): {_ms(every.get('before'))} -> "
                     f"{_ms(every.get('after'))}" + (f" ({pct:+.1%})" if pct is not None else ""))
    causes = {c["id"]: c for c in diff.get("causes", [])}

    def _comp(c: dict) -> str:
        if "component" not in c:
            return ""
        return (f"; {c['component'].removesuffix('_ms').replace('_', ' ')} {_ms(c['component_before_ms'])} -> "
                f"{_ms(c['component_after_ms'])} per step")

    gone = [f"{i} (was {_ms(causes[i]['before_ms'])}/step{_comp(causes[i])})" for i in diff.get("findings_gone", [])]
    new = [f"{i} ({_ms(causes[i]['after_ms'])}/step{_comp(causes[i])})" for i in diff.get("findings_appeared", [])]
    changed = [f"{i} {_ms(causes[i]['before_ms'])} -> {_ms(causes[i]['after_ms'])}/step"
               for i in diff.get("findings_changed", [])]
    pr = diff.get("prediction")
    if isinstance(pr, dict):
        err = pr.get("error")
        lines.append(f"PREDICTED vs MEASURED: fixing {', '.join(map(_printable, pr.get('causes', [])))} was predicted "
                     f"to give back {_ms(pr.get('predicted_saving_ms'))}/step; the step got "
                     f"{_ms(pr.get('measured_saving_ms'))} shorter"
                     + (" over every recorded step" if pr.get("measured_over") == "every recorded step" else "")
                     + (f" ({err:+.0%})" if err is not None else ""))
    lines.append("findings gone: " + (", ".join(gone) or "none"))
    lines.append("findings appeared: " + (", ".join(new) or "none"))
    lines.append("findings changed: " + (", ".join(changed) or "none"))
    if diff.get("findings_unchanged"):
        lines.append("findings unchanged: " + ", ".join(diff["findings_unchanged"]))
    bc = diff.get("breakdown_change_ms") or {}
    if bc:
        b, a = diff["before"]["breakdown_ms"], diff["after"]["breakdown_ms"]
        lines.append("where the step went (mean over ranks, ms): " + ", ".join(
            f"{k.removesuffix('_ms').replace('_', ' ')} {b[k]:.1f} -> {a[k]:.1f}" for k in bc
            if k != "gc_ms" or b[k] or a[k]))  # gc: placed collections, none on most runs
    hb, ha = (_dict_get(diff[s], "hta") for s in ("before", "after"))
    if hb or ha:
        if hb.get("status") == ha.get("status") == "ok":
            rb, ra = hb.get("run") or {}, ha.get("run") or {}
            lines.append("HTA temporal breakdown (median rank, share of kernel span): " + ", ".join(
                f"{k.removesuffix('_share').replace('_', '-')} {_share(rb.get(k))} -> {_share(ra.get(k))}"
                for k in ("compute_share", "non_compute_share", "idle_share")))
        else:
            lines.append(f"HTA: before {_printable(hb.get('reason') or hb.get('status'))}; "
                         f"after {_printable(ha.get('reason') or ha.get('status'))}")
    for side in ("before", "after"):
        s = diff[side]
        k = s.get("run_in_directory")
        which = "" if k is None else (f" (run {k} of those written there)" if k > 0 else
                                      " (the newest run written there)" if k == -1 else
                                      f" (run {k} from the newest of those written there)")
        lines.append(f"{side}: {_printable(s['path'])}{which} — {len(s['run']['ranks_found'])} rank(s), "
                     f"{s['run']['device']}, top cause: {s['top'] or 'none'}")
        if s.get("unnamed_wait") and not s["top"]:
            from diagnose.step.breakdown import unnamed_wait_caution

            lines.append(f"  caution ({side}): {unnamed_wait_caution(s['unnamed_wait'])}")
    for note in diff.get("comparability", []):
        lines.append(f"note: {_printable(note)}")
    return "\n".join(lines)


def write_diff(diff: dict, out: Path) -> list[Path]:
    import orjson

    from diagnose.output import _clean
    from diagnose.probes.safefs import write_atomic

    path = out / "diff.json"
    write_atomic(path, orjson.dumps(_clean(diff), option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    written = [path]
    try:
        from diagnose.reports.diff import write_diff_report
    except ImportError:
        return written
    written.append(write_diff_report(diff, out))
    return written


def _fail(msg: str) -> None:
    click.echo(f"diagnose: error: {msg}", err=True)
    sys.exit(2)


def run_diff(before: str, after: str, out: Path, *, hta: bool = False, hta_budget_mb: float | None = None,
             hta_timeout: float | None = None, cluster: str | None = None,
             runs: tuple[int | None, int | None] = (None, None)) -> int:
    """cluster: a Dask scheduler's address (or local:N) whose workers read both runs' traces. runs:
    which run of several written into each side's directory (`--before-run`, `--after-run`: a
    job rerun into one directory after a fix is its own before and after)."""
    from diagnose.errors import DiagnoseError

    with ExitStack() as stack:
        reader = None
        if cluster is not None:
            from diagnose.ingest.cluster import connect  # lazily: dask only with --cluster

            try:
                reader = stack.enter_context(connect(cluster))
            except DiagnoseError as exc:
                _fail(str(exc))
        diags = _diagnose_both(before, after, hta, hta_budget_mb, hta_timeout, reader, runs)
        if reader is not None:
            click.echo(reader.stats.line(), err=True)
    labels = [(Path(p).name or side) + (f" run {k}" if k is not None else "")
              for p, side, k in ((before, "before", runs[0]), (after, "after", runs[1]))]
    diff = diff_diagnoses(diags[0], diags[1], before_label=labels[0], after_label=labels[1], before_path=before,
                          after_path=after)
    for side, k in zip(("before", "after"), runs):
        if k is not None:
            diff[side]["run_in_directory"] = k
    try:
        written = write_diff(diff, out)
    except OSError as exc:
        _fail(f"{out}: cannot write outputs ({exc.strerror or exc})")
    click.echo(diff_summary(diff))
    click.echo("")
    click.echo("wrote " + ", ".join(str(p) for p in written))
    return 0


def _diagnose_both(before: str, after: str, hta: bool, hta_budget_mb: float | None, hta_timeout: float | None,
                   reader, runs: tuple[int | None, int | None] = (None, None)) -> list:
    from diagnose.errors import DiagnoseError
    from diagnose.pipeline import diagnose_paths

    diags = []
    for path, run_k in zip((before, after), runs):
        try:
            d = diagnose_paths([path], reader=reader, run_k=run_k)
        except DiagnoseError as exc:
            _fail(str(exc))
        if hta:
            from diagnose.hta import DEFAULT_BUDGET_MB, DEFAULT_TIMEOUT_S, attach_hta
            d = attach_hta(d, [path], budget_mb=hta_budget_mb or DEFAULT_BUDGET_MB,
                           timeout_s=hta_timeout or DEFAULT_TIMEOUT_S)
        diags.append(d)
    return diags


@click.command("diff")
@click.argument("before_dir")
@click.argument("after_dir")
@click.option("--out", "out", default="diagnose-diff", show_default=True, type=click.Path(path_type=Path),
              help="Directory for diff.json and report.html.")
@click.option("--hta/--no-hta", default=False, show_default=True,
              help="Add Holistic Trace Analysis's temporal breakdown of each run (needs the hta extra).")
@click.option("--hta-budget-mb", default=None, type=float, help="Largest expanded trace size HTA may load.")
@click.option("--hta-timeout", default=None, type=float, help="Seconds HTA may run per side.")
@click.option("--cluster", default=None, metavar="ADDRESS",
              help="Read both runs' traces on the workers of a Dask cluster (tcp://HOST:8786 or local:N; "
                   "see diagnose analyze --help).")
@click.option("--before-run", "before_run", default=None, type=int, metavar="K",
              help="BEFORE_DIR holds several runs' traces (a job rerun into it): compare run K (1 the first, "
                   "-1 the newest).")
@click.option("--after-run", "after_run", default=None, type=int, metavar="K",
              help="The same for AFTER_DIR (it may be BEFORE_DIR: `DIR DIR --before-run 1 --after-run -1`).")
def diff_command(before_dir: str, after_dir: str, out: Path, hta: bool, hta_budget_mb: float | None,
                 hta_timeout: float | None, cluster: str | None, before_run: int | None, after_run: int | None) -> None:
    """Compare two runs: what disappeared, appeared or changed, and the step time change."""
    from diagnose.errors import DiagnoseError
    from diagnose.ingest.cluster import paths_to_read  # dask itself is imported only to connect

    try:
        paths_to_read((before_dir, after_dir), cluster, (), hta)
    except DiagnoseError as exc:
        _fail(str(exc))
    if 0 in (before_run, after_run):
        _fail("--before-run/--after-run 0: runs count from 1 (the first) or from -1 (the newest)")
    sys.exit(run_diff(before_dir, after_dir, out, hta=hta, hta_budget_mb=hta_budget_mb, hta_timeout=hta_timeout,
                      cluster=cluster, runs=(before_run, after_run)))
