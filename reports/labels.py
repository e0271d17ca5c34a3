"""Human labels and units for the metric keys a finding carries.

The keys are the machine's (diagnosis.json keeps them, scripts read them); a page shows what
they mean. Most keys say their unit in a suffix (`_ms_per_step`, `_share`, `_bytes`, ...), so the
label is derived from the key; the keys whose words alone would mislead get a written label.
"""
from __future__ import annotations

import re
import statistics

from .charts import num
from .common import esc, fmt_value

# keys whose words need saying in full (the statistics, above all)
WRITTEN = {
    "p_last_more_than_chance": "Chance the late rank is last this often by luck (p-value)",
    "p_late_on_average": "Chance the late rank is this late on average by luck (p-value)",
    "p_threshold_per_test": "p-value below which a rank is called late (per test, Bonferroni)",
    "every_step_p_value": "Chance of the late rank's record over every probed step by luck (p-value)",
    "every_step_steps": "Steps in the probes' every-step record",
    "every_step_collectives": "Collectives in the probes' every-step record",
    "every_step_dataloader_share": "DataLoader share of the step over every probed step",
    "chance_last_share": "Share of collectives any rank would enter last by chance",
    "match_ratio": "Collectives matched across ranks",
    "collectives_matched": "Collectives matched across ranks",
    "own_estimate_ms": "The check's own estimate, before the replay (ms per step)",
    "replay_recoverable_ms": "Given back when the replay removes this cause (ms per step)",
    "replay_at_best_transfer_ms": "Given back with every transfer at its best observed speed (ms per step)",
    "critical_path_ms": "Time on the step's critical path (ms per step)",
    "wait_imposed_ms_per_step": "Time other ranks wait for the late rank(s) (ms per step)",
    "late_from": "Where the late rank's extra time goes",
    "late_rank_extra_ops": "What the late rank runs more of than the median rank",
    "worst_rank": "Worst rank",
    "clock_bound_us": "Host and device clocks agree within (µs)",
    "note": "Note",
    "headroom": "Device memory left unused (share)",
    "ms_outside_steps": "Time outside the profiled steps (ms)",
    "median_collective_bytes": "Median collective size",
    "share_of_step": "Share of the step",
}

# keys whose unit no suffix declares
KIND = {"headroom": "share", "match_ratio": "share", "ms_outside_steps": "ms", "share_of_step": "share"}

# the unit a key's suffix declares: (pattern at the end of the key, unit shown, kind of value)
SUFFIXES = (
    ("_ms_per_step", "ms per step", "ms"),
    ("_ms", "ms", "ms"),
    ("_us", "µs", "us"),
    ("_bytes", "", "bytes"),
    ("_mb_per_s", "MB/s", "num"),
    ("_share_of_step", "share of the step", "share"),
    ("_share_of_wait", "share of the wait", "share"),
    ("_share_of_idle", "share of the idle time", "share"),
    ("_share_of_device_time", "share of device time", "share"),
    ("_share", "share", "share"),
    ("_fraction", "share", "share"),
    ("_per_step", "per step", "num"),
)

WORDS = {"comm": "communication", "dataloader": "DataLoader", "aten": "ATen", "ops": "ops", "mb": "MB",
         "p": "p-value", "idle": "idle"}
_RANK = re.compile(r"rank(\d+)_(.+)")
_ADVICE = re.compile(r"advice\d+_(.+)_frees_bytes")


def _words(stem: str) -> str:
    text = " ".join(WORDS.get(w, w) for w in stem.split("_") if w)
    return text[:1].upper() + text[1:]


def metric_label(key: str) -> tuple[str, str]:
    """(label, kind) for a metric key; kind is ms, us, share, bytes, num or text (how to format)."""
    key = str(key)
    m = _RANK.fullmatch(key)
    if m:
        label, kind = metric_label(m.group(2))
        return f"Rank {m.group(1)}: {label}", kind
    m = _ADVICE.fullmatch(key)
    if m:
        return f"Memory freed by: {_words(m.group(1)).lower()}", "bytes"
    if key in WRITTEN:
        kind = KIND.get(key) or next((k for suffix, _, k in SUFFIXES if key.endswith(suffix)), "num")
        return WRITTEN[key], kind
    for suffix, unit, kind in SUFFIXES:
        if key.endswith(suffix) and len(key) > len(suffix):
            stem = key[: -len(suffix)]
            return (f"{_words(stem)} ({unit})" if unit else _words(stem)), kind
    return _words(key), "num"


def human_bytes(v: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(v) >= size:
            return f"{v / size:,.2f} {unit}"
    return f"{v:,.0f} B"


def metric_value(key: str, v) -> str | None:
    """The value formatted for its unit, or None when it is not a number (the caller escapes text)."""
    x = num(v)
    if x is None or isinstance(v, bool):
        return None
    kind = metric_label(key)[1]
    if kind == "share":
        return f"{x:.1%}"
    if kind == "bytes":
        return human_bytes(x)
    if kind == "ms":
        return f"{x:,.3f}" if abs(x) < 10 else f"{x:,.1f}"
    if float(x).is_integer():
        return f"{int(x):,}"
    return f"{x:,.4g}"


MAX_RANK_ROWS = 16
"""Per-rank metrics of one kind (rank<R>_...) shown row by row up to this many ranks; beyond, one row."""
TOP_RANKS = 5


def metric_rows(metrics: dict) -> list[tuple[str, str, str, bool]]:
    """(machine key, label, value as HTML, is a number) per row. A per-rank family past
    MAX_RANK_ROWS ranks (a 1,024-rank job's `rank<R>_mean_lateness_ms`) becomes one row: its
    median and its highest ranks (every value stays in diagnosis.json)."""
    families: dict[str, list[tuple[int, float]]] = {}
    for k, v in metrics.items():
        m = _RANK.fullmatch(str(k))
        if m and num(v) is not None:
            families.setdefault(m.group(2), []).append((int(m.group(1)), float(num(v))))
    big = {f for f, vs in families.items() if len(vs) > MAX_RANK_ROWS}
    rows: list[tuple[str, str, str, bool]] = []
    for k, v in metrics.items():
        m = _RANK.fullmatch(str(k))
        fam = m.group(2) if m else None
        if fam in big:
            big.discard(fam)  # the family's one row, where its first rank stood
            vals = families[fam]

            def fmt(x: float, fam: str = fam) -> str:
                return metric_value(f"rank0_{fam}", x) or fmt_value(x)
            top = sorted(vals, key=lambda rv: -rv[1])[:TOP_RANKS]
            text = (f"median {fmt(statistics.median(x for _, x in vals))}; highest: "
                    + ", ".join(f"rank {r} {fmt(x)}" for r, x in top) + f" (all {len(vals)} in diagnosis.json)")
            rows.append((f"rank<R>_{fam}", f"Per rank ({len(vals)} ranks): {metric_label(fam)[0]}", esc(text), False))
        elif fam is None or fam not in families or len(families[fam]) <= MAX_RANK_ROWS:
            shown = metric_value(k, v)
            rows.append((str(k), metric_label(k)[0], esc(shown) if shown else fmt_value(v), num(v) is not None))
    return rows
