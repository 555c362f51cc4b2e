#!/usr/bin/env bash
# Build nanscan on the GPU machine (its own torch, no network) and run the GPU tests and the GPU
# benchmarks in one go; logs and JSON go to $OUT. Usage (device tool): bash benchmarks/gpu_check.sh
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} NANSCAN_CUDA=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  time python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
  python3 -m nanscan info
} 2>&1 | tee "$OUT/build.log"
timeout 300 python3 -m pytest -q -x tests/test_cuda.py tests/test_summarize.py tests/test_ops.py 2>&1 | tail -40 | tee "$OUT/tests.log"
timeout 240 python3 -m pytest -q benchmarks --benchmark-min-rounds=5 --benchmark-max-time=0.5 \
  --benchmark-json="$OUT/bench.json" --benchmark-columns=median,rounds 2>&1 | tee "$OUT/bench.log"
