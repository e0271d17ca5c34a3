"""The HTA second-opinion section of the report (what `diagnose.hta` attached to extras)."""
from __future__ import annotations

from .common import _dict, _list, esc, fmt_ms, fmt_ranks, fmt_share, fmt_value
from .charts import num

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
