#!/bin/bash
# Round 18, device call 8: Llama-2-7B/32K generate() with the defaults on the final tree (the append advancing the
# position), 64 new tokens, Quest captured only (no HF row: the device time left did not cover one).
export PYTHONPATH=. ; O=${OUT:-results/round18}; mkdir -p $O
timeout 280 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --budgets 2048 --new-tokens 64 \
  --methods quest_graph_c --out $O/e2e_7b_32k.json > $O/e2e_7b_32k.log 2>&1; grep -E '^\| llama' $O/e2e_7b_32k.md; tail -2 $O/e2e_7b_32k.log | cut -c1-300
