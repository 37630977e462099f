#!/bin/bash
# Round 18, device call 3: the zero-math floor of every #16 row's shape (benchmarks/probes/floor_step.py: the GQA
# shared and union rows' own floors), the reference probe at 32K as its cross-check, and the #16 kernel table
# (scripts/bench_kernels.py --quick, both bound encodings), all in one session.
export PYTHONPATH=. ; O=${OUT:-results/round18}; mkdir -p $O
timeout 60 python floor_check_tmp.py 32768 > $O/floor_ref_32k.txt 2>&1; tail -1 $O/floor_ref_32k.txt | cut -c1-400
timeout 200 python benchmarks/probes/floor_step.py --out $O > $O/floor_step.txt 2>&1; cat $O/floor_step.txt | grep -v -i warn
timeout 300 python scripts/bench_kernels.py --quick --bounds key_dtype int8_channel --name kernels --out-dir $O \
  > $O/kernels.log 2>&1; grep -E "^\| llama|copy bandwidth" $O/kernels.log | cut -c1-400
