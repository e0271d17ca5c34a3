#!/usr/bin/env bash
# Prepared device check (run with the `device` tool when a task is lent a GPU; never in CI).
# Records real CUDA/NCCL traces through the probes on one GPU and checks their CUDA paths:
#   1. a plain single-process run (CUDA kernels, no collectives)
#   2. a 1-rank torchrun DDP job on NCCL (ncclDevKernel_* kernels, DDP bucket timed by CUDA events)
# then diagnoses both. Outputs land in $OUT (traces, diagnosis.json, a summary).
# The device image has torch but not orjson/plotly: carry their wheels in .whl/ (see the device
# README) and name .whl in `carry`.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.nccl.version())" | tee -a "$OUT/gpu.txt"
python3 -m diagnose.cli run --out "$OUT/single" -- python3 examples/train_ddp.py --steps 14 2>&1 | tail -20 | tee "$OUT/single.txt"
python3 -m diagnose.cli run --out "$OUT/ddp" -- python3 -m torch.distributed.run --nproc_per_node=1 \
  examples/train_ddp.py --steps 14 2>&1 | tail -20 | tee "$OUT/ddp.txt"
python3 - "$OUT" <<'PY' | tee "$OUT/checks.txt"
import gzip, json, sys
from pathlib import Path
out = Path(sys.argv[1])
for run in ("single", "ddp"):
    t = out / run / "traces"
    traces = sorted(t.glob("rank*.pt.trace.json.gz"))
    ev = json.load(gzip.open(traces[0]))["traceEvents"] if traces else []
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    nccl = [e for e in kernels if "nccl" in e.get("name", "").lower()]
    side = json.loads((t / "rank0.probe.json").read_text())
    steps = [json.loads(l) for l in (t / "rank0.steps.jsonl").read_text().splitlines()]
    colls = [c for s in steps for c in s["collectives"]]
    d = json.loads((out / run / "diagnosis.json").read_text())
    print(run, {"traces": len(traces), "kernels": len(kernels), "nccl_kernels": len(nccl),
                "device": side["meta"].get("device_name"), "nccl": side["meta"].get("nccl"),
                "disabled_parts": side["disabled_parts"], "collectives_timed": len(colls),
                "collective_ms_positive": all(c[2] > 0 for c in colls), "run_device": d["run"]["device"],
                "top": d["findings"][0]["id"] if d["findings"] else None})
PY
