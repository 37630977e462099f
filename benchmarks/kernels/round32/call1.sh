#!/bin/bash
# Round 32, call 1 (round 31's plan, first on an H200): where HF static + compile's token time goes
# (benchmarks/probes/hf_host_probe.py: kernels vs the GPU waiting on the host, Llama-2-7B/32K, with Quest's captured
# decode in the same process), then round 31's int8_step.sh (the patched step's scoring variants with int8_channel
# bounds at 7B B=1 128K and 32K, key-dtype rows as the control).
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH=. PYTHONUNBUFFERED=1; O=${OUT:-results/round32}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | tee $O/gpu.txt
lscpu | head -20 > $O/host_lscpu.txt
timeout 270 python benchmarks/probes/hf_host_probe.py --out $O/host_probe.json > $O/host_probe.log 2>&1
echo "rc $?" >> $O/host_probe.log
sed -i 's/timeout 400/timeout 260/' benchmarks/kernels/round31/int8_step.sh  # this call's budget; the copy travels
OUT=$O bash benchmarks/kernels/round31/int8_step.sh
find $O -name '*.json' -delete
