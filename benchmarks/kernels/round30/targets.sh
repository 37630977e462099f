#!/bin/bash
# Round 30 (as round 28's call1.sh) (an H200: #16's targets are set there): the kernel rows on the current tree (the GQA score's
# tensor-core form is the default since round 27), generate() with the defaults at Llama-2-7B/32K against HF static +
# compile in one process and at Llama-3-8B/128K, then the zero-math floor of each kernel row's shape.
export PYTHONPATH=. ; O=${OUT:-results/round30}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/targets_gpu.txt
timeout 130 python scripts/bench_kernels.py --quick --bounds key_dtype int8_channel --name targets_kernels --out-dir $O \
  > $O/targets_kernels.log 2>&1
grep -E "^\| llama" $O/targets_kernels.md | awk -F'|' '{print $2,$3,$4,$5,$6,$7, "score",$10, "graph",$14, "chain",$24, "x",$26}' \
  | tee -a $O/targets_gpu.txt
timeout 200 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48 --budgets 2048 \
  --methods quest_graph_c static --out $O/targets_e2e_7b_32k.json > $O/targets_e2e_7b.log 2>&1
timeout 130 python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --new-tokens 32 --budgets 2048 \
  --methods quest_graph_c --out $O/targets_e2e_8b_128k.json > $O/targets_e2e_8b.log 2>&1
grep -hE '^\| llama' $O/targets_e2e_*.md | tee -a $O/targets_gpu.txt
timeout 115 python benchmarks/probes/floor_step.py --out $O > $O/targets_floor_step.txt 2>&1
grep -v -i warn $O/targets_floor_step.txt | tail -10 | cut -c1-250 | tee -a $O/targets_gpu.txt
rm -f $O/*.json  # the device returns at most 8 files; the .md tables carry the rows
