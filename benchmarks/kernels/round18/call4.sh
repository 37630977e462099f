#!/bin/bash
# Round 18, device call 4: the Top-K with more warps a row (fewer keys a thread: the ncu profile of call 2 put the
# lean Top-K at ~2800 instructions a warp, one warp a scheduler, 5 cycles an instruction), alone and in the layer steps.
export PYTHONPATH=. ; O=${OUT:-results/round18}; mkdir -p $O
timeout 200 python benchmarks/kernels/bench_topk.py --out $O \
  --configs keys_per_thread=8,max_warps=16 keys_per_thread=4,max_warps=16 keys_per_thread=32 > $O/bench_topk.txt 2>&1
grep -v -i warn $O/bench_topk.txt | tail -30 | cut -c1-300
for kpt in 16 8 4; do
  timeout 120 python scripts/bench_kernels.py --quick --lengths 32768 131072 --batches 1 --bounds key_dtype \
    --topk-launch keys_per_thread=$kpt max_warps=16 --name kernels_kpt$kpt --out-dir $O > $O/kernels_kpt$kpt.log 2>&1
  echo "keys_per_thread=$kpt"; grep -E "^\| llama" $O/kernels_kpt$kpt.log | cut -d'|' -f2-8,24-27
done
