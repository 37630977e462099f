#!/bin/bash
# Round 32, call 2 (an H200): round 31's step_rows.sh (the step a patched 7B runs at B=1 against the separate kernels
# and the same call's floor), then round 30's targets.sh (the kernel rows, generate() at 7B/32K against HF static +
# compile in one process and 8B/128K, each kernel row's floor), with shorter timeouts to fit one call.
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH=. PYTHONUNBUFFERED=1; O=${OUT:-results/round32}; mkdir -p $O
sed -i 's/timeout 300/timeout 150/; s/timeout 120/timeout 70/' benchmarks/kernels/round31/step_rows.sh
OUT=$O bash benchmarks/kernels/round31/step_rows.sh
OUT=$O bash benchmarks/kernels/round30/targets.sh
find $O -name '*.json' -delete
