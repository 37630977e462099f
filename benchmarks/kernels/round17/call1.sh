#!/bin/bash
# Round 17, device call 1: the pipelined step (StepLaunch.pipelined: scoring + Top-K in one launch, attention +
# merge in a second, programmatically dependent one). The reference floor probe, the fused-step GPU tests (both
# modes), then the chained step against the separate kernels, the one-launch step and SDPA.
export PYTHONPATH=. ; O=${OUT:-results/round17}; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $O/gpu.txt 2>&1
# reference floor probe in the same call (an untracked copy of ../shared/probes/floor_check.py at the repo root).
[ -f floor_check_tmp.py ] && timeout 60 python floor_check_tmp.py 32768 > $O/floor_32k.txt 2>&1; tail -4 $O/floor_32k.txt
timeout 240 python -m pytest -q -m gpu tests/gpu/test_gpu_fused_step.py -p no:cacheprovider -x > $O/pytest_fused.txt 2>&1; tail -3 $O/pytest_fused.txt
timeout 420 python benchmarks/kernels/bench_fused_step.py --out $O --rows 7b-32k 8b-32k-max 7b-128k 7b-32k-b8 7b-32k-int8c \
  --configs "" pipelined=1 pipelined=1,score_programs_per_sm=2 pipelined=1,score_programs_per_sm=8 \
  pipelined=1,score_item=32,score_block=32 pipelined=1,score_item=128 pipelined=1,num_warps=8 \
  > $O/bench_fused.txt 2>&1; grep -v -i warn $O/bench_fused.txt | cut -c1-400
