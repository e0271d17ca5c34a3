"""Rank sets as text (diagnose.units.rank_ranges) and what the terminal prints at a thousand ranks."""
from __future__ import annotations

from dataclasses import replace

import pytest

from diagnose.output import _verdict, terminal_summary
from diagnose.units import MAX_RANGES, on_ranks, rank_ranges
from reports.common import fmt_ranks
from tests.conftest import shared_diagnosis


@pytest.mark.parametrize("ranks, text", [
    ([], ""),
    ([3], "3"),
    ([1, 0], "0, 1"),                       # two in a row stay two
    ([2, 0, 1], "0-2"),                     # three make a range
    ([0, 2, 3, 4, 5, 6, 7, 8], "0, 2-8"),
    ([4, 4, 5, 6], "4-6"),                  # repeats count once
    ([r for r in range(256) if r % 8 != 1], "0, 2-8, 10-16, 18-24, 26-32, ..., 250-255 (224 ranks)"),
])
def test_rank_ranges(ranks, text):
    assert rank_ranges(ranks) == text


def test_past_the_limit_the_first_ranges_the_last_and_the_count():
    odd = list(range(1, 40, 2))
    text = rank_ranges(odd)
    assert text.startswith(", ".join(map(str, odd[:MAX_RANGES - 1])) + ", ..., 39")
    assert text.endswith(f"({len(odd)} ranks)")


def test_the_report_uses_the_same_ranges_with_an_en_dash():
    assert fmt_ranks([0, 1, 2, 5]) == "0–2, 5"
    assert fmt_ranks([]) == "—"


def test_a_finding_on_every_rank_says_so():
    assert on_ranks((0, 1, 2), (0, 1, 2)) == "all 3 ranks"
    assert on_ranks((0, 1), (0, 1)) == "both ranks"
    assert on_ranks((1,), (0, 1)) == "rank 1"
    assert on_ranks((0,), (0,)) == "rank 0"
    assert on_ranks((0, 2, 3, 4), tuple(range(8))) == "ranks 0, 2-4"


def test_a_thousand_ranks_keep_the_verdict_and_the_ranked_causes_one_short_line_each():
    """DLRM's real diagnosis (launch overhead on all 8 ranks, the DataLoader on 7) with its ranks
    spread to 1,024 as a big job's would be: before, the verdict line listed every rank."""
    d = shared_diagnosis("param_dlrm_8rank_v100")
    found = tuple(range(1024))
    findings = tuple(replace(f, ranks=found if len(f.ranks) == 8 else tuple(r for r in found if r % 8 != 1))
                     for f in d.findings)
    big = replace(d, run=replace(d.run, ranks_found=found, world_size=1024), findings=findings)
    text = terminal_summary(big)
    head = text.split("\nchecklist:")[0]
    assert max(len(line) for line in head.splitlines()) < 260, head
    assert "all 1024 ranks" in head and "(896 ranks)" in head
    assert _verdict(big).endswith("recoverable on all 1024 ranks")


def test_the_report_s_headline_says_where_as_the_terminal_does():
    from reports.html import _headline

    d = {"findings": [{"title": "T", "recoverable_ms": 5.0, "share_of_step": 0.1, "ranks": [0, 1, 2, 3]}],
         "run": {"ranks_found": [0, 1, 2, 3]}}
    assert "on all 4 ranks." in _headline(d)
    d["run"]["ranks_found"] = list(range(8))
    assert "on ranks 0–3." in _headline(d)
