#!/bin/bash
# Round 24, device call 3 (same machine; run as one command line): Llama-3-8B/128K with the defaults; the ops of one
# eager decode step by caller; the #16 kernel table (separate score / Top-K / attention kernels), both bound encodings.
export PYTHONPATH=. ; O=${OUT:-results/round24}; mkdir -p $O
timeout 130 python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --budgets 2048 --new-tokens 32 \
  --methods quest_graph_c --out $O/call3_e2e_8b_128k.json > $O/call3_e2e_8b.log 2>&1
grep -hE '^\| llama' $O/call3_e2e_8b_128k.md
timeout 60 python benchmarks/probes/decode_ops.py --device cuda --layers 4 --length 4096 --budget 512 \
  > $O/call3_decode_ops.txt 2>&1; head -40 $O/call3_decode_ops.txt | cut -c1-220
timeout 300 python scripts/bench_kernels.py --quick --bounds key_dtype int8_channel --name call3_kernels --out-dir $O \
  > $O/call3_kernels.log 2>&1; grep -E "^\| llama|copy bandwidth" $O/call3_kernels.log | cut -c1-300
