#!/usr/bin/env bash
# The GPU check (issues 12, 13), in one call on the accelerator machine: build nanscan against the
# machine's own torch (no network), run the GPU tests, the launch counts, the benchmarks and the
# monitor's host cost, and write logs, JSON and a markdown ratio table to $OUT (8 files: the most
# the device tool brings back). Stops at a failed build. Slow tests (2**31 elements) run only with
# GPU_CHECK_SLOW=1. Each stage prints its time; estimated on an H200 (16 cores): build ~2 min (sm_90
# only), tests ~1 min, launch counts ~10 s, benchmarks ~3 min, host cost ~30 s: ~7 min in all.
#   bash benchmarks/gpu_check.sh            (OUT=... optional; GPU_CHECK_SLOW=1 for the slow tests)
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} NANSCAN_CUDA=1
STAGES="$OUT/stages.log"; : > "$STAGES"
t0=$(date +%s)
stage() {  # stage NAME: print and log the seconds since the last stage
  local now; now=$(date +%s)
  echo "stage $1: $((now - t0)) s" | tee -a "$STAGES"
  t0=$now
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  python3 -m pip install -q --no-deps --no-build-isolation -e . && python3 -m nanscan info
} 2>&1 | tee "$OUT/build.log"
build_status=${PIPESTATUS[0]}
stage build
if [ "$build_status" -ne 0 ]; then
  echo "build failed (status $build_status): see build.log; nothing else runs" | tee -a "$STAGES"
  exit 1
fi

MARK=(-m "not slow"); [ "${GPU_CHECK_SLOW:-0}" = 1 ] && MARK=()
# GPU tests first (fast, most telling), then every backend vs reference on CUDA tensors.
timeout 300 python3 -m pytest -q tests/test_cuda.py tests/test_summarize.py tests/test_ops.py "${MARK[@]}" \
  -p no:cacheprovider 2>&1 | tail -80 | tee "$OUT/tests.log"
stage tests

timeout 60 python3 -m benchmarks.launch_counts --json "$OUT/launches.json" 2>&1 | tail -40
stage launch_counts

timeout 300 python3 -m pytest -q benchmarks -p no:cacheprovider --benchmark-min-rounds=5 --benchmark-max-time=0.5 \
  --benchmark-json="$OUT/bench.json" --benchmark-columns=median,rounds 2>&1 | tee "$OUT/bench.log"
stage benchmarks

timeout 120 python3 -m benchmarks.host_cost --device cuda --steps 30 --rounds 5 2>&1 | tee "$OUT/host_cost.log"
stage host_cost

title="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader), $(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
python3 benchmarks/results_table.py "$OUT/bench.json" --title "$title" | tee "$OUT/results.md"
stage table
