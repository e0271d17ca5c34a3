"""scaling.json (a public contract, documented in the README) and the scaling report."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import orjson

from diagnose.output import _clean
from diagnose.probes.safefs import write_atomic
from diagnose.scaling import Scaling


def scaling_dict(s: Scaling) -> dict:
    body = asdict(s)
    return _clean({
        "schema_version": s.schema_version,
        "verdict": s.verdict,
        "mode": s.mode,
        "ideal_speedup": s.ideal_speedup,
        "observed_speedup": s.observed_speedup,
        "runs": body["points"],
        "waterfall": [{"id": b["id"], "lost_speedup": b["lost_speedup"], "delta_ms": b["delta_ms"]}
                      for b in body["waterfall"]],
        "baseline": body["baseline"],
        "what_if": body["what_if"],
        "assumptions": body["assumptions"],
        "warnings": body["warnings"],
    })


def write_scaling(s: Scaling, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    data = scaling_dict(s)
    written = [out / "scaling.json"]
    write_atomic(written[0], orjson.dumps(data, option=orjson.OPT_INDENT_2))
    try:
        from diagnose.reports.scaling import render_scaling
    except ImportError:
        return written
    written.append(out / "report.html")
    write_atomic(written[1], render_scaling(data).encode())
    return written
