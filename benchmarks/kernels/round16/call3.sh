#!/bin/bash
# Round 16, device call 3: the fused step persistent (programs all resident, each walking its items; no ticket)
# with score items of several blocks (one count a head per item), against the one-item-a-ticket launch.
export PYTHONPATH=. ; O=${OUT:-results/round16}; mkdir -p $O
timeout 150 python -m pytest -q -m gpu tests/gpu/test_gpu_fused_step.py -p no:cacheprovider -x > $O/pytest_fused3.txt 2>&1; tail -2 $O/pytest_fused3.txt
timeout 420 python benchmarks/kernels/bench_fused_step.py --out $O --rows 7b-32k 7b-128k 7b-32k-b8 8b-32k-max \
  --configs "" score_item=64 score_item=256 programs_per_sm=8 persistent=0 block_n=64,num_stages=2 \
  > $O/bench_fused3.txt 2>&1; grep -v Warn $O/bench_fused3.txt | grep -v _warn_once
