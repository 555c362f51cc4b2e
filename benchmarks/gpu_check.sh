#!/usr/bin/env bash
# The GPU check (issue 6), in one call on the accelerator machine: build nanscan against the machine's
# own torch (no network), run the GPU tests, the benchmarks and the launch counts, and write logs,
# JSON and a markdown ratio table to $OUT. Usage: bash benchmarks/gpu_check.sh   (OUT=... optional)
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} NANSCAN_CUDA=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  time python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
  python3 -m nanscan info
} 2>&1 | tee "$OUT/build.log"
# GPU tests first (fast, most telling), then every backend vs reference on CUDA tensors.
timeout 300 python3 -m pytest -q -x tests/test_cuda.py tests/test_summarize.py tests/test_ops.py -p no:cacheprovider \
  2>&1 | tail -60 | tee "$OUT/tests.log"
timeout 60 python3 -m benchmarks.launch_counts --json "$OUT/launches.json" 2>&1 | tee "$OUT/launches.log"
timeout 240 python3 -m pytest -q benchmarks -p no:cacheprovider --benchmark-min-rounds=5 --benchmark-max-time=0.5 \
  --benchmark-json="$OUT/bench.json" --benchmark-columns=median,rounds 2>&1 | tee "$OUT/bench.log"
title="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader), $(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
python3 benchmarks/results_table.py "$OUT/bench.json" --title "$title" | tee "$OUT/results.md"
