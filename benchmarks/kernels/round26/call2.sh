#!/bin/bash
# Round 26, device call 2: the rest of the GPU suite on the final tree; the three-launch step's Top-K launch at 1, 2,
# 4 (the default) and 8 warps (StepLaunch.topk_warps), chained.
export PYTHONPATH=. ; O=${OUT:-results/round26}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call2_gpu.txt
timeout 230 python -m pytest -q -m gpu tests/gpu/test_gpu_bounds_reuse.py tests/gpu/test_gpu_offload.py \
  tests/gpu/test_gpu_topk_chunked.py tests/gpu/test_gpu_segments.py tests/gpu/test_gpu_decode_gemv.py 2>&1 \
  | tee $O/call2_pytest.log | tail -4 | tee -a $O/call2_gpu.txt
timeout 170 python -m pytest -q -m gpu tests/gpu/test_gpu_compiled_step.py 2>&1 \
  | tee $O/call2_pytest_compiled.log | tail -3 | tee -a $O/call2_gpu.txt
B="launches=3,score_programs=4"
timeout 120 python benchmarks/kernels/bench_fused_step.py --rows 7b-32k-alloc 7b-32k-int8c 7b-128k --out $O/call2_fs \
  --configs $B $B,topk_warps=1 $B,topk_warps=2 $B,topk_warps=8 > $O/call2_fused_step.txt 2>&1
grep -E "SDPA|\[" $O/call2_fused_step.txt | cut -c1-150
