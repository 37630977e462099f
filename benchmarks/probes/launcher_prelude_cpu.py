#!/usr/bin/env python
"""Host time of the Triton launchers' own Python (argument checks, workspace, grid), with the kernel launch itself
stubbed out (`JITFunction.run` returns at once), on CPU tensors of a 7B decode layer's shapes (4K capacity).

    PYTHONPATH=. python benchmarks/probes/launcher_prelude_cpu.py

What an uncaptured CUDA step pays a launch on top of Triton's own launch, measured without a GPU (CPU
`torch.empty` stands in for the caching allocator). Prints the mean microseconds of 2000 calls per launcher.
"""
import importlib
import time

import torch
import triton.runtime.jit

import triton_kernels as tk


def timed(name, f, n=2000):
    for _ in range(50):
        f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    print(f"{name:12s} {(time.perf_counter() - t0) / n * 1e6:6.1f} us")


def main():
    triton.runtime.jit.JITFunction.run = lambda self, *a, **k: None  # no launch: the launcher's Python only
    for m in ("sparse_attention", "topk", "score", "append"):
        mod = importlib.import_module(f"triton_kernels.{m}")
        if hasattr(mod, "num_sms"):
            mod.num_sms = lambda device: 132  # an H200's SMs (the CPU has no properties to read)
    B, H, G, D, C, S, K = 1, 32, 1, 128, 4096 + 16, 16, 128
    q = torch.randn(B, H * G, D, dtype=torch.float16)
    k = torch.zeros(B, H, C, D, dtype=torch.float16)
    v = torch.zeros_like(k)
    kmin = torch.zeros(B, H, C // S, D, dtype=torch.float16)
    kmax = torch.zeros_like(kmin)
    valid = torch.ones(B, C, dtype=torch.bool)
    pos = torch.tensor(4000)
    ids = torch.zeros(B, H, K, dtype=torch.int32)
    scores = torch.zeros(B, H * G, C // S, dtype=torch.float32)
    kn = torch.zeros(B, H, 1, D, dtype=torch.float16)
    timed("attention", lambda: tk.sparse_decode_attention(q, k, v, ids, valid, C, S, 0.088))
    timed("score", lambda: tk.score_pages(q, kmin, kmax, C, S, pos=pos))
    timed("topk", lambda: tk.topk_pages(scores, K, G))
    timed("append", lambda: tk.append_token_at(k, v, kmin, kmax, valid, kn, kn, None, pos))


if __name__ == "__main__":
    main()
