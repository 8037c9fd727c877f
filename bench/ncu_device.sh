#!/bin/bash
# ncu of the GEMM or the fused layer (device tool): bash bench/ncu_device.sh "LAYER TOKENS PROMOTION [SHAPE [MAX_TILE [WGS]]]"
# or "fused SHAPE TOKENS [PROMOTION [ENGINE]]" ...
# (arguments of python -m bench.profile_one); reports under $OUT, a digest on stdout.
export PYTHONUNBUFFERED=1 MEGAMOE_CACHE_DIR=$PWD/.jitcache
OUT=${OUT:-/tmp}
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || ls /usr/local/cuda/bin/ncu)
i=0
for cfg in "$@"; do
  i=$((i+1))
  kernel=megamoe_gemm; [ "${cfg%% *}" = fused ] && kernel=megamoe_fused
  timeout 150 $NCU --clock-control none -k $kernel --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section LaunchStats \
    --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum.per_second,smsp__inst_executed.sum \
    python3 -m bench.profile_one $cfg > $OUT/ncu_$i.txt 2>&1
  echo "== $cfg"; grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Issued Warp|No Eligible|Active Warps|Eligible Warps|Warp Cycles Per Issued|L2 Hit|Stall|gmma_cycles|lts__t_bytes|inst_executed|SM Frequency|Executed Ipc" $OUT/ncu_$i.txt | cut -c1-200 | head -40
done
