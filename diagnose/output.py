"""Write diagnosis.json and render the terminal summary (no verdicts computed here)."""
from __future__ import annotations

import math
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import orjson

from diagnose import __version__
from diagnose.model import Diagnosis


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


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; outputs are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(d: Diagnosis, out_dir: Path) -> Path:
    path = out_dir / "diagnosis.json"
    write_atomic(path, orjson.dumps(diagnosis_dict(d), option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    return path


def _printable(s: str) -> str:
    """Trace text is untrusted: keep terminal control characters out of the summary."""
    return "".join(ch if ch.isprintable() else "?" for ch in s)


def terminal_summary(d: Diagnosis) -> str:
    r = d.run
    lines = []
    f = d.top
    if f is None:
        lines.append("VERDICT: no significant cause found (every check passed or was not measurable).")
    else:
        lines.append(f"VERDICT: {f.title}")
        if f.kind == "capacity":
            lines.append(f"  {_printable(_reason(d, f.id))} (capacity: no step time lost), confidence {f.confidence}")
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
                 f"{' (' + _printable(r.device_name) + ')' if r.device_name else ''}, "
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
        lines.append(f"  [{c.status:^14}] {c.id}: {_printable(c.reason)}")
    if d.warnings:
        lines.append("")
        lines.append("warnings:")
        lines += [f"  - {_printable(w)}" for w in d.warnings[:20]]
        if len(d.warnings) > 20:
            lines.append(f"  ... and {len(d.warnings) - 20} more (see diagnosis.json)")
    return "\n".join(lines)
