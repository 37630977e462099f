#!/bin/bash
# Round 21, device call 1: the weight GEMVs (cuBLAS vs a plain Triton GEMV), fused projections' tokens on a trained
# model (SmolLM2, fp16), and generate() at 7B/32K: defaults, fuse_projections=True, HF static + compile.
export PYTHONPATH=. ; O=${OUT:-results/round21}; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader > $O/gpu.txt
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $O/gpu.txt
git rev-parse --short HEAD >> $O/gpu.txt 2>/dev/null; cat $O/gpu.txt
timeout 150 python benchmarks/probes/gemv_probe.py --out $O/gemv.json 2>&1 | tee $O/gemv.txt | grep -v "Error$"
timeout 150 python benchmarks/probes/fused_tokens_real.py --out $O/fused_tokens_real.json > $O/fused_tokens_real.txt 2>&1
grep -v "GGUF\|Loading" $O/fused_tokens_real.txt | cut -c1-220
timeout 280 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --budgets 2048 --new-tokens 48 \
  --methods quest_graph_c quest_graph_c:quest/16/key_dtype/fused static --out $O/e2e_7b_32k.json > $O/e2e_7b_32k.log 2>&1
grep -E '^\| llama' $O/e2e_7b_32k.md; tail -2 $O/e2e_7b_32k.log | cut -c1-300
