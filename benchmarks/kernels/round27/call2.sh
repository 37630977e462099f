#!/bin/bash
# Round 27, device call 2: generate() at Llama-2-7B/32K with the defaults against HF static + compile in one
# process (#16's e2e row), then the GPU suite on this round's library code but the compiled-step file (call 3).
export PYTHONPATH=. ; O=${OUT:-results/round27}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call2_gpu.txt
timeout 200 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48 --budgets 2048 \
  --methods quest_graph_c static --out $O/call2_e2e_7b_32k.json > $O/call2_e2e_7b.log 2>&1
grep -hE '^\| llama' $O/call2_e2e_7b_32k.md | tee -a $O/call2_gpu.txt
timeout 370 python -m pytest -q -m gpu tests/gpu --ignore=tests/gpu/test_gpu_compiled_step.py 2>&1 \
  | tee $O/call2_pytest.log | tail -4 | tee -a $O/call2_gpu.txt
