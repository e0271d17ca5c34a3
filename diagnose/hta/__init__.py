"""Holistic Trace Analysis (HTA) as a second opinion on GPU traces.

`attach_hta(diagnosis, trace_paths, *, budget_mb, timeout_s) -> Diagnosis` returns a new
Diagnosis whose `extras["hta"]` holds HTA's evidence next to ours (status, per-check
comparisons with tolerances and definitions, HTA's temporal breakdown for the run, a
critical-path summary where HTA can build one). It never raises for what HTA or the
traces do: HTA missing, a CPU-only trace, an over-budget trace, an HTA exception or the
time limit all become a status and a reason ("HTA could not analyse this trace: ...").

Layout: `runner` (staging, budget, child process, typed `HtaResult`), `worker` (the child:
the only code that imports HTA's analyses), `compare` (our numbers vs HTA's).
The top-level `hta` package is HTA itself (PyPI `traceinsight`); this is `diagnose.hta`.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from diagnose.errors import one_line
from diagnose.hta.compare import hta_extras
from diagnose.hta.runner import (COULD_NOT, DEFAULT_BUDGET_MB, DEFAULT_TIMEOUT_S, Analysis, HtaResult,
                                 hta_importable, run_hta)
from diagnose.model import Diagnosis

__all__ = ["attach_hta", "not_requested", "run_hta", "hta_summary", "HtaResult", "Analysis", "COULD_NOT",
           "DEFAULT_BUDGET_MB", "DEFAULT_TIMEOUT_S", "hta_importable"]

NOT_REQUESTED = "HTA evidence was not requested (run with --hta to add Holistic Trace Analysis as a second opinion)"


def _files(diagnosis: Diagnosis, trace_paths) -> dict[int, Path]:
    """Rank -> file: the files the diagnosis used (its ranks are ours, not HTA's regex guess)."""
    files = {int(r): Path(p) for r, p in diagnosis.run.files.items()}
    if files:
        return files
    paths = [Path(p) for p in (trace_paths or [])]
    found = [p for d in paths for p in (sorted(d.glob("*.json*")) if d.is_dir() else [d])]
    return dict(enumerate(found))


def attach_hta(diagnosis: Diagnosis, trace_paths, *, budget_mb: float = DEFAULT_BUDGET_MB,
               timeout_s: float = DEFAULT_TIMEOUT_S, critical_path: bool = True) -> Diagnosis:
    """A new Diagnosis with `extras['hta']` filled in; the input is not modified.

    `trace_paths` is only used when the diagnosis records no files (the ranks and files the
    diagnosis used are what HTA is given).
    """
    if diagnosis.run.device == "cpu":
        res = HtaResult("failed", COULD_NOT + "it holds no GPU kernels (a CPU-only trace); HTA's analyses measure "
                        "GPU streams (on such traces its temporal and idle-time breakdowns raise IndexError / "
                        "ValueError and its comm/compute overlap is NaN)")
    else:
        res = run_hta(_files(diagnosis, trace_paths), budget_mb=budget_mb, timeout_s=timeout_s,
                      critical_path=critical_path)
    extras = {**diagnosis.extras, "hta": hta_extras(diagnosis, res, budget_mb=budget_mb, timeout_s=timeout_s)}
    return dataclasses.replace(diagnosis, extras=extras)


def not_requested(diagnosis: Diagnosis) -> Diagnosis:
    """A new Diagnosis that records that HTA was not asked for (the report says so either way)."""
    extras = {**diagnosis.extras, "hta": {"status": "not_requested", "reason": NOT_REQUESTED}}
    return dataclasses.replace(diagnosis, extras=extras)


def hta_summary(diagnosis: Diagnosis) -> str:
    """Terminal lines: what HTA said per check, and where it disagrees with us."""
    h = diagnosis.extras.get("hta") or {"status": "not_requested", "reason": NOT_REQUESTED}
    status = h.get("status")
    if status != "ok":
        return one_line(f"HTA second opinion: {h.get('reason') or status}")
    lines = ["HTA second opinion (Holistic Trace Analysis " + str(h.get("hta_version") or "?") + "):"]
    for cid, e in (h.get("by_check") or {}).items():
        verdict = {True: "agrees", False: "DISAGREES", None: "not compared"}[e.get("agrees")]
        lines.append(f"  {cid}: {verdict}. HTA says: {str(e.get('hta_says', ''))}")
        if e.get("disagreement"):
            lines.append(f"    {str(e['disagreement'])[:400]}")
    run = h.get("run") or {}
    if run.get("hta_says"):
        lines.append(f"  run: {str(run['hta_says'])}")
    cp = h.get("critical_path") or {}
    if cp.get("hta_says"):
        lines.append(f"  critical path: {str(cp['hta_says'])}")
    return "\n".join(one_line(line) for line in lines)  # HTA's text comes from the traces: untrusted

