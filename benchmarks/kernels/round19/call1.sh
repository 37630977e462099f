#!/bin/bash
# Round 19, device call 1: the fused-step GPU tests (quest_step at real sizes, and a patched model's decode through
# it: QuestConfig(fused_step=...)), then Llama-2-7B/32K generate() with the separate kernels and with the defaults.
export PYTHONPATH=. ; O=${OUT:-results/round19}; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $O/gpu.txt
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $O/gpu.txt
timeout 240 python -m pytest -q -m gpu tests/gpu/test_gpu_fused_step.py -x > $O/gpu_fused_step.log 2>&1; tail -3 $O/gpu_fused_step.log
timeout 330 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --budgets 2048 --new-tokens 64 \
  --methods quest_graph_c:quest/16/key_dtype/sep quest_graph_c --out $O/e2e_7b_32k.json > $O/e2e_7b_32k.log 2>&1
grep -E '^\| llama' $O/e2e_7b_32k.md; tail -2 $O/e2e_7b_32k.log | cut -c1-300
