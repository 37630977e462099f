export PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 python -m pytest -q -m gpu "tests/gpu/test_gpu_fused_step.py::test_patched_decode_through_the_fused_step_gives_the_separate_kernels_tokens" 2>&1 | grep -E "^E |passed|failed|Mismatch|Greatest" | head -30 | tee $OUT/fused_step_fail.txt
timeout 330 python -m pytest -q -m gpu tests/gpu/test_gpu_fused_step.py tests/gpu/test_gpu_bounds_reuse.py tests/gpu/test_gpu_segments.py tests/gpu/test_gpu_topk_chunked.py tests/gpu/test_gpu_offload.py --deselect "tests/gpu/test_gpu_fused_step.py::test_patched_decode_through_the_fused_step_gives_the_separate_kernels_tokens" 2>&1 | tail -15 | tee $OUT/pytest_rest2.txt
