#!/usr/bin/env bash
# The whole GPU verification in one command, for a fresh GPU machine without network:
#
#   tools/gpu_check.sh OUTDIR
#
# 1. builds the library from this checkout (CUDA on; ONNX Runtime headers from $KVCACHE_OP_ORT_INCLUDE_DIR,
#    the git-ignored folder .ort-headers/ of the checkout, or its packed form .ort-headers.tar.xz, made by
#    `tar -cJf .ort-headers.tar.xz -C .ort-headers .`) into OUTDIR/site, without network;
# 2. runs the tests that need no GPU: the CUDA host runner and the C entry points on the CPU;
# 3. runs the GPU tests (C entry point, device memory from torch or CuPy; the attention kernels too);
# 4. runs them again, fewer examples, under compute-sanitizer memcheck, racecheck, initcheck, synccheck (the
#    attention kernels' tests in a step of their own per tool: a few fast deterministic calls);
# 5. runs the CUDA benchmarks (python -m kvcache_op.benchmarks.gpu.bench, and .attention for the attention ops);
#    with the CUDA EP (6.), the exported decoder served end to end against transformers (.serving);
# 6. runs the ONNX Runtime CUDA EP tests when onnxruntime-gpu is importable, or can be installed from
#    .ort-gpu/ or $ORT_GPU_PARTS: a one-architecture bundle (tools/ort_gpu_bundle.py: SHA-256 checked, extracted),
#    or the wheel's parts (tools/wheel_parts.py: reassembled and SHA-256 checked, pip --no-deps --target; a folder
#    outside the checkout lets the parts arrive in several transfers);
# 7. writes OUTDIR/summary.md: device, pass/fail counts, sanitizer verdicts, the benchmark table, and
#    every step that was skipped, with the reason.
# Without a GPU it runs steps 1-2, says what it skipped, and exits 0 when those pass (1 where GPU_CHECK_ONLY names a
# step that needs the GPU).
# GPU_CHECK_SKIP="step step ..." skips the named steps (recorded as skipped, with that reason), GPU_CHECK_ONLY="step
# ..." runs only those (the build always runs): for a short device lease that re-checks only what changed.
# GPU_CHECK_BUILD_LIMIT=S gives the build S seconds (default 480).
# GPU_CHECK_DEADLINE=S: the whole check ends within S seconds of its start (a device lease's limit): every step's
# limit is cut to the time left less GPU_CHECK_RESERVE seconds (default 35: a step's 15 s from its limit's SIGTERM to
# a SIGKILL, and the summary), and a step that would
# get less than GPU_CHECK_MIN_STEP seconds (default 60) is recorded as skipped ("no time left") instead of starting;
# without it, each step's own limit alone. An outer `timeout` alone stops this script but not the step it runs, and
# loses the summary.
# GPU_CHECK_WORKERS=N runs the test steps that need no sanitizer in N pytest-xdist worker processes (default: 4 where
# pytest-xdist is importable and the machine has at least 8 cores, else 1: one process); the sanitizer steps always
# run in one process, under the tool. GPU_CHECK_SANITIZERS_TOGETHER=1 runs the four tools' steps side by side (each
# tool's two steps one after the other) instead of one tool after another.
# GPU_CHECK_PROFILE=1 adds steps that run the attention decode (B=64, kvlen 1024) under Nsight Compute, through
# the staged decode kernel (the default) and through the tile kernel, and the float16 prefill through both forms of
# the tensor-core kernel
# (logs/attention-ncu-CASE.log: speed of light, occupancy, memory workload, warp states, the instruction mix and
# where the kernel stalls).
# A test step passes when pytest passes and ran at least one test (every test skipped proves nothing on a GPU).
# Exit status: 0 when no step failed, none was left out for want of time, and every step GPU_CHECK_ONLY names ran.
# OUTDIR may be reused: what an earlier check wrote there (logs, tables, summary) is removed first; a folder holding
# files but no .gpu_check mark (one this check did not make) is refused, not cleaned.
set -u -o pipefail

OUT=${1:?usage: tools/gpu_check.sh OUTDIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
# What an earlier check left in OUTDIR goes first: the summary reads every report and table it finds there, and a
# step skipped or killed this time writes none, so an old one would read as this run's. Only in a folder this check
# made (its mark, .gpu_check) or an empty one: the names are common ones, and OUTDIR may be any folder.
if [ ! -e "$OUT/.gpu_check" ] && [ -n "$(ls -A "$OUT")" ]; then
  echo "OUTDIR $OUT holds files and no .gpu_check mark (this check cleans only a folder it made): name a new or" \
       "empty folder" >&2
  exit 2
fi
touch "$OUT/.gpu_check"
rm -rf "$OUT"/{logs,bench,attention-bench,serving-bench,serving-bench-float16,sampler-bench,summary.md,seconds.txt,device.txt}
mkdir -p "$OUT/logs"
STEPS=$OUT/steps.tsv   # step <TAB> status (pass|fail|skip) <TAB> detail <TAB> seconds (of the steps that ran)
# step NAME STATUS DETAIL [BEGAN]: records a step; BEGAN, the date +%s it started at, gives its seconds.
: >"$STEPS"
PY=${PYTHON:-python3}
START=$(date +%s)
DEADLINE=${GPU_CHECK_DEADLINE:-}
RESERVE=${GPU_CHECK_RESERVE:-35}
KILL_AFTER=15  # a step still running this long after its limit's SIGTERM gets SIGKILL (within the reserve)
MIN_STEP=${GPU_CHECK_MIN_STEP:-60}  # a step given less than this is not started
for setting in DEADLINE RESERVE MIN_STEP; do
  if [ -n "${!setting}" ] && ! [[ "${!setting}" =~ ^[0-9]+$ ]]; then
    echo "GPU_CHECK_$setting=${!setting}: a number of seconds was expected" >&2
    exit 2
  fi
done
# Every step name GPU_CHECK_ONLY and GPU_CHECK_SKIP may name.
KNOWN_STEPS="host-runner gpu-tests gpu-attention-tests sanitizer-memcheck sanitizer-attention-memcheck
  sanitizer-racecheck sanitizer-attention-racecheck sanitizer-initcheck sanitizer-attention-initcheck
  sanitizer-synccheck sanitizer-attention-synccheck benchmark attention-benchmark ort-cuda-ep serving-benchmark
  serving-benchmark-float16 sampler-benchmark"
for name in ${GPU_CHECK_ONLY:-} ${GPU_CHECK_SKIP:-}; do
  case " $(echo $KNOWN_STEPS) " in *" $name "*) ;; *)
    echo "GPU_CHECK_ONLY / GPU_CHECK_SKIP name $name, which is no step of this check (steps: $(echo $KNOWN_STEPS))" >&2
    exit 2 ;;
  esac
done

step() {
  local seconds=${4:+$(( $(date +%s) - $4 ))}
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$seconds" >>"$STEPS"
  printf '[gpu_check %4ss] %-30s %-5s %s\n' "$(( $(date +%s) - START ))" "$1" "$2" "$3${seconds:+ ($seconds s)}"
}

# limit_for REQUESTED: the seconds a step may take, REQUESTED cut to the time GPU_CHECK_DEADLINE leaves (less the
# reserve); prints nothing (and fails) when the time left, being less than REQUESTED, is under GPU_CHECK_MIN_STEP.
limit_for() {
  local limit=$1
  if [ -n "$DEADLINE" ]; then
    local left=$(( START + DEADLINE - RESERVE - $(date +%s) ))
    if [ "$left" -lt "$limit" ]; then
      if [ "$left" -lt "$MIN_STEP" ]; then return 1; fi
      limit=$left
    fi
  fi
  echo "$limit"
}
NO_TIME="no time left (GPU_CHECK_DEADLINE=$DEADLINE)"  # a step not started for want of time: the check fails

# ended RC LIMIT BEGAN: how a step that exited with RC ended, given its limit and the date +%s it began: "timed out
# after LIMIT s" (timeout's 124, or its SIGKILL's 137 once the limit had passed), "killed before its limit" (137
# sooner: the kernel's out-of-memory killer, say), else "exit RC".
ended() {
  if [ "$1" -eq 124 ] || { [ "$1" -eq 137 ] && [ $(( $(date +%s) - $3 )) -ge "$2" ]; }; then
    echo "timed out after $2 s"
  elif [ "$1" -eq 137 ]; then
    echo "killed before its limit (SIGKILL: out of memory?)"
  else
    echo "exit $1"
  fi
}

# OUTDIR/summary.md, with the seconds since the start in OUTDIR/seconds.txt.
summarize() { echo $(( $(date +%s) - START )) >"$OUT/seconds.txt"; "$PY" "$ROOT/tools/gpu_check_summary.py" "$OUT"; }

# True (and the step recorded as skipped) when $1 is named in $GPU_CHECK_SKIP, or $GPU_CHECK_ONLY is set and does
# not name it.
skipped() {
  case " ${GPU_CHECK_SKIP:-} " in *" $1 "*) step "$1" skip "named in GPU_CHECK_SKIP"; return 0 ;; esac
  if [ -n "${GPU_CHECK_ONLY:-}" ]; then
    case " $GPU_CHECK_ONLY " in *" $1 "*) ;; *) step "$1" skip "not named in GPU_CHECK_ONLY"; return 0 ;; esac
  fi
  return 1
}

# Runs pytest with a junit report; records pass/fail and seconds. $1 step name, $2 timeout (s), rest: pytest args
# (with XDIST=MODE in its environment: in GPU_CHECK_WORKERS pytest-xdist processes, distributed by MODE).
run_pytest() {
  local name=$1 requested=$2 limit began
  shift 2
  if skipped "$name"; then return 0; fi
  if ! limit=$(limit_for "$requested"); then step "$name" skip "$NO_TIME"; return 0; fi
  began=$(date +%s)
  local workers=($(xdist_args "${XDIST:-}"))
  (cd "$ROOT/tests" && timeout -k "$KILL_AFTER" "$limit" "${PREFIX[@]}" "$PY" -m pytest -q -rs -p no:cacheprovider \
      "${workers[@]}" --junitxml="$OUT/logs/$name.xml" "$@") >"$OUT/logs/$name.log" 2>&1
  local rc=$?
  local tail_line
  # pytest's own summary line ("3 passed, 1 skipped in 2.0s"), not a later line of the sanitizer ("ERROR SUMMARY")
  tail_line=$(grep -E '^(=+ )?([0-9]+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?)|no tests ran)' \
              "$OUT/logs/$name.log" | tail -1)
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then tail_line="$(ended $rc "$limit" "$began"); $tail_line"; fi
  if [ $rc -eq 0 ] && ! grep -qE '[0-9]+ passed' <<<"$tail_line"; then
    step "$name" fail "no test ran on the GPU: $tail_line (logs/$name.log)" "$began"
    return 1
  fi
  if [ $rc -eq 0 ]; then
    step "$name" pass "$tail_line" "$began"
  else
    step "$name" fail "exit $rc: $tail_line (logs/$name.log)" "$began"
  fi
  return $rc
}
PREFIX=()
# Worker processes for the test steps that run no sanitizer: the GPU tests are many small launches, each bound by
# its process's host work (hypothesis, numpy references), so processes side by side share one GPU well.
CORES=$("$PY" -c 'import os; print(len(os.sched_getaffinity(0)))')  # the cores this process may use
if [ -z "${GPU_CHECK_WORKERS:-}" ]; then
  GPU_CHECK_WORKERS=1
  if "$PY" -c 'import xdist' 2>/dev/null && [ "$CORES" -ge 8 ]; then GPU_CHECK_WORKERS=4; fi
elif ! [[ "$GPU_CHECK_WORKERS" =~ ^[1-9][0-9]*$ ]]; then
  echo "GPU_CHECK_WORKERS=$GPU_CHECK_WORKERS: a number of processes (1 or more) was expected" >&2
  exit 2
elif [ "$GPU_CHECK_WORKERS" -gt 1 ] && ! "$PY" -c 'import xdist' 2>/dev/null; then
  echo "GPU_CHECK_WORKERS=$GPU_CHECK_WORKERS needs pytest-xdist, which $PY cannot import (or set GPU_CHECK_WORKERS=1)" >&2
  exit 2
fi
xdist_args() {  # pytest's arguments for GPU_CHECK_WORKERS processes distributed by mode $1 (none: one process)
  if [ -n "$1" ] && [ "$GPU_CHECK_WORKERS" -gt 1 ]; then echo "-n $GPU_CHECK_WORKERS --dist $1"; fi
}

# Runs a benchmark module into OUTDIR/$3 with its log in logs/$1.log; records pass/fail. $1 step name, $2 timeout
# (s), $3 output folder, $4 the table it writes there, $5 the module (kvcache_op.benchmarks.gpu.*).
run_benchmark() {
  local name=$1 limit folder=$3 table=$4 module=$5
  local began
  if skipped "$name"; then return 0; fi
  if ! limit=$(limit_for "$2"); then step "$name" skip "$NO_TIME"; return 0; fi
  began=$(date +%s)
  # $module may carry arguments after the module name (split on spaces)
  if timeout -k "$KILL_AFTER" "$limit" "$PY" -m $module --out "$OUT/$folder" >"$OUT/logs/$name.log" 2>&1; then
    if [ -s "$OUT/$folder/$table" ]; then
      step "$name" pass "$folder/$table" "$began"
    else
      step "$name" fail "exit 0 but no $folder/$table written: see logs/$name.log" "$began"
    fi
  else
    local rc=$?
    step "$name" fail "$(ended $rc "$limit" "$began"): see logs/$name.log" "$began"
  fi
}

# 1. Build ------------------------------------------------------------------------------------------
if [ -z "${KVCACHE_OP_ORT_INCLUDE_DIR:-}" ]; then
  if [ -f "$ROOT/.ort-headers/onnxruntime_c_api.h" ]; then
    export KVCACHE_OP_ORT_INCLUDE_DIR=$ROOT/.ort-headers
  elif [ -f "$ROOT/.ort-headers.tar.xz" ]; then
    # the same headers packed (about 130 kB instead of 0.9 MB): room under a device's 64 MiB transfer limit
    rm -rf "$OUT/ort-headers"
    mkdir -p "$OUT/ort-headers"
    if ! tar -xJf "$ROOT/.ort-headers.tar.xz" -C "$OUT/ort-headers" >"$OUT/logs/ort-headers.log" 2>&1 \
       || [ ! -f "$OUT/ort-headers/onnxruntime_c_api.h" ]; then
      step build fail ".ort-headers.tar.xz does not unpack to a folder holding onnxruntime_c_api.h: see logs/ort-headers.log"
      summarize
      exit 1
    fi
    export KVCACHE_OP_ORT_INCLUDE_DIR=$OUT/ort-headers
  fi
fi
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=$PATH:/usr/local/cuda/bin KVCACHE_OP_CUDA=1
else
  export KVCACHE_OP_CUDA=0
fi
rm -rf "$OUT/site"
BUILD_BEGAN=$(date +%s)
if ! "$PY" -c 'import scikit_build_core' 2>/dev/null; then
  step build fail "scikit-build-core is not installed (pip install scikit-build-core, or carry its wheel): the offline build needs it"
  summarize
  exit 1
fi
# every core: the kernels compile in many files (CMakeLists.txt), the largest of them 68-85 s on one core of a 2-core
# machine; GPU_CHECK_BUILD_LIMIT seconds at most (default 480)
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$CORES}
if ! BUILD_LIMIT=$(limit_for "${GPU_CHECK_BUILD_LIMIT:-480}"); then
  step build fail "$NO_TIME"
  summarize
  exit 1
fi
timeout -k "$KILL_AFTER" "$BUILD_LIMIT" "$PY" -m pip install -v --no-deps --no-build-isolation --no-cache-dir \
  --target "$OUT/site" "$ROOT" >"$OUT/logs/build.log" 2>&1
BUILD_RC=$?
if [ $BUILD_RC -eq 0 ]; then
  step build pass "KVCACHE_OP_CUDA=$KVCACHE_OP_CUDA, headers: ${KVCACHE_OP_ORT_INCLUDE_DIR:-cached/fetched}" "$BUILD_BEGAN"
else
  why=$(ended $BUILD_RC "$BUILD_LIMIT" "$BUILD_BEGAN")
  if [[ $why == "timed out"* ]]; then why+=" (GPU_CHECK_BUILD_LIMIT)"; fi
  step build fail "$why: see logs/build.log" "$BUILD_BEGAN"
  summarize
  exit 1
fi
export PYTHONPATH=$OUT/site${PYTHONPATH:+:$PYTHONPATH}

# 2. No GPU needed ------------------------------------------------------------------------------------
# (one process: the host runners' summary lines, and one build of each runner)
run_pytest host-runner 300 test_cuda_host_runner.py test_attention_host_runner.py test_c_api_cpu.py

# Is there a GPU the tests can use? (the same reason the test suite prints when it skips)
# A probe that fails (the library or a test module does not import) is a failure, not a reason to skip the GPU steps.
if ! GPU_REASON=$(cd "$ROOT/tests" && "$PY" -c 'import conftest; print(conftest._gpu_unavailable_reason() or "")' \
                  2>"$OUT/logs/gpu-probe.log"); then
  step gpu-probe fail "the GPU probe failed: $(tail -1 "$OUT/logs/gpu-probe.log") (logs/gpu-probe.log)"
  GPU_REASON="the GPU probe failed (logs/gpu-probe.log)"
fi
GPU_REASON=$(tail -1 <<<"$GPU_REASON")
DEVICE=$("$PY" -c 'import torch; print(torch.cuda.get_device_name())' 2>/dev/null \
         || nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
printf '%s\n' "${DEVICE:-none}" >"$OUT/device.txt"

if [ -n "$GPU_REASON" ]; then
  for s in $KNOWN_STEPS; do  # every step but the host runner's needs the GPU
    if [ "$s" != host-runner ]; then step "$s" skip "$GPU_REASON"; fi
  done
else
  # 3. GPU tests ----------------------------------------------------------------------------------------
  XDIST=load run_pytest gpu-tests 300 test_gpu_c_entry.py test_bench_cuda_gpu.py test_gpu_torch.py
  XDIST=load run_pytest gpu-attention-tests 300 test_gpu_attention.py test_bench_attention_cuda.py

  # 4. compute-sanitizer ------------------------------------------------------------------------------
  SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  ATTENTION_SANITIZE="mha_split_decode and softcap or mhca_split_decode and bfloat16 or int4-g3-d24-page5-2"
  ATTENTION_SANITIZE+=" or int8-g8-d128-page16-3 or mha_prefill and causal-float16-24"
  ATTENTION_SANITIZE+=" or mhca_misaligned_buffers and 2-8 or invalid_mhca_call and offset_beyond_max_t or head_dim_4096"
  # the tensor-core kernel: a float16 prefill of GQA 4 (dynamic shared memory, chunks, the products), an int8 paged
  # head-major cache staged through it, and the one-by-one path of a NaN value
  ATTENTION_SANITIZE+=" or mha_prefill and causal-float16 and 128 and mma or mhca_prefill and alibi-mask2 and mma"
  ATTENTION_SANITIZE+=" or mma_non_finite and nan"  # (mma matches mma2 too: both forms)
  sanitize() {  # the two steps of one tool ($1): KeyValueCache's kernels, then the attention kernels; $2 scales the limits
    # torch's caching allocator off: each tensor its own allocation, so memcheck sees a read past its end and
    # initcheck a read of memory nothing wrote (in a cached pool block both look valid)
    # (and the tests' device buffers without their sentinel guards, KVCACHE_OP_TEST_GUARD_BYTES=0: a read of a guard
    # lies inside the allocation, which the tool cannot tell from a read of the buffer)
    PREFIX=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1 KVCACHE_OP_TEST_GUARD_BYTES=0 "$SANITIZER" --tool "$1" \
            --error-exitcode 86 --print-limit 20)
    HYPOTHESIS_PROFILE=gpu-sanitize run_pytest "sanitizer-$1" $(( 150 * $2 )) test_gpu_c_entry.py \
      -k "matches_reference or decode_and_prefill or off_a_16 or invalid_call_on_gpu and (start_pos or cachestarts)"
    # the attention kernels: a split decode with its merges (mask, ALiBi, softcap), a cache-attention split decode,
    # int4 paged with groups of 3 and int8 head-major caches, tiles of 16 query rows, misaligned buffers, invalid
    # calls (nothing launched, nothing written)
    HYPOTHESIS_PROFILE=gpu-sanitize run_pytest "sanitizer-attention-$1" $(( 120 * $2 )) test_gpu_attention.py \
      -k "$ATTENTION_SANITIZE"
    PREFIX=()
  }
  if [ -x "$SANITIZER" ]; then
    if [ "${GPU_CHECK_SANITIZERS_TOGETHER:-0}" = 1 ]; then
      # the four tools side by side, each in its own processes sharing the GPU (twice the time limits); their steps'
      # lines land in steps.tsv as they end, and a step a job never reported (the job itself killed) is a failure
      for tool in memcheck racecheck initcheck synccheck; do sanitize "$tool" 2 & done
      wait
      for tool in memcheck racecheck initcheck synccheck; do
        for name in "sanitizer-$tool" "sanitizer-attention-$tool"; do
          cut -f1 "$STEPS" | grep -qx "$name" || step "$name" fail "no verdict: its background job ended before it"
        done
      done
    else
      for tool in memcheck racecheck initcheck synccheck; do sanitize "$tool" 1; done
    fi
  else
    for tool in memcheck racecheck initcheck synccheck; do
      step "sanitizer-$tool" skip "compute-sanitizer not found"
      step "sanitizer-attention-$tool" skip "compute-sanitizer not found"
    done
  fi

  # 5. Benchmark ----------------------------------------------------------------------------------------
  run_benchmark benchmark 240 bench results.md kvcache_op.benchmarks.gpu.bench
  run_benchmark attention-benchmark 150 attention-bench results.md kvcache_op.benchmarks.gpu.attention

  if [ "${GPU_CHECK_PROFILE:-0}" = 1 ]; then
    # The benchmark's first case (the B=64 decode) through the staged decode kernel (the default), then through the
    # tile kernel, and the float16 prefill through the tensor-core kernel.
    NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    LISTED=$("$PY" -m kvcache_op.benchmarks.gpu.attention_profile --list)
    DECODE_CASE=$(grep -m1 "mhca decode .* tile kernel$" <<<"$LISTED" | cut -d: -f1)
    PREFILL_CASE=$(grep -m1 "mha prefill .* float16 packed$" <<<"$LISTED" | cut -d: -f1)
    PREFILL2_CASE=$(grep -m1 "mha prefill .* float16 packed tensor-core kernel in registers$" <<<"$LISTED" | cut -d: -f1)
    for case in 0 ${DECODE_CASE:-} ${PREFILL_CASE:-} ${PREFILL2_CASE:-}; do
      if ! NCU_LIMIT=$(limit_for 180); then step "attention-ncu-$case" skip "$NO_TIME"; continue; fi
      if [ -x "$NCU" ] && timeout -k "$KILL_AFTER" "$NCU_LIMIT" "$NCU" --clock-control none --section SpeedOfLight \
          --section Occupancy \
          --section WarpStateStats --section SchedulerStats --section InstructionStats --section SourceCounters \
          --section LaunchStats --section MemoryWorkloadAnalysis --kernel-name regex:"TileKernel|DecodeKernel|MmaKernel|MmaRegKernel" \
          --launch-skip 2 --launch-count 1 "$PY" -m kvcache_op.benchmarks.gpu.attention_profile --case "$case" \
          >"$OUT/logs/attention-ncu-$case.log" 2>&1; then
        step "attention-ncu-$case" pass "logs/attention-ncu-$case.log"
      else
        step "attention-ncu-$case" fail "ncu at $NCU: see logs/attention-ncu-$case.log"
      fi
    done
  fi

  # 6. ONNX Runtime CUDA EP -----------------------------------------------------------------------------
  # onnxruntime-gpu loads cuBLAS/cuRAND/cuDNN by soname; pip-installed CUDA libraries (nvidia-*-cu13, as
  # torch brings them) are not on the loader's path by themselves.
  NVIDIA_LIBS=$("$PY" -c 'import glob, os, site
dirs = {os.path.dirname(f) for sp in site.getsitepackages() for f in glob.glob(os.path.join(sp, "nvidia", "**", "lib*.so*"), recursive=True)}
print(":".join(sorted(dirs)))' 2>/dev/null)
  if [ -n "$NVIDIA_LIBS" ]; then export LD_LIBRARY_PATH=$NVIDIA_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi
  PARTS=${ORT_GPU_PARTS:-$ROOT/.ort-gpu}
  if [ -f "$PARTS/BUNDLE.json" ]; then  # a slim one-architecture bundle (tools/ort_gpu_bundle.py)
    if "$PY" "$ROOT/tools/ort_gpu_bundle.py" unpack "$PARTS" --out "$OUT/ort-gpu" >"$OUT/logs/ort-gpu-install.log" 2>&1; then
      export PYTHONPATH=$OUT/ort-gpu:$PYTHONPATH
    else
      step ort-gpu-install fail "see logs/ort-gpu-install.log"
    fi
  elif [ -f "$PARTS/MANIFEST.json" ]; then
    if wheel=$("$PY" "$ROOT/tools/wheel_parts.py" join "$PARTS" --out "$OUT/wheels" 2>"$OUT/logs/ort-gpu-install.log") \
       && "$PY" -m pip install -q --no-deps --no-index --target "$OUT/ort-gpu" "$wheel" >>"$OUT/logs/ort-gpu-install.log" 2>&1; then
      export PYTHONPATH=$OUT/ort-gpu:$PYTHONPATH
    else
      step ort-gpu-install fail "see logs/ort-gpu-install.log"
    fi
  fi
  if "$PY" -c 'import onnxruntime as o, sys; sys.exit("CUDAExecutionProvider" not in o.get_available_providers())' 2>/dev/null; then
    # the two files side by side, each with its session's exported models
    XDIST=loadfile run_pytest ort-cuda-ep 300 test_gpu_cuda_ep.py test_gpu_serving.py
    run_benchmark serving-benchmark 300 serving-bench README.md kvcache_op.benchmarks.gpu.serving
    run_benchmark serving-benchmark-float16 300 serving-bench-float16 README.md "kvcache_op.benchmarks.gpu.serving --dtype float16"
    run_benchmark sampler-benchmark 120 sampler-bench README.md kvcache_op.benchmarks.serving.sampler
  else
    for s in ort-cuda-ep serving-benchmark serving-benchmark-float16 sampler-benchmark; do
      step "$s" skip "onnxruntime-gpu is not importable (put its wheel's parts in .ort-gpu/ or \$ORT_GPU_PARTS: README, GPU)"
    done
  fi
fi

# A step GPU_CHECK_ONLY names that did not run (no GPU seen, no compute-sanitizer, no onnxruntime-gpu) fails the
# check: a lease's command names what it came to prove.
NOT_RUN=""
for name in ${GPU_CHECK_ONLY:-}; do
  if awk -F'\t' -v n="$name" '$1 == n && $2 == "skip" { found = 1 } END { exit !found }' "$STEPS"; then
    NOT_RUN+=" $name"
  fi
done
if [ -n "$NOT_RUN" ]; then step named-steps fail "named in GPU_CHECK_ONLY but skipped:$NOT_RUN"; fi

summarize
! grep -q -e $'\tfail\t' -e $'\tskip\t'"$NO_TIME" "$STEPS"
