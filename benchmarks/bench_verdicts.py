"""How often does the tool name the right cause on real jobs? Runs the examples' straggler
preset (the demo: rank 1 sleeps 150 ms before each backward) and the healthy job N times each,
and prints the counts: the straggler runs that name rank 1 first, and the healthy runs that flag
a straggler or anything else.

    python benchmarks/bench_verdicts.py --repeat 10
    python benchmarks/bench_verdicts.py --repeat 5 --nproc 8 --late-group   # a slow host's ranks

Each run is a real 2-rank torchrun job under `diagnose run` (about 15 s here; 8 ranks about 30 s).
With --late-group the faulty job is the last three ranks sleeping 300 ms a step together (as a
slow host's ranks would be late), and the right answer is those three named together. Nothing
else should run meanwhile: on a small host the ranks' speed is the host's.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_ddp.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one(pathology: str, nproc: int = 2, extra: tuple[str, ...] = ()) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "diagnose.cli", "run", "--out", tmp, "--schedule", "2,2,5", "--",
               sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={_port()}",
               str(EXAMPLE), "--pathology", pathology, *extra]
        subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        found = sorted(Path(tmp).glob("*/diagnosis.json"))
        return json.loads(found[-1].read_text()) if found else {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--healthy-only", action="store_true", help="run the healthy job alone")
    ap.add_argument("--nproc", type=int, default=2, help="ranks per job")
    ap.add_argument("--late-group", action="store_true",
                    help="the faulty job: the last three ranks sleep 300 ms a step together")
    a = ap.parse_args()
    group = list(range(a.nproc - 3, a.nproc)) if a.late_group else [1]
    if a.late_group and a.nproc < 7:
        ap.error("--late-group needs --nproc 7 or more (three late ranks, fewer than half)")
    faulty = (("none", ("--straggler-ranks", ",".join(map(str, group)), "--straggler-ms", "300")) if a.late_group
              else ("straggler", ()))
    want = f"ranks {group} first"
    named = Counter()
    healthy = Counter()
    for i in range(a.repeat):
        d = {} if a.healthy_only else one(faulty[0], a.nproc, faulty[1])
        top = (d.get("findings") or [{}])[0]
        if not a.healthy_only:
            named[want if top.get("id") == "straggler" and sorted(top.get("ranks") or []) == group else
                  f"other: {top.get('id')} {top.get('ranks')}"] += 1
        d = one("none", a.nproc)
        ids = [f["id"] for f in d.get("findings") or []]
        healthy["clean" if not ids else "straggler only" if set(ids) == {"straggler"} else
                "other: " + ",".join(ids)] += 1
        said = "" if a.healthy_only else f"faulty job -> {top.get('id')} {top.get('ranks')}; "
        print(f"run {i + 1}: {said}healthy -> {ids or 'clean'}", flush=True)
        for f in d.get("findings") or []:  # what a false flag said: enough to tell the host from the tool
            print(f"  healthy run flagged {f['id']} {f.get('ranks')}: {f.get('recoverable_ms')} ms, "
                  f"{f.get('share_of_step', 0):.1%}; {f.get('metrics', {}).get('late_from', '')}", flush=True)
    if not a.healthy_only:
        print(f"{'late group' if a.late_group else 'straggler preset'} ({a.repeat} runs, {a.nproc} ranks): "
              f"{dict(named)}")
    print(f"healthy job ({a.repeat} runs, {a.nproc} ranks): {dict(healthy)}")


if __name__ == "__main__":
    main()
