"""One self-contained, offline HTML report from diagnosis.json.

`render` is pure: dict in, HTML string out. It presents what the JSON says and
computes no verdicts. Every string from the JSON came from a trace file and is
untrusted, so it is escaped for the context it lands in (`esc` for HTML,
`script_json` for JSON inside <script>, `charts.plot_text` for Plotly labels).
"""
from __future__ import annotations

import functools
import html
import json
from pathlib import Path

import plotly.io as pio

from reports import charts
from reports.charts import num

MAX_EVENTS = 50      # per finding; the rest stay in diagnosis.json
MAX_LINES = 200      # warnings / skipped
STATUS_LABEL = {"flagged": "FLAGGED", "passed": "PASSED", "not_measurable": "NOT MEASURABLE"}
STATUS_MARK = {"flagged": "✖", "passed": "✔", "not_measurable": "?"}
PLOT_CONFIG = {"displaylogo": False, "responsive": True}


def esc(x) -> str:
    return "—" if x is None else html.escape(str(x), quote=True)


def script_json(obj_or_text) -> str:
    """JSON safe inside <script>: no `</script>`, `<!--` or `&` can survive."""
    text = obj_or_text if isinstance(obj_or_text, str) else json.dumps(obj_or_text, sort_keys=True)
    for ch, rep in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                    ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, rep)
    return text


@functools.lru_cache(maxsize=1)
def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs
    return get_plotlyjs()


def _dict(x) -> dict:
    return x if isinstance(x, dict) else {}


def _list(x) -> list:
    return x if isinstance(x, list) else []


def fmt_ms(x, digits: int = 2) -> str:
    v = num(x)
    return "—" if v is None else f"{v:,.{digits}f} ms"


def fmt_share(x) -> str:
    v = num(x)
    return "—" if v is None else f"{v:.0%}" if v >= 0.1 else f"{v:.1%}"


def fmt_ranks(ranks) -> str:
    """'0–7' or '0, 2–7': compact even for hundreds of ranks."""
    rs = sorted({int(r) for r in _list(ranks) if isinstance(r, int) or str(r).lstrip("-").isdigit()})
    parts, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}–{rs[j]}")
        i = j + 1
    return ", ".join(parts) or "—"


def fmt_value(v) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e6 else f"{v:,.0f}"
    return esc(v)


def fmt_ts(v) -> str:
    """Timestamps as written in the trace, whole microseconds when integral (for Perfetto search)."""
    f = num(v)
    if f is None:
        return esc(v)
    return f"{f:.0f}" if f == int(f) else f"{f:.3f}"


def fmt_dur(us) -> str:
    v = num(us)
    return "—" if v is None else f"{v / 1000:,.3f} ms"


# ---------------------------------------------------------------- charts ---

class ChartSet:
    """Collects figures; each gets a placeholder div, drawn by one script at the end."""

    def __init__(self) -> None:
        self.figures: list[str] = []

    def add(self, fig, label: str) -> str:
        i = len(self.figures)
        self.figures.append(pio.to_json(fig, validate=False))
        return f'<div class="chart" id="chart-{i}" data-chart="{i}" role="img" aria-label="{esc(label)}"></div>'

    def script(self) -> str:
        data = script_json("[" + ",".join(self.figures) + "]")
        # A page hook for the browser test: how many charts drew, and any JS errors.
        return f"""<script>
(function () {{
  var figs = {data}, cfg = {script_json(PLOT_CONFIG)}, done = [];
  document.body.dataset.chartsExpected = String(figs.length);
  figs.forEach(function (f, i) {{
    var el = document.getElementById("chart-" + i);
    if (!el || typeof Plotly === "undefined") return;
    done.push(Plotly.newPlot(el, f.data, f.layout || {{}}, cfg));
  }});
  Promise.all(done).then(function () {{ document.body.dataset.chartsRendered = String(done.length); }},
                         function (e) {{ window.__reportError(e); }});
}})();
</script>"""


# -------------------------------------------------------------- sections ---

def _headline(d: dict) -> str:
    findings = _list(d.get("findings"))
    top = _dict(findings[0]) if findings else {}
    if top:
        return (f'<p class="headline"><span class="kicker">Top cause</span> <strong>{esc(top.get("title"))}</strong>: '
                f'about {fmt_ms(top.get("recoverable_ms"), 1)} per step recoverable '
                f'({fmt_share(top.get("share_of_step"))} of the step), on rank(s) {fmt_ranks(top.get("ranks"))}.</p>')
    checks = _list(d.get("checks"))
    counts = {s: sum(1 for c in checks if _dict(c).get("status") == s) for s in STATUS_LABEL}
    return (f'<p class="headline"><strong>No significant cause found.</strong> '
            f'{counts["passed"]} check(s) passed, {counts["not_measurable"]} could not be measured; '
            f'the step breakdown below shows where the time goes.</p>')


def _run_facts(run: dict) -> str:
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
                                  f"<span class=muted>(from {esc(run.get('step_source'))})</span>"),
             ("Mean step" + (" (range over ranks)" if len(vals) > 1 else ""), mean_txt)]
    items = "".join(f"<div><dt>{k}</dt><dd>{v}</dd></div>" for k, v in facts)
    per_rank = " ".join(f'<span class="chip">rank {esc(k)}: {fmt_ms(v, 1)}</span>' for k, v in means.items())
    more = (f'<details{" open" if len(means) <= 16 else ""}><summary>Mean step time per rank</summary>'
            f'<p class="chips">{per_rank}</p></details>') if means else ""
    return f'<dl class="facts">{items}</dl>{more}'


def _causes_table(findings: list) -> str:
    if not findings:
        return '<p class="muted">No cause was flagged.</p>'
    head = ("<tr><th>#</th><th>Cause</th><th class=num>Est. recoverable<br>per step</th>"
            "<th class=num>Share<br>of step</th><th>Ranks</th><th>Confidence</th><th>Severity</th><th>Fix</th></tr>")
    rows = []
    for i, f in enumerate(map(_dict, findings), 1):
        rows.append(f'<tr><td>{i}</td><td><a href="#finding-{i}">{esc(f.get("title"))}</a></td>'
                    f'<td class=num>{fmt_ms(f.get("recoverable_ms"))}</td>'
                    f'<td class=num>{fmt_share(f.get("share_of_step"))}</td>'
                    f'<td>{fmt_ranks(f.get("ranks"))}</td><td>{esc(f.get("confidence"))}</td>'
                    f'<td>{_severity(f.get("severity"))}</td><td class=fix>{esc(f.get("fix"))}</td></tr>')
    return f'<table class="causes" id="causes"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>'


def _severity(sev) -> str:
    """A text badge (HIGH/MEDIUM/LOW); the styles differ in border too, not only colour."""
    sev = "" if sev is None else str(sev)
    return f'<span class="sev sev-{esc(sev)}">{esc(sev.upper())}</span>'


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


def _breakdown_section(breakdown: list, cs: ChartSet, composition: bool = True) -> str:
    means = charts.mean_breakdown(breakdown)
    if not means:
        return '<p class="muted">No per-step breakdown in this diagnosis.</p>'
    parts = []
    fig = charts.breakdown_bars(breakdown)
    if fig is not None:
        parts.append(cs.add(fig, "Mean step time per rank, stacked by component"))
    fig, step = charts.step_composition(breakdown) if composition else (None, None)
    if fig is not None:
        parts.append(cs.add(fig, f"Composition of step {step} per rank"))
        parts.append('<p class="muted">Each lane is one rank\'s step with its components laid end to end: '
                     'it shows how much of the step each part took, not when it happened. '
                     'Use the evidence tables to find the events in Perfetto.</p>')
    cols = [("step_ms", "step")] + [(k, lbl) for k, lbl, _, _ in charts.COMPONENTS]
    head = "<tr><th>Rank</th>" + "".join(f"<th class=num>{lbl} (ms)</th>" for _, lbl in cols) + "</tr>"
    body = "".join("<tr><td>" + str(r) + "</td>" + "".join(f"<td class=num>{m.get(k, 0):,.2f}</td>" for k, _ in cols)
                   + "</tr>" for r, m in means.items())
    parts.append(f'<details{" open" if len(means) <= 16 else ""}><summary>Mean per rank, as numbers</summary>'
                 f'<table class="breakdown"><thead>{head}</thead><tbody>{body}</tbody></table></details>')
    return "".join(parts)


def _timeline_section(extras: dict, cs: ChartSet) -> str:
    fig = charts.step_timeline(_dict(extras.get("timeline")))
    if fig is None:
        return ""
    return (cs.add(fig, "Timeline of one step on every rank") +
            '<p class="muted">Real intervals from the traces: when each rank computed, communicated or waited for '
            'data during one representative step. A rank whose rows start late is the one the others wait for.</p>')


def _metrics_table(metrics: dict) -> str:
    if not metrics:
        return '<p class="muted">No metrics recorded.</p>'
    rows = "".join(f"<tr><th scope=row>{esc(k)}</th><td class=num>{fmt_value(v)}</td></tr>" for k, v in metrics.items())
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


def _inputs(run: dict) -> str:
    files, offsets = _dict(run.get("files")), _dict(run.get("clock_offsets_us"))
    if not files:
        return ""
    rows = "".join(f"<tr><td>{esc(r)}</td><td class=mono>{esc(p)}</td>"
                   f"<td class=num>{fmt_value(offsets.get(r, 0))}</td></tr>" for r, p in files.items())
    return ('<h2 id="inputs">Input files</h2><table class="inputs"><thead><tr><th>Rank</th><th>File</th>'
            f'<th class=num>Clock offset (µs)</th></tr></thead><tbody>{rows}</tbody></table>')


# ------------------------------------------------------------------- hta ---

HTA_STATUS_LINE = {
    "not_requested": "HTA evidence was not requested (run with --hta to add Holistic Trace Analysis as a second "
                     "opinion).",
    "not_installed": "HTA evidence is not available: HTA (Holistic Trace Analysis) is not installed.",
}
AGREE_LABEL = {True: "AGREES", False: "DISAGREES", None: "NOT COMPARED"}


def _agree(v) -> str:
    key = v if v in (True, False) else None
    cls = {True: "agree", False: "disagree", None: "na"}[key]
    return f'<span class="hta-{cls}">{AGREE_LABEL[key]}</span>'


def _fmt_cmp(v, unit) -> str:
    x = num(v)
    if x is None:
        return "—"
    return f"{x:,.1f} µs" if unit == "us" else fmt_share(x)


def _hta_comparisons(rows: list) -> str:
    body = "".join(
        f'<tr><td>{esc(c.get("quantity"))}</td><td class=num>{_fmt_cmp(c.get("ours"), c.get("unit"))}</td>'
        f'<td class=num>{_fmt_cmp(c.get("hta"), c.get("unit"))}</td><td>{esc(c.get("tolerance"))}</td>'
        f'<td>{_agree(c.get("agrees"))}{(" " + esc(c.get("note"))) if c.get("note") else ""}</td></tr>'
        for c in map(_dict, rows))
    if not body:
        return ""
    return ('<table class="hta-cmp"><thead><tr><th>Quantity</th><th class=num>Ours</th><th class=num>HTA</th>'
            f'<th>Tolerance</th><th>Agrees?</th></tr></thead><tbody>{body}</tbody></table>')


def _hta_for_check(entry) -> str:
    """'HTA says' for one check or finding, the comparison, and any disagreement spelled out."""
    e = _dict(entry)
    if not e:
        return ""
    parts = [f'<p class="hta-says"><strong>HTA says:</strong> {esc(e.get("hta_says"))} {_agree(e.get("agrees"))}</p>',
             _hta_comparisons(_list(e.get("comparisons")))]
    if e.get("disagreement"):
        parts.append(f'<p class="hta-disagree"><strong>Disagreement:</strong> {esc(e.get("disagreement"))}</p>')
    elif e.get("definitions"):
        parts.append(f'<details><summary>Definitions</summary><p>{esc(e.get("definitions"))}</p></details>')
    return f'<div class="hta">{"".join(parts)}</div>'


def _hta_section(extras: dict) -> str:
    h = _dict(extras.get("hta"))
    status = str(h.get("status") or "not_requested")
    if status in HTA_STATUS_LINE:
        reason = h.get("reason") if status == "not_installed" else None
        return f'<p class="hta-status">{esc(HTA_STATUS_LINE[status])}{(" " + esc(reason)) if reason else ""}</p>'
    if status != "ok":
        return f'<p class="hta-status">{esc(h.get("reason") or status)}</p>'
    parts = [f'<p class="hta-status">Holistic Trace Analysis {esc(h.get("hta_version"))} on rank(s) '
             f'{fmt_ranks(h.get("ranks"))}, {len(_list(h.get("steps_kept")))} step(s) kept, '
             f'{fmt_value(num(h.get("seconds")))} s. A second opinion: where it and we disagree, both definitions '
             'are given and neither is preferred.</p>']
    for cid, entry in _dict(h.get("by_check")).items():
        parts.append(f'<h3>{esc(cid)}</h3>{_hta_for_check(entry)}')
    run = _dict(h.get("run"))
    if run:
        parts.append(f'<h3>Run: temporal breakdown</h3><p>{esc(run.get("hta_says"))}</p>'
                     f'{_hta_comparisons(_list(run.get("comparisons")))}')
        rows = "".join(f'<tr><td>{esc(r)}</td><td class=num>{fmt_ms(v.get("kernel_span_ms"))}</td>'
                       f'<td class=num>{fmt_share(v.get("compute_share"))}</td>'
                       f'<td class=num>{fmt_share(v.get("non_compute_share"))}</td>'
                       f'<td class=num>{fmt_share(v.get("idle_share"))}</td></tr>'
                       for r, v in ((r, _dict(v)) for r, v in _dict(run.get("per_rank")).items()))
        if rows:
            parts.append('<details><summary>Per rank</summary><table class="hta-run"><thead><tr><th>Rank</th>'
                         '<th class=num>Kernel span</th><th class=num>Compute</th><th class=num>Non-compute</th>'
                         f'<th class=num>Idle</th></tr></thead><tbody>{rows}</tbody></table></details>')
    cp = _dict(h.get("critical_path"))
    if cp:
        parts.append(f'<h3>Critical path</h3><p>{esc(cp.get("hta_says"))}</p>')
        if cp.get("caveat"):
            parts.append(f'<p class="muted">{esc(cp.get("caveat"))}</p>')
    lim = "".join(f"<li>{esc(x)}</li>" for x in _list(h.get("limitations")))
    if lim:
        parts.append(f'<details><summary>Where HTA is not right</summary><ul class="lines">{lim}</ul></details>')
    return "".join(parts)


# ------------------------------------------------------------------ page ---

CSS = """
:root{--fg:#1d1d1f;--muted:#5f6368;--line:#d0d4d9;--bg:#fff;--soft:#f5f6f8}
*{box-sizing:border-box}body{margin:0;font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;color:var(--fg);background:var(--bg)}
main{max-width:1280px;margin:0 auto;padding:20px 28px 60px}
header.top{display:flex;justify-content:space-between;align-items:baseline;border-bottom:2px solid var(--fg);padding-bottom:6px}
header.top h1{font-size:18px;margin:0}.muted{color:var(--muted)}
h2{font-size:19px;margin:34px 0 10px;border-bottom:1px solid var(--line);padding-bottom:4px}h3{font-size:17px;margin:0 0 6px}
.verdict{border:2px solid var(--fg);border-left-width:10px;padding:12px 18px;margin:16px 0;background:var(--soft)}
.headline{font-size:20px;margin:0 0 10px}.kicker{display:inline-block;font-size:12px;font-weight:700;letter-spacing:.06em;text-transform:uppercase;border:1px solid var(--fg);padding:0 5px;margin-right:4px;vertical-align:3px}
.facts{display:flex;flex-wrap:wrap;gap:6px 28px;margin:0}.facts div{min-width:120px}.facts dt{font-size:12px;color:var(--muted);text-transform:uppercase;letter-spacing:.04em}.facts dd{margin:0;font-weight:600}
details{margin:8px 0}summary{cursor:pointer;color:var(--muted)}.chips{display:flex;flex-wrap:wrap;gap:4px 8px;margin:6px 0}.chip{border:1px solid var(--line);border-radius:3px;padding:1px 6px;font-size:13px;font-variant-numeric:tabular-nums}
.warn{color:#a50e0e;font-weight:600}
table{border-collapse:collapse;width:100%;margin:8px 0 14px;font-size:14px}th,td{border:1px solid var(--line);padding:5px 8px;text-align:left;vertical-align:top}
thead th{background:var(--soft);font-size:13px}caption{text-align:left;font-weight:700;padding:4px 0}
.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}.mono{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px;word-break:break-all}
.causes td.fix{font-size:13px;max-width:420px}
.sev,.status{display:inline-block;font-size:12px;font-weight:700;letter-spacing:.04em;padding:1px 6px;border-radius:3px;white-space:nowrap}
.sev-high{background:#a50e0e;color:#fff}.sev-medium{background:#fff;color:#8a4b00;border:2px solid #8a4b00}.sev-low{background:#fff;color:#444;border:1px dashed #444}
.status-flagged{background:#a50e0e;color:#fff}.status-passed{border:1px solid #1e6b33;color:#1e6b33}.status-not_measurable{border:1px dashed #555;color:#555;background:repeating-linear-gradient(45deg,#fff,#fff 4px,#eee 4px,#eee 8px)}
tr.check-flagged td{font-weight:600}
.finding{border-top:3px double var(--line);padding-top:14px;margin-top:22px}.fix,.method{margin:4px 0}
.chart{width:100%;min-height:220px;margin:8px 0;border:1px solid var(--soft)}
.tables{display:grid;grid-template-columns:fit-content(440px) minmax(0,1fr);gap:16px;align-items:start}
@media (max-width:900px){.tables{grid-template-columns:1fr}}
.metrics th{font-weight:400;overflow-wrap:anywhere;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px}
ul.lines li{margin:2px 0;font-size:14px}footer{margin-top:40px;font-size:12px;color:var(--muted)}
@media print{.chart{break-inside:avoid}}
.hta{border-left:4px solid var(--line);padding:2px 12px;margin:8px 0}.hta-says{margin:4px 0}
span.hta-agree,span.hta-disagree,span.hta-na{display:inline-block;font-size:12px;font-weight:700;padding:0 5px;border-radius:3px}
span.hta-agree{border:1px solid #1e6b33;color:#1e6b33}span.hta-disagree{background:#8a4b00;color:#fff}p.hta-disagree{border:2px solid #8a4b00;padding:6px 10px}span.hta-na{border:1px dashed #555;color:#555}
.side{display:grid;grid-template-columns:1fr 1fr;gap:18px}@media (max-width:900px){.side{grid-template-columns:1fr}}
.chg-gone{color:#1e6b33;font-weight:700}.chg-appeared{color:#a50e0e;font-weight:700}
"""

# Installed before anything else runs, so errors in plotly or the chart loop are counted.
ERROR_HOOK = """<script>
window.__reportError = function (e) {
  var b = document.body; b.dataset.jsErrors = String(Number(b.dataset.jsErrors || 0) + 1);
  b.dataset.jsErrorText = String(e && e.message || e).slice(0, 300);
};
window.addEventListener("error", function (ev) { window.__reportError(ev.error || ev.message); });
</script>"""


def render(diagnosis: dict) -> str:
    d = _dict(diagnosis)
    run, findings = _dict(d.get("run")), [f for f in _list(d.get("findings")) if isinstance(f, dict)]
    checks, cs = _list(d.get("checks")), ChartSet()
    tool = _dict(d.get("tool"))
    # Sections that add charts are built in page order so chart ids follow the page.
    timeline = _dict(_dict(d.get("extras")).get("timeline"))
    # the real timeline, when the JSON has it, replaces the composition-only lanes
    breakdown_html = (_breakdown_section(_list(d.get("breakdown")), cs, composition=not timeline.get("ranks"))
                      + _timeline_section(_dict(d.get("extras")), cs))
    evidence = "".join(_finding_section(i, f, d, cs) for i, f in enumerate(findings, 1)) or \
        '<p class="muted">Nothing flagged, so no evidence to show.</p>'
    body = f"""<main>
<header class="top"><h1>Why is this training job slow? <span class="muted">torch-diagnose report</span></h1>
<span class="muted">{esc(tool.get("name", "torch-diagnose"))} {esc(tool.get("version", ""))} · schema {esc(d.get("schema_version"))}</span></header>
<section class="verdict" id="verdict" aria-label="Verdict">{_headline(d)}{_run_facts(run)}</section>
<h2 id="ranked-causes">Ranked causes</h2>{_causes_table(findings)}
<h2 id="checklist">Checklist</h2>{_checklist(checks, findings)}
<h2 id="breakdown">Where the step goes</h2>{breakdown_html}
<h2 id="evidence">Evidence</h2>{evidence}
<h2 id="hta">Second opinion: Holistic Trace Analysis (HTA)</h2>{_hta_section(_dict(d.get("extras")))}
{_lines("Warnings", _list(d.get("warnings")), "warnings")}
{_lines("Skipped inputs", _list(d.get("skipped")), "skipped")}
{_inputs(run)}
<footer>Self-contained report: no network access needed. Numbers come from diagnosis.json; this page computes no verdicts.</footer>
</main>"""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>torch-diagnose report</title><style>{CSS}</style></head>
<body>{ERROR_HOOK}{body}
<script>{_plotly_js()}</script>
{cs.script()}
</body></html>
"""


def write_report(d, out_dir: Path) -> Path:
    """Render a `diagnose.model.Diagnosis` to OUT_DIR/report.html (atomically)."""
    from diagnose.output import diagnosis_dict, write_atomic

    path = Path(out_dir) / "report.html"
    write_atomic(path, render(diagnosis_dict(d)).encode("utf-8"))
    return path


# ------------------------------------------------------------------ diff ---

CHANGE_LABEL = {"gone": "GONE", "appeared": "APPEARED", "changed": "CHANGED", "unchanged": "UNCHANGED",
                "not_flagged": "not flagged"}


def _diff_side(side: dict) -> str:
    run = _dict(side.get("run"))
    findings = [f for f in _list(side.get("findings")) if isinstance(f, dict)]
    rows = "".join(f'<tr><td>{esc(f.get("title"))}</td><td class=num>{fmt_ms(f.get("recoverable_ms"))}</td>'
                   f'<td class=num>{fmt_share(f.get("share_of_step"))}</td><td>{_severity(f.get("severity"))}</td></tr>'
                   for f in findings)
    table = (f'<table class="causes"><thead><tr><th>Cause</th><th class=num>Recoverable / step</th>'
             f'<th class=num>Share</th><th>Severity</th></tr></thead><tbody>{rows}</tbody></table>'
             if rows else '<p class="muted">No cause was flagged.</p>')
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
            '<th class=num>Recoverable / step</th><th>After</th><th class=num>Recoverable / step</th>'
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
    notes = "".join(f'<li>{esc(n)}</li>' for n in _list(d.get("comparability")))
    notes_html = f'<ul class="lines warn">{notes}</ul>' if notes else ""
    body = f"""<main>
<header class="top"><h1>What changed between two runs? <span class="muted">torch-diagnose diff</span></h1>
<span class="muted">{esc(tool.get("name", "torch-diagnose"))} {esc(tool.get("version", ""))} · diff {esc(d.get("diff_version"))}</span></header>
<section class="verdict" id="verdict" aria-label="Summary"><p class="headline"><span class="kicker">Step time</span>
<strong>{fmt_ms(st.get("before"), 1)} → {fmt_ms(st.get("after"), 1)}</strong>{esc(change)}</p>
<dl class="facts">{"".join(lists)}</dl>{notes_html}</section>
<h2 id="side-by-side">Before and after</h2><div class="side">{_diff_side(before)}{_diff_side(after)}</div>
<h2 id="causes">Per cause</h2>{_diff_causes(_list(d.get("causes")))}
<h2 id="breakdown">Where the step goes</h2>{chart or '<p class="muted">No step breakdown to compare.</p>'}
<footer>Self-contained report: no network access needed. Numbers come from diff.json; this page computes no verdicts.</footer>
</main>"""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>torch-diagnose diff</title><style>{CSS}</style></head>
<body>{ERROR_HOOK}{body}
<script>{_plotly_js()}</script>
{cs.script()}
</body></html>
"""


def write_diff_report(diff: dict, out_dir: Path) -> Path:
    """Render diff.json's dict to OUT_DIR/report.html (atomically)."""
    from diagnose.output import write_atomic

    path = Path(out_dir) / "report.html"
    write_atomic(path, render_diff(diff).encode("utf-8"))
    return path
