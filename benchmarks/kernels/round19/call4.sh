#!/bin/bash
# Round 19, device call 4: the whole GPU suite on the final tree.
export PYTHONPATH=. ; O=${OUT:-results/round19}; mkdir -p $O
timeout 570 python -m pytest -q -m gpu tests/gpu > $O/gpu_suite.log 2>&1; tail -4 $O/gpu_suite.log
