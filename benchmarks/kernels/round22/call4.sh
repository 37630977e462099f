#!/bin/bash
# Round 22, device call 4 (what little device time was left after refused starts): call 3's first rows only:
# generate() at Llama-2-7B/32K with the defaults after the recompile fix (and whether dynamo still hits its limit),
# then the GEMV's GPU tests.
export PYTHONPATH=. ; O=${OUT:-results/round22}; mkdir -p $O
(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git rev-parse --short HEAD) | tee $O/call4_gpu.txt
timeout 90 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48 --budgets 2048 \
  --methods quest_graph_c --out $O/call4_e2e_7b_32k.json > $O/call4_e2e.log 2>&1
grep -hE '^\| llama' $O/call4_e2e_7b_32k.md; echo "recompile_limit lines: $(grep -c recompile_limit $O/call4_e2e.log)"
timeout 60 python -m pytest -q -m gpu tests/gpu/test_gpu_decode_gemv.py 2>&1 | tail -2 | tee -a $O/call4_gpu.txt
