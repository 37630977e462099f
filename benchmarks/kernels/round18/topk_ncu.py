"""Round 18: the captured 32K decode's Top-K (32 rows of 2053 pages, k 129, the lean row kernel) launched alone,
for Nsight Compute to attribute its time by source line. Usage: python topk_ncu.py [P] [rows] [k]"""
import sys

import torch

import triton_kernels as tk

P = int(sys.argv[1]) if len(sys.argv) > 1 else 2053
R = int(sys.argv[2]) if len(sys.argv) > 2 else 32
K = int(sys.argv[3]) if len(sys.argv) > 3 else 129
g = torch.Generator(device="cuda").manual_seed(0)
scores = torch.randn(1, R, P, device="cuda", generator=g)
scores[..., -1] = float("inf")
for _ in range(6):
    ids = tk.topk_pages(scores, K)
torch.cuda.synchronize()
print("ids", tuple(ids.shape), "equal to torch.topk's:", torch.equal(ids, tk.topk_pages_ref(scores, K)))
