#!/bin/bash
# Round 18, device call 7: the whole GPU-marked suite on the final kernel code (15d2c3f).
export PYTHONPATH=. ; O=${OUT:-results/round18}; mkdir -p $O
timeout 580 python -m pytest -q -m gpu tests -p no:cacheprovider > $O/pytest_gpu_all.txt 2>&1; tail -15 $O/pytest_gpu_all.txt | cut -c1-300
