#!/bin/bash
# Round 26, device call 1: dependent launches for the rest of the captured step (inductor's compiled norms / MLPs /
# rotary via triton.enable_pdl, the append, the scoring launch): generate() at Llama-2-7B/32K with the defaults, the
# tree before (_ab/base: `git archive` of eee399b, untracked) and after, each in its own process on the same machine
# (same tokens?), HF static + compile beside the latter; then the GPU tests of what the change runs through.
export PYTHONPATH=. ; O=${OUT:-results/round26}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call1_gpu.txt
python -c "import torch, triton, transformers, torch._inductor.config as c; print(torch.__version__, triton.__version__, \
transformers.__version__, 'inductor enable_pdl:', getattr(c.triton, 'enable_pdl', 'absent'))" | tee -a $O/call1_gpu.txt
for T in base new; do
  R=. ; M="quest_graph_c static"; [ $T = base ] && R=_ab/base && M=quest_graph_c
  PYTHONPATH=$R timeout 170 python $R/scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48 \
    --budgets 2048 --methods $M --out $O/call1_e2e_$T.json > $O/call1_e2e_$T.log 2>&1
  echo "tree $T"; grep -hE '^\| llama' $O/call1_e2e_$T.md | tee -a $O/call1_gpu.txt
  python -c "import json; print([(r['method'], r['tokens_sha1'][:12], r.get('graph_replay_ms')) for r in json.load(open('$O/call1_e2e_$T.json'))['rows']])" \
    | tee -a $O/call1_gpu.txt
done
grep -i -E "warn.*compile|failed|error" $O/call1_e2e_new.log | head -5 | cut -c1-300
timeout 220 python -m pytest -q -m gpu tests/gpu/test_gpu_pdl.py tests/gpu/test_gpu_fused_step.py \
  tests/gpu/test_gpu_fuse_residual.py tests/gpu/test_gpu.py 2>&1 | tee $O/call1_pytest.log | tail -4 | tee -a $O/call1_gpu.txt
