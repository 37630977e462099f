#!/bin/bash
# Round 16, device call 4: the fused step's new defaults (call 2's fastest), and its registers capped (maxnreg) so
# that more programs fit an SM.
export PYTHONPATH=. ; O=${OUT:-results/round16}; mkdir -p $O
timeout 400 python benchmarks/kernels/bench_fused_step.py --out $O --rows 7b-32k 7b-128k 7b-32k-b8 8b-32k-max 7b-32k-int8c \
  --configs "" maxnreg=64 maxnreg=80 maxnreg=96 maxnreg=64,num_warps=2 maxnreg=72,score_block=32,score_item=64 \
  > $O/bench_fused4.txt 2>&1; grep -v Warn $O/bench_fused4.txt | grep -v _warn_once
