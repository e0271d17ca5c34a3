"""The probes under torch.compile, in process (the e2e stack tests run whole jobs): a probe must
not change what torch.compile does with the user's model."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from diagnose.probes import patches  # noqa: E402
from diagnose.probes.core import Probe, Schedule  # noqa: E402


def _graph_breaks(model_factory) -> dict:
    """Compile and run a model twice; dynamo's graph breaks by reason. Dynamo's tracing is what is
    tested: the backend runs the captured graphs as they are (no C++ build)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model_factory(), backend="eager")
    for _ in range(2):
        compiled(torch.randn(4, 8)).sum().backward()
    out = dict(counters["graph_break"])
    torch._dynamo.reset()
    return out


def test_a_compiled_ddp_model_traces_through_the_probe_as_without_it(tmp_path, gloo_world_of_one):
    """torch.compile(DDP(model)) traces DDP.forward, which the probe wraps: the wrapper once failed
    under tracing (a dict lookup on the module) and logged it, and the logger call was one more
    graph break in the user's model. Now the wrapper steps aside while compiling: the same graph
    breaks as without the probe, and the probe keeps working."""
    from torch import nn

    def ddp():
        return nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))

    without = _graph_breaks(ddp)
    probe = Probe(tmp_path, schedule=Schedule.parse("0,0,1"), strict_dir=False)
    undo = [patches._ddp(probe), patches._collectives(probe)]
    try:
        with_probe = _graph_breaks(ddp)
    finally:
        for u in undo:
            if u:
                u()
    assert not probe._failed, probe._failed
    assert probe.meta["model"]["wrapper"] == "DistributedDataParallel"  # facts taken at construction
    assert with_probe == without
