#!/bin/bash
# session 11 call 2: the 7B/32K uncaptured row at the shipped default (C++ wrapper built whole), with the GPU suite run
# during its compile (the suite ends before the row's timed steps start)
export PYTHONPATH=.
T0=$(date +%s)
mon() { while true; do echo "== t=$(( $(date +%s) - T0 ))s"; ps -eo etimes,pcpu,args --sort=-pcpu | grep -E "cc1plus" | grep -v grep | cut -c1-100 | head -4; sleep 15; done; }
mon > $OUT/ps.txt 2>&1 &
MON=$!
mkdir -p $OUT/d $OUT/q
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_d timeout 60 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --budgets 2048 --new-tokens 48 \
  --methods dense --out $OUT/d/e2e.json > $OUT/d.txt 2>&1; echo "dense rc $? at $(( $(date +%s) - T0 ))s" >> $OUT/times.txt
( TORCHINDUCTOR_CACHE_DIR=/tmp/ind_q timeout $(( 590 - ($(date +%s) - T0) )) python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --budgets 2048 --new-tokens 48 \
  --methods quest --out $OUT/q/e2e.json > $OUT/q.txt 2>&1; echo "quest rc $? at $(( $(date +%s) - T0 ))s" >> $OUT/times.txt ) &
( TORCHINDUCTOR_CACHE_DIR=/tmp/ind_t timeout 400 python -m pytest -q -m gpu tests -p no:cacheprovider > $OUT/gpu_suite.txt 2>&1; echo "suite rc $? at $(( $(date +%s) - T0 ))s" >> $OUT/times.txt ) &
wait %2 %3
kill $MON
