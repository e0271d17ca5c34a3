"""Sizes and rank sets as a person writes them: sizes in powers of 1000 (as device memory and GB/s
are quoted), ranks as ranges ("0-7, 9").

One formatter for the verdicts, the terminal and the report; a light module (nothing but the
standard library), so the CLI can import what prints sizes without loading the analysis."""
from __future__ import annotations

from collections.abc import Iterable

MAX_RANGES = 6
"""Rank ranges shown before the rest is counted: a 1,024-rank job's verdict stays one line."""


def human(n: float | None) -> str:
    if n is None:
        return "not measured"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def rank_ranges(ranks: Iterable[int], *, dash: str = "-", limit: int = MAX_RANGES) -> str:
    """Ranks as ranges, lowest first: "0, 1", "0-7", "0, 2-8, 10-16". Three or more consecutive
    ranks make a range; two stay as they are. Beyond `limit` ranges, the first ones, an ellipsis,
    the last one and the count: "0, 2-8, 10-16, 18-24, 26-32, ..., 250-255 (224 ranks)" (#20: at
    256 ranks a verdict listing every rank ran to 1,200 characters)."""
    rs = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{rs[i]}{dash}{rs[j]}")
        else:
            parts += [str(r) for r in rs[i:j + 1]]
        i = j + 1
    if len(parts) > limit:
        parts = parts[:limit - 1] + ["...", parts[-1]]
        return ", ".join(parts) + f" ({len(rs)} ranks)"
    return ", ".join(parts)


def on_ranks(ranks: Iterable[int], found: Iterable[int], *, dash: str = "-") -> str:
    """Where a finding holds, short at any rank count: "all 256 ranks", "both ranks", "rank 3",
    "ranks 0, 2-8" (found: the ranks the run has)."""
    rs, every = set(ranks), set(found)
    if len(every) > 1 and rs == every:
        return "both ranks" if len(every) == 2 else f"all {len(every)} ranks"
    return ("rank " if len(rs) == 1 else "ranks ") + rank_ranges(rs, dash=dash)
