#!/bin/bash
# Round 15, device call 5 (final tree: the interpreter's plain reductions behind a constexpr, compiled code unchanged):
# the Top-K GPU tests and the attention/decode GPU tests that run the Top-K.
export PYTHONPATH=. ; O=${OUT:-results/round15}; mkdir -p $O
timeout 270 python -m pytest -q -m gpu tests/gpu/test_gpu_topk_chunked.py tests/gpu/test_gpu.py -k "topk or union or lean or onepass or kernels or captured_step" -p no:cacheprovider > $O/gpu_topk_final.txt 2>&1; tail -2 $O/gpu_topk_final.txt
