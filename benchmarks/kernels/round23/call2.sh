#!/bin/bash
# Round 23, device call 2 (same machine): the rest of the GPU suite; the library GEMV's launch settings swept on this
# device at the 7B projection shapes; if one setting for all shapes beats the default there, generate() at
# Llama-2-7B/32K with it (against call 1's row with the defaults).
export PYTHONPATH=. ; O=${OUT:-results/round23}; mkdir -p $O
(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git rev-parse --short HEAD) | tee $O/call2_gpu.txt
timeout 320 python -m pytest -q -m gpu tests/gpu/test_gpu.py tests/gpu/test_gpu_fused_step.py \
  tests/gpu/test_gpu_bounds_reuse.py tests/gpu/test_gpu_topk_chunked.py tests/gpu/test_gpu_offload.py 2>&1 \
  | tee $O/call2_pytest.log | tail -6 | tee -a $O/call2_gpu.txt
timeout 120 python benchmarks/probes/gemv_probe.py --library --shapes "7b qkv fused 12288x4096" \
  "7b q|k|v|o 4096x4096" "7b gate_up fused 22016x4096" "7b down 4096x11008" --block-n 4 8 16 --block-k 512 1024 \
  --warps 4 8 --stages 2 3 4 --out $O/call2_gemv.json 2>&1 | tee $O/call2_gemv.txt | grep -v ': [A-Z]'
G=$(python -c "
import json; c = json.load(open('$O/call2_gemv.json'))['common']
d = (c['block_n'], c['block_k'], c['warps'], c['stages']) != (4, 1024, 8, 3)
print(f\"block_n={c['block_n']} block_k={c['block_k']} num_warps={c['warps']} num_stages={c['stages']}\" if d else '')
" 2>/dev/null)
if [ -n "$G" ]; then
  echo "generate() with --gemv-launch $G" | tee -a $O/call2_gpu.txt
  timeout 100 python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --new-tokens 48 --budgets 2048 \
    --methods quest_graph_c --gemv-launch $G --out $O/call2_e2e_7b_32k_gemv.json > $O/call2_e2e.log 2>&1
  grep -hE '^\| llama' $O/call2_e2e_7b_32k_gemv.md | tee -a $O/call2_gpu.txt
fi
