#!/usr/bin/env bash
# Builds the custom-op library with AddressSanitizer + UndefinedBehaviorSanitizer and runs the ONNX
# Runtime tests against that build (python itself is not instrumented: the runtimes are preloaded).
# Usage: tools/sanitize_tests.sh [pytest args...]   e.g. KVCACHE_FUZZ_EXAMPLES=10000 tools/sanitize_tests.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build/sanitize"
KVCACHE_OP_SANITIZE=1 cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build"
export KVCACHE_OP_LIBRARY="$build/libkvcache_op_ort.so"
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
# CPython's allocator is not leak-clean by ASan's standard; memory errors and UB abort the run.
# An allocation too large to satisfy returns NULL as malloc does (the tests ask for outputs of 2^49+
# bytes and expect ONNX Runtime's error, not an ASan abort).
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
cd "$root"
if [ "$#" -eq 0 ]; then
  set -- tests/test_ort_cpu_properties.py tests/test_ort_cpu_errors.py tests/test_ort_cpu_scenarios.py \
    tests/test_ort_cpu_fuzz.py tests/test_ort_cpu_aliasing.py tests/test_ort_cpu_sizes.py \
    tests/test_rotary_shift.py tests/test_rotary_errors.py tests/test_ort_rotary_fuzz.py \
    tests/test_mha_ort_cpu.py tests/test_mha_errors.py tests/test_mha_c_api.py tests/test_c_api_cpu.py \
    tests/test_cpu_kernel_rows.py \
    tests/test_empty_scale.py tests/test_aliasing_rule.py -q -p no:cacheprovider
fi
python3 -m pytest "$@"
