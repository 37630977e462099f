#!/bin/bash
# Round 21, device call 1: the Top-K's rank search by histograms (TopKLaunch.hist_bits) alone; the weight GEMVs
# (cuBLAS vs a plain Triton GEMV); fused projections' tokens on a trained model (SmolLM2, fp16, captured decode).
export PYTHONPATH=. ; O=${OUT:-results/round21}; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader > $O/gpu.txt
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $O/gpu.txt
git rev-parse --short HEAD >> $O/gpu.txt 2>/dev/null; cat $O/gpu.txt
timeout 120 python benchmarks/kernels/bench_topk.py --out $O --configs hist_bits=4 hist_bits=8 hist_bits=2 > $O/bench_topk.txt 2>&1
cat $O/bench_topk.md 2>/dev/null || tail -5 $O/bench_topk.txt
timeout 150 python benchmarks/probes/gemv_probe.py --out $O/gemv.json 2>&1 | tee $O/gemv.txt | grep -v "Error$"
timeout 150 python benchmarks/probes/fused_tokens_real.py --out $O/fused_tokens_real.json > $O/fused_tokens_real.txt 2>&1
grep -v "GGUF\|Loading" $O/fused_tokens_real.txt | cut -c1-220
