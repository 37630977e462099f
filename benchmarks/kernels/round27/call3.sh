#!/bin/bash
# Round 27, device call 3: the compiled-step GPU file; generate() at Llama-2-7B/128K with the defaults and with the
# separate kernels (the three-launch step's Top-K warps of round 26, not yet timed in generate()).
export PYTHONPATH=. ; O=${OUT:-results/round27}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call3_gpu.txt
timeout 200 python -m pytest -q -m gpu tests/gpu/test_gpu_compiled_step.py 2>&1 \
  | tee $O/call3_pytest.log | tail -3 | tee -a $O/call3_gpu.txt
timeout 150 python scripts/bench_e2e.py --shapes llama2-7b --lengths 131072 --new-tokens 32 --budgets 2048 \
  --methods quest_graph_c quest_graph_c:quest/16/key_dtype/sep --out $O/call3_e2e_7b_128k.json > $O/call3_e2e.log 2>&1
grep -hE '^\| llama' $O/call3_e2e_7b_128k.md | tee -a $O/call3_gpu.txt
