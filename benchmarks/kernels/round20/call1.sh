#!/bin/bash
# Round 20, device call 1: generate() with the defaults on the final tree (fused_step "auto"), Llama-2-7B/32K against
# HF static cache + compile in the same call, then Llama-3-8B/128K.
export PYTHONPATH=. ; O=${OUT:-results/round20}; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader > $O/gpu.txt
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $O/gpu.txt
git rev-parse --short HEAD >> $O/gpu.txt 2>/dev/null; cat $O/gpu.txt
timeout 330 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --budgets 2048 --new-tokens 48 \
  --methods quest_graph_c static --out $O/e2e_7b_32k.json > $O/e2e_7b_32k.log 2>&1
grep -E '^\| llama' $O/e2e_7b_32k.md; tail -2 $O/e2e_7b_32k.log | cut -c1-300
timeout 240 python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --budgets 2048 --new-tokens 32 \
  --methods quest_graph_c --out $O/e2e_8b_128k.json > $O/e2e_8b_128k.log 2>&1
grep -E '^\| llama' $O/e2e_8b_128k.md; tail -2 $O/e2e_8b_128k.log | cut -c1-300
