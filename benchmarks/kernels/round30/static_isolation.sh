#!/bin/bash
# Round 30, for the next device call (an H200): HF static cache + compile at Llama-2-7B/32K measured 12.13 ms/token in
# targets.sh (after the Quest run, same process) against 9.61-10.22 in rounds 22-25 on H200s. This separates the
# process order from the machine: HF alone in its own process, Quest alone in its own process, then both in one
# process with HF first.
export PYTHONPATH=. ; O=${OUT:-results/round30}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $O/static_gpu.txt
A="--shapes llama2-7b --lengths 32768 --new-tokens 48 --budgets 2048"
timeout 150 python scripts/bench_e2e.py $A --methods static --out $O/static_alone.json > $O/static_alone.log 2>&1
timeout 150 python scripts/bench_e2e.py $A --methods quest_graph_c --out $O/static_quest_alone.json > $O/static_quest.log 2>&1
timeout 200 python scripts/bench_e2e.py $A --methods static quest_graph_c --out $O/static_first.json > $O/static_first.log 2>&1
for f in static_alone static_quest_alone static_first; do  # the rows, and nvidia-smi's clocks around each (bench_e2e)
  grep -hE '^\| llama|^- (static|quest)' $O/$f.md | tee -a $O/static_gpu.txt; done
rm -f $O/*.json
