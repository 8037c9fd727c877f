#!/bin/bash
# The fused layer's robustness battery on one H200: the fuzzer's 300 cases, the long runs, every
# hang site, compute-sanitizer's tools, the bad calls. Each tool prints its own table; their logs
# go under $OUT (default /tmp/megamoe-robustness), and the last lines of each are printed at the end.
#
#   bash bench/robustness.sh 1     # part 1, about 6 minutes: the one-rank fuzz cases, the one-rank
#                                  # long run, bench.hangs, bench.sanitize (side by side)
#   bash bench/robustness.sh 2     # part 2, about 5 minutes: the several-rank fuzz cases, the
#                                  # two-rank long run, the bad calls (one after another)
#   bash bench/robustness.sh       # both (SEED, CASES, CALLS, SANITIZE_TOOLS change what they run)
#
# Set MEGAMOE_CACHE_DIR to a cache of built kernels (the device tool carries .jitcache) or the
# first calls build them.
#
# Part 1's one-rank work runs side by side (it is mostly the suite's CPU work). Part 2 runs what has
# several ranks one thing at a time: ranks on one GPU time-slice, and beside other processes'
# kernels every wait of a rank for its peer waits for a turn of all of them (bench/NOTES.md v23:
# one two-rank case took 85 s beside eight shards, 2-3 s alone).
set -o pipefail
PART=${1:-all}
case "$PART" in
  1 | 2 | all) ;;
  *)
    echo "usage: bash bench/robustness.sh [1 | 2]   (part 1, part 2, or both)" >&2
    exit 2
    ;;
esac
OUT=${OUT:-/tmp/megamoe-robustness}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SEED=${SEED:-0} CASES=${CASES:-300} CALLS=${CALLS:-10000}
SANITIZE_TOOLS=${SANITIZE_TOOLS:-memcheck,racecheck,synccheck,initcheck}
python3 -c "import megamoe.reference" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
T0=$(date +%s)
say() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/times.log"; }
run() { # name, timeout (s), command...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "exit $?" >>"$OUT/$name.log"
  say "$name done"
}

say "start (part $PART)"
if [ "$PART" = 1 ] || [ "$PART" = all ]; then
  run fuzz-r1 300 python3 -m megamoe.fuzz --device cuda --seed "$SEED" --cases "$CASES" --ranks 1 --jobs 6 &
  (
    run hangs 120 python3 -m bench.hangs
    run sanitize 330 python3 -m bench.sanitize --tools "$SANITIZE_TOOLS" --timeout 60 --log-dir "$OUT/sanitize"
  ) &
  run long-run-r1 200 python3 -m bench.long_run --calls "$CALLS" --every 1000 &
  wait
fi
if [ "$PART" = 2 ] || [ "$PART" = all ]; then
  run fuzz-r24 300 python3 -m megamoe.fuzz --device cuda --seed "$SEED" --cases "$CASES" --ranks 2,4
  run long-run-r2 200 python3 -m bench.long_run --calls "$CALLS" --every 1000 --ranks 2
  run bad-input 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_bad_input.py
fi
for f in "$OUT"/*.log; do
  echo "== $f"
  grep -v "^\[.*\] ok  \|FutureWarning\|enable_symm_mem" "$f" | tail -25
done
