#!/bin/bash
# Round 28, one device call when few come: call 2's GPU tests, then generate() at Llama-2-7B/32K with the defaults
# against HF static + compile in one process (#16's e2e row).
export PYTHONPATH=. ; O=${OUT:-results/round28}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call3_gpu.txt
timeout 150 python -m pytest -q -m gpu tests/gpu/test_gpu_compiled_step.py 2>&1 | tee $O/call3_compiled.log \
  | tail -1 | sed "s/^/compiled_step: /" | tee -a $O/call3_gpu.txt
timeout 90 python -m pytest -q -m gpu tests/gpu/test_gpu_recompile.py 2>&1 | tee $O/call3_recompile.log | tail -1 \
  | sed "s/^/recompile: /" | tee -a $O/call3_gpu.txt
timeout 45 python -m pytest -q -m gpu tests/gpu/test_gpu_score_mma.py 2>&1 | tail -1 | sed "s/^/score_mma: /" \
  | tee -a $O/call3_gpu.txt
timeout 80 python -m pytest -q -m gpu tests/gpu/test_gpu_pdl.py 2>&1 | tee $O/call3_pdl.log | tail -1 \
  | sed "s/^/pdl: /" | tee -a $O/call3_gpu.txt
timeout 200 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48 --budgets 2048 \
  --methods quest_graph_c static --out $O/call3_e2e_7b_32k.json > $O/call3_e2e_7b.log 2>&1
grep -hE '^\| llama' $O/call3_e2e_7b_32k.md | tee -a $O/call3_gpu.txt
