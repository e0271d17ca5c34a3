"""Read the probes' sidecars (`rank{R}.probe.json`, `rank{R}.steps.jsonl`) beside the traces.

They add what a few profiled steps cannot: every step's time, DataLoader wait and
collective arrivals, and run metadata (batch size, num_workers, model size). The
analysis works without them; with them, verdicts rest on every step.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

_SIDE = re.compile(r"^rank(\d+)\.(probe\.json|steps\.jsonl|steps\.1\.jsonl)$")
MAX_STEP_LINES = 200_000  # bound memory on very long runs: the newest steps matter most


@dataclass(frozen=True, slots=True)
class ProbeData:
    rank: int
    meta: dict
    steps: pd.DataFrame
    """step, start (epoch s), dur_ms, dataloader_ms, comm_ms; warm-up step 0 excluded."""
    collectives: pd.DataFrame
    """step, seq, name, arrival (epoch s), dur_ms, bytes, group."""
    partial: bool = False
    warnings: tuple[str, ...] = field(default_factory=tuple)


def _dirs(paths: list[str | Path]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        d = p if p.is_dir() else p.parent
        out.append(d)
        if p.is_dir():
            out += [s for s in sorted(d.iterdir()) if s.is_dir()]
    return out


def _read_steps(path: Path) -> tuple[list[dict], bool]:
    rows, partial = [], False
    with open(path, "rb") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                partial = True  # a rank killed mid-write leaves half a line: keep the complete ones
    return rows[-MAX_STEP_LINES:], partial


def probe_from_rows(rank: int, meta: dict, rows: list, partial: bool = False,
                    warnings: tuple[str, ...] = ()) -> ProbeData:
    """ProbeData from parsed step records (the warm-up step 0 is left out)."""
    rows = [r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), int) and r["step"] > 0
            and isinstance(r.get("start"), (int, float)) and isinstance(r.get("dur_ms"), (int, float))]
    steps = pd.DataFrame([{k: r.get(k) for k in ("step", "start", "dur_ms", "dataloader_ms", "comm_ms")}
                          for r in rows], columns=["step", "start", "dur_ms", "dataloader_ms", "comm_ms"])
    colls = []
    for r in rows:
        for seq, c in enumerate(r.get("collectives") or []):
            if isinstance(c, list) and len(c) >= 5:
                try:
                    colls.append({"step": r["step"], "seq": seq, "name": str(c[0]),
                                  "arrival": float(r["start"]) + float(c[1]) / 1000, "dur_ms": float(c[2]),
                                  "bytes": c[3], "group": str(c[4])})
                except (TypeError, ValueError):
                    continue
    return ProbeData(rank=rank, meta=meta, steps=steps, collectives=pd.DataFrame(colls), partial=partial,
                     warnings=warnings)


def load_probe_data(paths: list[str | Path]) -> dict[int, ProbeData]:
    found: dict[int, dict[str, Path]] = {}
    for d in _dirs(paths):
        if not d.exists():
            continue
        for f in d.iterdir():
            m = _SIDE.match(f.name)
            if m:
                found.setdefault(int(m.group(1)), {})[m.group(2)] = f
    out: dict[int, ProbeData] = {}
    for rank, files in found.items():
        warnings: list[str] = []
        meta: dict = {}
        if "probe.json" in files:
            try:
                body = json.loads(files["probe.json"].read_text())
                body = body if isinstance(body, dict) else {}
                meta = body.get("meta") if isinstance(body.get("meta"), dict) else {}
                meta = {**meta, "schedule": body.get("schedule"), "final": body.get("final")}
            except (ValueError, OSError) as exc:
                warnings.append(f"{files['probe.json'].name}: unreadable sidecar ({exc})")
        rows, partial = ([], False)
        for key in ("steps.1.jsonl", "steps.jsonl"):  # the rotated generation first: oldest steps first
            if key in files:
                try:
                    more, cut = _read_steps(files[key])
                    rows += more
                    partial = partial or cut
                except OSError as exc:
                    warnings.append(f"{files[key].name}: unreadable ({exc})")
        out[rank] = probe_from_rows(rank, meta, rows, partial, tuple(warnings))
    return out


def every_step_lateness(probes: dict[int, ProbeData]) -> pd.DataFrame:
    """Per matched collective (step, group, seq) in the probes: each rank's arrival lateness
    vs the median (ms) and which rank came last. Ranks on one host share the epoch clock."""
    frames = [p.collectives.assign(rank=r) for r, p in probes.items() if not p.collectives.empty]
    if len(frames) < 2:
        return pd.DataFrame()
    c = pd.concat(frames, ignore_index=True)
    c["seq"] = c.groupby(["rank", "step", "group"]).cumcount()
    n = c.groupby(["step", "group", "seq"])["rank"].transform("size")
    c = c[n >= 2].copy()
    c["lateness_ms"] = (c["arrival"] - c.groupby(["step", "group", "seq"])["arrival"].transform("median")) * 1000
    return c
