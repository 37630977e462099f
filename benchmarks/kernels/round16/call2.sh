#!/bin/bash
# Round 16, device call 2: the fused step with the ticket reset by the last ticket (no done count), its
# registers / shared memory, and fewer, fuller programs (score blocks of 64-128 pages, 2 pipeline stages).
export PYTHONPATH=. ; O=${OUT:-results/round16}; mkdir -p $O
timeout 420 python benchmarks/kernels/bench_fused_step.py --out $O --rows 7b-32k 7b-128k 7b-32k-b8 8b-32k-max \
  --configs score_block=64 score_block=128 score_block=64,num_stages=2 score_block=128,num_stages=2 \
  score_block=128,num_stages=2,num_warps=2 score_block=64,num_stages=2,block_n=64 > $O/bench_fused2.txt 2>&1; grep -v Warn $O/bench_fused2.txt | grep -v _warn_once
