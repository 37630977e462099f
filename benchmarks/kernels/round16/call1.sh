#!/bin/bash
# Round 16, device call 1: the one-launch Quest step (triton_kernels/fused_step.py): its GPU tests, then the
# chained step against the separate kernels and SDPA over a few StepLaunch settings.
export PYTHONPATH=. ; O=${OUT:-results/round16}; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $O/gpu.txt 2>&1
timeout 200 python -m pytest -q -m gpu tests/gpu/test_gpu_fused_step.py -p no:cacheprovider -x > $O/pytest_fused.txt 2>&1; tail -3 $O/pytest_fused.txt
timeout 360 python benchmarks/kernels/bench_fused_step.py --out $O --rows 7b-32k 8b-32k-max 7b-128k 7b-32k-b8 7b-32k-int8c 7b-32k-alloc \
  --configs "" num_warps=8 score_block=64 num_warps=2 programs_per_sm=8 > $O/bench_fused.txt 2>&1; tail -40 $O/bench_fused.txt
