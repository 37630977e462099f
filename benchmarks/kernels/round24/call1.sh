#!/bin/bash
# Round 24, device call 1: the Top-K GPU tests at real sizes after round 23's edit of the thresholds kernel's store
# mask (not GPU-run before); fuse_residual's GPU test (bitwise logits, kernels a replay); generate() at
# Llama-2-7B/32K with the defaults, the defaults without fuse_residual and HF static + compile, in one process (#16's
# >= 2x from one run, and the fusion's A/B).
export PYTHONPATH=. ; O=${OUT:-results/round24}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call1_gpu.txt
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  | tee -a $O/call1_gpu.txt
timeout 90 python -m pytest -q -m gpu tests/gpu/test_gpu_topk_chunked.py tests/gpu/test_gpu_fuse_residual.py 2>&1 \
  | tee $O/call1_pytest.log | tail -4 | tee -a $O/call1_gpu.txt
timeout 400 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48 --budgets 2048 \
  --methods quest_graph_c quest_graph_c:quest/16/key_dtype/nores static --out $O/call1_e2e_7b_32k.json \
  > $O/call1_e2e.log 2>&1
grep -hE '^\| llama' $O/call1_e2e_7b_32k.md | tee -a $O/call1_gpu.txt
echo "recompile_limit lines: $(grep -c recompile_limit $O/call1_e2e.log)" | tee -a $O/call1_gpu.txt
