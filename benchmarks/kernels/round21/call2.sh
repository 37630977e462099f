#!/bin/bash
# Round 21, device call 2 (device time was short): the decode GEMV's GPU tests; the GPU suite's main files on the
# new defaults (decode_gemv and fuse_projections "auto"); generate() at Llama-2-7B/32K with the defaults against
# decode_gemv=False (cuBLAS, fusion then off: the earlier default), same call. HF static + compile only if STATIC=1.
export PYTHONPATH=. ; O=${OUT:-results/round21}; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader > $O/gpu2.txt; cat $O/gpu2.txt
timeout 90 python -m pytest -q -m gpu tests/gpu/test_gpu_decode_gemv.py 2>&1 | tail -8 | tee $O/pytest_gemv.txt
timeout ${TESTS:-190} python -m pytest -q -m gpu tests/gpu/test_gpu.py tests/gpu/test_gpu_compiled_step.py 2>&1 | tail -12 | tee $O/pytest_gpu_main.txt
M="quest_graph_c quest_graph_c:quest/16/key_dtype/cublas"; [ "$STATIC" = 1 ] && M="$M static"
timeout ${E2E:-230} python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --budgets 2048 --new-tokens 48 \
  --methods $M --out $O/e2e_7b_32k.json > $O/e2e_7b_32k.log 2>&1
grep -E '^\| llama' $O/e2e_7b_32k.md; tail -2 $O/e2e_7b_32k.log | cut -c1-300
