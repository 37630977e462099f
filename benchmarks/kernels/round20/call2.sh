#!/bin/bash
# Round 20, device call 2: the whole GPU-marked suite on the final tree.
export PYTHONPATH=. ; O=${OUT:-results/round20}; mkdir -p $O
timeout 580 python -m pytest -q -m gpu tests -p no:cacheprovider > $O/gpu_suite.log 2>&1; tail -5 $O/gpu_suite.log
