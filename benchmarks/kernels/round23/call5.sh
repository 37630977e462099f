#!/bin/bash
# Round 23, device call 5: after the Top-K thresholds kernel's counter zeroing moved under a branch (triton 3.9's
# interpreter refused a scalar in that store's mask): the Top-K GPU tests at real sizes.
export PYTHONPATH=. ; O=${OUT:-results/round23}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call5_gpu.txt
timeout 75 python -m pytest -q -m gpu tests/gpu/test_gpu_topk_chunked.py 2>&1 | tail -3 | tee -a $O/call5_gpu.txt
