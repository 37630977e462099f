#!/bin/bash
# Round 34, call 3 (any Hopper card): the rest of the GPU suite that runs the score kernel, whose grid (KV head, page
# block, batch row) and compile-time page size changed for every caller this round: the kernels at real sizes (windows,
# beams' page tables, padding), the 8-bit bounds with selection reuse, and the compiled step that traces the kernel
# under inductor. Round 33's call3.sh follows as call 4.
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH=. PYTHONUNBUFFERED=1; O=${OUT:-results/round34}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu3.txt
timeout 560 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py tests/gpu/test_gpu_bounds_reuse.py \
  tests/gpu/test_gpu_compiled_step.py > $O/gpu_suite3.log 2>&1; echo "rc $?" >> $O/gpu_suite3.log
tail -5 $O/gpu_suite3.log
