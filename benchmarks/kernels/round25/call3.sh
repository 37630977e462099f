#!/bin/bash
# Round 25, device call 3 (the device time left, ~5 min): step1_probe.py on the GPU, then the fused-step GPU tests.
export PYTHONPATH=. ; O=${OUT:-results/round25}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call3_gpu.txt
timeout 90 python benchmarks/kernels/round25/step1_probe.py > $O/call3_step1_probe.txt 2>&1
grep -v -i warn $O/call3_step1_probe.txt | head -40 | cut -c1-400
timeout 150 python -m pytest -q -m gpu tests/gpu/test_gpu_fused_step.py tests/gpu/test_gpu_bounds_reuse.py 2>&1 \
  | tee $O/call3_pytest.log | tail -4 | tee -a $O/call3_gpu.txt
