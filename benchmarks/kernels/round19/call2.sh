#!/bin/bash
# Round 19, device call 2: the captured Llama-2-7B/32K step's replay with the separate kernels and with the
# three-launch step (fused_step False vs "auto"), alternated in one process; key_dtype then int8_channel bounds;
# then the fused-step GPU tests again (looser logit tolerance for the int8c row).
export PYTHONPATH=. ; O=${OUT:-results/round19}; mkdir -p $O
for b in key_dtype int8_channel; do
timeout 200 python benchmarks/probes/replay_ab.py --shape llama2-7b --length 32768 --bounds $b --field fused_step \
  --values false auto --out $O/replay_ab_7b_32k_$b.json > $O/replay_ab_7b_32k_$b.log 2>&1; grep -v -i warn $O/replay_ab_7b_32k_$b.log | tail -4 | cut -c1-300
done
timeout 150 python -m pytest -q -m gpu tests/gpu/test_gpu_fused_step.py > $O/gpu_fused_step.log 2>&1; tail -3 $O/gpu_fused_step.log
