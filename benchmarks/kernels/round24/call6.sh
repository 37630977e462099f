#!/bin/bash
# Round 24, device calls 6 and 7 (call 5's machine, warm; each sent as one command line): generate() at
# Llama-2-7B/32K with the GEMV setting call 5's sweep chose (call 5's own run of it was cut by the call's time limit),
# then (call 7) the library defaults and that setting again, one after the other on the same machine.
export PYTHONPATH=. ; O=${OUT:-results/round24}; mkdir -p $O
E="python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48 --budgets 2048 --methods quest_graph_c"
G="block_n=16 block_k=1024 num_warps=8 num_stages=4"
timeout 125 $E --gemv-launch $G --out $O/call6_e2e_7b_32k_gemv.json > $O/call6_e2e.log 2>&1  # call 6
timeout 60 $E --out $O/call7_e2e_7b_32k_default.json > $O/call7_e2e.log 2>&1  # call 7
timeout 30 $E --gemv-launch $G --out $O/call7_e2e_7b_32k_gemv.json > $O/call7_e2e_gemv.log 2>&1
grep -hE '^\| llama' $O/call6_e2e_7b_32k_gemv.md $O/call7_e2e_7b_32k_default.md $O/call7_e2e_7b_32k_gemv.md
