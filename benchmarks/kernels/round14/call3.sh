#!/bin/bash
# Round 14, device call 3 (final tree): the GPU suite; 8B/128K end to end with the defaults and with
# fuse_projections (the fused MLP's in-place product: its peak memory); the captured steps' kernels by name.
export PYTHONPATH=. ; O=${OUT:-results/round14}; mkdir -p $O
git log -1 --format=%h 2>/dev/null
python -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -4
python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --budgets 2048 --new-tokens 32 \
  --methods quest_graph_c quest_graph_c:quest/16/key_dtype/fused --out $O/e2e_8b_128k.json > $O/e2e_8b.log 2>&1
grep -E '^\| llama' $O/e2e_8b_128k.md; tail -2 $O/e2e_8b.log
python benchmarks/probes/profile_replay.py --shape llama3-8b --length 131072 --budget 2048 --rows 22 --out $O/profile_replay_8b_128k.json 2>&1 | grep -v "Warning\|warn("
python benchmarks/probes/profile_replay.py --shape llama2-7b --length 32768 --budget 2048 --rows 22 --out $O/profile_replay_7b_32k.json 2>&1 | grep -v "Warning\|warn("
