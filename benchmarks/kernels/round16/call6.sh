#!/bin/bash
# Round 16, device call 6 (review: the tail keys' load through `_tail_keys` with a cache modifier, the fused
# launcher's checks through the attention launcher's): the fused-step, Top-K and kernel GPU tests.
export PYTHONPATH=. ; O=${OUT:-results/round16}; mkdir -p $O
timeout 400 python -m pytest -q -m gpu tests/gpu/test_gpu_fused_step.py tests/gpu/test_gpu_topk_chunked.py tests/gpu/test_gpu.py -k "fused or topk or union or lean or onepass or kernels or captured_step" -p no:cacheprovider > $O/pytest_gpu_review.txt 2>&1; tail -3 $O/pytest_gpu_review.txt
