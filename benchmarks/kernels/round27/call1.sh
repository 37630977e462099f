#!/bin/bash
# Round 27, device call 1: the score kernel's tensor-core form (ScoreLaunch.mma) against the elementwise form in the
# kernel table (same process each; off / auto = GQA only / on), its GPU tests, then generate() at Llama-3-8B/128K
# (GQA: the separate kernels, so the new default form); the
# three-launch step (MHA, batch 1) with and without the form (StepLaunch.score_mma).
export PYTHONPATH=. ; O=${OUT:-results/round27}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call1_gpu.txt
timeout 120 python -m pytest -q -m gpu tests/gpu/test_gpu_score_mma.py 2>&1 | tee $O/call1_pytest.log | tail -3 \
  | tee -a $O/call1_gpu.txt
for m in off auto on; do
  timeout 100 python scripts/bench_kernels.py --quick --score-mma $m --name call1_kernels_$m --out-dir $O \
    > $O/call1_kernels_$m.log 2>&1
  grep -E "^\| llama" $O/call1_kernels_$m.md | awk -F'|' -v m=$m '{print m, $2,$3,$4,$7, "score",$10, "graph",$14, "chain",$24, "x",$26}' \
    | tee -a $O/call1_gpu.txt
done
B="launches=3,score_programs=4"
timeout 90 python benchmarks/kernels/bench_fused_step.py --rows 7b-32k-alloc 7b-128k --out $O/call1_fs \
  --configs $B $B,score_mma=1 > $O/call1_fused_step.txt 2>&1
grep -E "SDPA|\[" $O/call1_fused_step.txt | cut -c1-150 | tee -a $O/call1_gpu.txt
timeout 130 python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --new-tokens 32 --budgets 2048 \
  --methods quest_graph_c --out $O/call1_e2e_8b_128k.json > $O/call1_e2e_8b.log 2>&1
grep -hE '^\| llama' $O/call1_e2e_*.md | tee -a $O/call1_gpu.txt
