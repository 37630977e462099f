#!/bin/bash
# Round 15, device call 3: the one-pass union (TopKLaunch.onepass_union) and the lean path (lean=4096) on a GPU:
# the Top-K tests at real sizes (graph replays too), the Top-K alone with the union in three launches and one,
# the #16 kernel table chained with both off (lean=0, onepass_union=False) and the defaults, 32K and 128K.
export PYTHONPATH=. ; O=${OUT:-results/round15}; mkdir -p $O
python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_topk_chunked.py 2>&1 | tail -3
python benchmarks/kernels/bench_topk.py --configs onepass_union=False lean=0,onepass_union=False --out $O > $O/topk.log 2>&1; tail -1 $O/topk.log
grep -E '^\|' $O/bench_topk.md
for T in off on; do
  X=""; [ $T = off ] && X="--topk-launch lean=0 onepass_union=False"
  python scripts/bench_kernels.py --quick --lengths 32768 131072 $X --name kernels_r15_$T --out-dir $O > $O/kernels_$T.log 2>&1; tail -1 $O/kernels_$T.log
done
for T in off on; do echo "== round 15 Top-K $T"; grep -E '^\| llama' $O/kernels_r15_$T.md | cut -d'|' -f2-4,7,11,24-28; done
