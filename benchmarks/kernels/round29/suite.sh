#!/bin/bash
# Round 29: the GPU-marked suite on the library code with the 8-bit codes' tensor-core score ("mma8") in it, in two
# device calls (each under the 600 s a call may run): PART=a the files that run the score kernel's forms and the
# captured step (score_mma, pdl, recompile, compiled_step), PART=b every other file. PART=s (what a short budget
# allows): the three files that run the changed kernel at real sizes, each under its own timeout and log.
export PYTHONPATH=. ; O=${OUT:-results/round29}; mkdir -p $O
P=${PART:-a}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $O/suite_${P}_gpu.txt
A="tests/gpu/test_gpu_score_mma.py tests/gpu/test_gpu_pdl.py tests/gpu/test_gpu_recompile.py tests/gpu/test_gpu_compiled_step.py"
if [ "$P" = s ]; then
  for f in score_mma:230 bounds_reuse:90 fused_step:90; do
    timeout ${f#*:} python -m pytest -q -m gpu tests/gpu/test_gpu_${f%:*}.py -p no:cacheprovider > $O/suite_s_${f%:*}.log 2>&1
    echo "${f%:*} (rc $?): $(tail -1 $O/suite_s_${f%:*}.log)" | tee -a $O/suite_s_gpu.txt
  done
  exit 0
elif [ "$P" = a ]; then
  timeout 560 python -m pytest -q -m gpu $A -p no:cacheprovider > $O/suite_a_pytest.log 2>&1
else
  timeout 560 python -m pytest -q -m gpu tests/gpu $(for f in $A; do echo --ignore=$f; done) -p no:cacheprovider \
    > $O/suite_b_pytest.log 2>&1
fi
tail -3 $O/suite_${P}_pytest.log | tee -a $O/suite_${P}_gpu.txt
