#!/bin/bash
# Round 28, device call 7 (written for the next session; not run in round 28): the 8-bit codes' tensor-core score with
# the parts of q' stacked as rows (two products, not six). The script applies score_mma8_rows.patch to the device's
# copy of the tree first. Compiled offline for sm_90 (triton 3.8 here): 128
# registers, no spills, 8 KB shared memory, 1456 SASS instructions, against call 6's form (255 registers, 36 bytes
# spilled, 16 KB, 2992) and the elementwise int8 form (186, 0, 128 B, 4096). Its GPU tests first, then the kernel table
# with the form (auto) and without (off), each in its own process, then generate() at Llama-3-8B/128K.
export PYTHONPATH=. ; O=${OUT:-results/round28}; mkdir -p $O
git apply benchmarks/kernels/round28/score_mma8_rows.patch || { echo "the patch did not apply"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call7_gpu.txt
timeout 110 python -m pytest -q -m gpu tests/gpu/test_gpu_score_mma.py tests/gpu/test_gpu_bounds_reuse.py \
  -k "mma8 or default_form or bounds or reuse" 2>&1 | tee $O/call7_pytest.log | tail -1 | sed "s/^/pytest: /" \
  | tee -a $O/call7_gpu.txt
for m in auto off; do
  timeout 100 python scripts/bench_kernels.py --quick --batches 1 8 --lengths 32768 131072 --bounds key_dtype int8_channel \
    --score-mma $m --name call7_kernels_$m --out-dir $O > $O/call7_kernels_$m.log 2>&1
  grep -E "^\| llama3" $O/call7_kernels_$m.md | awk -F'|' -v m=$m '{print m,$2,$3,$4,$7,$8, "score",$10, "chain",$24, "x",$26}' \
    | tee -a $O/call7_gpu.txt
done
rm -f $O/*.json
timeout 150 python scripts/bench_e2e.py --shapes llama3-8b --lengths 131072 --budgets 2048 --new-tokens 32 \
  --methods quest_graph_c quest_graph_c:quest/16/int8_channel --out $O/call7_e2e_8b_128k.json > $O/call7_e2e.log 2>&1
grep -hE '^\| llama' $O/call7_e2e_8b_128k.md | tee -a $O/call7_gpu.txt
