#!/bin/bash
# Round 31: #16's batch-1 MHA rows on the step a patched model runs there (QuestConfig(fused_step="auto"):
# DECODE_STEP_LAUNCH, three launches chained by PDL, 4 resident scoring programs an SM), against the separate
# kernels that bench_kernels.py's table times, SDPA, and the same call's zero-math floor.
export PYTHONPATH=. ; O=${OUT:-results/round31}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv,noheader | tee $O/step_gpu.txt
timeout 300 python benchmarks/kernels/bench_fused_step.py --rows 7b-32k 7b-32k-int8c 7b-128k 7b-128k-int8c \
  --configs launches=3,score_programs=4 --out $O/step_rows > $O/step_rows.log 2>&1; echo "rc $?" >> $O/step_rows.log
timeout 120 python benchmarks/probes/floor_step.py --rows 7b-32k 7b-128k --out $O/floor > $O/step_floor.txt 2>&1
find $O -name '*.json' -delete
