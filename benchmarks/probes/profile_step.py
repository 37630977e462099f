#!/usr/bin/env python
"""Kernel-level profile of one Quest decode step (the fixed-shape step, run eagerly) on a random model.

    python benchmarks/probes/profile_step.py --shape llama2-7b --length 32768 --budget 2048
Prints the CUDA kernels by total time for one decode token (after warm-up); prints only (the committed
outputs beside this file are its stdout).
"""
import argparse

import torch

from quest_hf import QuestCache, patch_model
from quest_hf.bench import random_llama
from quest_hf.patch import cache_arg_name


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="llama2-7b")
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--gqa-mode", default="union")
    p.add_argument("--rows", type=int, default=18)
    a = p.parse_args()
    model = random_llama(a.shape, torch.float16, torch.device("cuda"), a.length + 64)
    patch_model(model, budget=a.budget, gqa_mode=a.gqa_mode, cuda_graph=False)  # the same step, uncaptured
    ids = torch.randint(1, 1000, (1, a.length), device="cuda")
    cache = QuestCache.from_model(model, max_length=a.length + 64)
    name = cache_arg_name(model)
    with torch.no_grad():
        model(input_ids=ids, **{name: cache})
        tok = ids[:, -1:]
        pos = torch.full_like(tok, a.length)
        for _ in range(3):
            model(input_ids=tok, position_ids=pos, **{name: cache})
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            model(input_ids=tok, position_ids=pos, **{name: cache})
            torch.cuda.synchronize()
    print(f"{a.shape} L={a.length} budget={a.budget} mode={a.gqa_mode}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
