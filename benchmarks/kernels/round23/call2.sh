#!/bin/bash
# Round 23, device call 2 (same machine): the rest of the GPU suite; the library GEMV's launch settings swept on this
# device at the 7B projection shapes; where a captured 7B/32K step's GPU time goes (kernel durations by name).
export PYTHONPATH=. ; O=${OUT:-results/round23}; mkdir -p $O
(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git rev-parse --short HEAD) | tee $O/call2_gpu.txt
timeout 330 python -m pytest -q -m gpu tests/gpu/test_gpu.py tests/gpu/test_gpu_fused_step.py \
  tests/gpu/test_gpu_bounds_reuse.py tests/gpu/test_gpu_topk_chunked.py tests/gpu/test_gpu_offload.py 2>&1 \
  | tee $O/call2_pytest.log | tail -6 | tee -a $O/call2_gpu.txt
timeout 120 python benchmarks/probes/gemv_probe.py --library --shapes "7b qkv fused 12288x4096" \
  "7b q|k|v|o 4096x4096" "7b gate_up fused 22016x4096" "7b down 4096x11008" --block-n 4 8 16 --block-k 512 1024 \
  --warps 4 8 --stages 2 3 4 --out $O/call2_gemv.json 2>&1 | tee $O/call2_gemv.txt | grep -v ': [A-Z]'
timeout 120 python benchmarks/probes/profile_replay.py --shape llama2-7b --length 32768 --budget 2048 \
  --out $O/call2_profile_replay_7b_32k.json > $O/call2_profile.txt 2>&1; tail -30 $O/call2_profile.txt
