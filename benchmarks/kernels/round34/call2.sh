#!/bin/bash
# Round 34, call 2 (any Hopper card; after call1.sh's tests pass): #16's kernel rows, key-dtype and int8_channel
# bounds, under five score launches, one process each, same machine: the default; trunc_parts + packed_codes +
# packed_bounds; 64 pages a program; both; both at 128 pages. Then the three-launch step with the word paths. Only
# logs and one table come back (the device returns 8 files).
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH=. PYTHONUNBUFFERED=1; O=${OUT:-results/round34}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | tee $O/gpu2.txt
run() {  # name, then ScoreLaunch fields
  local name=$1; shift
  timeout 85 python scripts/bench_kernels.py --quick --bounds key_dtype int8_channel --lengths 32768 131072 \
    ${1:+--score-launch "$@"} --name $name --out-dir $O/k > $O/$name.log 2>&1; echo "rc $?" >> $O/$name.log
  tail -1 $O/$name.log
}
run default
run opts trunc_parts=True packed_codes=True packed_bounds=True
run p64 block_p=64
run p64opts block_p=64 trunc_parts=True packed_codes=True packed_bounds=True
run p128opts block_p=128 trunc_parts=True packed_codes=True packed_bounds=True
# the three-launch step (what fused_step runs at MHA batch 1) with the word paths in its scoring launch
timeout 120 python benchmarks/kernels/bench_fused_step.py --rows 7b-32k 7b-32k-int8c 7b-128k 7b-128k-int8c \
  --configs launches=3,score_programs=4 launches=3,score_programs=4,packed_codes=True,packed_bounds=True \
  --out $O/k/fstep \
  > $O/fused_opts.log 2>&1; echo "rc $?" >> $O/fused_opts.log; grep -v -i warn $O/fused_opts.log | tail -8
# one table of the chained rows: name, shape, L, B, mode, bounds, score us, chain us, x SDPA
for n in default opts p64 p64opts p128opts; do
  grep -E "^\| llama" $O/k/$n.md | awk -F'|' -v n=$n '{print n, $2, $3, $4, $7, $8, $10, $24, $26}'
done > $O/rows.txt; cat $O/rows.txt
find $O -name '*.json' -delete; rm -rf $O/k
