#!/bin/bash
# Round 22, device call 6: after the second fix of compile_decode's per-layer MLP recompiles. Call 3 showed the
# first fix (the binding as a functools.partial) does not hold on torch 2.11: before 2.14 dynamo guards any forward
# set on a module instance by identity. The GEMV's projections are now a subclass (GemvLinear, bound by class).
# generate() at Llama-2-7B/32K with the defaults (dynamo's recompile-limit lines counted: expect 0), then the GPU
# tests of the GEMV, the segments, the whole-step compile and the patched fused step.
export PYTHONPATH=. ; O=${OUT:-results/round22}; mkdir -p $O
(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git rev-parse --short HEAD) | tee $O/call6_gpu.txt
timeout 100 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48 --budgets 2048 \
  --methods quest_graph_c --out $O/call6_e2e_7b_32k.json > $O/call6_e2e.log 2>&1
grep -hE '^\| llama' $O/call6_e2e_7b_32k.md; echo "recompile_limit lines: $(grep -c recompile_limit $O/call6_e2e.log)"
grep -o '"dynamo_unique_graphs": [0-9]*, "compiled_calls": [0-9]*' $O/call6_e2e_7b_32k.json
timeout 60 python -m pytest -q -m gpu tests/gpu/test_gpu_decode_gemv.py tests/gpu/test_gpu_segments.py 2>&1 \
  | tail -2 | tee -a $O/call6_gpu.txt
timeout 150 python -m pytest -q -m gpu tests/gpu/test_gpu_compiled_step.py 2>&1 | tail -2 | tee -a $O/call6_gpu.txt
timeout 60 python -m pytest -q -m gpu tests/gpu/test_gpu_fused_step.py -k patched_decode_through 2>&1 | tail -2 \
  | tee -a $O/call6_gpu.txt
