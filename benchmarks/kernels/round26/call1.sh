#!/bin/bash
# Round 26, device call 1 (round 25's call2.sh): step1_probe.py (where round 21's int8_channel step begins); generate() at Llama-3-8B/128K
# with key-dtype and int8_channel bounds in one process (the long-context side of 8-bit bounds as a default: there
# the bounds are most of a sparse layer's bytes); then the GPU tests not run in call 1, as far as the call's time goes.
export PYTHONPATH=. ; O=${OUT:-results/round26}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call1_gpu.txt
timeout 90 python benchmarks/kernels/round25/step1_probe.py > $O/call1_step1_probe.txt 2>&1
grep -v -i warn $O/call1_step1_probe.txt | head -40 | cut -c1-300
timeout 220 python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --budgets 2048 --new-tokens 32 \
  --methods quest_graph_c quest_graph_c:quest/16/int8_channel --out $O/call1_e2e_8b_128k.json > $O/call1_e2e.log 2>&1
grep -hE '^\| llama' $O/call1_e2e_8b_128k.md | tee -a $O/call1_gpu.txt
timeout 250 python -m pytest -q -m gpu tests/gpu/test_gpu_fused_step.py tests/gpu/test_gpu_bounds_reuse.py \
  tests/gpu/test_gpu_topk_chunked.py tests/gpu/test_gpu.py tests/gpu/test_gpu_offload.py 2>&1 \
  | tee $O/call1_pytest.log | tail -4
