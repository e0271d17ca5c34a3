"""A rank's cover (diagnose/step/cover.py): what the parent reads instead of the interval sets.
It must answer as the sets do, and what travels per rank must not grow with the kernels."""
from __future__ import annotations

import gzip
import pickle

import numpy as np
import orjson
import pytest

from diagnose.analyzers import reduce_rank
from diagnose.ingest.assemble import load_one
from diagnose.ingest.load import DEFAULT_MAX_BYTES
from diagnose.step.cover import LANE_SETS, MAX_DRAWN, STEP_SETS, idle_sets
from diagnose.step.intervals import clip, covered, merge, subtract
from tests.conftest import SHARED

SETS = ["hta_nccl_data_rank0of2_a100", "param_dlrm_8rank_v100", "kineto_resnet50_dataloader_v100/nw0"]


def _first(name):
    return str(sorted((SHARED / name).glob("*.gz"))[0])


@pytest.mark.parametrize("name", SETS + ["../../main/tests/fixtures/cpu_straggler_dataloader_2rank"])
def test_cover_answers_as_the_sets_do(name):
    x = load_one((_first(name), DEFAULT_MAX_BYTES, None))  # no reduction: the sets are kept beside it
    tl, m = x.timeline, x.idle
    cov = tl.cover
    lo, hi = tl.steps.start, tl.steps.end
    # per step: the sets' coverage, by definition
    dl_free = subtract(tl.dataloader, merge(tl.compute, tl.comm)) if tl.is_gpu else tl.dataloader
    for k, s in enumerate((tl.compute, tl.comm, tl.dataloader, dl_free, tl.input_copies, tl.host_busy, tl.compiled)):
        assert np.allclose(cov.per_step[:, k], covered(s, lo, hi), rtol=0, atol=1e-6), STEP_SETS[k]
    # lane parts between any two lane points, and a fraction of a microsecond past one (a lane
    # resuming at a collective's end): what covered() of the sets gives there
    gaps = idle_sets(m, float(lo.min()), float(hi.max()))
    lane = [dl_free, *[subtract(s, dl_free) for s in gaps], tl.input_copies]
    a, b = cov.lanes.points[:-1], cov.lanes.points[1:]
    for a_, b_ in ((a, b), (cov.lanes.points[:1].repeat(b.size), b), (a, a + 0.4)):
        got = cov.lane_parts(a_ + 7.0, b_ + 7.0, 7.0)  # on a clock 7 us ahead
        want = np.stack([covered(s, a_, b_) for s in lane], axis=1)
        assert got.shape == (a_.size, len(LANE_SETS)) and np.allclose(got, want, rtol=0, atol=1e-6)
    # the drawing: each step's longest intervals of each lane, clipped to the step
    for i, (s, e) in enumerate(zip(lo, hi)):
        want = clip(tl.compute, float(s), float(e))
        starts, ends = cov.drawing.lane("compute", i)
        assert len(starts) == min(len(want), MAX_DRAWN)
        if len(want) <= MAX_DRAWN:
            assert np.array_equal(starts, want.starts) and np.array_equal(ends, want.ends)
        else:
            assert (ends - starts).min() >= np.sort(want.ends - want.starts)[-MAX_DRAWN]


def _denser(doc: dict, pieces: int) -> dict:
    """Every device kernel split into `pieces` kernels with a microsecond between them: the same
    steps and collectives, `pieces` times the kernels and idle gaps."""
    out = []
    for e in doc["traceEvents"]:
        if e.get("cat") == "kernel" and e.get("dur", 0) > 2 * pieces and "nccl" not in e.get("name", "").lower():
            d = (e["dur"] - (pieces - 1)) / pieces
            out += [{**e, "ts": e["ts"] + i * (d + 1), "dur": d} for i in range(pieces)]
        else:
            out.append(e)
    return {**doc, "traceEvents": out}


def test_what_travels_per_rank_does_not_grow_with_the_kernels(tmp_path):
    # #20: the parent holds every rank's result; a rank's interval sets (one interval per kernel
    # and idle gap) made it grow with the trace: 420 KB for a 26 MB ResNet-50 rank before
    import dataclasses

    from diagnose.step.intervals import Intervals

    doc = orjson.loads(gzip.decompress((SHARED / "hta_nccl_data_rank0of2_a100" / "nccl_data.json.gz").read_bytes()))
    rest, stretch, points, kernels = [], [], [], []
    for pieces in (1, 8):
        p = tmp_path / f"dense{pieces}.json"
        p.write_bytes(orjson.dumps(_denser(doc, pieces)))
        x = load_one((str(p), DEFAULT_MAX_BYTES, reduce_rank))
        assert x.error is None and x.timeline.compute is None  # the sets stay where the trace was read
        cov, tl = x.timeline.cover, x.timeline
        assert cov.lanes.points.size <= 2 * len(tl.steps) + len(tl.collectives) + len(cov.exposed)
        whole = len(pickle.dumps(x, protocol=4))
        # what is indexed by the stretches of exposed communication, which compute kernels running
        # beside a collective cut up (the step graph has a point at each), apart
        x.timeline = dataclasses.replace(tl, cover=dataclasses.replace(
            cov, exposed=Intervals.empty(), lanes=dataclasses.replace(
                cov.lanes, points=np.empty(0), cum=np.zeros((0, 0)), inside=np.zeros((0, 0), bool))))
        rest.append(len(pickle.dumps(x, protocol=4)))
        stretch.append(whole - rest[-1])
        points.append(cov.lanes.points.size)
        kernels.append(sum(1 for e in orjson.loads(p.read_bytes())["traceEvents"] if e.get("cat") == "kernel"))
    assert kernels[1] > 4 * kernels[0]
    assert rest[1] == rest[0]  # everything else: per step and per collective, whatever the kernels
    # and the rest at most an exposed interval, a point, and a running sum and flag per lane set each
    per_point = 16 + 8 + 9 * len(LANE_SETS)
    assert all(s <= per_point * n + 2_000 for s, n in zip(stretch, points)), (stretch, points)


def test_the_parent_keeps_each_ranks_mini_timeline_on_disk():
    # only the report reads it, for 16 ranks at most: each rank's is written to one temporary
    # file as it arrives and read back when drawn (ingest/spill.py)
    from diagnose.ingest.assemble import load_run
    from diagnose.ingest.spill import Spilled

    path = SHARED / "param_dlrm_8rank_v100"
    run = load_run([path], reduce=reduce_rank)
    f = sorted(path.glob("*.gz"))[3]
    whole = load_one((str(f), DEFAULT_MAX_BYTES, None)).timeline.cover.drawing
    kept = next(tl.cover for tl in run.timelines.values() if tl.file == f.name)
    assert isinstance(kept.drawing, Spilled) and kept.drawing.size > 1000
    back = kept.drawn()
    for lane in whole.starts:
        assert np.array_equal(back.starts[lane], whole.starts[lane]) and np.array_equal(back.ends[lane], whole.ends[lane])
    assert np.array_equal(back.idle_cls, whole.idle_cls)
