#!/bin/bash
# Round 19, device call 3: DECODE_STEP_LAUNCH with the separate attention's tiles (32-token steps, 3 stages): the
# 7B/32K replay A/B again (and whether the 128 greedy tokens now match), then the fused-step GPU tests.
export PYTHONPATH=. ; O=${OUT:-results/round19}; mkdir -p $O
timeout 200 python benchmarks/probes/replay_ab.py --shape llama2-7b --length 32768 --field fused_step \
  --values false auto --out $O/replay_ab_7b_32k_tiles32.json > $O/replay_ab_7b_32k_tiles32.log 2>&1; grep -v -i warn $O/replay_ab_7b_32k_tiles32.log | tail -4 | cut -c1-300
timeout 200 python -m pytest -q -m gpu tests/gpu/test_gpu_fused_step.py > $O/gpu_fused_step.log 2>&1; tail -3 $O/gpu_fused_step.log
