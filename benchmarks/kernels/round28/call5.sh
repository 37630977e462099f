#!/bin/bash
# Round 28, the tests alone, in priority order, for a call with little device time left: this round's recompile-limit
# test, the compiled-step file (the step now compiles through quest_hf.recompile.Compiled), then round 27's two test
# fixes.
export PYTHONPATH=. ; O=${OUT:-results/round28}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call5_gpu.txt
timeout 90 python -m pytest -q -m gpu tests/gpu/test_gpu_recompile.py 2>&1 | tee $O/call5_recompile.log | tail -1 \
  | sed "s/^/recompile: /" | tee -a $O/call5_gpu.txt
timeout 150 python -m pytest -q -m gpu tests/gpu/test_gpu_compiled_step.py 2>&1 | tee $O/call5_compiled.log \
  | tail -1 | sed "s/^/compiled_step: /" | tee -a $O/call5_gpu.txt
timeout 45 python -m pytest -q -m gpu tests/gpu/test_gpu_score_mma.py 2>&1 | tail -1 | sed "s/^/score_mma: /" \
  | tee -a $O/call5_gpu.txt
timeout 80 python -m pytest -q -m gpu tests/gpu/test_gpu_pdl.py 2>&1 | tee $O/call5_pdl.log | tail -1 \
  | sed "s/^/pdl: /" | tee -a $O/call5_gpu.txt
