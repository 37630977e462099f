#!/bin/bash
# Round 17, device call 6: after the Top-K wait's fix (a barrier before the count goes back to 0; call 2's hang),
# the three-launch step over score item sizes and warps beside the one-launch step, chained.
export PYTHONPATH=. ; O=${OUT:-results/round17}; mkdir -p $O
timeout 280 python benchmarks/kernels/bench_fused_step.py --out $O --rows 7b-32k 8b-32k-max 7b-32k-int8c 7b-128k \
  --configs "" launches=3 launches=3,score_item=16,score_block=16 launches=3,score_item=32,score_block=32 launches=3,num_warps=8 \
  > $O/bench_fused.txt 2>&1; grep -v -i warn $O/bench_fused.txt | cut -c1-300
