"""One self-contained, offline HTML report from diagnosis.json.

`render` is pure: dict in, HTML string out. It presents what the JSON says and
computes no verdicts. Every string from the JSON came from a trace file and is
untrusted, so it is escaped for the context it lands in (`esc` for HTML,
`script_json` for JSON inside <script>, `charts.plot_text` for Plotly labels).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from diagnose.units import human, on_ranks  # sizes in powers of 1000, as the GB/s beside them and the terminal

from . import charts
from .charts import num
from .common import (MAX_EVENTS, MAX_LINES, STATUS_LABEL, STATUS_MARK, ChartSet, _dict, _list,
                            _plotly_js, esc, fmt_dur, fmt_ms, fmt_ranks, fmt_share, fmt_ts, fmt_value, page_parts)

__all__ = ["render", "render_parts", "write_report", "_plotly_js"]  # _plotly_js: the tests check it is inlined once
from .hta import _hta_for_check, _hta_section
from .labels import metric_rows

# -------------------------------------------------------------- sections ---

def _where(finding: dict, d: dict) -> str:
    """The finding's ranks as the terminal says them ("all 8 ranks", "ranks 0, 2–8"), escaped."""
    def ints(xs) -> list[int]:
        return [int(r) for r in _list(xs) if isinstance(r, int) or str(r).lstrip("-").isdigit()]
    return esc(on_ranks(ints(finding.get("ranks")), ints(_dict(d.get("run")).get("ranks_found")), dash="–"))


def _headline(d: dict) -> str:
    findings = _list(d.get("findings"))
    top = _dict(findings[0]) if findings else {}
    if top:
        return (f'<p class="headline"><span class="kicker">Top cause</span> <strong>{esc(top.get("title"))}</strong>: '
                f'about {fmt_ms(top.get("recoverable_ms"), 1)} per step recoverable '
                f'({fmt_share(top.get("share_of_step"))} of the step), on {_where(top, d)}.</p>' + _window(d))
    checks = _list(d.get("checks"))
    counts = {s: sum(1 for c in checks if _dict(c).get("status") == s) for s in STATUS_LABEL}
    return (f'<p class="headline"><strong>No significant cause found.</strong> '
            f'{counts["passed"]} check(s) passed, {counts["not_measurable"]} could not be measured; '
            f'the step breakdown below shows where the time goes.</p>'
            + unnamed_wait_note(_dict(d.get("extras")).get("unnamed_wait")) + _window(d))


def unnamed_wait_note(w) -> str:
    """The caution under "no significant cause" where a rank waited for late peers at least the
    straggler check's threshold and nothing was named (extras.unnamed_wait; a diff's side too)."""
    from diagnose.step.breakdown import unnamed_wait_caution

    w = _dict(w)
    try:
        text = unnamed_wait_caution(w) if w else ""
    except (KeyError, TypeError, ValueError):  # a hand-edited diagnosis.json: no caution, no crash
        return ""
    return f'<p class="warn">Caution: {esc(text)}.</p>' if text else ""


def _window(d: dict) -> str:
    """The caution beside the verdict when the profiled steps were not the run's usual ones
    (extras.window, diagnose/step/window.py)."""
    from diagnose.step.window import caution

    w = _dict(_dict(d.get("extras")).get("window"))
    if w.get("unlike") is not True:
        return ""
    try:
        text = caution(w)
    except (KeyError, TypeError, ValueError):  # a hand-edited diagnosis.json: no caution, no crash
        return ""
    return f'<p class="warn">Caution: {esc(text)}.</p>'


def _window_of(extras: dict | None) -> str:
    """', profiled window K of N' where the traces were one run's repeated windows, else ''."""
    pw = _dict(_dict(extras).get("profiled_windows"))
    written, analysed = num(pw.get("written")), num(pw.get("analysed"))
    return f", profiled window {int(analysed)} of {int(written)}" if written and analysed and written > 1 else ""


def _run_facts(run: dict, extras: dict | None = None) -> Iterator[str]:
    """The run's facts, then each rank's mean step (a chip a rank, given one at a time)."""
    found, missing = _list(run.get("ranks_found")), _list(run.get("ranks_missing"))
    ws = run.get("world_size")
    ranks = f"{len(found)} of {esc(ws)} ranks" if ws is not None else f"{len(found)} rank(s)"
    if missing:
        ranks += f' <span class="warn">(missing: {fmt_ranks(missing)})</span>'
    device = esc(run.get("device"))
    if run.get("device_name"):
        device += f" ({esc(run.get('device_name'))})"
    means = {str(k): num(v) for k, v in _dict(run.get("mean_step_ms")).items()}
    vals = [v for v in means.values() if v is not None]
    mean_txt = (f"{min(vals):,.1f}–{max(vals):,.1f} ms" if len(vals) > 1 else fmt_ms(vals[0], 1)) if vals else "—"
    facts = [("World size", esc(ws)), ("Ranks found", ranks), ("Backend", esc(run.get("backend"))),
             ("Device", device), ("Steps analysed", f"{esc(run.get('steps_analysed'))} "
                                  f"<span class=muted>(from {esc(run.get('step_source'))}{_window_of(extras)})</span>"),
             ("Mean step" + (" (range over ranks)" if len(vals) > 1 else ""), mean_txt)]
    compiled = num(_dict(_dict(extras).get("compiled")).get("host_share"))
    if compiled is not None:
        facts.append(("torch.compile", f"{fmt_share(compiled)} <span class=muted>of host time in compiled code</span>"))
    evaluation = _dict(_dict(extras).get("evaluation"))
    if num(evaluation.get("ms_per_step")):
        facts.append(("Evaluation in the steps", f"{fmt_ms(evaluation.get('ms_per_step'), 1)} per step "
                      f"<span class=muted>({fmt_share(evaluation.get('share_of_step'))}: an evaluation's "
                      "loop)</span>"))
    items = "".join(f"<div><dt>{k}</dt><dd>{v}</dd></div>" for k, v in facts)
    yield f'<dl class="facts">{items}</dl>'
    if means:
        yield f'<details{" open" if len(means) <= 16 else ""}><summary>Mean step time per rank</summary><p class="chips">'
        yield from _each(f'<span class="chip">rank {esc(k)}: {fmt_ms(v, 1)}</span>' for k, v in means.items())
        yield '</p></details>'


def _causes_table(findings: list) -> str:
    if not findings:
        return '<p class="muted">No cause was flagged.</p>'
    head = ("<tr><th>#</th><th>Cause</th><th class=num>Est. recoverable<br>per step</th>"
            "<th class=num>Share<br>of step</th><th>Ranks</th><th>Confidence</th><th>Impact</th><th>Fix</th></tr>")
    rows = []
    for i, f in enumerate(map(_dict, findings), 1):
        rows.append(f'<tr><td>{i}</td><td><a href="#finding-{i}">{esc(f.get("title"))}</a></td>'
                    f'<td class=num>{fmt_ms(f.get("recoverable_ms"))}</td>'
                    f'<td class=num>{fmt_share(f.get("share_of_step"))}</td>'
                    f'<td>{fmt_ranks(f.get("ranks"))}</td><td>{esc(f.get("confidence"))}</td>'
                    f'<td>{_severity(f.get("severity"))}</td><td class=fix>{esc(f.get("fix"))}</td></tr>')
    return f'<table class="causes" id="causes"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>'


def _severity(sev) -> str:
    """A text badge (HIGH IMPACT / MEDIUM IMPACT / LOW IMPACT: severity is the share of the step at
    stake, not how sure the tool is, which the confidence says in the same words); the styles differ
    in border too, not only colour."""
    sev = "" if sev is None else str(sev)
    return f'<span class="sev sev-{esc(sev)}">{esc(sev.upper())} IMPACT</span>' if sev else ""


def _checklist(checks: list, findings: list) -> str:
    anchors = {_dict(f).get("id"): i for i, f in enumerate(findings, 1)}
    rows = []
    for c in map(_dict, checks):
        st = str(c.get("status", ""))
        label = STATUS_LABEL.get(st, st.upper() or "UNKNOWN")
        title = esc(c.get("title") or c.get("id"))
        if st == "flagged" and c.get("id") in anchors:
            title = f'<a href="#finding-{anchors[c.get("id")]}">{title}</a>'
        cls = st if st in STATUS_LABEL else "unknown"
        rows.append(f'<tr class="check-{cls}"><td><span class="status status-{cls}">{STATUS_MARK.get(st, "")} '
                    f'{esc(label)}</span></td><td>{title}</td><td>{esc(c.get("reason"))}</td></tr>')
    if not rows:
        return '<p class="muted">No checks in this diagnosis.</p>'
    return ('<table class="checks"><thead><tr><th>Status</th><th>Check</th><th>Reason</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>')


def _breakdown_section(breakdown: Sequence, cs: ChartSet, composition: bool = True) -> Iterator[str]:
    """The charts, then the table of each rank's mean (a row a rank, given one at a time)."""
    means = charts.mean_breakdown(breakdown)
    if not means:
        yield '<p class="muted">No per-step breakdown in this diagnosis.</p>'
        return
    parts = []
    fig = charts.breakdown_bars(breakdown, means=means)
    if fig is not None:
        parts.append(cs.add(fig, "Mean step time per rank, stacked by component"))
    fig, step = charts.step_composition(breakdown) if composition else (None, None)
    if fig is not None:
        parts.append(cs.add(fig, f"Composition of step {step} per rank"))
        parts.append('<p class="muted">Each lane is one rank\'s step with its components laid end to end: '
                     'it shows how much of the step each part took, not when it happened. '
                     'Use the evidence tables to find the events in Perfetto.</p>')
    cols = [("step_ms", "step")] + [(k, lbl) for k, lbl, _, _ in charts.shown_components(means)]
    head = "<tr><th>Rank</th>" + "".join(f"<th class=num>{lbl} (ms)</th>" for _, lbl in cols) + "</tr>"
    yield from parts
    yield (f'<details{" open" if len(means) <= 16 else ""}><summary>Mean per rank, as numbers</summary>'
           f'<table class="breakdown"><thead>{head}</thead><tbody>')
    yield from ("<tr><td>" + str(r) + "</td>" + "".join(f"<td class=num>{m.get(k, 0):,.2f}</td>" for k, _ in cols)
                + "</tr>" for r, m in means.items())
    yield '</tbody></table></details>'


def _timeline_section(extras: dict, cs: ChartSet) -> str:
    tl = _dict(extras.get("timeline"))
    others = [(str(k), _dict(v)) for k, v in _dict(tl.get("other_steps")).items() if k in ("slowest", "fastest")]
    views = [("median", tl)] + others
    shown = _dict(tl.get("shown"))
    charts_html = []
    for which, t in views:
        fig = charts.step_timeline(t, f"{which} step" if len(views) > 1 else "")
        if fig is None:
            continue
        hidden = " timeline-hidden" if charts_html else ""
        on = "on every rank" if not shown else "on the ranks shown"
        charts_html.append((which, t.get("step"), f'<div class="timeline-view{hidden}" data-view="{esc(which)}">'
                            f'{cs.add(fig, f"Timeline of the {which} step {on}")}</div>'))
    if not charts_html:
        return ""
    selector = ""
    if len(charts_html) > 1:
        # a step selector: every view is drawn at load (at full width), the others kept out of sight
        buttons = "".join(f'<button type="button" data-view="{esc(w)}" aria-pressed="{str(i == 0).lower()}">'
                          f'{esc(w)} step ({esc(s)})</button>' for i, (w, s, _) in enumerate(charts_html))
        selector = f'<div class="step-selector" role="group" aria-label="Step shown">Show: {buttons}</div>'
    note = (f'<p class="muted">{esc(shown.get("ranks"))} of {esc(shown.get("of"))} ranks shown: '
            f'{esc(shown.get("why"))}.</p>' if shown else "")
    return (selector + "".join(h for _, _, h in charts_html) + note +
            '<p class="muted">Real intervals from the traces: when each rank computed, communicated or waited for '
            'data during one step. A rank whose rows start late is the one the others wait for.</p>')


def _over_time_section(extras: dict, cs: ChartSet) -> str:
    """The whole run from the probes' every-step record: when the job got slower, if it did."""
    over = _dict(extras.get("over_time"))
    fig = charts.over_time_lines(over)
    if fig is None:
        return ""
    said = "".join(f"<li>{esc(c['text'])}</li>" for c in _list(over.get("changes"))
                   if isinstance(c, dict) and c.get("text"))
    heat = charts.over_time_heatmap(over)
    return ('<h3 id="over-time">Every step of the run</h3>' + cs.add(fig, "Step time over the whole run")
            + (f"<ul>{said}</ul>" if said else "")
            + (cs.add(heat, "Each rank's own time per step against the median rank's, over the whole run") if heat is not None else "")
            + '<p class="muted">From the probes\' record of every step, profiled or not (the timeline above shows '
            'one profiled step). A change of level that lasts is the fail_slow check\'s; <code>diagnose changes '
            'RUN_DIR</code> lists every one.</p>')


def _top_ops_section(extras: dict) -> str:
    """Per rank, the heaviest ops or kernels (collapsible: one <details> per rank)."""
    ranks = [x for x in _list(_dict(extras.get("top_ops")).get("ranks")) if isinstance(x, dict)]
    if not ranks:
        return ""
    parts = []
    for x in ranks:
        rows = "".join(f'<tr><td class=mono>{esc(o.get("name"))}</td><td class=num>{fmt_ms(o.get("ms_per_step"), 3)}</td>'
                       f'<td class=num>{fmt_value(o.get("calls_per_step"))}</td>'
                       f'<td class=num>{fmt_share(o.get("share_of_step"))}</td></tr>'
                       for o in map(_dict, _list(x.get("top"))))
        parts.append(f'<details class="top-ops"><summary>Rank {esc(x.get("rank"))}: heaviest {esc(x.get("kind"))} '
                     f'(mean step {fmt_ms(x.get("step_ms"), 1)})</summary><table class="top-ops"><thead><tr>'
                     '<th>Name</th><th class=num>Time per step</th><th class=num>Calls per step</th>'
                     f'<th class=num>Share of step</th></tr></thead><tbody>{rows}</tbody></table></details>')
    return ('<h3 id="top-ops">Heaviest ops and kernels, per rank</h3><p class="muted">Host ops by self time on CPU '
            'ranks, kernels by device time on GPU ranks; the straggler check compares these between ranks.</p>'
            + "".join(parts))


def _comm_groups_section(extras: dict) -> str:
    """Communication per process group and collective kind (diagnose/step/bandwidth.py)."""
    groups = [g for g in _list(_dict(extras.get("comm_groups")).get("groups")) if isinstance(g, dict)]
    if not groups:
        return ""

    def cells(g: dict) -> str:
        link = f'<td>{esc(g.get("link_text"))}</td>' if g.get("link_text") else '<td class=muted>-</td>'
        if not g.get("sized"):
            return '<td class=muted colspan=6>sizes not recorded</td>' + link
        return (f'<td class=num>{esc(human(num(g.get("median_bytes"))))}</td>'
                f'<td class=num>{fmt_ms(g.get("median_transfer_ms"), 3)}</td>'
                f'<td class=num>{fmt_value(g.get("algbw_gbps"))}</td><td class=num>{fmt_value(g.get("busbw_gbps"))}</td>'
                f'<td>{esc(g.get("regime"))}</td><td>{esc(g.get("transfer"))}</td>' + link)

    rows = "".join(f'<tr><td>{esc(g.get("group")) or "-"}</td><td>{esc(g.get("kind"))}</td>'
                   f'<td class=num>{fmt_value(g.get("ranks"))}</td><td class=num>{fmt_value(g.get("count"))}</td>'
                   f'<td class=num>{fmt_ms(g.get("exposed_ms_per_step"), 2)}</td>{cells(g)}</tr>' for g in groups)
    return ('<h3 id="comm-groups">Communication by process group</h3><p class="muted">Exposed: the communication '
            'not hidden under compute (nor waiting for the last rank), given to the collective running then, on '
            'the median rank. Size, transfer and bandwidth are medians over the collectives whose size the trace '
            'records; bus bandwidth as nccl-tests counts it, comparable with the link\'s peak. The transfer runs '
            'from the last rank\'s arrival, so waiting for a late rank is not counted against the link (with one '
            'rank loaded it is, and the table says so). Against the link: bandwidth-bound groups judged against '
            'the peak given with --link-gbps (diagnose/step/link.py); without it, no verdict.</p>'
            '<table class="comm-groups"><thead><tr><th>Group</th><th>Collective</th><th class=num>Ranks</th>'
            '<th class=num>Count</th><th class=num>Exposed per step</th><th class=num>Size</th>'
            '<th class=num>Transfer</th><th class=num>Alg. GB/s</th><th class=num>Bus GB/s</th><th>Regime</th>'
            f'<th>Transfer measured</th><th>Against the link</th></tr></thead><tbody>{rows}</tbody></table>')


REPLAY_PARTS = {"dataloader": "DataLoader wait", "compute": "compute and host work", "communication": "communication",
                "comm_wait": "waiting on a transfer in flight", "gc": "Python garbage collection",
                **{k: label for k, label, _, _ in charts.IDLE_CAUSES}}


def _replay_section(extras: dict, findings: list, cs: ChartSet) -> str:
    rep = _dict(extras.get("replay"))
    if not rep:
        return ""
    rows = []
    for f in findings:
        m = _dict(f.get("metrics"))
        if "replay_recoverable_ms" not in m and "critical_path_ms" not in m:
            continue
        own = m.get("own_estimate_ms", f.get("recoverable_ms"))  # own_estimate_ms: the replay replaced it
        # sized over the run's every-step record: its figure is its own; the replay's is the profiled steps'
        over = " (its figure: over the run; the replay: the profiled steps)" if f.get("over") == "run" else ""
        rows.append(f'<tr><td>{esc(f.get("title"))}{over}</td><td class=num>{fmt_ms(own)}</td>'
                    f'<td class=num>{fmt_ms(m.get("replay_recoverable_ms"))}</td>'
                    f'<td class=num>{fmt_ms(m.get("critical_path_ms"))}</td></tr>')
    table = ('<table class="replay"><thead><tr><th>Cause</th><th class=num>Its own estimate</th>'
             '<th class=num>Replayed without it</th><th class=num>On the critical path</th></tr></thead>'
             f'<tbody>{"".join(rows)}</tbody></table>') if rows else ""
    cp = _dict(rep.get("critical_path"))
    fig = charts.critical_path_bar(_dict(cp.get("by_part_ms")), {k: REPLAY_PARTS.get(k, k) for k in
                                                                  _dict(cp.get("by_part_ms"))})
    chart = cs.add(fig, "Critical path of the mean step, by part") if fig is not None else ""
    err = num(rep.get("fidelity_max_error"))
    given = ("Each finding's recoverable time above is the replayed figure, but for those sized over the run."
             if rep.get("replaces_estimates") is True
             else "The replay does not reproduce the steps closely enough here: findings keep their own estimates.")
    return ('<h3 id="replay">What each fix gives back: the step graph replayed</h3>'
            '<p>Every rank\'s steps as one dependency graph (work in program order, collectives that end no earlier '
            'than their last arrival), replayed with one cause removed: a freed wait that only exposes another '
            f'saves nothing. All flagged causes removed together: {fmt_ms(rep.get("combined_what_if_ms"))} per step '
            f'of {fmt_ms(rep.get("replayed_step_ms"))}. The unedited replay reproduces the measured steps within '
            f'{fmt_share(err) if err is not None else "—"}. {given}</p>{table}{chart}')


def _metrics_table(metrics: dict) -> str:
    if not metrics:
        return '<p class="muted">No metrics recorded.</p>'
    # numbers stay on one line, right-aligned; text values (op lists, notes) wrap, so a long one
    # cannot squeeze the names column to nothing
    # a human label on the page; the machine key (as in diagnosis.json) in the tooltip
    rows = "".join(f"<tr><th scope=row title=\"{esc(k)}\">{esc(label)}</th>"
                   f"<td class={'num' if is_num else 'val'}>{value}</td></tr>"
                   for k, label, value, is_num in metric_rows(metrics))
    return f'<table class="metrics evidence"><caption>Metrics</caption><tbody>{rows}</tbody></table>'


def _events_table(events: list) -> str:
    if not events:
        return '<p class="muted">No trace events attached to this finding.</p>'
    rows = []
    for e in map(_dict, events[:MAX_EVENTS]):
        rows.append(f'<tr><td>{esc(e.get("rank"))}</td><td class=mono>{esc(e.get("file"))}</td>'
                    f'<td class="num mono">{fmt_ts(e.get("ts_us"))}</td><td class=num>{fmt_dur(e.get("dur_us"))}</td>'
                    f'<td class=mono>{esc(e.get("name"))}</td><td>{esc(e.get("step"))}</td>'
                    f'<td>{esc(e.get("note"))}</td></tr>')
    more = (f'<p class="muted">{len(events) - MAX_EVENTS} more event(s) in diagnosis.json.</p>'
            if len(events) > MAX_EVENTS else "")
    return ('<table class="events evidence"><caption>Trace events (timestamps as written in the file, µs)</caption>'
            '<thead><tr><th>Rank</th><th>File</th><th class=num>ts_us</th><th class=num>Duration</th><th>Name</th>'
            f'<th>Step</th><th>Note</th></tr></thead><tbody>{"".join(rows)}</tbody></table>{more}')


def _finding_section(i: int, f: dict, d: dict, cs: ChartSet) -> str:
    figs = charts.finding_charts(f, _list(d.get("breakdown")), _dict(d.get("extras")))
    chart_html = "".join(cs.add(fig, f"Chart for {f.get('title', '')}") for fig in figs) or \
        '<p class="muted">No per-rank numbers to chart for this finding.</p>'
    return (f'<section class="finding" id="finding-{i}"><h3>{i}. {esc(f.get("title"))} '
            f'{_severity(f.get("severity"))}</h3>'
            f'<p>{fmt_ms(f.get("recoverable_ms"))} per step ({fmt_share(f.get("share_of_step"))}) on rank(s) '
            f'{fmt_ranks(f.get("ranks"))}; confidence {esc(f.get("confidence"))}.</p>'
            f'<p class="fix"><strong>Fix:</strong> {esc(f.get("fix"))}</p>'
            f'<p class="method"><strong>Method:</strong> {esc(f.get("method"))}</p>'
            f'{_hta_for_check(_dict(_dict(_dict(d.get("extras")).get("hta")).get("by_check")).get(f.get("id")))}'
            f'{chart_html}<div class="tables">{_metrics_table(_dict(f.get("metrics")))}'
            f'{_events_table(_list(f.get("events")))}</div></section>')


def _lines(title: str, items: list, anchor: str) -> str:
    if not items:
        return f'<h2 id="{anchor}">{title}</h2><p class="muted">None.</p>'
    lis = "".join(f"<li>{esc(x)}</li>" for x in items[:MAX_LINES])
    more = f'<p class="muted">{len(items) - MAX_LINES} more in diagnosis.json.</p>' if len(items) > MAX_LINES else ""
    return f'<h2 id="{anchor}">{title} ({len(items)})</h2><ul class="lines">{lis}</ul>{more}'


def _inputs(run: dict) -> Iterator[str]:
    """Each rank's file and clock offset (a row a rank, given one at a time)."""
    files, offsets = _dict(run.get("files")), _dict(run.get("clock_offsets_us"))
    if not files:
        return
    yield ('<h2 id="inputs">Input files</h2><table class="inputs"><thead><tr><th>Rank</th><th>File</th>'
           '<th class=num>Clock offset (µs)</th></tr></thead><tbody>')
    yield from (f"<tr><td>{esc(r)}</td><td class=mono>{esc(p)}</td>"
                f"<td class=num>{fmt_value(offsets.get(r, 0))}</td></tr>" for r, p in files.items())
    yield '</tbody></table>'


def _each(items: Iterable[str], sep: str = " ") -> Iterator[str]:
    """sep.join(items), given an item at a time."""
    for i, x in enumerate(items):
        yield sep + x if i else x


def render(diagnosis: dict) -> str:
    return "".join(render_parts(diagnosis))


def render_parts(diagnosis: dict) -> Iterator[str]:
    """render's page in pieces, in page order: what grows with the ranks (each rank's chip, table
    row and file) a piece a rank, so that write_report never holds the page whole. Made as one
    text (and encoded whole) from every breakdown row as a dict, the report rose 18.0 MB above the
    answer at 1,024 DLRM ranks and 15.4 at 256; in pieces 7.2 and 7.0, 3.4 of it plotly.js's gzip
    made once a process (#20; docs/cluster-memory-log.md)."""
    d = _dict(diagnosis)
    run, findings = _dict(d.get("run")), [f for f in _list(d.get("findings")) if isinstance(f, dict)]
    checks, cs = _list(d.get("checks")), ChartSet()
    tool, extras = _dict(d.get("tool")), _dict(d.get("extras"))
    # the real timeline, when the JSON has it, replaces the composition-only lanes
    timeline = _dict(extras.get("timeline"))

    def body() -> Iterator[str]:
        # Sections that add charts are made in page order (as they are given) so chart ids follow the page.
        yield f"""<main>
<header class="top"><h1>Why is this training job slow? <span class="muted">torch-diagnose report</span></h1>
<span class="muted">{esc(tool.get("name", "torch-diagnose"))} {esc(tool.get("version", ""))} · schema {esc(d.get("schema_version"))}</span></header>
<section class="verdict" id="verdict" aria-label="Verdict">{_headline(d)}"""
        yield from _run_facts(run, extras)
        yield f"""</section>
<h2 id="ranked-causes">Ranked causes</h2>{_causes_table(findings)}
<h2 id="checklist">Checklist</h2>{_checklist(checks, findings)}
<h2 id="breakdown">Where the step goes</h2>"""
        yield from _breakdown_section(_list(d.get("breakdown")), cs, composition=not timeline.get("ranks"))
        yield _timeline_section(extras, cs)
        yield _over_time_section(extras, cs)
        yield _replay_section(extras, findings, cs)
        yield _top_ops_section(extras)
        yield _comm_groups_section(extras)
        yield '\n<h2 id="evidence">Evidence</h2>'
        yield from (_finding_section(i, f, d, cs) for i, f in enumerate(findings, 1))
        if not findings:
            yield '<p class="muted">Nothing flagged, so no evidence to show.</p>'
        yield f"""
<h2 id="hta">Second opinion: Holistic Trace Analysis (HTA)</h2>{_hta_section(extras)}
{_lines("Warnings", _list(d.get("warnings")), "warnings")}
{_lines("Skipped inputs", _list(d.get("skipped")), "skipped")}
"""
        yield from _inputs(run)
        yield """
<footer>Self-contained report: no network access needed. Numbers come from diagnosis.json; this page computes no verdicts.</footer>
</main>"""

    return page_parts("torch-diagnose report", body(), cs)


WRITE_CHARS = 1 << 18
"""The page is encoded and written at most this many characters at a time."""


def write_report(d, out_dir: Path) -> Path:
    """Render a `diagnose.model.Diagnosis` to OUT_DIR/report.html (atomically), written as it is
    made: its breakdown rows read one at a time (output.RowDicts), the page a piece at a time."""
    from diagnose.output import diagnosis_dict
    from diagnose.probes.safefs import write_atomic

    def encoded() -> Iterator[bytes]:
        for part in render_parts(diagnosis_dict(d, rows_when_read=True)):
            for i in range(0, len(part), WRITE_CHARS):
                yield part[i:i + WRITE_CHARS].encode("utf-8")

    path = Path(out_dir) / "report.html"
    write_atomic(path, encoded)
    return path
