"""The report's extras at more ranks than it draws one by one (extras.shown_ranks)."""
from __future__ import annotations

import gzip
from pathlib import Path

import orjson
import pytest

from diagnose.extras import MAX_TIMELINE_RANKS
from diagnose.pipeline import diagnose_paths
from diagnose.output import diagnosis_dict
from reports.html import render
from tests.conftest import built_once

STRAGGLER = Path(__file__).parent / "fixtures" / "cpu_straggler_2rank"
WORLD, LATE = 24, 21


def _spread(out: Path) -> None:
    """The recorded 2-rank straggler job as 24 ranks: rank 21 the late rank's trace, every other
    rank the punctual one's (rank ids rewritten), as a bigger job with one slow host would be."""
    src = sorted(STRAGGLER.glob("rank*.json.gz"))
    punctual, late = (orjson.loads(gzip.decompress(p.read_bytes())) for p in src)
    for r in range(WORLD):
        doc = late if r == LATE else punctual
        doc["distributedInfo"] = {**doc["distributedInfo"], "rank": r, "world_size": WORLD}
        (out / f"rank{r}.pt.trace.json").write_bytes(orjson.dumps(doc))


@pytest.fixture(scope="module")
def spread(tmp_path_factory):
    return diagnose_paths([str(built_once(tmp_path_factory, "straggler24", _spread))])


def test_a_late_rank_past_the_first_sixteen_is_drawn_and_the_page_says_which_ranks_it_shows(spread):
    d = spread
    assert d.top is not None and d.top.id == "straggler" and d.top.ranks == (LATE,)
    tl = d.extras["timeline"]
    drawn = [x["rank"] for x in tl["ranks"]]
    assert LATE in drawn and len(drawn) == MAX_TIMELINE_RANKS and drawn == sorted(drawn)
    assert LATE in [x["rank"] for x in d.extras["top_ops"]["ranks"]]
    assert tl["shown"]["ranks"] == MAX_TIMELINE_RANKS and tl["shown"]["of"] == WORLD
    # the critical path runs through the late rank; every rank it passes is drawn, so it is drawn
    assert {seg[2] for seg in tl["critical_path"]} <= set(drawn) and LATE in {seg[2] for seg in tl["critical_path"]}
    html = render(diagnosis_dict(d))
    assert f"{MAX_TIMELINE_RANKS} of {WORLD} ranks shown" in html
    assert "on the ranks shown" in html
