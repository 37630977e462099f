#!/bin/bash
# Round 28: round 25's step-1 probe (where the fused step and the separate kernels part under int8_channel bounds),
# then generate() at Llama-3-8B/128K with key-dtype and int8_channel bounds in one process.
export PYTHONPATH=. ; O=${OUT:-results/round28}; mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader > $O/probe_8b_gpu.txt
timeout 120 python benchmarks/kernels/round25/step1_probe.py > $O/probe_8b_step1_probe.txt 2>&1
grep -v -i warn $O/probe_8b_step1_probe.txt | head -40 | cut -c1-300
timeout 240 python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --budgets 2048 --new-tokens 32 \
  --methods quest_graph_c quest_graph_c:quest/16/int8_channel --out $O/probe_8b_e2e_8b_128k.json > $O/probe_8b_e2e.log 2>&1
grep -hE '^\| llama' $O/probe_8b_e2e_8b_128k.md
