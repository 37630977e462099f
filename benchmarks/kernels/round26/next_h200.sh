#!/bin/bash
# Not run this round (no device time left): what the next device call should run on an H200 with this round's
# final tree. generate() with the defaults against HF static + compile at Llama-2-7B/32K (the #16 e2e row), the
# 7B/128K row (the three-launch step's Top-K now at 8 warps there), Llama-3-8B/128K; then the GPU files the round's
# last changes run through.
export PYTHONPATH=. ; O=${OUT:-results/round26_next}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt
timeout 200 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48 --budgets 2048 \
  --methods quest_graph_c static --out $O/e2e_7b_32k.json > $O/e2e_7b_32k.log 2>&1
timeout 120 python scripts/bench_e2e.py --shapes llama2-7b --lengths 131072 --new-tokens 32 --budgets 2048 \
  --methods quest_graph_c quest_graph_c:quest/16/key_dtype/sep --out $O/e2e_7b_128k.json > $O/e2e_7b_128k.log 2>&1
timeout 120 python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --new-tokens 32 --budgets 2048 \
  --methods quest_graph_c --out $O/e2e_8b_128k.json > $O/e2e_8b_128k.log 2>&1
grep -hE '^\| llama' $O/e2e_*.md | tee -a $O/gpu.txt
timeout 150 python -m pytest -q -m gpu tests/gpu/test_gpu_pdl.py tests/gpu/test_gpu_fused_step.py 2>&1 \
  | tee $O/pytest.log | tail -3 | tee -a $O/gpu.txt
