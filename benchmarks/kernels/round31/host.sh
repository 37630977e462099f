#!/bin/bash
# Round 31, call 2: where HF static + compile's token time goes (benchmarks/probes/hf_host_probe.py: kernels vs the
# GPU waiting on the host), Llama-2-7B/32K, with Quest's captured decode in the same process; on an H200 also
# step_rows.sh (call 1 came on an H100).
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH=. ; O=${OUT:-results/round31}; mkdir -p $O
timeout 420 python benchmarks/probes/hf_host_probe.py --out $O/host_probe.json > $O/host_probe.log 2>&1; echo "rc $?" >> $O/host_probe.log
lscpu | head -20 > $O/host_lscpu.txt
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  OUT=$O/r bash benchmarks/kernels/round31/step_rows.sh; cp $O/r/*.log $O/r/*.txt $O/ 2>/dev/null; rm -rf $O/r
fi
