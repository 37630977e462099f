#!/bin/bash
# Round 28, device call 6: the 8-bit codes' tensor-core score form ("mma8": q x channel scales in three bf16 parts, six
# products a KV group). Applies $PATCH (default score_mma8.patch) to the device's copy of the tree, then its GPU tests,
# the kernel table with the form (auto, the default for GQA) and without it (off), each in its own process, then
# generate() at Llama-3-8B/128K with key-dtype and int8_channel bounds. Outputs are named $NAME_* (default call6).
# call7.sh runs the same with score_mma8_rows.patch. (Call 6 itself ran on a tree with the patch already applied.)
export PYTHONPATH=. ; O=${OUT:-results/round28}; mkdir -p $O
N=${NAME:-call6}
git apply ${PATCH:-benchmarks/kernels/round28/score_mma8.patch} || { echo "the patch did not apply"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/${N}_gpu.txt
timeout 110 python -m pytest -q -m gpu tests/gpu/test_gpu_score_mma.py tests/gpu/test_gpu_bounds_reuse.py \
  -k "mma8 or default_form or bounds or reuse" 2>&1 | tee $O/${N}_pytest.log | tail -1 | sed "s/^/pytest: /" \
  | tee -a $O/${N}_gpu.txt
for m in auto off; do
  timeout 100 python scripts/bench_kernels.py --quick --batches 1 8 --lengths 32768 131072 --bounds key_dtype int8_channel \
    --score-mma $m --name ${N}_kernels_$m --out-dir $O > $O/${N}_kernels_$m.log 2>&1
  grep -E "^\| llama" $O/${N}_kernels_$m.md | awk -F'|' -v m=$m '{print m,$2,$3,$4,$7,$8, "score",$10, "chain",$24, "x",$26}' \
    | tee -a $O/${N}_gpu.txt
done
rm -f $O/*.json
timeout 150 python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --budgets 2048 --new-tokens 32 \
  --methods quest_graph_c quest_graph_c:quest/16/int8_channel --out $O/${N}_e2e_8b_128k.json > $O/${N}_e2e.log 2>&1
grep -hE '^\| llama' $O/${N}_e2e_8b_128k.md | tee -a $O/${N}_gpu.txt
