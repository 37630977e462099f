#!/bin/bash
# Round 18, device call 6: the captured 7B/32K step's kernels by name, the tree before this round (f3d9f6e, an
# untracked `git archive` copy in base_tree/) and this tree in one session; then the step-shape floors with more
# launch shapes for the small (GQA) stages.
O=${OUT:-results/round18}; mkdir -p $O
(cd base_tree && PYTHONPATH=. timeout 200 python benchmarks/probes/profile_replay.py --shape llama2-7b --length 32768 \
  --budget 2048 --rows 16 --out $O/profile_replay_7b_32k_base.json > $O/profile_replay_7b_32k_base.txt 2>&1)
export PYTHONPATH=.
timeout 200 python benchmarks/probes/profile_replay.py --shape llama2-7b --length 32768 --budget 2048 --rows 16 \
  --out $O/profile_replay_7b_32k_new.json > $O/profile_replay_7b_32k_new.txt 2>&1
for f in base new; do echo "== $f"; grep -v -i warn $O/profile_replay_7b_32k_$f.txt | grep -E "ms of kernels|append|add<long>|Functor" | cut -c1-140; done
timeout 200 python benchmarks/probes/floor_step.py --out $O > $O/floor_step.txt 2>&1; grep -v -i warn $O/floor_step.txt
