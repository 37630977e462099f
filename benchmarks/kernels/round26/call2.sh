#!/bin/bash
# Round 26, device call 2 (round 25's unrun call 2): step1_probe.py (where round 21's int8_channel step begins);
# generate() at Llama-3-8B/128K with key-dtype and int8_channel bounds in one process; the fused-step and
# bounds/reuse GPU tests.
export PYTHONPATH=. ; O=${OUT:-results/round26}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call2_gpu.txt
timeout 90 python benchmarks/kernels/round25/step1_probe.py > $O/call2_step1_probe.txt 2>&1
grep -v -i warn $O/call2_step1_probe.txt | head -30 | cut -c1-300
timeout 200 python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --budgets 2048 --new-tokens 32 \
  --methods quest_graph_c quest_graph_c:quest/16/int8_channel --out $O/call2_e2e_8b_128k.json > $O/call2_e2e.log 2>&1
grep -hE '^\| llama' $O/call2_e2e_8b_128k.md | tee -a $O/call2_gpu.txt
timeout 250 python -m pytest -q -m gpu tests/gpu/test_gpu_fused_step.py tests/gpu/test_gpu_bounds_reuse.py 2>&1 \
  | tee $O/call2_pytest.log | tail -3
