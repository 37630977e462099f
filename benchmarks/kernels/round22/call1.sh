#!/bin/bash
# Round 22, device call 1: the decode GEMV's GPU tests (the dependent launch new); generate() at Llama-2-7B/32K with
# the defaults (GEMV + fused projections, the GEMV dependently launched), with cuBLAS's GEMVs, with the GEMV launched
# plainly (--gemv-launch pdl=False), HF static + compile; the fused step's token test (the attention now lets the
# GEMV start early); where the captured step's time goes by kernel name (last: what the call's time leaves).
export PYTHONPATH=. ; O=${OUT:-results/round22}; mkdir -p $O
(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch,triton,transformers as t;print(torch.__version__,triton.__version__,t.__version__)"; git rev-parse --short HEAD) | tee $O/call1_gpu.txt
timeout 80 python -m pytest -q -m gpu tests/gpu/test_gpu_decode_gemv.py 2>&1 | tail -4 | tee -a $O/call1_gpu.txt
timeout 70 python -m pytest -q -m gpu tests/gpu/test_gpu_fused_step.py -k patched_decode_through 2>&1 | tail -3 | tee -a $O/call1_gpu.txt
E="python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --budgets 2048 --new-tokens 48"
timeout 170 $E --methods quest_graph_c quest_graph_c:quest/16/key_dtype/cublas --out $O/call1_e2e_7b_32k.json > $O/call1_e2e.log 2>&1
timeout 90 $E --methods quest_graph_c --gemv-launch pdl=False --out $O/call1_e2e_7b_32k_nopdl.json >> $O/call1_e2e.log 2>&1
grep -hE '^\| llama' $O/call1_e2e_7b_32k*.md
timeout 130 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48 --methods static \
  --out $O/call1_e2e_7b_static.json >> $O/call1_e2e.log 2>&1
grep -hE '^\| llama' $O/call1_e2e_7b_static.md; tail -2 $O/call1_e2e.log | cut -c1-300
timeout 90 python benchmarks/probes/profile_replay.py --shape llama2-7b --length 32768 --budget 2048 --rows 30 \
  --out $O/call1_profile_7b_32k.json > $O/call1_profile_7b_32k.txt 2>&1; head -20 $O/call1_profile_7b_32k.txt | cut -c1-150
