#!/bin/bash
# Round 17, device call 7: the GPU suite on the round's final kernel code.
export PYTHONPATH=. ; O=${OUT:-results/round17}; mkdir -p $O
timeout 570 python -m pytest -q -m gpu tests -p no:cacheprovider > $O/pytest_gpu_all.txt 2>&1; tail -4 $O/pytest_gpu_all.txt
