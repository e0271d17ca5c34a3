"""Write diagnosis.json and render the terminal summary (no verdicts computed here)."""
from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import orjson

from diagnose import __version__
from diagnose.errors import one_line
from diagnose.model import Diagnosis
from diagnose.probes.safefs import write_atomic  # the one safe writer, shared with the probes


def _clean(x):
    """JSON has no NaN/inf: write null. Non-UTF-8 bytes in file names (surrogates) become U+FFFD."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, str):
        return x.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def diagnosis_dict(d: Diagnosis) -> dict:
    body = asdict(d)
    return _clean({
        "schema_version": d.schema_version,
        "tool": {"name": "torch-diagnose", "version": __version__},
        "verdict": _verdict(d),
        "run": body["run"],
        "findings": body["findings"],
        # a check keeps its numbers even when it passed: "why not flagged" is evidence too
        "checks": [{**{k: v for k, v in c.items() if k != "finding"},
                    "metrics": c["finding"]["metrics"] if c.get("finding") else {}} for c in body["checks"]],
        "breakdown": body["breakdown"],
        "warnings": body["warnings"],
        "skipped": body["skipped"],
        "extras": body["extras"],
    })


def _reason(d: Diagnosis, check_id: str) -> str:
    return next((c.reason for c in d.checks if c.id == check_id), "")


def _verdict(d: Diagnosis) -> str:
    f = d.top
    if f is None:
        return "no significant cause found: every check passed or could not be measured"
    if f.kind == "capacity":
        return f"{f.title}: {_reason(d, f.id)}"
    return (f"{f.title}: {f.recoverable_ms:.1f} ms per step ({f.share_of_step:.0%}) recoverable"
            f" on rank(s) {', '.join(map(str, f.ranks))}")


def write_json(d: Diagnosis, out_dir: Path) -> Path:
    path = out_dir / "diagnosis.json"
    write_atomic(path, orjson.dumps(diagnosis_dict(d), option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    return path


def terminal_summary(d: Diagnosis) -> str:
    """The summary `analyze` prints. Titles, reasons, fixes, device names and warnings carry trace
    text (op names, file names, metadata), which is untrusted: every line goes through one
    sanitiser (`one_line`), so an escape sequence is shown escaped, never acted on by the terminal."""
    r = d.run
    lines = []
    f = d.top
    if f is None:
        lines.append("VERDICT: no significant cause found (every check passed or was not measurable).")
    else:
        lines.append(f"VERDICT: {f.title}")
        if f.kind == "capacity":
            lines.append(f"  {_reason(d, f.id)} (capacity: no step time lost), confidence {f.confidence}")
        else:
            lines.append(f"  {f.recoverable_ms:.1f} ms per step recoverable ({f.share_of_step:.0%} of the step), "
                         f"rank(s) {', '.join(map(str, f.ranks))}, confidence {f.confidence}")
        lines.append(f"  fix: {f.fix}")
    found = len(r.ranks_found)
    ws = r.world_size or found
    mean = sum(r.mean_step_ms.values()) / max(len(r.mean_step_ms), 1)
    lines.append("")
    backend = r.backend or ("none (single process)" if ws == 1 else "?")
    lines.append(f"run: {found} of {ws} ranks, backend {backend}, device {r.device}"
                 f"{' (' + r.device_name + ')' if r.device_name else ''}, "
                 f"{r.steps_analysed} step(s) from {r.step_source}, mean step {mean:.1f} ms")
    if d.findings:
        lines.append("")
        lines.append("ranked causes:")
        for i, x in enumerate(d.findings, 1):
            lines.append(f"  {i}. {x.id:<24} {x.recoverable_ms:9.2f} ms/step {x.share_of_step:6.1%}  "
                         f"ranks {','.join(map(str, x.ranks))}  [{x.severity}, {x.confidence} confidence]")
    lines.append("")
    lines.append("checklist:")
    for c in d.checks:
        lines.append(f"  [{c.status:^14}] {c.id}: {c.reason}")
    if d.warnings:
        lines.append("")
        lines.append("warnings:")
        lines += [f"  - {w}" for w in d.warnings[:20]]
        if len(d.warnings) > 20:
            lines.append(f"  ... and {len(d.warnings) - 20} more (see diagnosis.json)")
    return "\n".join(one_line(line) for line in lines)
