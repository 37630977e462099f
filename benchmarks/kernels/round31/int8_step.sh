#!/bin/bash
# For the next device call (an H200): round 31's H100 call had the patched step (three launches, 4 resident scoring
# programs an SM) at 66.2 us against the separate kernels' 61.0 at 7B B=1 128K with int8_channel bounds, its score
# kernel 36.0 us. This times the scoring variants there and at 32K, with key-dtype rows as the control, so that
# fused_step="auto" can take the bounds format into account if an H200 agrees.
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH=. ; O=${OUT:-results/round31}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | tee $O/int8_gpu.txt
timeout 400 python benchmarks/kernels/bench_fused_step.py --rows 7b-128k-int8c 7b-32k-int8c 7b-128k \
  --configs launches=3,score_programs=4 launches=3 launches=3,score_programs=4,score_block=128,score_item=128 \
  launches=3,score_programs=2 --out $O/int8_step > $O/int8_step.log 2>&1; echo "rc $?" >> $O/int8_step.log
find $O -name '*.json' -delete
