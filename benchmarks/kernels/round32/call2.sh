#!/bin/bash
# Round 32, call 2 (an H200): round 31's step_rows.sh (the step a patched 7B runs at B=1 against the separate kernels
# and the same call's floor), with shorter timeouts to fit one call, then round 30's targets.sh (the kernel rows,
# generate() at 7B/32K against HF static + compile in one process and 8B/128K, each kernel row's floor).
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH=. PYTHONUNBUFFERED=1; O=${OUT:-results/round32}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv,noheader | tee $O/step_gpu.txt
timeout 150 python benchmarks/kernels/bench_fused_step.py --rows 7b-32k 7b-32k-int8c 7b-128k 7b-128k-int8c \
  --configs launches=3,score_programs=4 --out $O/step_rows > $O/step_rows.log 2>&1; echo "rc $?" >> $O/step_rows.log
timeout 70 python benchmarks/probes/floor_step.py --rows 7b-32k 7b-128k --out $O/floor > $O/step_floor.txt 2>&1
OUT=$O bash benchmarks/kernels/round30/targets.sh
find $O -name '*.json' -delete
