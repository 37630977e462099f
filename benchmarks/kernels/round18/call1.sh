#!/bin/bash
# Round 18, device call 1: the fused-step GPU tests on the tree (the review refactor f3d9f6e and the resident
# scoring grid), the reference floor probe, then the three-launch step with a resident, head-ordered scoring grid
# (StepLaunch.score_programs) against one item a program, chained.
export PYTHONPATH=. ; O=${OUT:-results/round18}; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $O/gpu.txt 2>&1
timeout 240 python -m pytest -q -m gpu tests/gpu/test_gpu_fused_step.py -p no:cacheprovider > $O/pytest_fused.txt 2>&1
tail -3 $O/pytest_fused.txt
timeout 60 python floor_check_tmp.py 32768 > $O/floor_32k.txt 2>&1; tail -4 $O/floor_32k.txt
timeout 290 python benchmarks/kernels/bench_fused_step.py --out $O --rows 7b-32k 7b-32k-int8c 8b-32k-max \
  --configs "" launches=3 launches=3,score_programs=1 launches=3,score_programs=2 launches=3,score_programs=4 \
  launches=3,score_item=32,score_block=32,score_programs=2 launches=3,score_item=32,score_block=32,score_programs=4 \
  launches=3,score_item=16,score_block=16,score_programs=4 \
  > $O/bench_fused.txt 2>&1; grep -v -i warn $O/bench_fused.txt | cut -c1-330
