"""The HTML report on real diagnoses: verdict first, evidence per finding, offline, XSS-safe."""
from __future__ import annotations

import base64
import copy
import gzip
import html
import re
from pathlib import Path
from html.parser import HTMLParser

import pytest

from diagnose.reports.common import _plotly_js_packed
from diagnose.reports.html import _plotly_js, render, write_report
from tests.conftest import SHARED as TRACES
from tests.conftest import shared_diagnosis

SETS = ["param_dlrm_8rank_v100", "kineto_resnet50_dataloader_v100/nw0", "kineto_resnet50_dataloader_v100/nw4",
        "hta_sampled_2rank_of128", "edge_hta_ddp_world1_v100"]
HEALTHY = {"kineto_resnet50_dataloader_v100/nw4", "edge_hta_ddp_world1_v100"}

# Each payload, if it ever ran, would leave a mark the browser test looks for.
HOSTILE = {
    "script": "<script>document.body.dataset.pwned='script';document.title='PWNED'</script>",
    "img": "\"><img src=x onerror=\"document.body.dataset.pwned='img'\">",
    "svg": "'><svg onload=document.body.dataset.pwned='svg'>",
    "close": "</script><script>document.body.dataset.pwned='close'</script>",
}


def trace_set(name: str) -> Path:
    p = TRACES / name
    if not p.exists():
        pytest.skip(f"shared trace set {name} not found at {p} (clone without ../shared)")
    return p


def _diagnosis(name: str):
    trace_set(name)  # skips when the set is missing
    return shared_diagnosis(name)


def diagnosis_json(name: str) -> dict:
    from diagnose.output import diagnosis_dict
    return diagnosis_dict(_diagnosis(name))


def hostile_diagnosis() -> dict:
    """The real DLRM diagnosis with attacker-controlled text wherever trace text lands."""
    d = copy.deepcopy(diagnosis_json("param_dlrm_8rank_v100"))
    h = HOSTILE
    ev = d["findings"][0]["events"][0]
    ev["name"], ev["file"], ev["note"] = h["script"], h["img"], h["svg"]
    d["findings"][0]["title"] = h["close"]
    d["findings"][0]["metrics"][h["img"]] = h["script"]
    d["warnings"] = [h["img"], h["close"]]
    d["skipped"] = [h["svg"] + ": unreadable"]
    d["run"]["device_name"] = h["script"]
    d["run"]["backend"] = h["img"]
    d["run"]["files"]["0"] = h["close"]
    d["checks"][0]["reason"] = h["svg"]
    if d["extras"].get("lateness"):
        d["extras"]["lateness"]["collectives"][0] = h["close"]
    # the fail-slow line names hosts from the probes' sidecars
    d["extras"]["over_time"] = {"bucket_steps": 1, "steps": [1, 2, 3], "job_ms": [10.0, 10.0, 20.0],
                                "ranks": [{"rank": 0, "step_ms": [10.0, 10.0, 20.0]}],
                                "changes": [{"step": 3, "text": h["script"]}]}
    return d


class Page(HTMLParser):
    """Elements with their attributes and the section/finding they sit in, plus the verdict text."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict, str | None]] = []
        self.scripts: list[str] = []
        self._stack: list[tuple[str, str | None]] = []
        self.section_text: dict[str, str] = {}
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        parent = self._stack[-1][1] if self._stack else None
        here = a.get("id") if tag == "section" else parent
        self.elements.append((tag, a, here))
        if tag not in {"meta", "br", "img", "link", "input", "hr"}:
            self._stack.append((tag, here))

    def handle_endtag(self, tag):
        while self._stack:
            if self._stack.pop()[0] == tag:
                break

    def handle_data(self, data):
        if self._stack and self._stack[-1][0] == "script":
            self.scripts.append(data)
        elif self._stack and self._stack[-1][1]:
            sid = self._stack[-1][1]
            self.section_text[sid] = self.section_text.get(sid, "") + data

    def in_section(self, sid: str, tag: str, cls: str | None = None) -> list[dict]:
        return [a for t, a, s in self.elements if s == sid and t == tag
                and (cls is None or cls in (a.get("class") or "").split())]


@pytest.mark.parametrize("name", SETS)
def test_verdict_names_the_top_cause(name):
    d = diagnosis_json(name)
    page = Page(render(d))
    verdict = page.section_text["verdict"]
    if name in HEALTHY:
        assert not d["findings"]
        assert "No significant cause found" in verdict
    else:
        assert d["findings"][0]["title"] in verdict
        assert "No significant cause" not in verdict
    assert page.in_section("verdict", "dl", "facts")
    assert [a for t, a, _ in page.elements if t == "table" and a.get("id") == "causes"] or not d["findings"]
    # the breakdown is shown even when nothing is flagged
    assert len([a for t, a, _ in page.elements if t == "div" and "chart" in (a.get("class") or "").split()]) >= 1


@pytest.mark.parametrize("name", [s for s in SETS if s not in HEALTHY])
def test_every_finding_has_a_chart_and_evidence(name):
    d = diagnosis_json(name)
    page = Page(render(d))
    assert d["findings"]
    for i, f in enumerate(d["findings"], 1):
        sid = f"finding-{i}"
        assert page.in_section(sid, "div", "chart"), f"no chart for {f['id']}"
        assert page.in_section(sid, "table", "evidence"), f"no evidence table for {f['id']}"
        assert f["method"] in page.section_text[sid]


def test_checklist_is_in_order_with_text_labels():
    d = diagnosis_json("param_dlrm_8rank_v100")
    text = render(d)
    labels = re.findall(r'<span class="status status-\w+">\S* ([A-Z ]+)</span>', text)
    want = {"flagged": "FLAGGED", "passed": "PASSED", "not_measurable": "NOT MEASURABLE"}
    assert labels == [want[c["status"]] for c in d["checks"]]
    positions = [text.index(html.escape(c["reason"], quote=True)) for c in d["checks"]]
    assert positions == sorted(positions)


def test_run_facts_say_ranks_found_of_world_size():
    d = diagnosis_json("hta_sampled_2rank_of128")
    verdict = Page(render(d)).section_text["verdict"]
    assert "2 of 128 ranks" in verdict
    assert "missing: 2–127" in verdict


@pytest.mark.parametrize("name", ["param_dlrm_8rank_v100", "edge_hta_ddp_world1_v100"])
def test_self_contained_and_plotly_once(name):
    text = render(diagnosis_json(name))
    # plotly.js once, packed (gzip + base64: the browser unpacks it), never also in the clear
    packed = _plotly_js_packed()
    assert text.count(packed) == 1 and _plotly_js()[:300] not in text
    assert gzip.decompress(base64.b64decode(packed)).decode() == _plotly_js()
    assert "<script src" not in text.lower() and "<link " not in text.lower()
    page = Page(text)
    for tag, a, _ in page.elements:
        for attr in ("src", "href"):
            v = a.get(attr)
            assert v is None or v.startswith("#"), f"<{tag} {attr}={v!r}> points outside the page"
    # nothing big besides plotly.js, and the page well under plotly's own 4.8 MB
    assert len(text.encode()) - len(packed) < 300_000
    assert len(text.encode()) < 2_400_000


def assert_inert(text: str, payloads) -> Page:
    """No payload survives raw, nothing executable was injected; returns the parsed page."""
    for payload in payloads:
        assert payload not in text
    page = Page(text)
    tags = [t for t, _, _ in page.elements]
    assert "img" not in tags and "svg" not in tags
    assert tags.count("script") == 4  # error hook, charts, packed plotly.js, its loader: nothing injected
    assert not [(t, k) for t, a, _ in page.elements for k in a if k.startswith("on")]
    assert all("</script" not in s.lower() for s in page.scripts)
    return page


def test_hostile_strings_are_inert():
    page = assert_inert(render(hostile_diagnosis()), HOSTILE.values())
    # ... and still shown to the reader, as text
    assert HOSTILE["script"] in page.section_text["verdict"]
    assert HOSTILE["script"] in page.section_text["finding-1"]


@pytest.mark.parametrize("bad", [
    {},
    {"findings": None, "checks": "x", "breakdown": [None, {"rank": "a"}], "run": [], "extras": None},
    {"findings": [None, {"id": "mystery", "ranks": ["x", 3], "metrics": {"rank3_foo": "n/a"}}],
     "breakdown": [{"rank": 0, "step": 1, "step_ms": None, "compute_ms": "7"}],
     "extras": {"lateness": {"ranks": [0], "collectives": ["a", "b"], "lateness_ms": [[1.0]]}, "future": {"x": 1}},
     "checks": [{"id": "new_check", "status": "weird"}], "warnings": [1, None]},
    {"extras": {"over_time": {"steps": [1, "x"], "ranks": [None, {"rank": "r"}], "changes": [None, {"step": "a"}]}}},
    {"extras": {"over_time": {"steps": [1, 2], "job_ms": [1.0], "ranks": [{"rank": 0, "step_ms": [1.0, None]}],
                              "changes": "x", "bucket_steps": "y"}}},
])
def test_never_crashes_on_odd_input(bad):
    text = render(bad)
    assert text.startswith("<!DOCTYPE html>")


def test_unknown_keys_are_ignored_and_nulls_shown_as_dash():
    d = copy.deepcopy(diagnosis_json("param_dlrm_8rank_v100"))
    d["extras"]["scaling"] = {"anything": [1, 2]}
    d["findings"][0]["recoverable_ms"] = None
    d["findings"][0]["events"][0]["dur_us"] = None
    assert "<!DOCTYPE html>" in render(d)


def test_write_report_writes_report_html(tmp_path):
    path = write_report(_diagnosis("param_dlrm_8rank_v100"), tmp_path)
    assert path == tmp_path / "report.html"
    text = path.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert not [p for p in tmp_path.iterdir() if p.name != "report.html"]  # no temp file left behind


def test_idle_causes_replace_other_in_the_step_chart_and_timeline():
    from diagnose.reports import charts
    d = diagnosis_json("hta_sampled_2rank_of128")
    fig = charts.breakdown_bars(d["breakdown"])
    names = [t["name"] for t in fig["data"]]
    assert "idle: waiting for launches" in names and "idle: work queued, waiting" in names
    assert "other / idle" not in names  # fully split on a GPU run
    # the stack still adds up to each rank's mean step
    means = charts.mean_breakdown(d["breakdown"])
    for i, r in enumerate(sorted(means)):
        assert sum(t["y"][i] for t in fig["data"]) == pytest.approx(means[r]["step_ms"], rel=1e-6)
    tl = charts.step_timeline(d["extras"]["timeline"])
    lanes = {y for t in tl["data"] for y in t["y"]}
    assert {"rank 0 · device idle", "rank 0 · host ops"} <= lanes
    idle_bars = [t for t in tl["data"] if t["y"] and t["y"][0].endswith("device idle")]
    assert {t["name"] for t in idle_bars} >= {"idle: waiting for launches", "idle: work queued, waiting"}


def test_cpu_run_keeps_other_as_one_component():
    from diagnose.reports import charts
    trace_set("edge_hta_cpu_only_gloo_rank34of300")
    d = diagnosis_json("edge_hta_cpu_only_gloo_rank34of300")
    names = [t["name"] for t in charts.breakdown_bars(d["breakdown"])["data"]]
    assert "other / idle" in names
    assert not any(n.startswith("idle:") for n in names)


def test_replay_section_lists_each_cause_with_its_replayed_figure():
    d = diagnosis_json("param_dlrm_8rank_v100")
    page = render(d)
    assert "What each fix gives back" in page and "Critical path of the mean step" in page
    from diagnose.reports.common import fmt_ms

    assert "Each finding's recoverable time above is the replayed figure, but for those sized over the run." in page
    for f in d["findings"]:
        m = f["metrics"]
        if "replay_recoverable_ms" in m:
            # the row: the check's own estimate beside the replayed figure (now the finding's)
            row = (f'<tr><td>{html.escape(f["title"], quote=True)}</td><td class=num>{fmt_ms(m["own_estimate_ms"])}'
                   f'</td><td class=num>{fmt_ms(f["recoverable_ms"])}</td>')
            assert row in page, row
    # a text metric wraps instead of squeezing the names column
    assert '<td class=val>' in page


def test_long_text_metric_values_do_not_use_the_nowrap_number_cell():
    d = copy.deepcopy(diagnosis_json("param_dlrm_8rank_v100"))
    d["findings"][0]["metrics"] = {"a_long_list": "x" * 500, "a_number": 1.5}
    page = render(d)
    assert '<td class=val>' + "x" * 500 in page and "<td class=num>1.5" in page


def test_critical_path_strip_tiles_the_step_and_runs_through_the_late_rank():
    """The strip over the mini timeline is the chain that set the shown step's end: its stretches
    follow each other without gap from the start of the rank it begins on (a late start is where a
    path begins) to the latest rank's end, and on param_dlrm_8rank_v100 it runs through rank 7,
    which enters the first all_to_all last."""
    d = diagnosis_json("param_dlrm_8rank_v100")
    tl = d["extras"]["timeline"]
    strip = tl["critical_path"]
    assert strip and {iv[2] for iv in strip} >= {7}
    for a, b in zip(strip, strip[1:]):
        assert b[0] == pytest.approx(a[0] + a[1], abs=2e-3)
    end = max(r["start_ms"] + r["dur_ms"] for r in tl["ranks"])
    first = next(r for r in tl["ranks"] if r["rank"] == strip[0][2])
    assert strip[0][0] == pytest.approx(first["start_ms"], abs=2e-3)
    assert strip[-1][0] + strip[-1][1] == pytest.approx(end, abs=2e-3)
    page = render(d)
    assert '"critical path"' in page


def test_severity_badge_is_not_confused_with_confidence():
    """Severity (share of the step at stake) and confidence shared the words high/low: a "LOW"
    badge beside "confidence high". The badge now says IMPACT."""
    d = diagnosis_json("hta_nccl_data_rank0of2_a100")
    page = render(d)
    sev = d["findings"][0]["severity"]
    assert f'<span class="sev sev-{sev}">{sev.upper()} IMPACT</span>' in page
    assert "<th>Impact</th>" in page and "<th>Severity</th>" not in page


@pytest.mark.parametrize("name", ["param_dlrm_8rank_v100", "kineto_resnet50_dataloader_v100/nw0",
                                  "hta_sampled_2rank_of128"])
def test_metrics_show_human_labels_and_keep_the_key_as_a_tooltip(name):
    d = diagnosis_json(name)
    page = render(d)
    keys = [k for f in d["findings"] for k in f["metrics"]]
    assert keys
    rows = dict(re.findall(r'<th scope=row title="([^"]*)">([^<]*)</th>', page))
    for k in keys:
        label = html.unescape(rows[html.escape(k, quote=True)])
        assert label != k and "_" not in label, (k, label)
    # numbers carry their unit's form: shares as percentages
    share = next(k for k in keys if k.endswith("share_of_step") or k.endswith("_share"))
    assert re.search(rf'title="{re.escape(share)}">[^<]*</th><td class=num>[0-9.]+%</td>', page)


def test_top_ops_table_per_rank_matches_the_raw_kernels():
    """nw0 (one GPU rank): the heaviest kernel's time per step, recomputed from the raw trace
    (sum of its kernel events' durations inside the profiled steps, over the step count)."""
    import gzip
    import json as _json

    d = diagnosis_json("kineto_resnet50_dataloader_v100/nw0")
    top = d["extras"]["top_ops"]["ranks"][0]
    assert top["rank"] == 0 and top["kind"] == "kernels" and len(top["top"]) == 10
    first = top["top"][0]
    path = next(trace_set("kineto_resnet50_dataloader_v100/nw0").glob("*.json*"))
    ev = _json.load(gzip.open(path))["traceEvents"]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in ev if str(e.get("name", "")).startswith("ProfilerStep#")]
    inside = [e for e in ev if e.get("cat") == "Kernel" and e.get("name") == first["name"]
              and any(a <= e["ts"] < b for a, b in steps)]
    assert first["ms_per_step"] == pytest.approx(sum(e["dur"] for e in inside) / 1000 / len(steps), rel=1e-3)
    assert first["calls_per_step"] == pytest.approx(len(inside) / len(steps), rel=1e-3)
    page = render(d)
    assert 'id="top-ops"' in page and page.count('<details class="top-ops">') == 1
    assert html.escape(first["name"], quote=True) in page


def test_every_step_of_the_run_is_drawn_from_the_probes_record():
    """tests/fixtures/cpu_checkpoint_2rank ran under `diagnose run`: its every-step record (the
    rank*.steps.jsonl files, read here raw) is the whole-run chart's data, one point per step."""
    import json

    from diagnose.output import diagnosis_dict
    from tests.conftest import fixture_diagnosis

    path = Path(__file__).parent / "fixtures" / "cpu_checkpoint_2rank"
    d = diagnosis_dict(fixture_diagnosis(path))
    over = d["extras"]["over_time"]
    raw = {r: {x["step"]: x["dur_ms"] for x in map(json.loads, (path / f"rank{r}.steps.jsonl").read_text().split())
               if x["step"] >= 1} for r in (0, 1)}
    assert over["bucket_steps"] == 1 and over["steps"] == sorted(raw[0])
    for row in over["ranks"]:
        assert row["step_ms"] == pytest.approx([raw[row["rank"]][s] for s in over["steps"]], abs=1e-3)
    assert over["changes"] == []  # 11 steps: too few for a change of level
    page = render(d)
    assert 'id="over-time"' in page and "Step time over the whole run" in page
    # a diagnosis without the record (bare traces): no section
    assert 'id="over-time"' not in render(diagnosis_json("param_dlrm_8rank_v100"))


def test_a_per_rank_metric_of_many_ranks_is_one_row_with_its_median_and_highest_ranks():
    """A 1,024-rank straggler finding carries rank<R>_mean_lateness_ms for every rank: the page's
    evidence table had 1,049 rows. Past MAX_RANK_ROWS ranks a family is one row; few stay rows."""
    from reports.html import _metrics_table
    from reports.labels import MAX_RANK_ROWS

    many = {"collectives_matched": 5, **{f"rank{r}_mean_lateness_ms": (141.75 if r == 700 else 0.0) for r in range(1024)},
            "rank700_last_share": 1.0, "p_late_on_average": 0.0}
    html = _metrics_table(many)
    assert html.count("<tr>") == 4
    assert "Per rank (1024 ranks): Mean lateness (ms)" in html
    assert "median 0.000; highest: rank 700 141.8, rank 0 0.000" in html and "(all 1024 in diagnosis.json)" in html
    few = {f"rank{r}_mean_lateness_ms": float(r) for r in range(MAX_RANK_ROWS)}
    assert _metrics_table(few).count("<tr>") == MAX_RANK_ROWS


def test_mean_breakdown_sums_as_it_goes_and_gives_the_lists_means():
    """mean_breakdown keeps a running sum per rank and component (#20: the lists of every value
    were the render's height at 1,024 ranks): the same means, to the bit, as summing each rank's
    list of values, with a later row's idle split lowering the rank's last other_ms, rows in any
    order, some values missing."""
    import random
    from collections import defaultdict

    from diagnose.reports import charts as C

    def by_lists(rows):
        acc = defaultdict(lambda: defaultdict(list))
        for row in rows:
            r = row["rank"]
            for key in ("step_ms", *(c[0] for c in C.COMPONENTS)):
                if C.num(row.get(key)) is not None:
                    acc[r][key].append(C.num(row[key]))
            split = row.get("other_by_cause_ms")
            if split and acc[r]["other_ms"]:
                parts = {k: C.num(v) or 0.0 for k, v in split.items() if f"idle_{k}" in C.IDLE_KEYS}
                for k, v in parts.items():
                    acc[r][f"idle_{k}"].append(v)
                acc[r]["other_ms"][-1] = max(acc[r]["other_ms"][-1] - sum(parts.values()), 0.0)
        return {r: {k: sum(v) / len(v) for k, v in c.items()} for r, c in sorted(acc.items())}

    rng = random.Random(3)
    classes = ("latency", "queued", "sync", "launch", "unknown_class")
    rows = [{"rank": r, "step": s, "step_ms": rng.uniform(5, 50), "compute_ms": rng.uniform(1, 9) / 3,
             "exposed_comm_ms": rng.uniform(0, 4), "straggler_wait_ms": rng.uniform(0, 2),
             "dataloader_ms": rng.uniform(0, 1), "other_ms": rng.uniform(0, 6),
             "other_by_cause_ms": {c: rng.uniform(0, 1.5) for c in classes} if r % 2 else {}}
            for r in range(6) for s in range(7)]
    rng.shuffle(rows)
    for row in rows[::4]:
        row.pop(rng.choice(["compute_ms", "step_ms", "dataloader_ms"]))
    for row in rows[1::9]:
        row["other_ms"] = None  # no value this step: the rank's previous one takes the split
    got = C.mean_breakdown(rows)
    assert got == by_lists(rows) and sorted(got) == list(range(6))
    assert any("idle_sync" in m for m in got.values()) and all("idle_unknown_class" not in m for m in got.values())


def page_figures(page: str) -> list[dict]:
    """The figures a page draws, as the page holds them (plotly's JSON)."""
    import json

    m = re.search(r"var figs = (\[.*?\]), cfg = ", page, re.S)
    assert m, "no figures on the page"
    return json.loads(m.group(1))


def test_every_figure_is_one_plotly_accepts_and_writes_back_as_it_is():
    """The reports build their figures as plain dicts (reports/charts.py: plotly.graph_objects
    cost 16 MB of the command's memory to check them as they were made, #20): each one drawn
    here, every kind the reports draw (stacked and overlaid bars, the timeline and its critical
    path, both heatmaps, the whole run's lines and its change line, the scaling curve and
    waterfall, the diff's bars), goes through plotly's own validators, which refuse any property
    plotly does not know or a value of the wrong kind, and plotly writes it back unchanged."""
    import json

    import plotly.graph_objects as go
    import plotly.io as pio

    from diagnose.diff import diff_diagnoses
    from diagnose.output import diagnosis_dict
    from diagnose.reports.diff import render_diff
    from diagnose.reports.scaling import render_scaling
    from diagnose.scaling import ScalePoint, account
    from diagnose.scaling_output import scaling_dict
    from tests.conftest import fixture_diagnosis

    fixtures = Path(__file__).parent / "fixtures"
    pages = [render(diagnosis_json(n)) for n in ("param_dlrm_8rank_v100", "hta_sampled_2rank_of128")]
    pages += [render(diagnosis_dict(fixture_diagnosis(fixtures / n)))
              for n in ("cpu_straggler_2rank", "cpu_checkpoint_2rank", "gpu_h200/none_long")]
    pages.append(render_diff(diff_diagnoses(_diagnosis("kineto_resnet50_dataloader_v100/nw0"),
                                            _diagnosis("kineto_resnet50_dataloader_v100/nw4"))))

    def point(n, step, causes):
        return ScalePoint(nproc=n, step_ms=step, step_source="probe steps", per_rank_batch=32,
                          throughput=n * 32 / step * 1000, speedup=1.0, efficiency=1.0, run_dir=f"n{n}",
                          trace_step_ms=step, causes_ms=causes, compute_ms=100.0, replayed_step_ms=step,
                          causes_from="replay")

    pages.append(render_scaling(scaling_dict(account({1: point(1, 100.0, {"straggler": 0.0}),
                                                      2: point(2, 180.0, {"straggler": 60.0})},
                                                     ranks_by_cause={"straggler": (1,)}))))
    kinds = set()
    for page in pages:
        for fig in page_figures(page):
            assert json.loads(pio.to_json(go.Figure(fig), validate=False)) == fig
            kinds |= {t["type"] for t in fig["data"]} | {s["type"] for s in fig["layout"].get("shapes", [])}
    assert kinds == {"bar", "heatmap", "scatter", "waterfall", "line"}
    # and a property plotly does not know is refused: the check above can fail
    with pytest.raises(ValueError):
        go.Figure({"data": [{"type": "bar", "colour": "red"}], "layout": {}})
