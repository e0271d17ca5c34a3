"""The scaling report: speedup curve, lost-speedup waterfall, baseline panel, what-if table.

Pure `render_scaling(scaling_dict) -> str`; same rules as the diagnosis report: one
self-contained file, every string from the data escaped.
"""
from __future__ import annotations

from .charts import FLAGGED_COLOUR, OTHER_COLOUR, _figure, _layout, _trace, num, plot_text
from .common import ChartSet, _dict, _list, esc, fmt_ms, fmt_share, page

LABELS = {
    "dataloader_starvation": "DataLoader wait",
    "input_stall": "input copies",
    "exposed_communication": "exposed communication",
    "straggler": "straggler wait",
    "launch_overhead": "launch / per-op overhead",
    "cpu_contention": "CPU contention",
    "compute_inflation": "compute inflation",
    "unexplained": "unexplained",
    "every_cause": "every cause together",
}


def _label(cid) -> str:
    return LABELS.get(str(cid), str(cid))


def _curve(runs: list, cs: ChartSet) -> str:
    ns = [num(r.get("nproc")) for r in runs]
    sp = [num(r.get("speedup")) for r in runs]
    base = ns[0] or 1
    fig = _figure(_trace("scatter", x=ns, y=[n / base for n in ns], name="ideal", mode="lines+markers",
                         line={"dash": "dash", "color": OTHER_COLOUR}, marker={"symbol": "square"}),
                  _trace("scatter", x=ns, y=sp, name="observed", mode="lines+markers+text",
                         text=[f"{v:.2f}x" if v is not None else "" for v in sp], textposition="top left",
                         line={"color": FLAGGED_COLOUR}, marker={"symbol": "circle", "size": 10}))
    # the diagnosis report's look (one theme for every page)
    _layout(fig, "Speedup vs world size (dashed: ideal)", height=380,
            xaxis={"title": {"text": "ranks (N)"}, "tickvals": ns},  # integer world sizes: no 1.2-rank ticks
            yaxis={"title": {"text": "speedup"}})
    return cs.add(fig, "speedup curve: observed vs ideal")


def _waterfall(d: dict, cs: ChartSet) -> str:
    bars = [b for b in _list(d.get("waterfall")) if isinstance(b, dict)]
    ideal, observed = num(d.get("ideal_speedup")), num(d.get("observed_speedup"))
    x = ["ideal"] + [plot_text(_label(b.get("id"))) for b in bars] + ["observed"]
    y = [ideal] + [-(num(b.get("lost_speedup")) or 0.0) for b in bars] + [observed]
    fig = _figure(_trace("waterfall", x=x, y=y, measure=["absolute"] + ["relative"] * len(bars) + ["total"],
                         text=[f"{v:+.2f}x" if i not in (0, len(y) - 1) else f"{v:.2f}x"
                               for i, v in enumerate(v or 0.0 for v in y)],
                         textposition="outside", connector={"line": {"color": "#888"}},
                         decreasing={"marker": {"color": FLAGGED_COLOUR}},
                         increasing={"marker": {"color": "#1e6b33"}},
                         totals={"marker": {"color": OTHER_COLOUR}}))
    _layout(fig, "Where the speedup went: ideal -> each cause -> observed", height=420, showlegend=False,
            yaxis={"title": {"text": "speedup"}})
    return cs.add(fig, "lost speedup waterfall")


def _fmt(v, spec: str, suffix: str = "") -> str:
    x = num(v)
    return "—" if x is None else format(x, spec) + suffix


def _runs_table(runs: list) -> str:
    rows = "".join(
        f"<tr><td class=num>{esc(r.get('nproc'))}</td><td class=num>{fmt_ms(r.get('step_ms'), 1)}</td>"
        f"<td class=num>{_fmt(r.get('throughput'), ',.1f')}</td>"
        f"<td class=num>{_fmt(r.get('speedup'), '.2f', 'x')}</td>"
        f"<td class=num>{fmt_share(r.get('efficiency'))}</td><td>{esc(r.get('step_source'))}</td>"
        f"<td>{esc(r.get('run_dir'))}</td></tr>" for r in runs)
    return ("<table><thead><tr><th>N</th><th>step time</th><th>samples/s</th><th>speedup</th><th>efficiency</th>"
            f"<th>step time from</th><th>run directory</th></tr></thead><tbody>{rows}</tbody></table>")


def render_scaling(data: dict) -> str:
    d = _dict(data)
    runs = [r for r in _list(d.get("runs")) if isinstance(r, dict)]
    cs = ChartSet()
    curve = _curve(runs, cs) if runs else ""
    water = _waterfall(d, cs)
    bars = "".join(f"<tr><td>{esc(_label(b.get('id')))}</td><td class=num>{num(b.get('lost_speedup')) or 0:+.3f}x</td>"
                   f"<td class=num>{num(b.get('delta_ms')) or 0:+.2f} ms</td></tr>"
                   for b in _list(d.get("waterfall")) if isinstance(b, dict))
    base = "".join(f"<tr><td>{esc(_label(f.get('id')))}</td><td class=num>{fmt_ms(f.get('recoverable_ms'))}</td>"
                   f"<td class=num>{fmt_share(f.get('share_of_step'))}</td></tr>"
                   for f in _list(d.get("baseline")) if isinstance(f, dict)) or \
        '<tr><td colspan=3>Nothing flagged at the smallest world size.</td></tr>'
    whatif = "".join(f"<tr><td>{esc(_label(w.get('id')))}</td><td class=num>{fmt_ms(w.get('step_ms'), 1)}</td>"
                     f"<td class=num>{num(w.get('speedup')) or 0:.2f}x</td></tr>"
                     for w in _list(d.get("what_if")) if isinstance(w, dict))
    last = runs[-1].get("nproc") if runs else "?"
    head = esc(d.get("verdict")) if isinstance(d.get("verdict"), str) and d.get("verdict") else (
        f"{num(d.get('observed_speedup')) or 0:.2f}x observed at N={esc(last)} of an ideal "
        f"{num(d.get('ideal_speedup')) or 0:.2f}x")
    head += f" <span class=muted>({esc(d.get('mode'))} scaling)</span>"
    body = f"""<main>
<header class="top"><h1>Scaling: where did the speedup go? <span class="muted">torch-diagnose</span></h1></header>
<section class="verdict" id="verdict"><p class="headline">{head}</p>{_runs_table(runs)}</section>
<h2>Speedup</h2>{curve}
<h2>Lost speedup, cause by cause (what got worse as N grew)</h2>{water}
<table id="waterfall-table"><thead><tr><th>cause</th><th>lost speedup</th><th>change per step</th></tr></thead><tbody>{bars}</tbody></table>
<h2>Slow already at the smallest N (baseline: costs throughput at every N, not speedup)</h2>
<table id="baseline"><thead><tr><th>cause</th><th>ms per step</th><th>share</th></tr></thead><tbody>{base}</tbody></table>
<h2>What if (at the largest N)</h2>
<table id="what-if"><thead><tr><th>without</th><th>step time</th><th>speedup</th></tr></thead><tbody>{whatif}</tbody></table>
<h2>Assumptions</h2><ul>{''.join(f'<li>{esc(a)}</li>' for a in _list(d.get('assumptions')))}</ul>
{''.join(f'<p class="muted">warning: {esc(w)}</p>' for w in _list(d.get('warnings')))}
<footer>Self-contained report: no network access needed. Numbers come from scaling.json.</footer>
</main>"""
    return page("torch-diagnose scaling report", body, cs)
