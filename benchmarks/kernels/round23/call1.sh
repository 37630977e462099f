#!/bin/bash
# Round 23, device call 1: the GPU tests of the GEMV, segments and whole-step compile on the final tree of round 22
# (Method back to the plain object); generate() at Llama-2-7B/32K with the defaults and HF static + compile in one
# process (the >= 2x ratio of #16 from one run); where the captured 7B/32K step's GPU time goes, by kernel name.
export PYTHONPATH=. ; O=${OUT:-results/round23}; mkdir -p $O
(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git rev-parse --short HEAD) | tee $O/call1_gpu.txt
timeout 100 python -m pytest -q -m gpu tests/gpu/test_gpu_decode_gemv.py tests/gpu/test_gpu_segments.py 2>&1 \
  | tail -3 | tee -a $O/call1_gpu.txt
timeout 150 python -m pytest -q -m gpu tests/gpu/test_gpu_compiled_step.py 2>&1 | tail -3 | tee -a $O/call1_gpu.txt
timeout 240 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48 --budgets 2048 \
  --methods quest_graph_c static --out $O/call1_e2e_7b_32k.json > $O/call1_e2e.log 2>&1
grep -hE '^\| llama' $O/call1_e2e_7b_32k.md | tee -a $O/call1_gpu.txt
echo "recompile_limit lines: $(grep -c recompile_limit $O/call1_e2e.log)" | tee -a $O/call1_gpu.txt
timeout 110 python benchmarks/probes/profile_replay.py --shape llama2-7b --length 32768 --budget 2048 \
  --out $O/call1_profile_replay_7b_32k.json > $O/call1_profile.txt 2>&1; head -22 $O/call1_profile.txt
