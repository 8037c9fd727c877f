#!/bin/bash
# One device call: GPU tests of the GEMM core, then the benchmark table. Logs under $OUT.
# Usage (device tool): bash bench/run_device.sh [pytest args...]
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MEGAMOE_CACHE_DIR=$PWD/.jitcache
export MEGAMOE_TEST_LOG=${OUT:-/tmp}/results.jsonl
OUT=${OUT:-/tmp}
# An uninstalled checkout (the device machine's copy) lacks the package-dir mapping of pyproject:
# link megamoe.reference / .conformance / .kernel to their folders when the import fails.
python3 -c "import megamoe.reference, megamoe.conformance, megamoe.kernel" 2>/dev/null ||
  for m in reference conformance kernel; do [ -e megamoe/$m ] || ln -s ../$m megamoe/$m; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/gpu.txt
ls .jitcache | wc -l
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -s -q -p no:cacheprovider tests/gpu/test_gemm.py tests/gpu/test_gemm_layout.py "$@" 2>&1 | tee $OUT/tests.log | grep -v "^done"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout ${BENCH_TIMEOUT:-240} python3 -m bench.gemm --json $OUT/bench.json ${BENCH_ARGS:-} 2>&1 | tee $OUT/bench.log
fi
