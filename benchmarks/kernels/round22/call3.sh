#!/bin/bash
# Round 22, device call 3: after the fix of compile_decode's per-layer recompiles under the GEMV (a bound projection
# was guarded by identity: one compiled MLP a layer up to dynamo's limit of 8, the other 24 layers' MLPs eager).
# generate() at Llama-2-7B/32K with the defaults and HF static + compile; Llama-3-8B/128K with the defaults; the GPU
# tests of the GEMV, the segments (their layer bindings) and the whole-step compile (it traces the bindings).
export PYTHONPATH=. ; O=${OUT:-results/round22}; mkdir -p $O
(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git rev-parse --short HEAD) | tee $O/call3_gpu.txt
E="python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48"
timeout 110 $E --budgets 2048 --methods quest_graph_c --out $O/call3_e2e_7b_32k.json > $O/call3_e2e.log 2>&1
grep -hE '^\| llama' $O/call3_e2e_7b_32k.md; grep -c recompile_limit $O/call3_e2e.log
timeout 100 python -m pytest -q -m gpu tests/gpu/test_gpu_decode_gemv.py tests/gpu/test_gpu_segments.py 2>&1 \
  | tail -3 | tee -a $O/call3_gpu.txt
timeout 170 python -m pytest -q -m gpu tests/gpu/test_gpu_compiled_step.py 2>&1 | tail -3 | tee -a $O/call3_gpu.txt
timeout 130 $E --methods static --out $O/call3_e2e_7b_static.json >> $O/call3_e2e.log 2>&1
grep -hE '^\| llama' $O/call3_e2e_7b_static.md
timeout 150 python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --budgets 2048 --new-tokens 32 \
  --methods quest_graph_c --out $O/call3_e2e_8b_128k.json > $O/call3_e2e_8b.log 2>&1
grep -hE '^\| llama' $O/call3_e2e_8b_128k.md; grep -c recompile_limit $O/call3_e2e_8b.log
