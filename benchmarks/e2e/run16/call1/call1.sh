#!/bin/bash
# run 16 call 1: the 7B/32K uncaptured row with the C++ wrapper's entry built apart (cpp_wrapper_build_separate):
# A at -O0 (the tree's option then), B at -O1 (environment override), one after the other
export PYTHONPATH=.
T0=$(date +%s)
P=$(python -c "import torch._inductor.codecache as c;print(c.__file__)")
D=$(dirname $P)
{ grep -n "min_optimize" $P; grep -n "min_optimize\|compile_wrapper_opt_level" $D/cpp_builder.py; } > $OUT/torch211_min_optimize.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
python -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)" >> $OUT/gpu.txt
mon() { while true; do echo "== t=$(( $(date +%s) - T0 ))s"; ps -eo etimes,pcpu,args --sort=-pcpu | grep -E "cc1plus" | grep -v grep | cut -c1-100 | head -4; sleep 15; done; }
mon > $OUT/ps.txt 2>&1 &
MON=$!
mkdir -p $OUT/a $OUT/b
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_a timeout 330 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --budgets 2048 --new-tokens 48 \
  --methods dense quest --out $OUT/a/e2e.json > $OUT/a.txt 2>&1; echo "A rc $? at $(( $(date +%s) - T0 ))s" >> $OUT/times.txt
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_b AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL=O1 timeout $(( 575 - ($(date +%s) - T0) )) python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --budgets 2048 --new-tokens 48 \
  --methods quest --out $OUT/b/e2e.json > $OUT/b.txt 2>&1; echo "B rc $? at $(( $(date +%s) - T0 ))s" >> $OUT/times.txt
kill $MON
