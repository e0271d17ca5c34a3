"""Uneven work across ranks (diagnose/analyzers/imbalance.py): a recorded job whose ranks take
turns at being slowest, its figures against what the job injected, and the check's corners."""
from __future__ import annotations

import shutil
import statistics
from pathlib import Path

import pytest

from diagnose.pipeline import diagnose_paths
from examples.train_ddp import uneven_extra_ms
from tests.test_straggler import write_pair

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "cpu_uneven_2rank"
MOST_MS = 400.0  # the fixture's --uneven-ms


def _check(d, cid="load_imbalance"):
    return next(c for c in d.checks if c.id == cid)


def _injected(steps) -> tuple[float, float]:
    """What the job injected over these steps: (each rank's mean wait for the step's slowest,
    the slowest rank's extra work over the other's), ms per step, from the job's own seeded draws."""
    diffs = [abs(uneven_extra_ms(0, s, 0, MOST_MS) - uneven_extra_ms(1, s, 0, MOST_MS)) for s in steps]
    return statistics.fmean(diffs) / 2, statistics.fmean(diffs)


@pytest.fixture(scope="module")
def recorded():
    return diagnose_paths([FIXTURE])


def test_a_job_whose_ranks_take_turns_at_being_slowest_is_called_uneven_work(recorded):
    """tests/fixtures/cpu_uneven_2rank (README): each step each rank computes a random 0-400 ms more.
    Before this check: "no significant cause found", the waiting called arrival jitter."""
    d = recorded
    top = d.findings[0]
    assert top.id == "load_imbalance" and top.ranks == (0, 1) and top.confidence == "high"
    assert _check(d, "straggler").status == "passed"  # no rank is late more than chance
    m = top.metrics
    # judged on the probes' every-step record: 29 steps (step 0, the warm-up, left out)
    assert m["judged_on"] == "every_step_record" and m["steps_judged"] == 29
    # the job's own draws over those steps: which rank had more work, step by step
    draws = {s: uneven_extra_ms(1, s, 0, MOST_MS) > uneven_extra_ms(0, s, 0, MOST_MS) for s in range(1, 30)}
    assert m["rank1_slowest_share"] == pytest.approx(sum(draws.values()) / 29, abs=2 / 29)
    assert m["rank0_slowest_share"] + m["rank1_slowest_share"] == pytest.approx(1.0)


def test_its_figures_are_what_the_job_injected(recorded):
    """The profiled steps' waits and the slowest rank's extra compute against the seeded draws:
    each step one rank computes |a - b| ms more, the other waits that long, so each rank waits
    |a - b| / 2 on average, and spreading the work evenly gives that back."""
    d = recorded
    steps = sorted({s.step for s in d.breakdown})
    wait, extra = _injected(steps)
    top = d.findings[0]
    assert top.metrics["wait_ms_per_step"] == pytest.approx(wait, rel=0.1)
    assert top.recoverable_ms == pytest.approx(wait, rel=0.1)  # replayed: every rank to the median
    assert top.metrics["uneven_in"] == "compute_ms"
    assert top.metrics["slowest_extra_compute_ms"] == pytest.approx(extra, rel=0.1)
    assert "batch by tokens" in top.fix
    # the evidence: each rank's latest arrival, both ranks late somewhere
    assert {e.rank for e in top.events} == {0, 1}


def test_without_the_every_step_record_the_profiled_steps_decide(tmp_path):
    for f in FIXTURE.glob("*.pt.trace.json.gz"):
        shutil.copy(f, tmp_path / f.name)
    d = diagnose_paths([tmp_path])
    c = _check(d)
    assert c.status == "flagged" and c.finding.confidence == "medium"
    m = c.finding.metrics
    steps = sorted({s.step for s in d.breakdown})
    assert m["judged_on"] == "profiled_steps" and m["steps_judged"] == len(steps) == 5
    slower1 = sum(uneven_extra_ms(1, s, 0, MOST_MS) > uneven_extra_ms(0, s, 0, MOST_MS) for s in steps)
    assert m["rank1_slowest_share"] == pytest.approx(slower1 / 5)


def test_one_rank_slowest_at_every_step_is_the_straggler_s(tmp_path):
    write_pair(tmp_path, [1] * 6, late_us=2_000.0)
    d = diagnose_paths([tmp_path])
    assert _check(d, "straggler").status == "flagged"
    c = _check(d)
    assert c.status == "passed" and c.reason.startswith("the waiting at collectives is first the straggler check's "
                                                        "(rank 1)")
    assert "load_imbalance" not in [f.id for f in d.findings]


def test_too_few_steps_to_tell_turns_from_a_slow_rank(tmp_path):
    write_pair(tmp_path, [0, 1], late_us=2_000.0)
    c = _check(diagnose_paths([tmp_path]))
    assert c.status == "passed" and c.reason.startswith("2 profiled step(s): whether the slowest rank changes")


def test_one_replay_answers_both_questions(recorded):
    """Every rank brought to the median is the straggler's edit with none named: one replay, and
    the clean step (every cause removed) the same with or without this cause."""
    from diagnose.context import build_context
    from diagnose.ingest.assemble import load_run
    from diagnose.analyzers import reduce_rank

    run = load_run([FIXTURE], reduce=reduce_rank)
    m = build_context(run, {}).model
    assert m.saving("load_imbalance", (0, 1)) == m.saving("straggler", ())
    assert len([k for k in m._savings if k[0] in ("straggler", "load_imbalance")]) == 1
    rep = recorded.extras["replay"]
    assert rep["by_cause_ms"]["load_imbalance"] == rep["by_cause_ms"]["straggler"]


def _padded_lengths(fixture: Path) -> dict[int, dict[int, int]]:
    """From the raw traces: each rank's padded sequence length at each profiled step (the token
    embedding's input, [batch, tokens], as record_shapes wrote it)."""
    import gzip
    import json

    out: dict[int, dict[int, int]] = {}
    for f in sorted(fixture.glob("rank*.pt.trace.json.gz")):
        events = json.loads(gzip.open(f).read())["traceEvents"]
        steps = [(e["ts"], e["ts"] + e["dur"], int(e["name"].split("#")[1])) for e in events
                 if str(e.get("name", "")).startswith("ProfilerStep#")]
        emb = [(e["ts"], e["args"]["Input Dims"][1][1]) for e in events if e.get("name") == "aten::embedding"]
        rank = int(f.name[4])
        out[rank] = {s: max(n for ts, n in emb if a <= ts < b) for a, b, s in steps}
    return out


def _slowest(d) -> dict[int, int]:
    import pandas as pd

    from diagnose.analyzers.imbalance import _slowest_by_profiled_step

    t = pd.DataFrame([{"rank": r.rank, "step": r.step, "step_ms": r.step_ms, "straggler_wait_ms": r.straggler_wait_ms}
                      for r in d.breakdown])
    return _slowest_by_profiled_step(t).to_dict()


def test_a_hugging_face_trainer_on_sequences_of_varying_length_is_called_uneven_work():
    """tests/fixtures/cpu_hf_lengths_2rank (README): the Trainer on sequences of 16-256 tokens, each
    batch padded to its longest; nothing injected. The rank with the longer batch at a step is that
    step's slowest, and which rank that is changes."""
    fixture = FIXTURE.parent / "cpu_hf_lengths_2rank"
    d = diagnose_paths([fixture])
    top = d.findings[0]
    assert top.id == "load_imbalance" and top.ranks == (0, 1) and top.metrics["uneven_in"] == "compute_ms"
    tokens, slowest = _padded_lengths(fixture), _slowest(d)
    longer = {s: int(tokens[1][s] > tokens[0][s]) for s in tokens[0] if abs(tokens[1][s] - tokens[0][s]) >= 20}
    assert len(longer) >= 4 and set(longer.values()) == {0, 1}  # the longer batch changes rank
    assert all(slowest[s] == r for s, r in longer.items()), (longer, slowest)


def test_the_trainers_length_grouped_sampler_deals_the_longer_batch_to_rank_0():
    """tests/fixtures/cpu_hf_grouped_2rank: the same job with train_sampling_strategy="group_by_length":
    its steps are shorter (less padding), but the length-sorted batches are dealt to the ranks in
    turn, so rank 0 gets the longer of each pair at every step: a straggler, late from compute, and
    no longer uneven work."""
    fixture = FIXTURE.parent / "cpu_hf_grouped_2rank"
    d = diagnose_paths([fixture])
    tokens = _padded_lengths(fixture)
    assert all(tokens[0][s] > tokens[1][s] for s in tokens[0])
    top = d.findings[0]
    assert top.id == "straggler" and top.ranks == (0,) and top.metrics["late_from"].startswith("compute")
    assert _check(d).status == "passed"
    ungrouped = diagnose_paths([FIXTURE.parent / "cpu_hf_lengths_2rank"])
    assert statistics.fmean(d.run.mean_step_ms.values()) < 0.9 * statistics.fmean(ungrouped.run.mean_step_ms.values())


def test_a_bug_in_this_check_does_not_cost_the_straggler_s_verdict(monkeypatch):
    """Both checks come from the straggler's checklist entry; the pipeline guards an entry, so the
    entry guards this one."""
    from diagnose.analyzers import imbalance

    def broken(*a, **kw):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(imbalance, "analyze", broken)
    d = diagnose_paths([FIXTURE.parent / "cpu_straggler_2rank"])
    assert d.findings[0].id == "straggler" and d.findings[0].ranks == (1,)
    c = _check(d)
    assert c.status == "not_measurable" and c.reason == "failed on this input (ZeroDivisionError: a bug)"
