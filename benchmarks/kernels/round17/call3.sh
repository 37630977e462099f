#!/bin/bash
# Round 17, device call 3: call 2 hung at the first three-launch step. Each case alone under a timeout: PDL off,
# then on; small then real sizes; eager, then graph replays.
export PYTHONPATH=. ; O=${OUT:-results/round17}; mkdir -p $O
run() { echo "== $*"; timeout 25 "$@" 2>&1 | grep -v -i warn | tail -3; echo "rc=${PIPESTATUS[0]}"; }
{
run env QUEST_HF_PDL=0 python benchmarks/kernels/round17/diag3.py 3 4096 4 1
run env QUEST_HF_PDL=0 python benchmarks/kernels/round17/diag3.py 3 32768 32 1
run python benchmarks/kernels/round17/diag3.py 3 4096 4 1
run python benchmarks/kernels/round17/diag3.py 3 32768 32 1 graph
run python benchmarks/kernels/round17/diag3.py 2 32768 32 1 graph
} > $O/diag3.txt 2>&1; cat $O/diag3.txt
