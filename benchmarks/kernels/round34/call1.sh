#!/bin/bash
# Round 34, call 1 (any Hopper card): the GPU test files that rounds 33 and 34 changed (the score kernel's grid and
# page-size constant, its packed_codes / trunc_parts options in the separate score and the three-launch step, and
# fused_step="auto" declining 8-bit bounds), then the score kernel under ncu (score_ncu.py). call2.sh times the options.
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH=. PYTHONUNBUFFERED=1; O=${OUT:-results/round34}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | tee $O/gpu.txt
timeout 380 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_score_mma.py tests/gpu/test_gpu_fused_step.py \
  > $O/gpu_tests.log 2>&1; echo "rc $?" >> $O/gpu_tests.log; tail -3 $O/gpu_tests.log
# Is the 8-bit score bound by issue or by DRAM? One profiled launch a row and score launch (score_ncu.py says which).
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active
M=$M,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread
timeout 150 ncu --profile-from-start off --metrics $M python benchmarks/kernels/round34/score_ncu.py > $O/score_ncu.txt 2>&1
echo "rc $?" >> $O/score_ncu.txt; grep -E "profiled|_score_pages|duration|dram__|issue_active|inst_executed|warps_active|registers" $O/score_ncu.txt | head -80
