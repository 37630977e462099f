#!/bin/bash
# Round 26, device call 1: dependent launches for the rest of the captured step (inductor's compiled norms / MLPs /
# rotary via triton.enable_pdl, the append, the scoring launch): generate() at Llama-2-7B/32K, defaults and HF
# static + compile, the tree before (_ab/base: `git archive` of the commit before, untracked) and after, each in its
# own process, same machine (same tokens?); then the three-launch step's Top-K launch at 1, 2, 4 (the default) and 8
# warps (StepLaunch.topk_warps), chained.
export PYTHONPATH=. ; O=${OUT:-results/round26}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call1_gpu.txt
python -c "import torch, triton, transformers, torch._inductor.config as c; print(torch.__version__, triton.__version__, \
transformers.__version__, 'inductor enable_pdl:', getattr(c.triton, 'enable_pdl', 'absent'))" | tee -a $O/call1_gpu.txt
for T in base new; do
  R=. ; [ $T = base ] && R=_ab/base
  PYTHONPATH=$R timeout 200 python $R/scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48 \
    --budgets 2048 --methods quest_graph_c static --out $O/call1_e2e_$T.json > $O/call1_e2e_$T.log 2>&1
  echo "tree $T"; grep -hE '^\| llama' $O/call1_e2e_$T.md | tee -a $O/call1_gpu.txt
  python -c "import json; print([(r['method'], r['tokens_sha1'][:12], r.get('graph_replay_ms')) for r in json.load(open('$O/call1_e2e_$T.json'))['rows']])" \
    | tee -a $O/call1_gpu.txt
done
grep -i -E "warn.*compile|failed|error" $O/call1_e2e_new.log | head -5
B="launches=3,score_programs=4"
timeout 120 python benchmarks/kernels/bench_fused_step.py --rows 7b-32k-alloc 7b-32k-int8c 7b-128k --out $O/call1_fs \
  --configs $B $B,topk_warps=1 $B,topk_warps=2 $B,topk_warps=8 > $O/call1_fused_step.txt 2>&1
grep -E "SDPA|\[" $O/call1_fused_step.txt | cut -c1-150
