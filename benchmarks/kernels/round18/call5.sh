#!/bin/bash
# Round 18, device call 5: the captured 7B/32K step's kernels by name after the decode append advances the device
# position in its own launch (no `pos += 1` kernel a layer), then the step-shape floors again (floor_step.py with the
# expected random union size and an L2-rotating same-size copy).
export PYTHONPATH=. ; O=${OUT:-results/round18}; mkdir -p $O
timeout 300 python benchmarks/probes/profile_replay.py --shape llama2-7b --length 32768 --budget 2048 --rows 16 \
  --out $O/profile_replay_7b_32k.json > $O/profile_replay_7b_32k.txt 2>&1; grep -v -i warn $O/profile_replay_7b_32k.txt | tail -18 | cut -c1-160
timeout 200 python benchmarks/probes/floor_step.py --out $O > $O/floor_step.txt 2>&1; grep -v -i warn $O/floor_step.txt
