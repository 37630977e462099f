#!/bin/bash
# Round 23, device call 3 (same machine): the compiled-step GPU tests (call 1's 150 s timeout cut them), then call 2's
# GEMV sweep and generate() again (the probe passed a 1-D out to the library's GEMV, which wants [1, N]).
export PYTHONPATH=. ; O=${OUT:-results/round23}; mkdir -p $O
timeout 240 python -m pytest -q -m gpu tests/gpu/test_gpu_compiled_step.py 2>&1 | tail -3 | tee $O/call3_gpu.txt
sed -n '/^timeout 120 python benchmarks/,$p' benchmarks/kernels/round23/call2.sh | sed 's/call2_/call3_/g' > /tmp/c3.sh
O=$O bash -c "export PYTHONPATH=.; O=$O; $(cat /tmp/c3.sh)"
