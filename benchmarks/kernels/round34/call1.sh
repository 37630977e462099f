#!/bin/bash
# Round 34, call 1 (any Hopper card): the GPU test files that rounds 33 and 34 changed (the score kernel's grid and
# page-size constant, its packed_codes / trunc_parts options in the separate score and the three-launch step, and
# fused_step="auto" declining 8-bit bounds). call2.sh then times the options.
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH=. PYTHONUNBUFFERED=1; O=${OUT:-results/round34}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | tee $O/gpu.txt
timeout 420 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_score_mma.py tests/gpu/test_gpu_fused_step.py \
  > $O/gpu_tests.log 2>&1; echo "rc $?" >> $O/gpu_tests.log; tail -3 $O/gpu_tests.log
