#!/usr/bin/env bash
# The prepared device run (with the `device` tool when a task is lent a GPU; never in CI). One
# command, three parts side by side on the machine's cores:
#   1. GPU (cores 0-5): examples/gpu_idle.py under `diagnose run` once per injected idle cause
#      (the labelled fixtures tests/fixtures/gpu_h200: RECORD picks others), the DataLoader
#      cause's num_workers=4 twin, and a 1-rank torchrun DDP job on NCCL (DDP=0: not); every run
#      samples telemetry (NVML) every 0.5 s. Traces, sidecars, step logs, telemetry and
#      diagnosis.json come back in fixtures.tar.gz.
#   2. benchmarks/bench_whatif.py --repeats 3 on the CPU (cores 6-10, gloo): a quiet host with
#      more cores than the 2-core development VM.
#   3. benchmarks/bench_verdicts.py --repeat 10 on the CPU (cores 11-15). BENCH=0: neither;
#      BENCH=whatif: the what-if cases split over both core sets (two cases each), no verdicts.
# 2026-12-04: parts 1 took 2.5 min, 2 and 3 were cut at their 300 s (README: what-if table).
# Second lease the same day: BENCH=whatif with five recordings and DDP took 234 s in all.
# Needs: the device image's torch; orjson, msgspec and plotly as wheels in .whl/ (name .whl in
# `carry`):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl orjson msgspec plotly
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
W=/tmp/gpu-work
mkdir -p "$OUT" "$W/fixtures"
export PYTHONUNBUFFERED=1 DIAGNOSE_TELEMETRY_S=0.5
export OUT W RECORD DDP
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  {
    python3 -m pip install -q --no-index --no-deps .whl/*.whl &&
    { python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . ||
      python3 -m pip install -q --no-index --no-deps --no-build-isolation .; }
  } >"$OUT/install.log" 2>&1 || { echo "install failed"; tail -20 "$OUT/install.log"; exit 3; }
fi
nproc; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.nccl.version())" | tee -a "$OUT/gpu.txt"

record() {  # NAME SCHEDULE ARGS...: one run under the probes, kept as fixture gpu_NAME
  local name=$1 schedule=$2; shift 2
  local t0=$SECONDS
  timeout 150 python3 -m diagnose.cli run --out "$W/runs/$name" --schedule "$schedule" -- "$@" >"$W/$name.txt" 2>&1
  local rc=$?
  local run; run=$(ls -d "$W/runs/$name"/*/ 2>/dev/null | head -1)
  echo "$name rc=$rc $((SECONDS - t0)) s run=$run"
  if [ -n "$run" ]; then
    mkdir -p "$W/fixtures/gpu_$name"
    cp -r "$run/traces" "$W/fixtures/gpu_$name/" 2>/dev/null
    cp "$run/diagnosis.json" "$W/fixtures/gpu_$name/" 2>/dev/null
    grep -v '^\s*$' "$W/$name.txt" | tail -40 >"$W/fixtures/gpu_$name/run.txt"
  fi
}

gpu_part() {  # RECORD: the recordings to make, NAME=ARGS;... (default: every labelled fixture)
  local default="none=--cause none;tiny-kernels=--cause tiny-kernels;pageable-copy=--cause pageable-copy"
  default+=";pinned-copy=--cause pinned-copy;item-sync=--cause item-sync;stream-wait=--cause stream-wait"
  default+=";cuda-graph=--cause cuda-graph;host-stall=--cause host-stall"
  default+=";dataloader=--cause dataloader --steps 30;dataloader_nw4=--cause dataloader --steps 30 --num-workers 4"
  local item name rest schedule
  IFS=';' read -ra items <<<"${RECORD:-$default}"
  for item in "${items[@]}"; do
    name=${item%%=*} rest=${item#*=} schedule=2,2,5
    if [[ $rest == schedule:* ]]; then  # NAME=schedule:W,U,A ARGS: another profiler window
      schedule=${rest%% *} rest=${rest#* }
      schedule=${schedule#schedule:}
    fi
    # shellcheck disable=SC2086
    record "$name" "$schedule" python3 examples/gpu_idle.py $rest
  done
  if [ "${DDP:-1}" = 1 ]; then
    record ddp_nccl 2,2,5 python3 -m torch.distributed.run --nproc_per_node=1 examples/train_ddp.py --steps 14
  fi
  tar -C "$W/fixtures" -czf "$OUT/fixtures.tar.gz" .
  ls -la "$OUT"
}

export -f record gpu_part
if [ "${BENCH:-1}" = 1 ]; then
(CUDA_VISIBLE_DEVICES= taskset -c 6-10 timeout 300 python3 benchmarks/bench_whatif.py --repeats 3 >"$OUT/whatif.txt" 2>&1; echo "whatif rc=$?" >>"$OUT/whatif.txt") &
(CUDA_VISIBLE_DEVICES= taskset -c 11-15 timeout 300 python3 benchmarks/bench_verdicts.py --repeat 10 >"$OUT/verdicts.txt" 2>&1; echo "verdicts rc=$?" >>"$OUT/verdicts.txt") &
elif [ "${BENCH:-1}" = whatif ]; then  # the what-if cases split over both core sets, no verdicts
(CUDA_VISIBLE_DEVICES= taskset -c 6-10 timeout 300 python3 benchmarks/bench_whatif.py --repeats 3 --cases straggler,combined >"$OUT/whatif.txt" 2>&1; echo "whatif rc=$?" >>"$OUT/whatif.txt") &
(CUDA_VISIBLE_DEVICES= taskset -c 11-15 timeout 300 python3 benchmarks/bench_whatif.py --repeats 3 --cases dataloader_starvation,exposed_communication >"$OUT/whatif2.txt" 2>&1; echo "whatif rc=$?" >>"$OUT/whatif2.txt") &
fi
taskset -c 0-5 bash -c gpu_part 2>&1 | tee "$OUT/record.log"
wait
tail -n 12 "$OUT/whatif.txt" "$OUT/whatif2.txt" "$OUT/verdicts.txt" 2>/dev/null || true  # absent with BENCH=0
