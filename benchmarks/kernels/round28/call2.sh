#!/bin/bash
# Round 28, device call 2: generate() at Llama-2-7B/32K with the defaults against HF static + compile in one
# process (#16's e2e row); round 27's two test fixes (the score-form near-tie check; test_gpu_pdl resetting dynamo,
# once as is and once with inductor's dependent launches off) and the compiled-step file, unrun since round 26.
export PYTHONPATH=. ; O=${OUT:-results/round28}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call2_gpu.txt
timeout 200 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48 --budgets 2048 \
  --methods quest_graph_c static --out $O/call2_e2e_7b_32k.json > $O/call2_e2e_7b.log 2>&1
grep -hE '^\| llama' $O/call2_e2e_7b_32k.md | tee -a $O/call2_gpu.txt
timeout 60 python -m pytest -q -m gpu tests/gpu/test_gpu_score_mma.py 2>&1 | tail -1 | sed "s/^/score_mma: /" \
  | tee -a $O/call2_gpu.txt
timeout 100 python -m pytest -q -m gpu tests/gpu/test_gpu_pdl.py 2>&1 | tee $O/call2_pdl.log | tail -1 \
  | sed "s/^/pdl as is: /" | tee -a $O/call2_gpu.txt
QUEST_HF_INDUCTOR_PDL=0 timeout 100 python -m pytest -q -m gpu tests/gpu/test_gpu_pdl.py 2>&1 | tail -1 \
  | sed "s/^/pdl, inductor PDL off: /" | tee -a $O/call2_gpu.txt
timeout 150 python -m pytest -q -m gpu tests/gpu/test_gpu_compiled_step.py 2>&1 | tee $O/call2_compiled.log \
  | tail -1 | sed "s/^/compiled_step: /" | tee -a $O/call2_gpu.txt
timeout 120 python -m pytest -q -m gpu tests/gpu/test_gpu_recompile.py 2>&1 | tee $O/call2_recompile.log | tail -1 \
  | sed "s/^/recompile: /" | tee -a $O/call2_gpu.txt
