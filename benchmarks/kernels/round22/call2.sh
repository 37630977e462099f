#!/bin/bash
# Round 22, device call 2: generate() at Llama-3-8B/128K with the defaults; the GPU test files the round's changes
# touch (the fused step's attention launch, the GEMV in the compiled step and the captured decode).
export PYTHONPATH=. ; O=${OUT:-results/round22}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call2_gpu.txt
timeout 200 python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --budgets 2048 --new-tokens 32 \
  --methods quest_graph_c --out $O/call2_e2e_8b_128k.json > $O/call2_e2e.log 2>&1
grep -hE '^\| llama' $O/call2_e2e_8b_128k.md; tail -2 $O/call2_e2e.log | cut -c1-300
timeout 350 python -m pytest -q -m gpu tests/gpu/test_gpu_fused_step.py tests/gpu/test_gpu.py tests/gpu/test_gpu_compiled_step.py \
  2>&1 | tail -8 | tee -a $O/call2_gpu.txt
