#!/bin/bash
# The fused layer's robustness battery on one H200: the fuzzer's 300 cases, the long runs, every
# hang site, compute-sanitizer's tools, the bad calls. Each tool prints its own table; their logs
# go under $OUT (default /tmp/megamoe-robustness), and the last lines of each are printed at the end.
# Four parts, each sized for one device call (at most about 10 minutes):
#
#   bash bench/robustness.sh 1     # the one-rank fuzz cases beside the one-rank long run, then the
#                                  # bad calls
#   bash bench/robustness.sh 2     # alone, one after another: every hang site, the several-rank
#                                  # fuzz cases, the two-rank long run
#   bash bench/robustness.sh 3     # compute-sanitizer's memcheck, synccheck, initcheck (side by side)
#   bash bench/robustness.sh 4     # racecheck, and racecheck on the publication probe
#   bash bench/robustness.sh       # all four (SEED, CASES, CALLS change what they run)
#
# Set MEGAMOE_CACHE_DIR to a cache of built kernels (the device tool carries .jitcache) or the
# first calls build them.
#
# What has several ranks, and the hang sites, run alone: ranks on one GPU time-slice, and beside
# other processes' kernels every wait of a rank for its peer waits for a turn of all of them
# (bench/NOTES.md v23: one two-rank case took 85 s beside eight shards, 2-3 s alone); a trap takes
# seconds longer to become an error beside other processes (v26: 13.3 s alone, 19.1 s beside the
# other sites).
set -o pipefail
PART=${1:-all}
case "$PART" in
  1 | 2 | 3 | 4 | all) ;;
  *)
    echo "usage: bash bench/robustness.sh [1 | 2 | 3 | 4]   (one part, or all)" >&2
    exit 2
    ;;
esac
OUT=${OUT:-/tmp/megamoe-robustness}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SEED=${SEED:-0} CASES=${CASES:-300} CALLS=${CALLS:-10000}
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
part() { [ "$PART" = "$1" ] || [ "$PART" = all ]; }
if part 1; then
  run fuzz-r1 300 python3 -m megamoe.fuzz --device cuda --seed "$SEED" --cases "$CASES" --ranks 1 --jobs 6 &
  run long-run-r1 200 python3 -m bench.long_run --calls "$CALLS" --every 1000 &
  wait
  run bad-input 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_bad_input.py -n 3
fi
if part 2; then
  run hangs 100 python3 -m bench.hangs
  run fuzz-r24 300 python3 -m megamoe.fuzz --device cuda --seed "$SEED" --cases "$CASES" --ranks 2,4
  run long-run-r2 150 python3 -m bench.long_run --calls "$CALLS" --every 1000 --ranks 2
fi
if part 3; then
  for tool in memcheck synccheck initcheck; do
    run "sanitize-$tool" 540 python3 -m bench.sanitize --tools $tool --timeout 90 --log-dir "$OUT/sanitize" &
  done
  wait
fi
if part 4; then
  run racecheck-probe 60 python3 -m bench.sanitize --probe --timeout 25
  run racecheck 500 python3 -m bench.sanitize --tools racecheck --timeout 120
fi
for f in "$OUT"/*.log; do
  echo "== $f"
  grep -v "^\[.*\] ok  \|FutureWarning\|enable_symm_mem" "$f" | tail -25
done
