"""What every report page shares: escaping, formatting, the chart set, CSS, the page shell.

Every string that reaches a page came from a trace file and is untrusted: `esc` for
HTML, `script_json` for JSON inside <script>, `charts.plot_text` for Plotly labels.
"""
from __future__ import annotations

import base64
import functools
import html
import json
import zlib
from collections.abc import Iterable, Iterator, Sequence
from importlib import resources

import orjson

from diagnose.units import rank_ranges

from .charts import num

MAX_EVENTS = 50      # per finding; the rest stay in diagnosis.json
MAX_LINES = 200      # warnings / skipped
STATUS_LABEL = {"flagged": "FLAGGED", "passed": "PASSED", "not_measurable": "NOT MEASURABLE"}
STATUS_MARK = {"flagged": "✖", "passed": "✔", "not_measurable": "?"}
PLOT_CONFIG = {"displaylogo": False, "responsive": True}
PLOTLY_JS = "package_data/plotly.min.js"
"""Where the plotly package keeps plotly.js (what plotly.offline.get_plotlyjs reads)."""


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


@functools.lru_cache(maxsize=1)
def _plotly_gzip() -> bytearray:
    """plotly.js gzipped (read only, though a bytearray: the stream grows in place, never joined
    from its pieces, a copy as large), packed from the package's file a piece at a time
    (gzip.compress(..., mtime=0) is this zlib stream, byte for byte): as one text, plotly.js (a few
    non-ASCII characters) was held at two bytes a character beside its encoding and the gzip: 17
    MB more at the highest point and 11 MB held after, against 5 and 2 (the report command's
    memory, docs/cluster-memory-log.md)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: a gzip header (mtime 0) and trailer
    out = bytearray()
    with resources.files("plotly").joinpath(PLOTLY_JS).open("rb") as f:
        while chunk := f.read(1 << 18):
            out += z.compress(chunk)
    out += z.flush()
    return out


PACKED_CHUNK = 3 << 16
"""Bytes of the gzip base64-encoded at a time (a multiple of 3: the pieces join into one encoding)."""


def _plotly_js_packed_parts() -> Iterator[str]:
    """plotly.js gzipped and base64-encoded: 4.8 MB becomes 2.0 MB in every page, which stays one
    self-contained file (no plotly partial bundle ships with the Python package, so the page
    cannot embed only the chart types it uses). The browser unpacks it with DecompressionStream
    (Chromium 80, Firefox 113, Safari 16.4); an older browser shows the tables and says why the
    charts are missing. Encoded a piece at a time as the page is written: the whole encoding,
    held beside the gzip, was the report's highest point at 256 DLRM ranks (#20)."""
    gz = _plotly_gzip()
    for i in range(0, len(gz), PACKED_CHUNK):
        yield base64.b64encode(gz[i:i + PACKED_CHUNK]).decode("ascii")


def _plotly_js_packed() -> str:
    """The pieces as one text (the tests look for it in a page)."""
    return "".join(_plotly_js_packed_parts())


def _dict(x) -> dict:
    return x if isinstance(x, dict) else {}


def _list(x) -> Sequence:
    """x where it is a list (or the breakdown's rows made as read, output.RowDicts), else []."""
    return x if isinstance(x, Sequence) and not isinstance(x, (str, bytes, bytearray)) else []


def fmt_ms(x, digits: int = 2) -> str:
    v = num(x)
    return "—" if v is None else f"{v:,.{digits}f} ms"


def fmt_share(x) -> str:
    v = num(x)
    return "—" if v is None else f"{v:.0%}" if v >= 0.1 else f"{v:.1%}"


def fmt_ranks(ranks) -> str:
    """'0–7' or '0, 2–7': compact even for thousands of ranks (diagnose.units.rank_ranges)."""
    rs = {int(r) for r in _list(ranks) if isinstance(r, int) or str(r).lstrip("-").isdigit()}
    return esc(rank_ranges(rs, dash="–")) or "—"


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

# The timeline's step selector: shows one drawn view, hides the others (works before the charts draw)
STEP_SELECTOR = """document.querySelectorAll(".step-selector button").forEach(function (b) {
  b.addEventListener("click", function () {
    document.querySelectorAll(".step-selector button").forEach(function (o) { o.setAttribute("aria-pressed", String(o === b)); });
    document.querySelectorAll(".timeline-view").forEach(function (v) {
      v.classList.toggle("timeline-hidden", v.dataset.view !== b.dataset.view);
    });
  });
});"""


class ChartSet:
    """Collects figures; each gets a placeholder div, drawn by one script at the end."""

    def __init__(self) -> None:
        self.figures: list[str] = []

    def add(self, fig, label: str) -> str:
        i = len(self.figures)
        # plotly's JSON as plotly.io writes it (orjson; NaN as null), without plotly.io: its first
        # figure imported 80 modules (narwhals, its validators' base), 5 MB held to the end (#20)
        self.figures.append(orjson.dumps(fig, option=orjson.OPT_SERIALIZE_NUMPY).decode())
        return f'<div class="chart" id="chart-{i}" data-chart="{i}" role="img" aria-label="{esc(label)}"></div>'

    def script(self) -> str:
        data = script_json("[" + ",".join(self.figures) + "]")
        # A page hook for the browser test: how many charts drew, and any JS errors.
        return f"""<script>
{STEP_SELECTOR}
window.__drawCharts = function () {{
  var figs = {data}, cfg = {script_json(PLOT_CONFIG)}, done = [];
  document.body.dataset.chartsExpected = String(figs.length);
  figs.forEach(function (f, i) {{
    var el = document.getElementById("chart-" + i);
    if (!el || typeof Plotly === "undefined") return;
    done.push(Plotly.newPlot(el, f.data, f.layout || {{}}, cfg));
  }});
  Promise.all(done).then(function () {{ document.body.dataset.chartsRendered = String(done.length); }},
                         function (e) {{ window.__reportError(e); }});
}};
</script>"""


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
.metrics td.val{overflow-wrap:anywhere;font-size:12.5px}
.metrics th{font-weight:400;overflow-wrap:anywhere;min-width:14ch;font-size:13px}
ul.lines li{margin:2px 0;font-size:14px}footer{margin-top:40px;font-size:12px;color:var(--muted)}
@media print{.chart{break-inside:avoid}}
.hta{border-left:4px solid var(--line);padding:2px 12px;margin:8px 0}.hta-says{margin:4px 0}
span.hta-agree,span.hta-disagree,span.hta-na{display:inline-block;font-size:12px;font-weight:700;padding:0 5px;border-radius:3px}
span.hta-agree{border:1px solid #1e6b33;color:#1e6b33}span.hta-disagree{background:#8a4b00;color:#fff}p.hta-disagree{border:2px solid #8a4b00;padding:6px 10px}span.hta-na{border:1px dashed #555;color:#555}
.side{display:grid;grid-template-columns:1fr 1fr;gap:18px}@media (max-width:900px){.side{grid-template-columns:1fr}}
.chg-gone{color:#1e6b33;font-weight:700}.chg-appeared{color:#a50e0e;font-weight:700}
.step-selector{margin:8px 0}.step-selector button{font:inherit;font-size:13px;margin-left:6px;padding:2px 10px;border:1px solid var(--fg);background:#fff;cursor:pointer}
.step-selector button[aria-pressed=true]{background:var(--fg);color:#fff}
.timeline-hidden{visibility:hidden;height:0;overflow:hidden}
.top-ops summary{font-size:14px}
"""

# Installed before anything else runs, so errors in plotly or the chart loop are counted (the
# browser test reads them from the page).
ERROR_HOOK = """<script>
window.__reportError = function (e) {
  var b = document.body; b.dataset.jsErrors = String(Number(b.dataset.jsErrors || 0) + 1);
  b.dataset.jsErrorText = String(e && e.message || e).slice(0, 300);
};
window.addEventListener("error", function (ev) { window.__reportError(ev.error || ev.message); });
// console warnings too (plotly reports bad input there, then draws it wrong): counted on the page
["warn", "error", "trace"].forEach(function (k) {
  var orig = console[k];
  console[k] = function () {
    var b = document.body;
    b.dataset.consoleWarnings = String(Number(b.dataset.consoleWarnings || 0) + 1);
    b.dataset.consoleText = Array.prototype.map.call(arguments, String).join(" ").slice(0, 300);
    if (orig) return orig.apply(console, arguments);
  };
});
</script>"""


# Unpacks plotly.js (see _plotly_js_packed), runs it, then draws the charts.
PLOTLY_LOADER = """<script>
(function () {
  var packed = document.getElementById("plotly-packed").textContent.trim();
  if (typeof DecompressionStream === "undefined") {
    document.querySelectorAll(".chart").forEach(function (el) {
      el.textContent = "This browser cannot unpack the page's charts (it lacks DecompressionStream: " +
                       "Chromium 80, Firefox 113, Safari 16.4 or later); the tables hold the same numbers.";
    });
    return;
  }
  var bin = atob(packed), bytes = new Uint8Array(bin.length);
  for (var i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  new Response(new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"))).text().then(function (src) {
    var s = document.createElement("script");
    s.textContent = src;
    document.head.appendChild(s);
    window.__drawCharts();
  }, function (e) { window.__reportError(e); });
})();
</script>"""


def page(title: str, body: str, cs: ChartSet) -> str:
    """One self-contained HTML document: inline CSS, plotly.js once, the charts drawn at the end."""
    return "".join(page_parts(title, (body,), cs))


def page_parts(title: str, body: Iterable[str], cs: ChartSet) -> Iterator[str]:
    """page's document in pieces, the body's as they come (its charts added as it is made: the
    script that draws them is made after it), plotly.js a piece at a time, never copied into the page."""
    yield f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{esc(title)}</title><style>{CSS}</style></head>
<body>{ERROR_HOOK}"""
    yield from body
    yield f"""
{cs.script()}
<script type="application/octet-stream" id="plotly-packed">"""
    yield from _plotly_js_packed_parts()
    yield f"""</script>
{PLOTLY_LOADER}
</body></html>
"""
