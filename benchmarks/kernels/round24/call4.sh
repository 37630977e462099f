#!/bin/bash
# Round 24, device call 4 (same machine; run as one command line): the zero-math floor of every #16 row's shape
# (benchmarks/probes/floor_step.py), and where the captured 7B/32K step's GPU time goes by kernel name (with
# fuse_residual on: the 64 residual-add kernels of round 23's profile are gone).
export PYTHONPATH=. ; O=${OUT:-results/round24}; mkdir -p $O
timeout 200 python benchmarks/probes/floor_step.py --out $O > $O/call4_floor_step.txt 2>&1
grep -v -i warn $O/call4_floor_step.txt | tail -30 | cut -c1-250
timeout 110 python benchmarks/probes/profile_replay.py --shape llama2-7b --length 32768 --budget 2048 \
  --out $O/call4_profile_replay_7b_32k.json > $O/call4_profile.txt 2>&1; head -24 $O/call4_profile.txt | cut -c1-200
