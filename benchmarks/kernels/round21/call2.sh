#!/bin/bash
# Round 21, device call 2: the #16 layer steps at B=1 with the histogram rank search (the separate kernels), same
# call as the radix default; generate() at Llama-2-7B/32K: defaults, fuse_projections=True, HF static + compile.
export PYTHONPATH=. ; O=${OUT:-results/round21}; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader > $O/gpu2.txt; cat $O/gpu2.txt
H=${HIST:-4}
for cfg in radix hist; do
  extra=""; [ $cfg = hist ] && extra="--topk-launch hist_bits=$H"
  timeout 130 python scripts/bench_kernels.py --quick --lengths 32768 131072 --batches 1 $extra --name kernels_$cfg \
    --out-dir $O > $O/kernels_$cfg.log 2>&1; grep -E "^\|" $O/kernels_$cfg.md | head -20
done
timeout 300 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --budgets 2048 --new-tokens 48 \
  --methods quest_graph_c quest_graph_c:quest/16/key_dtype/fused static --out $O/e2e_7b_32k.json > $O/e2e_7b_32k.log 2>&1
grep -E '^\| llama' $O/e2e_7b_32k.md; tail -2 $O/e2e_7b_32k.log | cut -c1-300
