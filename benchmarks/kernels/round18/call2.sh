#!/bin/bash
# Round 18, device call 2: the resident scoring grid where more score items make more rounds (128K, batch 8),
# then Nsight Compute on the lean Top-K alone (32 x 2053, where its ~5 us over a dependent tiny kernel goes).
export PYTHONPATH=. ; O=${OUT:-results/round18}; mkdir -p $O
timeout 280 python benchmarks/kernels/bench_fused_step.py --out $O --rows 7b-128k 7b-128k-int8c 7b-32k-b8 \
  --configs launches=3,num_warps=8 launches=3,num_warps=8,score_programs=2 launches=3,num_warps=8,score_programs=4 \
  launches=3,num_warps=8,score_item=128,score_block=64,score_programs=4 \
  > $O/bench_fused.txt 2>&1; grep -v -i warn $O/bench_fused.txt | cut -c1-330
which ncu > $O/ncu_where.txt 2>&1
timeout 200 ncu --clock-control none --kernel-name regex:topk --launch-skip 3 --launch-count 1 --set full \
  --import-source yes -f -o $O/topk python benchmarks/kernels/round18/topk_ncu.py > $O/ncu_run.txt 2>&1
tail -5 $O/ncu_run.txt
timeout 60 ncu -i $O/topk.ncu-rep --page details > $O/topk_details.txt 2>&1
grep -E "Duration|Registers|Achieved Occupancy|Stall|Warp Cycles|Issued" $O/topk_details.txt | head -30
timeout 60 ncu -i $O/topk.ncu-rep --page source --csv --print-source cuda > $O/topk_source_cuda.csv 2>&1
timeout 60 ncu -i $O/topk.ncu-rep --page source --csv --print-source sass > $O/topk_source_sass.csv 2>&1
wc -l $O/topk_source_*.csv; head -3 $O/topk_source_cuda.csv | cut -c1-600
