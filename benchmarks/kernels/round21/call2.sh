#!/bin/bash
# Round 21, device call 2: the decode GEMV GPU tests; generate() at Llama-2-7B/32K with the defaults (decode_gemv + fusion
# "auto"), with decode_gemv=False (cuBLAS, the earlier default) and HF static + compile; then the GPU suite's
# tests/gpu files as time allows (call 3 runs the rest).
export PYTHONPATH=. ; O=${OUT:-results/round21}; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader > $O/gpu2.txt; cat $O/gpu2.txt
timeout 100 python -m pytest -q -m gpu tests/gpu/test_gpu_decode_gemv.py 2>&1 | tail -15 | tee $O/pytest_gemv.txt
timeout 330 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --budgets 2048 --new-tokens 48 \
  --methods quest_graph_c quest_graph_c:quest/16/key_dtype/cublas static --out $O/e2e_7b_32k.json > $O/e2e_7b_32k.log 2>&1
grep -E '^\| llama' $O/e2e_7b_32k.md; tail -2 $O/e2e_7b_32k.log | cut -c1-300
timeout ${REST:-150} python -m pytest -q -m gpu tests/gpu --ignore=tests/gpu/test_gpu_decode_gemv.py 2>&1 | tail -15 | tee $O/pytest_gpu_dir.txt
