#!/bin/bash
# Round 22, device call 5: the rest of the GPU suite on the fixed tree (call 3 ran the GEMV, segments and
# compiled-step files).
export PYTHONPATH=. ; O=${OUT:-results/round22}; mkdir -p $O
(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git rev-parse --short HEAD) | tee $O/call5_gpu.txt
timeout 560 python -m pytest -q -m gpu tests/gpu/test_gpu.py tests/gpu/test_gpu_fused_step.py \
  tests/gpu/test_gpu_bounds_reuse.py tests/gpu/test_gpu_topk_chunked.py tests/gpu/test_gpu_offload.py 2>&1 \
  | tee $O/call5_pytest.log | tail -15 | tee -a $O/call5_gpu.txt
