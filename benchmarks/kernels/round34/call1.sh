#!/bin/bash
# Round 34, call 1 (any Hopper card): the score kernel's issue-saving options (built this round, off by default, never
# yet run on a GPU). First the GPU test files they and round 33 changed, then #16's kernel rows with int8_channel
# bounds under five score launches, one process each, same machine: the default; trunc_parts + packed_codes;
# 64 pages a program; both; both at 128 pages. Only md tables and logs come back (the device returns 8 files).
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH=. PYTHONUNBUFFERED=1; O=${OUT:-results/round34}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | tee $O/gpu.txt
timeout 240 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_score_mma.py tests/gpu/test_gpu_fused_step.py \
  > $O/gpu_tests.log 2>&1; echo "rc $?" >> $O/gpu_tests.log; tail -3 $O/gpu_tests.log
run() {  # name, then ScoreLaunch fields
  local name=$1; shift
  timeout 75 python scripts/bench_kernels.py --quick --bounds int8_channel --lengths 32768 131072 \
    ${1:+--score-launch "$@"} --name $name --out-dir $O/k > $O/$name.log 2>&1; echo "rc $?" >> $O/$name.log
  tail -1 $O/$name.log
}
run default
run opts trunc_parts=True packed_codes=True
run p64 block_p=64
run p64opts block_p=64 trunc_parts=True packed_codes=True
run p128opts block_p=128 trunc_parts=True packed_codes=True
# one table of the chained rows: name, shape, L, B, mode, score us, chain us, x SDPA
for n in default opts p64 p64opts p128opts; do
  grep -E "^\| llama" $O/k/$n.md | awk -F'|' -v n=$n '{print n, $2, $3, $4, $7, $10, $24, $26}'
done > $O/rows.txt; cat $O/rows.txt
find $O -name '*.json' -delete; rm -rf $O/k
