#!/bin/bash
# Round 21, device call 3: the rest of the GPU suite (the families file and the tests/gpu files call 2 left).
export PYTHONPATH=. ; O=${OUT:-results/round21}; mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu3.txt
timeout ${T:-280} python -m pytest -q -m gpu tests --ignore=tests/gpu/test_gpu_decode_gemv.py ${SKIP} 2>&1 | tail -20 | tee $O/pytest_rest.txt
