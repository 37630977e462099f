#!/bin/bash
# Round 15, device call 4 (final tree): the whole GPU-marked suite, then the 8B/128K decode with the defaults.
export PYTHONPATH=. ; O=${OUT:-results/round15}; mkdir -p $O
python -m pytest -q -m gpu tests -p no:cacheprovider > $O/gpu_suite.txt 2>&1; tail -3 $O/gpu_suite.txt
timeout 240 python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --budgets 2048 --new-tokens 32 --methods quest_graph_c --out $O/e2e_8b_128k.json > $O/e2e.log 2>&1; grep -E '^\|' $O/e2e_8b_128k.md | head -3; tail -1 $O/e2e.log
