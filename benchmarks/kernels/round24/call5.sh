#!/bin/bash
# Round 24, device call 5 (a new machine): the library GEMV's launch settings swept on an H200 (its defaults were
# chosen on an H100) at the Llama-2-7B projection shapes; if one setting for all shapes beats the
# defaults' summed time by >= 1% (the same-run A/B), it becomes the default in this copy of the tree
# (set_gemv_defaults.py) and generate() at Llama-2-7B/32K runs on it; the GPU tests of fuse_residual, the segments
# and the GEMV run either way.
export PYTHONPATH=. ; O=${OUT:-results/round24}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/call5_gpu.txt
grep -q H200 $O/call5_gpu.txt || { echo "not an H200 (round 23 swept the GEMV on an H100): nothing run"; exit 0; }
timeout 75 python benchmarks/probes/gemv_probe.py --library --shapes "7b qkv fused 12288x4096" \
  "7b q|k|v|o 4096x4096" "7b gate_up fused 22016x4096" "7b down 4096x11008" --block-n 4 8 16 --block-k 1024 --warps 4 8 --stages 2 3 4 \
  --out $O/call5_gemv.json > $O/call5_gemv.txt 2>&1; grep -v ': [A-Z]' $O/call5_gemv.txt | cut -c1-400
G=$(python -c "
import json; c = json.load(open('$O/call5_gemv.json'))['common']
d = c['library_default_sum_us']
if d is not None and c['sum_us'] < 0.99 * d:
    print(f\"block_n={c['block_n']} block_k={c['block_k']} num_warps={c['warps']} num_stages={c['stages']}\")
" 2>/dev/null)
if [ -n "$G" ]; then  # the setting becomes the library's default in this copy of the tree
  python benchmarks/kernels/round24/set_gemv_defaults.py $G | tee -a $O/call5_gpu.txt
else
  echo "defaults kept (no setting >= 1% faster summed)" | tee -a $O/call5_gpu.txt
fi
# The GPU tests of what changed after calls 1-4 (fuse_residual's binding beneath the segment interception, the hook
# guards) and of the GEMV (on the new defaults where they changed).
timeout 85 python -m pytest -q -m gpu tests/gpu/test_gpu_fuse_residual.py tests/gpu/test_gpu_segments.py \
  tests/gpu/test_gpu_decode_gemv.py 2>&1 | tee $O/call5_pytest.log | tail -3 | tee -a $O/call5_gpu.txt
if [ -n "$G" ]; then
  timeout 95 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48 --budgets 2048 \
    --methods quest_graph_c --out $O/call5_e2e_7b_32k.json > $O/call5_e2e.log 2>&1
  grep -hE '^\| llama' $O/call5_e2e_7b_32k.md | tee -a $O/call5_gpu.txt
fi
