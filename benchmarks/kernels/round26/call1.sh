#!/bin/bash
# Round 26, device call 1: the three-launch step's Top-K launch at 1, 2, 4 (the default) and 8 warps
# (StepLaunch.topk_warps), chained, and the Top-K alone at 1-2 warps; round 25's unrun call 2: step1_probe.py
# (where round 21's int8_channel step begins), generate() at Llama-3-8B/128K with key-dtype and int8_channel bounds in
# one process; the fused-step and bounds/reuse GPU tests.
export PYTHONPATH=. ; O=${OUT:-results/round26}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call1_gpu.txt
B="launches=3,score_programs=4"
timeout 150 python benchmarks/kernels/bench_fused_step.py --rows 7b-32k-alloc 7b-32k-int8c 7b-128k --out $O/call1_fs \
  --configs $B $B,topk_warps=1 $B,topk_warps=2 $B,topk_warps=8 > $O/call1_fused_step.txt 2>&1
grep -E "SDPA|\[" $O/call1_fused_step.txt | cut -c1-200
timeout 60 python benchmarks/kernels/bench_topk.py --out $O/call1_topk \
  --configs keys_per_thread=64,max_warps=1 keys_per_thread=32,max_warps=2 > $O/call1_topk.txt 2>&1
grep -E "mha-static-32K|mha-static-128K" $O/call1_topk/*.md | head -12
timeout 90 python benchmarks/kernels/round25/step1_probe.py > $O/call1_step1_probe.txt 2>&1
grep -v -i warn $O/call1_step1_probe.txt | head -30 | cut -c1-300
timeout 200 python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --budgets 2048 --new-tokens 32 \
  --methods quest_graph_c quest_graph_c:quest/16/int8_channel --out $O/call1_e2e_8b_128k.json > $O/call1_e2e.log 2>&1
grep -hE '^\| llama' $O/call1_e2e_8b_128k.md | tee -a $O/call1_gpu.txt
timeout 100 python -m pytest -q -m gpu tests/gpu/test_gpu_fused_step.py tests/gpu/test_gpu_bounds_reuse.py 2>&1 \
  | tee $O/call1_pytest.log | tail -3
