"""Hang hints from Flight Recorder dumps (JSON, the layout torch 2.13's gloo recorder writes)."""
from __future__ import annotations

import importlib.util
import json
import pickle

import pytest

from diagnose.errors import DiagnoseError
from diagnose.hang import analyze_hang, read_dump, read_dumps, render_hang


def entry(seq: int, op: str = "gloo:all_reduce", pg=("0", "default_pg"), t: int = 1_000_000_000, p2p=False) -> dict:
    return {"collective_seq_id": seq, "is_p2p": p2p, "p2p_seq_id": 0, "pg_id": 0, "process_group": list(pg),
            "profiling_name": op, "state": "scheduled", "time_created_ns": t, "retired": True}


def dump(*entries) -> dict:
    return {"version": "2.7", "comm_lib_version": "", "pg_config": {}, "entries": list(entries)}


def test_the_rank_behind_is_named_with_the_collective_it_did_not_enter():
    dumps = {0: dump(entry(16), entry(17), entry(18, t=2_000_000_000)),
             1: dump(entry(16), entry(17, "gloo:broadcast")),
             2: dump(entry(17), entry(18))}
    rep = analyze_hang(dumps, expected=[0, 1, 2])
    assert rep.suspects == [1] and rep.no_dump == []
    (g,) = rep.groups
    assert g.frontier.seq == 18 and g.behind == (1,) and g.waiting == (0, 2)
    text = render_hang(rep, now_ns=7_000_000_000)
    assert text.startswith("HANG HINT: rank(s) 1 did not enter")
    assert "rank(s) 0, 2 entered collective #18 (gloo:all_reduce) 5.0 s ago" in text
    assert "rank 1: last entered #17 (gloo:broadcast), 1 behind" in text


def test_groups_are_judged_apart_and_p2p_is_not_a_collective():
    dp, tp = ("1", "dp"), ("2", "tp")
    dumps = {0: dump(entry(5, pg=dp), entry(9, pg=tp), entry(40, "nccl:send", pg=tp, p2p=True)),
             1: dump(entry(5, pg=dp), entry(8, pg=tp))}
    rep = analyze_hang(dumps, expected=[0, 1])
    by = {g.group: g for g in rep.groups}
    assert by["1:dp"].behind == () and by["2:tp"].behind == (1,) and by["2:tp"].frontier.seq == 9
    assert rep.suspects == [1]


def test_all_ranks_in_the_same_collective_means_no_missing_rank():
    rep = analyze_hang({0: dump(entry(3)), 1: dump(entry(3))}, expected=[0, 1])
    assert rep.suspects == []
    assert "no rank is missing" in render_hang(rep)


def test_silent_and_recorder_less_ranks_are_reported():
    rep = analyze_hang({0: dump(entry(3)), 1: {"diagnose_error": "RuntimeError: no recorder"}}, expected=[0, 1, 2])
    assert rep.no_dump == [2] and rep.unavailable == {1: "RuntimeError: no recorder"} and rep.suspects == [2]
    text = render_hang(rep)
    assert "no dump from rank(s) 2" in text and "rank 1: no Flight Recorder" in text


def test_dumps_are_json_only_never_unpickled(tmp_path):
    p = tmp_path / "rank0.fr.json"
    p.write_bytes(pickle.dumps({"entries": []}))
    with pytest.raises(DiagnoseError, match="never unpickled"):
        read_dump(p)
    p.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(DiagnoseError, match="not a Flight Recorder dump"):
        read_dump(p)
    p.write_text(json.dumps(dump(entry(1))))
    (tmp_path / "rank1.fr.json").write_text(json.dumps(dump(entry(2))))
    assert sorted(read_dumps(tmp_path)) == [0, 1]


def test_hostile_names_stay_on_one_line():
    rep = analyze_hang({0: dump(entry(2, "x\n\x1b[31mred")), 1: dump(entry(1))}, expected=[0, 1])
    text = render_hang(rep, now_ns=2_000_000_000)
    assert "\x1b" not in text and "(x\\n\\x1b[31mred)" in text and len(text.splitlines()) == 4


def test_probe_answers_a_fresh_request_once_and_ignores_a_stale_one(tmp_path):
    import time

    from diagnose.probes.hang import HangWatcher
    from diagnose.probes.safefs import SafeDir

    errors = []
    w = HangWatcher(SafeDir.open(tmp_path), rank=3, on_error=errors.append)
    (tmp_path / "hang.json").write_text(json.dumps({"id": "old", "time": time.time() - 3600}))
    w.poll()
    assert not list(tmp_path.glob("hang-*"))
    (tmp_path / "hang.json").write_text(json.dumps({"id": "abc", "time": time.time()}))
    w._seen = None  # the file system's mtime may not tick within one test
    w.poll()
    body = json.loads((tmp_path / "hang-abc" / "rank3.fr.json").read_text())
    # torch's recorder answers with its dump: no entries key at all when this process made no
    # process group, the earlier group's entries when another test in this worker made one
    if importlib.util.find_spec("torch") is not None:
        assert "version" in body and isinstance(body.get("entries", []), list), body
    else:
        assert "diagnose_error" in body
    dump_file = tmp_path / "hang-abc" / "rank3.fr.json"
    assert analyze_hang({3: read_dump(dump_file)}, expected=[3]).suspects == []
    assert errors == []


def test_flight_recorder_is_on_only_when_asked_and_the_jobs_own_setting_wins(tmp_path):
    from diagnose.launch import probe_env

    assert "TORCH_FR_BUFFER_SIZE" not in probe_env(tmp_path, "off", base={})
    on = probe_env(tmp_path, "off", base={}, flight_recorder=True)
    assert on["TORCH_FR_BUFFER_SIZE"] == "2000" and on["TORCH_INCLUDE_STACK_TRACE"] == "0"
    own = probe_env(tmp_path, "off", base={"TORCH_FR_BUFFER_SIZE": "64"}, flight_recorder=True)
    assert own["TORCH_FR_BUFFER_SIZE"] == "64"
