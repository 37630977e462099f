#!/bin/bash
# Round 14, device call 2: where generate() spends a token outside the captured replay (8B/128K, 7B/32K), and the
# 7B/32K decode end to end against HF static + compile in the same call (tail tile on: the library default now).
export PYTHONPATH=. ; O=${OUT:-results/round14}; mkdir -p $O
python benchmarks/probes/profile_generate.py --shape llama3-8b --length 131072 --tokens 24 --out $O/profile_generate_8b_128k.json 2>&1 | grep -v "Warning\|warn("
python benchmarks/probes/profile_generate.py --shape llama2-7b --length 32768 --tokens 24 --out $O/profile_generate_7b_32k.json 2>&1 | grep -v "Warning\|warn("
python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --budgets 2048 --new-tokens 48 --methods quest_graph_c static \
  --out $O/e2e_7b_32k.json > $O/e2e_7b_32k.log 2>&1; grep -E '^\| llama' $O/e2e_7b_32k.md; tail -2 $O/e2e_7b_32k.log
