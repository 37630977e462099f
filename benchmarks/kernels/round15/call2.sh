#!/bin/bash
# Round 15, device call 2 (tail tile held apart again in the lean path): its real-size tests, the Top-K alone with
# it off and on, the #16 kernel table chained with it off and on at 32K and 128K, batch 1 and 8.
export PYTHONPATH=. ; O=${OUT:-results/round15}; mkdir -p $O
python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_topk_chunked.py 2>&1 | tail -2
python benchmarks/kernels/bench_topk.py --configs lean=False --out $O > $O/topk.log 2>&1; tail -1 $O/topk.log
grep -E '^\|' $O/bench_topk.md
for T in off on; do
  X=""; [ $T = off ] && X="--topk-launch lean=False"
  python scripts/bench_kernels.py --quick --lengths 32768 131072 $X --name kernels_lean_$T --out-dir $O > $O/kernels_$T.log 2>&1; tail -1 $O/kernels_$T.log
done
for T in off on; do echo "== lean $T"; grep -E '^\| llama' $O/kernels_lean_$T.md | cut -d'|' -f2-4,7,11,24-28; done
