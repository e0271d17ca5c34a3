"""The before/after report of `diagnose diff` (from diff.json)."""
from __future__ import annotations

from pathlib import Path

from . import charts
from .charts import num
from .common import STATUS_LABEL, ChartSet, _dict, _list, esc, fmt_ms, fmt_share, page
from .html import _severity, unnamed_wait_note

CHANGE_LABEL = {"gone": "GONE", "appeared": "APPEARED", "changed": "CHANGED", "unchanged": "UNCHANGED",
                "not_flagged": "not flagged"}


def _diff_side(side: dict) -> str:
    run = _dict(side.get("run"))
    findings = [f for f in _list(side.get("findings")) if isinstance(f, dict)]
    rows = "".join(f'<tr><td>{esc(f.get("title"))}</td><td class=num>{fmt_ms(f.get("recoverable_ms"))}</td>'
                   f'<td class=num>{fmt_share(f.get("share_of_step"))}</td><td>{_severity(f.get("severity"))}</td></tr>'
                   for f in findings)
    table = (f'<table class="causes"><thead><tr><th>Cause</th><th class=num>Recoverable / step</th>'
             f'<th class=num>Share</th><th>Impact</th></tr></thead><tbody>{rows}</tbody></table>'
             if rows else '<p class="muted">No cause was flagged.</p>' + unnamed_wait_note(side.get("unnamed_wait")))
    ranks = _list(run.get("ranks_found"))
    device = esc(run.get("device")) + (f" ({esc(run.get('device_name'))})" if run.get("device_name") else "")
    hta = _dict(side.get("hta"))
    hta_line = ""
    if hta:
        hta_run = _dict(hta.get("run"))
        said = hta_run.get("hta_says") or hta.get("reason") or hta.get("status")
        hta_line = f'<p><strong>HTA:</strong> {esc(said)}</p>'
    return (f'<div><h3>{esc(str(side.get("label", "")).upper())}: <span class=mono>{esc(side.get("path"))}</span></h3>'
            f'<p>Mean step <strong>{fmt_ms(side.get("step_ms"), 1)}</strong>; {len(ranks)}'
            f'{" of " + esc(run.get("world_size")) if run.get("world_size") is not None else ""} rank(s); {device}; '
            f'{esc(run.get("steps_analysed"))} step(s).</p>'
            f'{table}{hta_line}</div>')


def _diff_causes(causes: list) -> str:
    rows = []
    for c in map(_dict, causes):
        ch = str(c.get("change", ""))
        comp = ""
        if c.get("component"):
            comp = (f'{esc(str(c.get("component")).removesuffix("_ms").replace("_", " "))}: '
                    f'{fmt_ms(c.get("component_before_ms"))} → {fmt_ms(c.get("component_after_ms"))}')
        rows.append(f'<tr><td>{esc(c.get("title") or c.get("id"))}</td>'
                    f'<td><span class="chg-{esc(ch)}">{esc(CHANGE_LABEL.get(ch, ch))}</span></td>'
                    f'<td>{esc(STATUS_LABEL.get(str(c.get("before_status")), c.get("before_status")))}</td>'
                    f'<td class=num>{fmt_ms(c.get("before_ms"))}</td>'
                    f'<td>{esc(STATUS_LABEL.get(str(c.get("after_status")), c.get("after_status")))}</td>'
                    f'<td class=num>{fmt_ms(c.get("after_ms"))}</td><td>{comp}</td></tr>')
    if not rows:
        return '<p class="muted">No checks to compare.</p>'
    return ('<table class="diff-causes"><thead><tr><th>Check</th><th>Change</th><th>Before</th>'
            '<th class=num>Before: recoverable / step</th><th>After</th><th class=num>After: recoverable / step</th>'
            f'<th>Step breakdown (mean over ranks)</th></tr></thead><tbody>{"".join(rows)}</tbody></table>')


def render_diff(diff: dict) -> str:
    """BEFORE and AFTER side by side, from diff.json. Pure: dict in, HTML out; computes nothing new."""
    d = _dict(diff)
    before, after, st = _dict(d.get("before")), _dict(d.get("after")), _dict(d.get("step_ms"))
    cs, tool = ChartSet(), _dict(d.get("tool"))
    pct = num(st.get("change_pct"))
    change = f" ({pct:+.1%})" if pct is not None else ""
    lists = []
    for key, label in (("findings_gone", "Gone"), ("findings_appeared", "Appeared"), ("findings_changed", "Changed")):
        items = ", ".join(esc(x) for x in _list(d.get(key))) or "none"
        lists.append(f"<div><dt>{label}</dt><dd>{items}</dd></div>")
    fig = charts.diff_breakdown_bars(before, after)
    chart = cs.add(fig, "Mean step time before and after, by component") if fig is not None else ""
    pr = _dict(d.get("prediction"))
    predicted = ""
    if pr:
        err = num(pr.get("error"))
        predicted = (f'<p><span class="kicker">Predicted vs measured</span> fixing '
                     f'{esc(", ".join(str(x) for x in _list(pr.get("causes"))))} was predicted to give back '
                     f'<strong>{fmt_ms(pr.get("predicted_saving_ms"), 1)}</strong> per step '
                     f'({esc(pr.get("method"))}); the step got <strong>{fmt_ms(pr.get("measured_saving_ms"), 1)}'
                     f'</strong> shorter{f" (prediction {err:+.0%})" if err is not None else ""}.</p>')
    every = _dict(d.get("every_step_ms"))
    every_html = ""
    if every:
        ep = num(every.get("change_pct"))
        every_html = (f'<p><span class="kicker">Every step</span> <strong>{fmt_ms(every.get("before"), 1)} → '
                      f'{fmt_ms(every.get("after"), 1)}</strong>{esc(f" ({ep:+.1%})" if ep is not None else "")} '
                      '<span class="muted">(the probes\' record of every step outside the profiled ones)</span></p>')
    notes = "".join(f'<li>{esc(n)}</li>' for n in _list(d.get("comparability")))
    notes_html = f'<ul class="lines warn">{notes}</ul>' if notes else ""
    body = f"""<main>
<header class="top"><h1>What changed between two runs? <span class="muted">torch-diagnose diff</span></h1>
<span class="muted">{esc(tool.get("name", "torch-diagnose"))} {esc(tool.get("version", ""))} · diff {esc(d.get("diff_version"))}</span></header>
<section class="verdict" id="verdict" aria-label="Summary"><p class="headline"><span class="kicker">Step time</span>
<strong>{fmt_ms(st.get("before"), 1)} → {fmt_ms(st.get("after"), 1)}</strong>{esc(change)}</p>
{every_html}{predicted}<dl class="facts">{"".join(lists)}</dl>{notes_html}</section>
<h2 id="side-by-side">Before and after</h2><div class="side">{_diff_side(before)}{_diff_side(after)}</div>
<h2 id="causes">Per cause</h2>{_diff_causes(_list(d.get("causes")))}
<h2 id="breakdown">Where the step goes</h2>{chart or '<p class="muted">No step breakdown to compare.</p>'}
<footer>Self-contained report: no network access needed. Numbers come from diff.json; this page computes no verdicts.</footer>
</main>"""
    return page("torch-diagnose diff", body, cs)


def write_diff_report(diff: dict, out_dir: Path) -> Path:
    """Render diff.json's dict to OUT_DIR/report.html (atomically)."""
    from diagnose.probes.safefs import write_atomic

    path = Path(out_dir) / "report.html"
    write_atomic(path, render_diff(diff).encode("utf-8"))
    return path
