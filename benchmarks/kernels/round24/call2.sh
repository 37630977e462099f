#!/bin/bash
# Round 24, device call 2 (same machine): the rest of the GPU suite on the final tree; Llama-3-8B/128K with the
# defaults if time is left.
export PYTHONPATH=. ; O=${OUT:-results/round24}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call2_gpu.txt
timeout 100 python -m pytest -q -m gpu tests/gpu/test_gpu_decode_gemv.py tests/gpu/test_gpu_segments.py 2>&1 \
  | tail -3 | tee -a $O/call2_gpu.txt
timeout 150 python -m pytest -q -m gpu tests/gpu/test_gpu_compiled_step.py 2>&1 | tail -3 | tee -a $O/call2_gpu.txt
timeout 300 python -m pytest -q -m gpu tests/gpu/test_gpu.py tests/gpu/test_gpu_fused_step.py \
  tests/gpu/test_gpu_bounds_reuse.py tests/gpu/test_gpu_offload.py 2>&1 \
  | tee $O/call2_pytest.log | tail -6 | tee -a $O/call2_gpu.txt
