#!/bin/bash
# Round 28, device call 2 (any GPU): round 27's two test fixes (the score-form near-tie check; test_gpu_pdl resetting
# dynamo), the compiled-step file (unrun since round 26) and this round's recompile-limit test.
export PYTHONPATH=. ; O=${OUT:-results/round28}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call2_gpu.txt
timeout 60 python -m pytest -q -m gpu tests/gpu/test_gpu_score_mma.py 2>&1 | tail -1 | sed "s/^/score_mma: /" \
  | tee -a $O/call2_gpu.txt
timeout 150 python -m pytest -q -m gpu tests/gpu/test_gpu_recompile.py 2>&1 | tee $O/call2_recompile.log | tail -1 \
  | sed "s/^/recompile: /" | tee -a $O/call2_gpu.txt
timeout 120 python -m pytest -q -m gpu tests/gpu/test_gpu_pdl.py 2>&1 | tee $O/call2_pdl.log | tail -1 \
  | sed "s/^/pdl: /" | tee -a $O/call2_gpu.txt
timeout 200 python -m pytest -q -m gpu tests/gpu/test_gpu_compiled_step.py 2>&1 | tee $O/call2_compiled.log \
  | tail -1 | sed "s/^/compiled_step: /" | tee -a $O/call2_gpu.txt
