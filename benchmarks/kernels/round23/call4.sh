#!/bin/bash
# Round 23, device call 4: generate() at Llama-2-7B/32K, the defaults and HF static + compile in one process (the
# >= 2x ratio of #16 from one run), then Llama-3-8B/128K with the defaults, if time is left.
export PYTHONPATH=. ; O=${OUT:-results/round23}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call4_gpu.txt
timeout 150 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48 --budgets 2048 \
  --methods quest_graph_c static --out $O/call4_e2e_7b_32k.json > $O/call4_e2e.log 2>&1
grep -hE '^\| llama' $O/call4_e2e_7b_32k.md | tee -a $O/call4_gpu.txt
echo "recompile_limit lines: $(grep -c recompile_limit $O/call4_e2e.log)" | tee -a $O/call4_gpu.txt
timeout 100 python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --budgets 2048 --new-tokens 32 \
  --methods quest_graph_c --out $O/call4_e2e_8b_128k.json > $O/call4_e2e_8b.log 2>&1
grep -hE '^\| llama' $O/call4_e2e_8b_128k.md | tee -a $O/call4_gpu.txt
