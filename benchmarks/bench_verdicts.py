"""How often does the tool name the right cause on real jobs? Runs the examples' straggler
preset (the demo: rank 1 sleeps 150 ms before each backward) and the healthy job N times each,
and prints the counts: the straggler runs that name rank 1 first, and the healthy runs that flag
a straggler or anything else.

    python benchmarks/bench_verdicts.py --repeat 10

Each run is a real 2-rank torchrun job under `diagnose run` (about 15 s here). Nothing else should
run meanwhile: on a small host the ranks' speed is the host's.
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


def one(pathology: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "diagnose.cli", "run", "--out", tmp, "--schedule", "2,2,5", "--",
               sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_port()}",
               str(EXAMPLE), "--pathology", pathology]
        subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        found = sorted(Path(tmp).glob("*/diagnosis.json"))
        return json.loads(found[-1].read_text()) if found else {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--healthy-only", action="store_true", help="run the healthy job alone")
    a = ap.parse_args()
    named = Counter()
    healthy = Counter()
    for i in range(a.repeat):
        d = {} if a.healthy_only else one("straggler")
        top = (d.get("findings") or [{}])[0]
        if not a.healthy_only:
            named["rank 1 first" if top.get("id") == "straggler" and top.get("ranks") == [1] else
                  f"other: {top.get('id')} {top.get('ranks')}"] += 1
        d = one("none")
        ids = [f["id"] for f in d.get("findings") or []]
        healthy["clean" if not ids else "straggler only" if set(ids) == {"straggler"} else
                "other: " + ",".join(ids)] += 1
        said = "" if a.healthy_only else f"straggler preset -> {top.get('id')} {top.get('ranks')}; "
        print(f"run {i + 1}: {said}healthy -> {ids or 'clean'}", flush=True)
        for f in d.get("findings") or []:  # what a false flag said: enough to tell the host from the tool
            print(f"  healthy run flagged {f['id']} {f.get('ranks')}: {f.get('recoverable_ms')} ms, "
                  f"{f.get('share_of_step', 0):.1%}; {f.get('metrics', {}).get('late_from', '')}", flush=True)
    if not a.healthy_only:
        print(f"straggler preset ({a.repeat} runs): {dict(named)}")
    print(f"healthy job ({a.repeat} runs): {dict(healthy)}")


if __name__ == "__main__":
    main()
