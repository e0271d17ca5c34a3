"""Real 2-rank torchrun gloo jobs with an injected fault; the right cause must rank first."""
from __future__ import annotations

import pytest

from diagnose.pipeline import diagnose_paths
from tests.conftest import torchrun

pytestmark = pytest.mark.e2e


def test_straggler_rank1_is_named(tmp_path):
    res = torchrun(tmp_path, "--pathology", "straggler")
    assert res.returncode == 0, res.stderr[-2000:]
    d = diagnose_paths([tmp_path])
    assert d.findings[0].id == "straggler"
    assert d.findings[0].ranks == (1,)
    # the injected 150 ms sleep; CPU contention on a 2-core host moves it by tens of ms
    assert d.findings[0].recoverable_ms > 80


def test_slow_getitem_dataloader_ranks_first(tmp_path):
    res = torchrun(tmp_path, "--pathology", "dataloader")
    assert res.returncode == 0, res.stderr[-2000:]
    d = diagnose_paths([tmp_path])
    assert d.findings[0].id == "dataloader_starvation"
    assert d.findings[0].share_of_step > 0.5
