#!/bin/bash
# Round 25, device call 1: round 21's unexplained int8_channel step (gemv_pdl_probe.py: the GEMV's dependent launch
# on / off); generate() at Llama-2-7B/32K with the defaults, with bounds="int8_channel" and HF static + compile in one
# process (the speed side of making 8-bit bounds the default); the GPU tests of the files the fast path runs through.
export PYTHONPATH=. ; O=${OUT:-results/round25}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call1_gpu.txt
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  | tee -a $O/call1_gpu.txt
timeout 100 python benchmarks/kernels/round25/gemv_pdl_probe.py > $O/call1_gemv_pdl_probe.txt 2>&1
grep -E "^bounds|Error|error" $O/call1_gemv_pdl_probe.txt | cut -c1-300
timeout 330 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48 --budgets 2048 \
  --methods quest_graph_c quest_graph_c:quest/16/int8_channel static --out $O/call1_e2e_7b_32k.json \
  > $O/call1_e2e.log 2>&1
grep -hE '^\| llama' $O/call1_e2e_7b_32k.md | tee -a $O/call1_gpu.txt
echo "recompile_limit lines: $(grep -c recompile_limit $O/call1_e2e.log)" | tee -a $O/call1_gpu.txt
timeout 120 python -m pytest -q -m gpu tests/gpu/test_gpu_fuse_residual.py tests/gpu/test_gpu_segments.py \
  tests/gpu/test_gpu_decode_gemv.py 2>&1 | tee $O/call1_pytest.log | tail -3 | tee -a $O/call1_gpu.txt
