#!/bin/bash
# Round 28: the GPU suite's files that call2.sh does not run (ran on an H100 right after it).
export PYTHONPATH=. ; O=${OUT:-results/round28}; mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader > $O/suite_rest_gpu.txt
timeout 540 python -m pytest -q -m gpu tests/gpu --ignore=tests/gpu/test_gpu_compiled_step.py \
  --ignore=tests/gpu/test_gpu_recompile.py --ignore=tests/gpu/test_gpu_pdl.py --ignore=tests/gpu/test_gpu_score_mma.py \
  -x -p no:cacheprovider > $O/suite_rest_pytest.log 2>&1
tail -3 $O/suite_rest_pytest.log
