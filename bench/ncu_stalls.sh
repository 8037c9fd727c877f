#!/bin/bash
# Stall breakdown + source hot spots of one GEMM configuration or fused layer call (device tool):
# bash bench/ncu_stalls.sh "1 8 k32 ..." "fused gpt-oss 8" ... (arguments of python -m bench.profile_one).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MEGAMOE_CACHE_DIR=$PWD/.jitcache
OUT=${OUT:-/tmp}
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
i=0
for cfg in "$@"; do
  i=$((i+1))
  kernel=megamoe_gemm; [ "${cfg%% *}" = fused ] && kernel=megamoe_fused
  timeout 200 $NCU --clock-control none -k $kernel --launch-skip 1 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section ComputeWorkloadAnalysis \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,regex:sm__pipe_tensor.*cycles_active.avg.pct_of_peak_sustained_active \
    python3 -m bench.profile_one $cfg > $OUT/stall_$i.txt 2>&1
  echo "== $cfg"
  grep -E "stalled_.*ratio|pipe_tensor" $OUT/stall_$i.txt | awk '{ if ($NF+0 > 0.05) print }' | cut -c1-160
done
