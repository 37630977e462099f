#!/bin/bash
# Round 22, device call 1: where the captured 7B/32K step's time goes with the round-21 defaults (the decode GEMV and
# fused projections on), by kernel name; generate() with the defaults, with cuBLAS's GEMVs, with 8-bit bounds, and
# HF static + compile, same call.
export PYTHONPATH=. ; O=${OUT:-results/round22}; mkdir -p $O
(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch,triton,transformers as t;print(torch.__version__,triton.__version__,t.__version__)"; git rev-parse --short HEAD) | tee $O/call1_gpu.txt
timeout 150 python benchmarks/probes/profile_replay.py --shape llama2-7b --length 32768 --budget 2048 --rows 30 \
  --out $O/call1_profile_7b_32k.json > $O/call1_profile_7b_32k.txt 2>&1; head -32 $O/call1_profile_7b_32k.txt | cut -c1-160
timeout 400 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --budgets 2048 --new-tokens 48 \
  --methods quest_graph_c quest_graph_c:quest/16/key_dtype/cublas quest_graph_c:quest/16/int8_channel static \
  --out $O/call1_e2e_7b_32k.json > $O/call1_e2e_7b_32k.log 2>&1
grep -E '^\| llama' $O/call1_e2e_7b_32k.md; tail -3 $O/call1_e2e_7b_32k.log | cut -c1-300
