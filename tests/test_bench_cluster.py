"""benchmarks/bench_cluster.py, #20's measurement, runs in each of its modes (at 4 and 8 ranks:
what it prints is checked for shape, not for speed). Its `--phases` mode once failed on a name
it no longer imported and nothing noticed."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cluster.py"
pytest.importorskip("distributed")


def _bench(*args: str) -> str:
    res = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=600,
                         check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_the_table_the_growth_per_rank_and_the_64_worker_estimate():
    out = _bench("--ranks", "4,8", "--paths", "local,cluster")
    assert not re.search(r"^\d+ ranks: (local|cluster) \{'error'", out, re.M), out
    rows = [line for line in out.splitlines() if re.match(r"\| (4|8) \|", line)]
    assert len(rows) == 2 and all(" KiB |" in r for r in rows), out  # bytes back per rank, from the cluster
    assert re.search(r"client peak from 4 to 8 ranks: single [+-]\d", out), out
    # the per-rank growth against the rank's file and its summary as it travels
    assert re.search(r"per added rank the single client's peak grew -?\d+\.\d KB: -?\d+\.\d+% of the rank's "
                     r"file \(\d+\.\d MB\), -?\d+\.\d% of its summary as it travels \(\d+ KiB\)", out), out
    assert "8 ranks on 64 workers" in out, out


@pytest.mark.parametrize("mode", ["--phases", "--resident"])
def test_the_memory_by_phase(mode):
    out = _bench(mode, "8")
    for phase in ("load_files", "match_collectives", "build_graph", "check straggler", "annotate",
                  "_timeline_extra", "end"):
        assert re.search(rf"^  {re.escape(phase)} +-?\d+\.\d +-?\d+\.\d", out, re.M), (phase, out)


def test_what_is_held_at_two_rank_counts():
    out = _bench("--held", "2,4")
    assert re.search(r"held when the replays start: \d+\.\d\d MB at 2 ranks, \d+\.\d\d at 4", out), out
    sizes = re.search(r"the answer itself .*: (\d+\.\d\d) MB at 2 ranks, (\d+\.\d\d) at 4", out)
    assert sizes and 0 < float(sizes[1]) <= float(sizes[2]), out
    assert re.search(r"^  +[+-]\d+\.\d KB +[+-]\d+ blocks  \S+\.py:\d+", out, re.M), out
