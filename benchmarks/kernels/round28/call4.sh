#!/bin/bash
# Round 28, the warm machine's next call: the kernel rows (GQA score in its tensor-core form) and Llama-3-8B/128K.
export PYTHONPATH=. ; O=${OUT:-results/round28}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call4_gpu.txt
timeout 120 python scripts/bench_kernels.py --quick --name call4_kernels --out-dir $O > $O/call4_kernels.log 2>&1
grep -E "^\| llama" $O/call4_kernels.md | awk -F'|' '{print $2,$3,$4,$5,$6,$7, "score",$10, "graph",$14, "chain",$24, "x",$26}' \
  | tee -a $O/call4_gpu.txt
timeout 130 python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --new-tokens 32 --budgets 2048 \
  --methods quest_graph_c --out $O/call4_e2e_8b_128k.json > $O/call4_e2e_8b.log 2>&1
grep -hE '^\| llama' $O/call4_e2e_*.md | tee -a $O/call4_gpu.txt
