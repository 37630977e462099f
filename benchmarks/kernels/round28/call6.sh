#!/bin/bash
# Round 28, device call 6 (on the tree with score_mma8.patch applied: git apply benchmarks/kernels/round28/score_mma8.patch): the 8-bit codes' tensor-core score form ("mma8": q x channel scales in three bf16 parts, six
# products a KV group). Its GPU tests first, then the kernel table with the form (auto, the default for GQA) and
# without it (off), each in its own process, then generate() at Llama-3-8B/128K with key-dtype and int8_channel bounds.
export PYTHONPATH=. ; O=${OUT:-results/round28}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call6_gpu.txt
timeout 110 python -m pytest -q -m gpu tests/gpu/test_gpu_score_mma.py tests/gpu/test_gpu_bounds_reuse.py -k "mma8 or default_form or bounds or reuse" 2>&1 \
  | tee $O/call6_pytest.log | tail -1 | sed "s/^/pytest: /" | tee -a $O/call6_gpu.txt
for m in auto off; do
  timeout 100 python scripts/bench_kernels.py --quick --batches 1 8 --lengths 32768 131072 --bounds key_dtype int8_channel \
    --score-mma $m --name call6_kernels_$m --out-dir $O > $O/call6_kernels_$m.log 2>&1
  grep -E "^\| llama" $O/call6_kernels_$m.md | awk -F'|' -v m=$m '{print m,$2,$3,$4,$7,$8, "score",$10, "chain",$24, "x",$26}' \
    | tee -a $O/call6_gpu.txt
done
rm -f $O/*.json
timeout 150 python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --budgets 2048 --new-tokens 32 \
  --methods quest_graph_c quest_graph_c:quest/16/int8_channel --out $O/call6_e2e_8b_128k.json > $O/call6_e2e.log 2>&1
grep -hE '^\| llama' $O/call6_e2e_8b_128k.md | tee -a $O/call6_gpu.txt
