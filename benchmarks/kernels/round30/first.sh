#!/bin/bash
# Round 30, the first call of a session: #16's target rows where an H200 came (targets.sh), else the GPU suite.
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash benchmarks/kernels/round30/targets.sh
else bash benchmarks/kernels/round30/suite.sh; fi
