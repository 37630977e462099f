#!/bin/bash
# Round 32, call 1 (round 31's plan, first on an H200): where HF static + compile's token time goes
# (benchmarks/probes/hf_host_probe.py: kernels vs the GPU waiting on the host, Llama-2-7B/32K, with Quest's captured
# decode in the same process), then the patched step's scoring variants with int8_channel bounds at 7B B=1 128K, key-dtype rows as
# the control (round 31's int8_step.sh, narrowed).
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH=. PYTHONUNBUFFERED=1; O=${OUT:-results/round32}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | tee $O/gpu.txt
lscpu | head -20 > $O/host_lscpu.txt
timeout 250 python benchmarks/probes/hf_host_probe.py --out $O/host_probe.json > $O/host_probe.log 2>&1
echo "rc $?" >> $O/host_probe.log
# round 31's int8_step.sh, narrowed to fit the device time left this session: the 128K rows, three scoring forms
timeout 190 python benchmarks/kernels/bench_fused_step.py --rows 7b-128k-int8c 7b-128k \
  --configs launches=3,score_programs=4 launches=3 launches=3,score_programs=2 --out $O/int8_step \
  > $O/int8_step.log 2>&1; echo "rc $?" >> $O/int8_step.log
find $O -name '*.json' -delete
