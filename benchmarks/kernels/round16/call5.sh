#!/bin/bash
# Round 16, device call 5: the whole GPU-marked suite on the final kernels (the Top-K's and attention's shared
# helpers took cache-modifier parameters for the fused step).
export PYTHONPATH=. ; O=${OUT:-results/round16}; mkdir -p $O
timeout 560 python -m pytest -q -m gpu tests -p no:cacheprovider > $O/pytest_gpu_all.txt 2>&1; tail -4 $O/pytest_gpu_all.txt
