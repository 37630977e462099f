#!/bin/bash
# Round 26, device call 2: the whole GPU suite on the final tree (dependent launches through the captured step:
# append, scoring launch, inductor's kernels; tests/gpu/test_gpu_pdl.py new).
export PYTHONPATH=. ; O=${OUT:-results/round26}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call2_gpu.txt
timeout 390 python -m pytest -q -m gpu tests/gpu --ignore=tests/gpu/test_gpu_compiled_step.py 2>&1 \
  | tee $O/call2_pytest.log | tail -4 | tee -a $O/call2_gpu.txt
timeout 170 python -m pytest -q -m gpu tests/gpu/test_gpu_compiled_step.py 2>&1 \
  | tee $O/call2_pytest_compiled.log | tail -3 | tee -a $O/call2_gpu.txt
