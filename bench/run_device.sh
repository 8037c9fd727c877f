#!/bin/bash
# One device call: GPU tests of the GEMM core, then the benchmark table. Logs under $OUT.
# Usage (device tool): bash bench/run_device.sh            (TESTS, BENCH_ARGS, SKIP_TESTS=1, SKIP_BENCH=1)
# Cubins come from .jitcache (carry it: `MEGAMOE_CACHE_DIR=$PWD/.jitcache pytest tests/test_compile_gate.py`
# builds every used specialisation on a CPU machine).
set -o pipefail
OUT=${OUT:-/tmp}
export PYTHONUNBUFFERED=1 MEGAMOE_CACHE_DIR=$PWD/.jitcache MEGAMOE_TEST_LOG=$OUT/results.jsonl
# The device machine's copy is not installed: install it editable, offline (its dependencies are
# there), so that megamoe.reference / .conformance / .kernel map to their folders as in pyproject.
python3 -c "import megamoe.reference, megamoe.conformance, megamoe.kernel" 2>/dev/null ||
  python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/gpu.txt
echo "cubins carried: $(ls .jitcache/*.cubin 2>/dev/null | wc -l)"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rfEx -p no:cacheprovider ${TESTS:-tests/gpu} 2>&1 |
    tee $OUT/tests.log | grep -v "^RESULT" | tail -${TEST_TAIL:-40}
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout ${BENCH_TIMEOUT:-240} python3 -m bench.gemm --json $OUT/bench.json ${BENCH_ARGS:-} 2>&1 |
    tee $OUT/bench.log | grep -v "^done"
fi
