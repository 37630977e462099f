#!/bin/bash
# Round 17, device call 2: the step in three launches (StepLaunch.launches=3: score items one a program ->
# Top-K one a KV head, waiting on its head's count -> attention + merge, each programmatically dependent on the
# one before), over score item sizes and warps; the one-launch step and the two-launch one beside it.
export PYTHONPATH=. ; O=${OUT:-results/round17}; mkdir -p $O
timeout 500 python benchmarks/kernels/bench_fused_step.py --out $O --rows 7b-32k 8b-32k-max 7b-32k-int8c 7b-128k 7b-32k-b8 \
  --configs "" launches=3 launches=3,score_item=32,score_block=32 launches=3,score_item=16,score_block=16 \
  launches=3,score_item=128 launches=3,num_warps=8 launches=3,num_stages=3,block_n=32 launches=2,score_programs_per_sm=8 \
  > $O/bench_fused.txt 2>&1; grep -v -i warn $O/bench_fused.txt | cut -c1-330
