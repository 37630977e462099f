#!/bin/bash
# Round 24, device call 5 (a new machine, the device time left): first the GPU tests of what changed after calls 1-4
# (fuse_residual's binding beneath the segment interception, the hook guards), with the segments and the GEMV; then,
# on an H200 only (round 23 swept it on an H100), the library GEMV's launch settings at the Llama-2-7B projection
# shapes. If one setting for all shapes beats the defaults' summed time by >= 1% (the same-run A/B), it becomes the
# default in this copy of the tree (set_gemv_defaults.py): the GEMV's GPU tests and generate() at 7B/32K run on it.
export PYTHONPATH=. ; O=${OUT:-results/round24}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call5_gpu.txt
timeout 85 python -m pytest -q -m gpu tests/gpu/test_gpu_fuse_residual.py tests/gpu/test_gpu_segments.py \
  tests/gpu/test_gpu_decode_gemv.py 2>&1 | tee $O/call5_pytest.log | tail -3 | tee -a $O/call5_gpu.txt
grep -q H200 $O/call5_gpu.txt || { echo "not an H200: no GEMV sweep"; exit 0; }
timeout 75 python benchmarks/probes/gemv_probe.py --library --shapes "7b qkv fused 12288x4096" \
  "7b q|k|v|o 4096x4096" "7b gate_up fused 22016x4096" "7b down 4096x11008" --block-n 4 8 16 --block-k 1024 \
  --warps 4 8 --stages 2 3 4 --out $O/call5_gemv.json > $O/call5_gemv.txt 2>&1
grep -v ': [A-Z]' $O/call5_gemv.txt | cut -c1-400
G=$(python -c "
import json; c = json.load(open('$O/call5_gemv.json'))['common']
d = c['library_default_sum_us']
if d is not None and c['sum_us'] < 0.99 * d:
    print(f\"block_n={c['block_n']} block_k={c['block_k']} num_warps={c['warps']} num_stages={c['stages']}\")
" 2>/dev/null)
[ -n "$G" ] || { echo "defaults kept (no setting >= 1% faster summed)" | tee -a $O/call5_gpu.txt; exit 0; }
python benchmarks/kernels/round24/set_gemv_defaults.py $G | tee -a $O/call5_gpu.txt
timeout 40 python -m pytest -q -m gpu tests/gpu/test_gpu_decode_gemv.py 2>&1 | tee $O/call5_pytest_gemv.log | tail -2 \
  | tee -a $O/call5_gpu.txt
timeout 95 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48 --budgets 2048 \
  --methods quest_graph_c --out $O/call5_e2e_7b_32k.json > $O/call5_e2e.log 2>&1
grep -hE '^\| llama' $O/call5_e2e_7b_32k.md | tee -a $O/call5_gpu.txt
