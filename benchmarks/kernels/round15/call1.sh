#!/bin/bash
# Round 15, device call 1: the lean Top-K path (TopKLaunch.lean) on a GPU: its real-size tests, the Top-K alone
# with it off and on, the #16 kernel table chained with it off and on (32K and 128K, batch 1 and 8), and the
# reference floor probe in the same call (an untracked copy of ../shared/probes/floor_check.py at the repo root).
export PYTHONPATH=. ; O=${OUT:-results/round15}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_topk_chunked.py 2>&1 | tail -3
python benchmarks/kernels/bench_topk.py --configs lean=False --out $O/topk > $O/topk.log 2>&1; tail -2 $O/topk.log
cat $O/topk/bench_topk.md
python floor_check_tmp.py 32768 2>&1 | tail -8
for T in off on; do
  X=""; [ $T = off ] && X="--topk-launch lean=False"
  python scripts/bench_kernels.py --quick --lengths 32768 131072 $X --name kernels_lean_$T --out-dir $O > $O/kernels_$T.log 2>&1; tail -1 $O/kernels_$T.log
done
for T in off on; do echo "== lean $T"; grep -E '^\| llama|copy bandwidth' $O/kernels_lean_$T.md; done
