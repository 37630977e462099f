#!/bin/bash
# Round 30: the GPU-marked suite's files that round 29 did not run on the library code with the 8-bit codes'
# tensor-core score ("mma8", 3cc7fa3): every file of tests/gpu but score_mma, bounds_reuse and fused_step (those
# three ran on it in round 29: 177 passed). One pytest process, the captured-step files first.
export PYTHONPATH=. ; O=${OUT:-results/round30}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $O/suite_gpu.txt
F="tests/gpu/test_gpu_pdl.py tests/gpu/test_gpu_recompile.py tests/gpu/test_gpu_compiled_step.py"
R=$(ls tests/gpu/test_gpu*.py | grep -v -E "score_mma|bounds_reuse|fused_step|_pdl|recompile|compiled_step")
timeout ${T:-560} python -m pytest -q -m gpu $F $R -p no:cacheprovider -rfEs > $O/suite_pytest.log 2>&1
echo "rc $?" >> $O/suite_gpu.txt
grep -E "passed|failed|error" $O/suite_pytest.log | tail -3 | tee -a $O/suite_gpu.txt
