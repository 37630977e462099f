#!/bin/bash
# Round 14, device call 4 (tree as call 3): the reference floor probe (an untracked copy of ../shared/probes/floor_check.py
# at the repo root), the #16 kernel table with both bounds, and a third 8B/128K decode with the defaults (64 tokens).
export PYTHONPATH=. ; O=${OUT:-results/round14}; mkdir -p $O
python floor_check_tmp.py 32768 2>&1 | tail -8
python scripts/bench_kernels.py --quick --bounds key_dtype int8_channel --name kernels_final --out-dir $O > $O/kernels_final.log 2>&1; grep -E "^\| llama|copy bandwidth" $O/kernels_final.log
python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --budgets 2048 --new-tokens 64 --methods quest_graph_c --out $O/e2e_8b_128k_call4.json > $O/e2e.log 2>&1; grep -E '^\| llama' $O/e2e_8b_128k_call4.md | head -1; tail -1 $O/e2e.log
