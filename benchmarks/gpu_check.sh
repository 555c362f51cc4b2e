#!/usr/bin/env bash
# The GPU check, on the accelerator machine (one H200, torch 2.11 / triton 3.6, no network; see
# ../shared/gpu/README.md): build nanscan against the machine's own torch; part 1 runs the GPU tests,
# the launch counts and the kernel, host-cost and monitor benchmarks; part 2 the whole test suite with
# CUDA available, then the CUDA-graph benchmark -- writing logs, JSON and markdown tables to $OUT.
#
# HOW TO RUN IT (device tool `run`, from the repository root):
#   1. command: bash benchmarks/gpu_check.sh --part 1        timeout_s: 570
#      Build, tests/test_cuda.py (its >2**31-element case included), launch counts, the step
#      profile of GPT-2-small (benchmarks/step_profile.py), kernel benchmarks, host cost on CUDA,
#      the monitor benchmarks eager / compiled, the step profile of a 1.1B Llama, results.md.
#      Fits a 520 s deadline (check here: `bash benchmarks/gpu_check.sh --part 1 --plan`).
#   2. At once, on the warm machine, with what is left of the device time (status: budget_left_s):
#      command: NANSCAN_GPU_DEADLINE=<budget_left_s - 60, at most 520> bash benchmarks/gpu_check.sh --part 2
#      timeout_s: that deadline + 40. The whole suite, file by file, 8 files at once, each test at
#      most 90 s (benchmarks/gpu_tests.py: a crashing or hung test is named and the file goes on
#      after it) after the traffic account of GPT-2-small's step (benchmarks/traffic.py) and the
#      compiled step with fused records (benchmarks/compiled_traffic.py), then the CUDA-graph
#      monitor benchmark if time is left. It rebuilds first only if
#      the machine is a fresh one. `--plan` shows the suite's schedule against the deadline.
#   3. give_back, then commit what came back under benchmarks/results/<date>-h200/ (p1/, p2/):
#      every file, plus <date>-h200.md (the tables) and the numbers in benchmarks/README.md and the
#      README's GPU rows. A failing GPU test is the finding to fix first.
#
# Every stage's time limit is the smaller of its own and what is left of the part's deadline
# (NANSCAN_GPU_DEADLINE, 520 s from the script's start); a stage with less than its minimum left is
# skipped and says so. Tests run through benchmarks/gpu_tests.py: each file in its own process, so a
# crash ends one test, never the run; its tests.md names every failed, crashed and timed-out test,
# and its deadline is the stage's. Benchmark output is tee'd as it is produced; results.md is
# written as soon as the benchmarks it tabulates end. Stages run in order of value. $OUT gets at
# most 8 files per part (the device tool's limit): part 1 check-1.log (every stage's output),
# tests.log / .md, profile.json, profile-llama.json, bench-kernels.json, bench-monitor.json,
# results.md (the tests' tests.json is removed: tests.md holds the same); part 2
# check-2.log, tests.log / .md / .json, traffic.json, compiled-fused.json, bench-cudagraphs.json,
# results.md.
#
#   bash benchmarks/gpu_check.sh --part 1|2 [--plan]      (OUT=... optional)
set -uo pipefail
cd "$(dirname "$0")/.."

PART=1
PLAN=0
while [ $# -gt 0 ]; do
  case "$1" in
    --part) PART="${2:-}"; shift 2 ;;
    --part=*) PART="${1#--part=}"; shift ;;
    --plan) PLAN=1; shift ;;
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (accepted: --part 1|2, --plan)" >&2; exit 2 ;;
  esac
done
case "$PART" in 1|2) ;; *) echo "gpu_check.sh: --part must be 1 or 2, got '$PART'" >&2; exit 2 ;; esac

DEADLINE_S=${NANSCAN_GPU_DEADLINE:-520}
START=$(date +%s)

# name | own limit (s) | minimum worth starting (s) | estimate on the H200 (s)
PART1_STAGES=(
  "build|240|60|110"
  "cuda_tests|90|30|40"
  "launch_counts|45|10|10"
  "step_profile|60|25|30"
  "bench_kernels|150|40|70"
  "host_cost|90|20|30"
  "bench_monitor|240|60|180"
  "llama_profile|90|30|40"
  "table|20|2|2"
)
# The suite's estimate is benchmarks/gpu_tests.py's plan for SUITE_JOBS processes (its ESTIMATES).
SUITE_JOBS=8
SUITE_TEST_TIMEOUT=90
suite_estimate() {
  local est; est=$(python3 -m benchmarks.gpu_tests --plan --jobs "$SUITE_JOBS" --deadline 100000 2>/dev/null \
    | sed -n 's/^estimated: \([0-9]*\) s.*/\1/p')
  echo "${est:-9999}"  # (no plan: the part cannot be shown to fit)
}
PART2_STAGES=(
  "build_if_fresh|240|60|0"
  "traffic|60|20|30"
  "compiled_fused|150|60|90"
  "suite|520|60|$(suite_estimate)"
  "bench_cudagraphs|150|40|90"
  "table|20|2|2"
)
if [ "$PART" = 1 ]; then STAGES=("${PART1_STAGES[@]}"); else STAGES=("${PART2_STAGES[@]}"); fi

field() { echo "$1" | cut -d'|' -f"$2"; }
limit_of() { for s in "${STAGES[@]}"; do [ "$(field "$s" 1)" = "$1" ] && field "$s" 2; done; }
min_of() { for s in "${STAGES[@]}"; do [ "$(field "$s" 1)" = "$1" ] && field "$s" 3; done; }

if [ "$PLAN" = 1 ]; then
  # What the part may take: each stage's limit, cut to what the deadline leaves if every stage
  # before it ran to its estimate, and the worst case (every stage to its own limit).
  printf "gpu_check.sh --part %s: deadline %d s (device command limit 600 s; run with timeout_s 570)\n" "$PART" "$DEADLINE_S"
  printf "%-20s %8s %8s %10s %14s\n" stage limit min estimate "starts by (est)"
  at=0; worst=0
  for s in "${STAGES[@]}"; do
    name=$(field "$s" 1); lim=$(field "$s" 2); min=$(field "$s" 3); est=$(field "$s" 4)
    printf "%-20s %8d %8d %10d %14d\n" "$name" "$lim" "$min" "$est" "$at"
    at=$((at + est)); worst=$((worst + lim))
  done
  printf "estimated total: %d s of %d s; every stage to its own limit: %d s, cut at the deadline to %d s\n" \
    "$at" "$DEADLINE_S" "$worst" "$(( worst < DEADLINE_S ? worst : DEADLINE_S ))"
  if [ "$at" -gt "$DEADLINE_S" ]; then echo "DOES NOT FIT: the estimates exceed the deadline"; exit 1; fi
  if [ "$DEADLINE_S" -gt 560 ]; then echo "DOES NOT FIT: the deadline leaves no slack under 600 s"; exit 1; fi
  echo "fits: the estimates end $((DEADLINE_S - at)) s before the deadline"
  exit 0
fi

OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} NANSCAN_CUDA=1
LOG="$OUT/check-$PART.log"; : > "$LOG"
BENCH_LOG="$LOG"  # (one log a part: $OUT brings back at most 8 files)
BENCH=(-p no:cacheprovider --benchmark-min-rounds=5 --benchmark-max-time=0.5 --benchmark-columns=median,rounds)
PYTEST_REPORT=(-rfE --tb=short --durations=20 -p no:cacheprovider)
t_stage=$(date +%s)

left() { echo $(( DEADLINE_S - ($(date +%s) - START) )); }
# budget NAME: the stage's time limit now (0: skip it); logs the decision
budget() {
  local lim min rest; lim=$(limit_of "$1"); min=$(min_of "$1"); rest=$(( $(left) - 5 ))
  if [ "$rest" -lt "$min" ]; then
    echo "== stage $1 SKIPPED: ${rest} s left of the deadline, it needs ${min} s" | tee -a "$LOG" >&2
    echo 0
  else
    echo $(( lim < rest ? lim : rest ))
  fi
}
done_stage() {  # done_stage NAME STATUS: log the stage's seconds and exit status
  local now; now=$(date +%s)
  echo "== stage $1: $((now - t_stage)) s, status $2, $(left) s left of the deadline" | tee -a "$LOG"
  t_stage=$now
}
# run_limited NAME CMD...: run under the stage's budget; SIGINT first (pytest then still writes its
# summary and JUnit file), SIGKILL 10 s later
run_limited() {
  local name=$1; shift
  local lim; lim=$(budget "$name")
  if [ "$lim" -le 0 ]; then return 124; fi
  timeout -s INT -k 10 "$lim" "$@"
}
built() { python3 -c 'import nanscan, sys; sys.exit(0 if "cuda" in nanscan.available_backends() else 1)' 2>/dev/null; }
build() {
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
    python3 -c 'import shutil; print("ninja:", shutil.which("ninja"))'
    run_limited "$1" python3 -m pip install -q --no-deps --no-build-isolation -e . && python3 -m nanscan info
  } 2>&1 | tee -a "$LOG"
  return "${PIPESTATUS[0]}"
}
table() {  # table OUTFILE JSON...: the ratio table of the JSONs present
  local out=$1; shift
  local jsons=(); for j in "$@"; do [ -s "$j" ] && jsons+=("$j"); done
  [ ${#jsons[@]} -eq 0 ] && { echo "no benchmark JSON to tabulate" | tee -a "$LOG"; return 0; }
  local title
  title="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null), $(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
  run_limited table python3 benchmarks/results_table.py "${jsons[@]}" --title "$title" 2>&1 | tee "$out"
}

if [ "$PART" = 1 ]; then
  build build; status=$?
  done_stage build "$status"
  if [ "$status" -ne 0 ]; then
    echo "build failed (status $status): see check-1.log; nothing else runs" | tee -a "$LOG"
    exit 1
  fi

  # The GPU-only tests first (test_cuda's >2**31-element case included; the clean read decided on
  # the device; the traffic account's launches against the profiler's), each file in its own
  # process: a crash names its test and the rest still run.
  run_limited cuda_tests python3 -m benchmarks.gpu_tests tests/test_cuda.py tests/test_clean_read.py \
    tests/test_traffic.py --jobs 1 \
    --per-test-timeout "$SUITE_TEST_TIMEOUT" --deadline "$(( $(budget cuda_tests) - 15 ))" --out "$OUT" 2>&1 | tee -a "$LOG"
  done_stage cuda_tests "${PIPESTATUS[0]}"
  rm -f "$OUT/tests.json"  # (tests.md says the same; $OUT brings back at most 8 files)

  run_limited launch_counts python3 -m benchmarks.launch_counts 2>&1 | tee -a "$LOG"  # (its table, in the log)
  done_stage launch_counts "${PIPESTATUS[0]}"

  # What a watched step asks of the device and the host (launches, memcpys, syncs, pinned
  # allocations, nanscan ops, top host ops), unwatched / sync / async / the read decided on the
  # host, and their interleaved timing, for GPT-2-small and the host-bound 200x Linear(8, 8): before
  # the benchmarks, so that a short run still says why.
  run_limited step_profile python3 -m benchmarks.step_profile --model gpt,host-bound --steps 5 --warmup 3 --rounds 8 \
    --json "$OUT/profile.json" 2>&1 | grep -v '^USDT:' | tee -a "$LOG"
  done_stage step_profile "${PIPESTATUS[0]}"

  run_limited bench_kernels python3 -m pytest -q benchmarks/bench_summarize.py "${BENCH[@]}" \
    --benchmark-json="$OUT/bench-kernels.json" 2>&1 | tee -a "$BENCH_LOG"
  done_stage bench_kernels "${PIPESTATUS[0]}"

  run_limited host_cost python3 -m benchmarks.host_cost --device cuda --steps 30 --rounds 5 2>&1 | tee -a "$LOG"
  done_stage host_cost "${PIPESTATUS[0]}"

  run_limited bench_monitor python3 -m pytest -q benchmarks/bench_monitor.py -k "not reduce-overhead" "${BENCH[@]}" \
    --benchmark-json="$OUT/bench-monitor.json" 2>&1 | tee -a "$BENCH_LOG"
  done_stage bench_monitor "${PIPESTATUS[0]}"

  # The compute-bound common case: a 1.1B Llama (TinyLlama's shape, bf16, seq 2048), eager, the
  # same variants and counts (its JSON rides in profile.json's place when the GPT one is missing).
  run_limited llama_profile python3 -m benchmarks.step_profile --model llama-1b --steps 2 --warmup 2 --rounds 5 \
    --json "$OUT/profile-llama.json" 2>&1 | grep -v '^USDT:' | tee -a "$LOG"
  done_stage llama_profile "${PIPESTATUS[0]}"

  table "$OUT/results.md" "$OUT/bench-kernels.json" "$OUT/bench-monitor.json"
  done_stage table 0
else
  if built; then
    echo "nanscan's CUDA build is here (a warm machine): no rebuild" | tee -a "$LOG"; status=0
  else
    build build_if_fresh; status=$?
  fi
  done_stage build_if_fresh "$status"
  [ "$status" -ne 0 ] && { echo "build failed (status $status): nothing else runs" | tee -a "$LOG"; exit 1; }

  # The traffic account of GPT-2-small's watched step (bf16): bytes by kind, op calls and the
  # launches they imply against the profiler's count, syncs, bytes read back, the time added.
  run_limited traffic python3 -m benchmarks.traffic --device cuda --layers 12 --d 768 --heads 12 --vocab 50257 \
    --seq 512 --batch 8 --autocast bf16 --rounds 5 --json "$OUT/traffic.json" 2>&1 | tee -a "$LOG"
  done_stage traffic "${PIPESTATUS[0]}"

  # Records fused into the compiled graph's kernels (opt-in: NANSCAN_FUSED_RECORDS=1), GPT-2-small's
  # widths at 6 layers (two compiles must fit the stage), bf16: inductor's own byte count of the
  # real Triton graphs and the record kernels, watched against unwatched, and the step timed
  # interleaved (the opaque ops' compiled step is part 1's bench_monitor).
  NANSCAN_FUSED_RECORDS=1 run_limited compiled_fused python3 -m benchmarks.compiled_traffic --device cuda --layers 6 \
    --d 768 --heads 12 --vocab 50257 --seq 512 --batch 8 --warmup 2 --rounds 10 --steps 3 \
    --json "$OUT/compiled-fused.json" 2>&1 | grep -v '^USDT:' | tee -a "$LOG"
  done_stage compiled_fused "${PIPESTATUS[0]}"

  # The whole suite with CUDA available: each file in its own process, SUITE_JOBS at once, each
  # test at most SUITE_TEST_TIMEOUT s, ended at the stage's budget (benchmarks/gpu_tests.py).
  run_limited suite python3 -m benchmarks.gpu_tests --jobs "$SUITE_JOBS" --per-test-timeout "$SUITE_TEST_TIMEOUT" \
    --deadline "$(( $(budget suite) - 15 ))" --out "$OUT" 2>&1 | tee -a "$LOG"
  done_stage suite "${PIPESTATUS[0]}"

  run_limited bench_cudagraphs python3 -m pytest -q benchmarks/bench_monitor.py -k "reduce-overhead" "${BENCH[@]}" \
    --benchmark-json="$OUT/bench-cudagraphs.json" 2>&1 | tee -a "$BENCH_LOG"
  done_stage bench_cudagraphs "${PIPESTATUS[0]}"

  table "$OUT/results.md" "$OUT/bench-cudagraphs.json"
  done_stage table 0
fi
