#!/bin/bash
# ncu of the GEMM (device tool): bash bench/ncu_device.sh "1 8 fast" "1 512 fast" ...
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MEGAMOE_CACHE_DIR=$PWD/.jitcache
OUT=${OUT:-/tmp}
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || ls /usr/local/cuda/bin/ncu)
i=0
for cfg in "$@"; do
  i=$((i+1))
  timeout 150 $NCU --clock-control none -k megamoe_gemm --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section LaunchStats --section Occupancy \
    python3 -m bench.profile_one $cfg > $OUT/ncu_$i.txt 2>&1
  echo "== $cfg"; grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Stall|Issued Warp|No Eligible|Active Warps|Eligible Warps|Warp Cycles Per Issued|L2 Hit|Registers|Shared Memory Config|Dynamic Shared|stalled|Elapsed Cycles|SM Frequency" $OUT/ncu_$i.txt | cut -c1-400 | head -50
done
