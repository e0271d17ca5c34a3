"""Plotly figures for the HTML report, built only from what diagnosis.json says.

Every function takes plain dicts/lists (the JSON), tolerates missing or odd values,
and returns a figure or None when there is nothing honest to draw.

A figure is plotly's own JSON form, a dict of `data` (the traces) and `layout`, built here as
plain dicts (`_trace`, `_layout`): plotly.graph_objects checked each property as it was set and
loaded its validators to do it, 16 MB of the report command's memory held from the first figure
on, most of the render's cost (#20). plotly.js reads the same JSON; the tests pass every figure
the reports draw through plotly's validators (tests/test_report.py).
"""
from __future__ import annotations

import html
import math
import re
import statistics
from collections import defaultdict

import numpy as np

# (breakdown key, legend label, colour, bar pattern). Okabe-Ito colours are
# colour-blind safe; the patterns keep the stack readable in greyscale/print.
GC_COLOUR = "#882255"  # the step graph's garbage-collection part (diagnose/step/pauses.py)
COMPONENTS: tuple[tuple[str, str, str, str], ...] = (
    ("compute_ms", "compute", "#0072B2", ""),
    ("exposed_comm_ms", "exposed comm", "#E69F00", "/"),
    ("straggler_wait_ms", "straggler wait", "#D55E00", "x"),
    ("dataloader_ms", "dataloader wait", "#009E73", "."),
    ("gc_ms", "garbage collection", GC_COLOUR, "+"),  # drawn only where a rank has some (shown_components)
    ("other_ms", "other / idle", "#9E9E9E", "\\"),
)
# GPU ranks: other_ms split by why the device idled (the idle model's classes, in the JSON as
# other_by_cause_ms); the residual "other / idle" is then ~0 and dropped when it is.
IDLE_CAUSES: tuple[tuple[str, str, str, str], ...] = (
    ("idle_launch", "idle: waiting for launches", "#CC79A7", "\\"),
    ("idle_queued", "idle: work queued, waiting", "#F0E442", "-"),
    ("idle_sync", "idle: host sync drain", "#555555", "+"),
    ("idle_input", "idle: input copy", "#66C2A5", "."),
    ("idle_latency", "idle: scheduling latency", "#DDDDDD", ""),
    ("idle_unattributed", "idle: unattributed", "#9E9E9E", "|"),
)
FLAGGED_COLOUR, OTHER_COLOUR = "#CC3311", "#BBBBBB"
# ColorBrewer's RdBu reversed (plotly.py's "RdBu_r": blue early, red late), as the stops plotly.py
# writes for that name: plotly.js knows no "RdBu_r", and its own "RdBu" is another scale
DIVERGING = [[i / 10, c] for i, c in enumerate((
    "rgb(5,48,97)", "rgb(33,102,172)", "rgb(67,147,195)", "rgb(146,197,222)", "rgb(209,229,240)", "rgb(247,247,247)",
    "rgb(253,219,199)", "rgb(244,165,130)", "rgb(214,96,77)", "rgb(178,24,43)", "rgb(103,0,31)"))]
# the critical-path strip's colour per graph part (diagnose/step/graph.py PARTS)
CRITICAL_COLOURS = {"compute": COMPONENTS[0][2], "communication": COMPONENTS[1][2], "comm_wait": COMPONENTS[1][2],
                    "dataloader": COMPONENTS[3][2], "gc": GC_COLOUR, **{k: c for k, _, c, _ in IDLE_CAUSES}}
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif"

# Which breakdown component shows each finding per rank, when metrics carry no
# per-rank numbers of their own.
FINDING_COMPONENT = {
    "dataloader_starvation": "dataloader_ms",
    "exposed_communication": "exposed_comm_ms",
    "straggler": "straggler_wait_ms",
    "load_imbalance": "straggler_wait_ms",
    "launch_overhead": "idle_launch",
    "device_wait": "idle_queued",
    "host_sync": "idle_sync",
}
# Preferred per-rank metric suffix (metrics key rank<N>_<suffix>) per finding.
FINDING_METRIC = {
    "dataloader_starvation": "dataloader_ms",
    "exposed_communication": "exposed_comm_ms",
    "straggler": "mean_lateness_ms",
    "gc_pause": "full_pass_ms_per_step",
}
METRIC_TITLE = {
    "dataloader_ms": "DataLoader wait per step, per rank (ms)",
    "exposed_comm_ms": "Exposed communication per step, per rank (ms)",
    "mean_lateness_ms": "Mean arrival lateness at collectives vs the median rank, per rank (ms)",
    "full_pass_ms_per_step": "Full garbage collections per step over the run, per rank (ms)",
}
_RANK_KEY = re.compile(r"^rank(\d+)_(.+)$")


def plot_text(s) -> str:
    """Plotly renders labels as pseudo-HTML, so untrusted text is escaped there too."""
    return html.escape(str(s), quote=False)


def num(x) -> float | None:
    """A finite float, or None for anything else (null, strings like 'not recorded')."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def _rank(x) -> int | None:
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


def _pattern(shape) -> dict:
    # Overlay a dark hatch on the fill colour: colour for screens, hatch for greyscale.
    return {"shape": shape, "fillmode": "overlay", "fgcolor": "rgba(0,0,0,0.6)", "size": 7, "solidity": 0.2}


def _bar_marker(colour: str, shape: str) -> dict:
    """A stacked bar's fill: its colour, a thin dark outline, its hatch."""
    return {"color": colour, "line": {"color": "#333", "width": 0.5}, "pattern": _pattern(shape)}


def _bar_width(n: int) -> float | None:
    # Plotly stretches one or two bars across the whole plot; keep them bar-shaped.
    return 0.35 if n <= 2 else None


Figure = dict
"""plotly's JSON form of a figure: {"data": [trace, ...], "layout": {...}}."""


def _figure(*traces: dict) -> Figure:
    return {"data": list(traces), "layout": {}}


def _trace(kind: str, **props) -> dict:
    """A trace as plotly writes it: a property given as None is not set."""
    return {**{k: v for k, v in props.items() if v is not None}, "type": kind}


def _axis(fig: Figure, name: str, **props) -> None:
    """Set properties of one axis, keeping those it has (plotly's update_xaxes / update_yaxes)."""
    fig["layout"][name] = {**fig["layout"].get(name, {}), **props}


def _layout(fig: Figure, title: str, height: int = 340, **kw) -> Figure:
    """Every figure's look: no plotly theme (template "none", written as plotly.py writes it),
    the page's font, a legend below, light grid lines."""
    axes = {name: kw.pop(name, {}) for name in ("xaxis", "yaxis")}
    fig["layout"].update(
        template={"data": {"scatter": [{"type": "scatter"}]}},
        title={"text": plot_text(title), "x": 0, "font": {"size": 14}},
        height=height, font={"family": FONT, "size": 12, "color": "#222"},
        margin={"l": 70, "r": 20, "t": 50, "b": 50}, paper_bgcolor="white", plot_bgcolor="white",
        legend={"orientation": "h", "y": -0.2, "traceorder": "normal"}, **kw)
    _axis(fig, "xaxis", **{**axes["xaxis"], "showgrid": False, "linecolor": "#888", "automargin": True})
    _axis(fig, "yaxis", **{**axes["yaxis"], "gridcolor": "#e5e5e5", "zeroline": True, "zerolinecolor": "#888",
                           "automargin": True})
    return fig


def mean_breakdown(breakdown: list) -> dict[int, dict[str, float]]:
    """Mean of every component (and step_ms) per rank over the analysed steps."""
    # a running sum and count per component, an array slot a rank, each value added in row order
    # as sum() of a list would: a list (or a dict) of every value per rank was 2.5-2.8 MB above
    # the render's base at 1,024 ranks (#20). A rank's last other_ms waits to be added: a later
    # row's idle split still lowers it.
    keys = ("step_ms", *(c[0] for c in COMPONENTS), *(c[0] for c in IDLE_CAUSES))
    at: dict[int, int] = {}
    n = len(breakdown or [])
    sums = {k: np.zeros(n) for k in keys}
    counts = {k: np.zeros(n, dtype=np.int64) for k in keys}
    last_other: dict[int, float] = {}

    def add(i: int, key: str, v: float) -> None:
        sums[key][i] += v
        counts[key][i] += 1

    for row in breakdown or []:
        r = _rank(row.get("rank")) if isinstance(row, dict) else None
        if r is None:
            continue
        i = at.setdefault(r, len(at))
        for key in keys[:1 + len(COMPONENTS)]:
            v = num(row.get(key))
            if v is None:
                continue
            if key == "other_ms":
                if i in last_other:
                    add(i, key, last_other[i])
                last_other[i] = v
            else:
                add(i, key, v)
        split = row.get("other_by_cause_ms")
        if isinstance(split, dict) and split and i in last_other:
            parts = {k: num(v) or 0.0 for k, v in split.items() if f"idle_{k}" in IDLE_KEYS}
            for k, v in parts.items():
                add(i, f"idle_{k}", v)
            last_other[i] = max(last_other[i] - sum(parts.values()), 0.0)
    for i, v in last_other.items():
        add(i, "other_ms", v)
    return {r: {k: float(sums[k][i]) / int(counts[k][i]) for k in keys if counts[k][i]} for r, i in sorted(at.items())}


IDLE_KEYS = frozenset(c[0] for c in IDLE_CAUSES)


def shown_components(means: dict[int, dict[str, float]]) -> tuple[tuple[str, str, str, str], ...]:
    """The components to draw: with the idle split, the idle causes replace "other / idle" (kept
    only where something is left over, e.g. CPU ranks beside GPU ones)."""
    comps = COMPONENTS if any(m.get("gc_ms", 0.0) > 0.0005 for m in means.values()) else \
        tuple(c for c in COMPONENTS if c[0] != "gc_ms")  # no collection placed (GPU ranks, older probes)
    if not any(k in IDLE_KEYS for m in means.values() for k in m):
        return comps
    rest = comps[-1:] if any(m.get("other_ms", 0.0) > 0.0005 for m in means.values()) else ()
    return comps[:-1] + IDLE_CAUSES + rest


def component_label(key: str) -> str:
    return next((c[1] for c in COMPONENTS + IDLE_CAUSES if c[0] == key), key)


def breakdown_bars(breakdown: list, ranks: list[int] | None = None,
                   means: dict[int, dict[str, float]] | None = None) -> Figure | None:
    """Stacked bars: where the mean step went, per rank. means: mean_breakdown(breakdown), where
    the caller has it already (a second one held beside it at 1,024 ranks, #20)."""
    means = mean_breakdown(breakdown) if means is None else means
    if ranks:
        shown = set(ranks)
        means = {r: m for r, m in means.items() if r in shown}
    if not means:
        return None
    x = [f"rank {r}" for r in means]
    fig = _figure(*(_trace("bar", x=x, y=[m.get(key, 0.0) for m in means.values()], name=label,
                           width=_bar_width(len(x)),
                           marker=_bar_marker(colour, shape),
                           hovertemplate=f"%{{x}}<br>{label}: %{{y:.2f}} ms<extra></extra>")
                    for key, label, colour, shape in shown_components(means)))
    return _layout(fig, "Mean step time per rank, by component (ms)", barmode="stack",
                   yaxis={"title": {"text": "ms per step"}})


def representative_step(breakdown: list) -> int | None:
    """The median step number among those every rank has (the middle of the window)."""
    by_rank: dict[int, set] = defaultdict(set)
    for row in breakdown or []:
        if isinstance(row, dict) and _rank(row.get("rank")) is not None and _rank(row.get("step")) is not None:
            by_rank[_rank(row["rank"])].add(_rank(row["step"]))
    if not by_rank:
        return None
    common = set.intersection(*by_rank.values()) or set.union(*by_rank.values())
    steps = sorted(common)
    return steps[len(steps) // 2]


def step_composition(breakdown: list) -> tuple[Figure | None, int | None]:
    """One step per rank as a horizontal lane, components stacked left to right.

    Event-level lanes are not in the JSON, so this shows the composition of the
    step, not the order things happened in; the title says so.
    """
    step = representative_step(breakdown)
    rows = {}
    for row in breakdown or []:
        if isinstance(row, dict) and _rank(row.get("step")) == step and _rank(row.get("rank")) is not None:
            rows.setdefault(_rank(row["rank"]), row)
    if not rows:
        return None, None
    ranks = sorted(rows, reverse=True)  # rank 0 on top, like Perfetto
    y = [f"rank {r}" for r in ranks]
    means = mean_breakdown([rows[r] for r in ranks])  # one step each: its own components, split
    fig = _figure(*(_trace("bar", y=y, x=[means.get(r, {}).get(key, 0.0) for r in ranks], name=label,
                           orientation="h", width=0.6 if len(y) <= 2 else None,
                           marker=_bar_marker(colour, shape),
                           hovertemplate=f"%{{y}}<br>{label}: %{{x:.2f}} ms<extra></extra>")
                    for key, label, colour, shape in shown_components(means)))
    height = max(180, min(1400, 110 + 26 * len(ranks)))
    # No x-axis title: the legend sits below and would collide with it; the unit is in the title.
    return _layout(fig, f"Composition of one step (step {step}) per rank, ms — totals, not time order",
                   height=height, barmode="stack"), step


LANES: tuple[tuple[str, str, str, str], ...] = (
    ("host", "host ops", "#56B4E9", ""),
    ("compute", "compute", "#0072B2", ""),
    ("communication", "communication", "#E69F00", "/"),
    ("dataloader", "dataloader wait", "#009E73", "."),
)
IDLE_LANE = "device idle"
"""One row per rank: each idle gap coloured by its cause ([start, dur, class] in the JSON)."""
MAX_TIMELINE_BARS = 6000  # keep the page light even for many ranks
CRITICAL_ROW = "critical path"
"""The strip over the lanes: each stretch of the chain that set the step's end, by part."""


def step_timeline(timeline: dict, which: str = "") -> Figure | None:
    """One step per rank on a shared, clock-aligned time axis: a mini Perfetto.

    Each rank gets one row per lane (host ops on the training thread, compute, communication,
    dataloader wait) and, on GPU ranks, a row of device idle gaps coloured by their cause; a late
    rank shows as a row whose work starts later than the others'.
    """
    rows = [r for r in (timeline or {}).get("ranks") or [] if isinstance(r, dict) and _rank(r.get("rank")) is not None]
    if not rows:
        return None
    fig = _figure()
    budget = MAX_TIMELINE_BARS
    has_idle = any((r.get("lanes") or {}).get("idle") for r in rows)
    labels = [label for _, label, _, _ in LANES] + ([IDLE_LANE] if has_idle else [])
    order = [f"rank {_rank(r['rank'])} · {label}" for r in sorted(rows, key=lambda x: _rank(x["rank"]), reverse=True)
             for label in reversed(labels)]
    series = [(key, label, label, colour, shape, None) for key, label, colour, shape in LANES]
    series += [("idle", IDLE_LANE, label, colour, shape, key.removeprefix("idle_"))
               for key, label, colour, shape in IDLE_CAUSES]
    for key, row_label, name, colour, shape, cause in series:
        ys, xs, bases = [], [], []
        for r in rows:
            for iv in ((r.get("lanes") or {}).get(key) or [])[: max(budget, 0)]:
                ok = isinstance(iv, list) and len(iv) == (2 if cause is None else 3)
                if not ok or (cause is not None and iv[2] != cause):
                    continue
                start, dur = num(iv[0]), num(iv[1])
                if start is None or dur is None:
                    continue
                ys.append(f"rank {_rank(r['rank'])} · {row_label}")
                xs.append(dur)
                bases.append(start)
                budget -= 1
        if ys:
            fig["data"].append(_trace(
                "bar", y=ys, x=xs, base=bases, orientation="h", name=name, width=0.8,
                marker={"color": colour, "line": {"width": 0}, "pattern": _pattern(shape)},
                hovertemplate=f"%{{y}}<br>start %{{base:.2f}} ms, {plot_text(name)} %{{x:.3f}} ms<extra></extra>"))
    crit = [iv for iv in (timeline.get("critical_path") or [])[:max(budget, 0)]
            if isinstance(iv, list) and len(iv) == 4 and num(iv[0]) is not None and num(iv[1]) is not None]
    if crit and fig["data"]:
        # the chain that set the step's end, above every rank's lanes: which rank, doing what
        order.append(CRITICAL_ROW)
        fig["data"].append(_trace(
            "bar", y=[CRITICAL_ROW] * len(crit), x=[num(iv[1]) for iv in crit], base=[num(iv[0]) for iv in crit],
            orientation="h", name=CRITICAL_ROW, width=0.8,
            marker={"color": [CRITICAL_COLOURS.get(str(iv[3]), OTHER_COLOUR) for iv in crit],
                    "line": {"color": "#000", "width": 1}},
            customdata=[[plot_text(f"rank {_rank(iv[2])}"), plot_text(str(iv[3]).removeprefix("idle_"))]
                        for iv in crit],
            hovertemplate="critical path: %{customdata[0]}, %{customdata[1]}<br>start %{base:.2f} ms, "
                          "%{x:.3f} ms<extra></extra>"))
    if not fig["data"]:
        return None
    _axis(fig, "yaxis", categoryorder="array", categoryarray=order)
    height = max(200, min(1600, 90 + 18 * len(order)))
    step = timeline.get("step")
    which = f" ({which})" if which else ""
    return _layout(fig, f"Timeline of step {step}{which} on every rank (ms from the earliest rank's start; clocks aligned)",
                   height=height, barmode="overlay")


def critical_path_bar(by_part: dict, labels: dict) -> Figure | None:
    """One horizontal bar: the mean step's critical path split by part (ms)."""
    parts = [(k, num(v)) for k, v in (by_part or {}).items() if num(v) and num(v) > 0]
    if not parts:
        return None
    fig = _figure()
    for k, v in parts:
        label = plot_text(labels.get(k, k))
        fig["data"].append(_trace(
            "bar", y=["critical path"], x=[v], name=label, orientation="h", width=0.5,
            marker={"color": CRITICAL_COLOURS.get(k, OTHER_COLOUR), "line": {"color": "#333", "width": 0.5}},
            hovertemplate=f"{label}: %{{x:.2f}} ms<extra></extra>"))
    return _layout(fig, "Critical path of the mean step, by part (ms)", height=200, barmode="stack")


def per_rank_metric(metrics: dict) -> dict[str, dict[int, float]]:
    """Group metrics keys like rank7_mean_lateness_ms into {suffix: {rank: value}}."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for key, v in (metrics or {}).items():
        m = _RANK_KEY.match(str(key))
        if m and num(v) is not None:
            out[m.group(2)][int(m.group(1))] = num(v)
    return dict(out)


def rank_bars(values: dict[int, float], flagged: list[int], title: str, unit: str) -> Figure | None:
    """Per-rank bars; the finding's ranks are coloured AND hatched (readable without colour)."""
    if not values:
        return None
    ranks = sorted(values)
    hit = set(flagged or [])
    x = [f"rank {r}" + (" (flagged)" if r in hit else "") for r in ranks]
    fig = _figure()
    # one trace per colour: a per-bar colour array under a hatch pattern is invalid to plotly
    # (its overlay takes marker.color as one colour: a console warning, and black bars)
    for flagged_side, colour, shape in ((False, OTHER_COLOUR, ""), (True, FLAGGED_COLOUR, "/")):
        idx = [i for i, r in enumerate(ranks) if (r in hit) == flagged_side]
        if idx:
            fig["data"].append(_trace(
                "bar", x=[x[i] for i in idx], y=[values[ranks[i]] for i in idx], width=_bar_width(len(x)),
                marker=_bar_marker(colour, shape),
                hovertemplate=f"%{{x}}: %{{y:.3f}} {unit}<extra></extra>"))
    _axis(fig, "xaxis", categoryorder="array", categoryarray=x)
    return _layout(fig, title, showlegend=False, barmode="overlay", yaxis={"title": {"text": unit}})


def lateness_heatmap(lateness: dict) -> Figure | None:
    """Rank x collective arrival lateness (ms; positive = later than the median rank)."""
    if not isinstance(lateness, dict):
        return None
    ranks, cols, z = lateness.get("ranks"), lateness.get("collectives"), lateness.get("lateness_ms")
    if not (isinstance(ranks, list) and isinstance(cols, list) and isinstance(z, list)) or not ranks or not cols:
        return None
    if len(z) != len(ranks) or any(not isinstance(row, list) or len(row) != len(cols) for row in z):
        return None  # a malformed matrix would draw something misleading
    z = [[num(v) for v in row] for row in z]
    big = len(ranks) * len(cols) > 400  # cell labels only while they stay legible
    fig = _figure(_trace(
        "heatmap", z=z, x=[plot_text(c) for c in cols], y=[f"rank {plot_text(r)}" for r in ranks],
        colorscale=DIVERGING, zmid=0, colorbar={"title": {"text": "ms late"}},
        texttemplate=None if big else "%{z:.2f}", xgap=1, ygap=1,
        hovertemplate="%{y}, collective %{x}<br>%{z:.3f} ms vs median rank<extra></extra>"))
    height = max(260, min(1400, 120 + 28 * len(ranks)))
    return _layout(fig, "Arrival lateness at each collective (ms after the median rank)",
                   height=height, xaxis={"type": "category", "tickangle": -45},
                   yaxis={"autorange": "reversed", "type": "category"})


def over_time_heatmap(over: dict) -> Figure | None:
    """Rank by time: each rank's own time per step (the step less its collectives) per bucket of
    steps, relative to the median rank's in that bucket. In synchronous training every rank's step
    lasts as long as the slowest's, so it is the own time that shows which rank got slow: a bright
    row from its change on; a whole-job slowdown moves every row alike (the line chart shows it)."""
    heat = over.get("heat") if isinstance(over, dict) else None
    if not isinstance(heat, dict):
        return None
    steps = [num(x) for x in heat.get("steps") or []]
    rows = [(r, row.get("own_ms")) for row in heat.get("ranks") or [] if isinstance(row, dict)
            for r in [_rank(row.get("rank"))] if r is not None]
    rows = [(r, [num(v) for v in y]) for r, y in rows if isinstance(y, list) and len(y) == len(steps)]
    if len(steps) < 2 or any(x is None for x in steps) or len(rows) < 2:
        return None
    job = [statistics.median(col) if (col := [y[i] for _, y in rows if y[i] is not None]) else None
           for i in range(len(steps))]
    z = [[(v / j - 1.0) * 100 if v is not None and j else None for v, j in zip(y, job)] for _, y in rows]
    bucket = num(heat.get("bucket_steps")) or 1
    fig = _figure(_trace(
        "heatmap", z=z, x=steps, y=[f"rank {r}" for r, _ in rows], customdata=[y for _, y in rows],
        colorscale=DIVERGING, zmid=0, colorbar={"title": {"text": "% vs median rank"}},
        ygap=1 if len(rows) <= 64 else 0,
        hovertemplate="%{y}, from step %{x}: own time %{customdata:.1f} ms per step (%{z:+.0f}% vs the median "
                      "rank)<extra></extra>"))
    height = max(260, min(1400, 120 + (18 if len(rows) <= 64 else 4) * len(rows)))
    title = "Each rank's own time per step (less its collectives) against the median rank's" + (
        f" (median of each {bucket:.0f} steps)" if bucket > 1 else "")
    return _layout(fig, title, height=height, xaxis={"title": {"text": "step"}},
                   yaxis={"autorange": "reversed", "type": "category"})


def finding_charts(finding: dict, breakdown: list, extras: dict) -> list[Figure]:
    """The charts that back one finding, most specific first; never empty if data exists."""
    fid = str(finding.get("id", ""))
    ranks = [r for r in (_rank(x) for x in finding.get("ranks") or []) if r is not None]
    per_rank = per_rank_metric(finding.get("metrics") or {})
    figs: list[Figure | None] = []
    if fid in ("straggler", "load_imbalance"):  # who came last where: one rank, or turns
        figs.append(lateness_heatmap((extras or {}).get("lateness")))
    suffix = FINDING_METRIC.get(fid)
    if suffix in per_rank:
        figs.append(rank_bars(per_rank[suffix], ranks, METRIC_TITLE.get(suffix, suffix),
                              "ms" if suffix.endswith("_ms") else ""))
    elif fid in FINDING_COMPONENT:
        key = FINDING_COMPONENT[fid]
        means = mean_breakdown(breakdown)
        if key in IDLE_KEYS and not any(key in m for m in means.values()):
            key = "other_ms"  # no idle split (CPU ranks): the idle time as a whole
        label = component_label(key)
        vals = {r: m[key] for r, m in means.items() if key in m}
        figs.append(rank_bars(vals, ranks, f"Mean {label} per step, per rank (ms, from the step breakdown)", "ms"))
    figs = [f for f in figs if f is not None]
    if not figs:  # unknown finding kind or no per-rank numbers: the affected ranks' breakdown
        figs.append(breakdown_bars(breakdown, ranks) or breakdown_bars(breakdown))
    return [f for f in figs if f is not None]


def diff_breakdown_bars(before: dict, after: dict) -> Figure | None:
    """Two stacked bars, BEFORE and AFTER: the mean step (over ranks) by component."""
    sides = [(str((x or {}).get("label") or name), (x or {}).get("breakdown_ms"))
             for name, x in (("before", before), ("after", after))]
    if not all(isinstance(b, dict) and any(num(v) is not None for v in b.values()) for _, b in sides):
        return None
    x = [f"{name}: {plot_text(label)}" for name, (label, _) in zip(("before", "after"), sides)]
    comps = shown_components({i: {k: num(v) or 0.0 for k, v in b.items()} for i, (_, b) in enumerate(sides)})
    fig = _figure(*(_trace("bar", x=x, y=[num(b.get(key)) or 0.0 for _, b in sides], name=label, width=0.35,
                           marker=_bar_marker(colour, shape),
                           hovertemplate=f"%{{x}}<br>{label}: %{{y:.2f}} ms<extra></extra>")
                    for key, label, colour, shape in comps))
    return _layout(fig, "Mean step time before and after, by component (ms, mean over ranks)", barmode="stack",
                   yaxis={"title": {"text": "ms per step"}})


def over_time_lines(over: dict) -> Figure | None:
    """The whole run's step time per rank (and the job's, the median over ranks), from the probes'
    every-step record, with the fail-slow change drawn as a vertical line."""
    if not isinstance(over, dict):
        return None
    steps = [num(s) for s in over.get("steps") or []]
    if len(steps) < 2 or any(s is None for s in steps):
        return None
    fig = _figure()
    for row in over.get("ranks") or []:
        if not isinstance(row, dict) or _rank(row.get("rank")) is None:
            continue
        y = [num(v) for v in row.get("step_ms") or []]
        if len(y) == len(steps):
            fig["data"].append(_trace(
                "scatter", x=steps, y=y, mode="lines", name=f"rank {_rank(row['rank'])}", line={"width": 1},
                opacity=0.7, hovertemplate=f"rank {_rank(row['rank'])}, step %{{x}}: %{{y:.1f}} ms<extra></extra>"))
    job = [num(v) for v in over.get("job_ms") or []]
    if len(job) == len(steps):
        fig["data"].append(_trace("scatter", x=steps, y=job, mode="lines", name="job (median over ranks)",
                                  line={"width": 2.5, "color": "#222", "dash": "dot"},
                                  hovertemplate="job, step %{x}: %{y:.1f} ms<extra></extra>"))
    if not fig["data"]:
        return None
    for c in over.get("changes") or []:
        step = num(c.get("step")) if isinstance(c, dict) else None
        if step is not None:  # a vertical line the plot's height, labelled at its top left (plotly's add_vline)
            lay = fig["layout"]
            lay.setdefault("shapes", []).append(
                {"line": {"color": FLAGGED_COLOUR, "width": 2, "dash": "dash"}, "type": "line", "x0": step, "x1": step,
                 "xref": "x", "y0": 0, "y1": 1, "yref": "y domain"})
            lay.setdefault("annotations", []).append(
                {"showarrow": False, "text": plot_text(f"slower from step {step:.0f}"), "x": step, "xanchor": "right",
                 "xref": "x", "y": 1, "yanchor": "top", "yref": "y domain"})
    bucket = num(over.get("bucket_steps")) or 1
    title = "Step time over the whole run" + (f" (median of each {bucket:.0f} steps)" if bucket > 1 else "")
    return _layout(fig, title, height=320, xaxis={"title": {"text": "step"}}, yaxis={"title": {"text": "ms"}})
