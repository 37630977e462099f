#!/bin/bash
# Round 31's device call: round 30's static_isolation.sh (HF static + compile alone / Quest alone / HF first), then
# step_rows.sh. Everything lands in $OUT/round31.tar.gz (the device returns few files), the summaries beside it.
cd "$(dirname "$0")/../../.." || exit 1
O=${OUT:-results/round31}; mkdir -p $O/r
OUT=$O/r bash benchmarks/kernels/round30/static_isolation.sh
OUT=$O/r bash benchmarks/kernels/round31/step_rows.sh
tar czf $O/round31.tar.gz -C $O r && cp $O/r/static_gpu.txt $O/r/step_rows.log $O/r/step_floor.txt $O/ && rm -rf $O/r
