#!/bin/bash
# Round 14, device call 1: the tail tile (TopKLaunch.tail_tile) on a GPU: its real-size test, the Top-K alone,
# the layer step over the captured decode's allocation, and the 8B/128K decode end to end, each with it off and on.
export PYTHONPATH=. ; O=${OUT:-results/round14}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_topk_chunked.py 2>&1 | tail -3
python benchmarks/kernels/bench_topk.py --configs tail_tile=64 --out $O/topk 2>&1 | grep -v Warning | tail -2
cat $O/topk/bench_topk.md
for T in off on; do
  X=""; [ $T = on ] && X="--topk-launch tail_tile=64"
  python scripts/bench_kernels.py --quick --lengths 32768 131072 --batches 1 --extra-pages 5 $X \
    --name kernels_xp5_$T --out-dir $O > $O/kernels_$T.log 2>&1; tail -1 $O/kernels_$T.log
done
for T in off on; do echo "== tail tile $T"; grep -E '^\| llama' $O/kernels_xp5_$T.md; done
for T in off on; do
  X=""; [ $T = on ] && X="--topk-launch tail_tile=64"
  python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --budgets 2048 --new-tokens 32 \
    --methods quest_graph_c $X --out $O/e2e_8b_$T.json > $O/e2e_8b_$T.log 2>&1; grep -E '^\| llama' $O/e2e_8b_$T.md; tail -2 $O/e2e_8b_$T.log
done
