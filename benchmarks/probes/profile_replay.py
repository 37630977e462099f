#!/usr/bin/env python
"""Where a captured Quest decode step's GPU time goes: torch profiler kernel durations of graph replays, summed
by kernel name per step (random-weight model of `--shape`, batch 1, one generate() to capture, then `--steps` replays
of the same slot).

    python benchmarks/probes/profile_replay.py --shape llama3-8b --length 131072 --budget 2048
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from quest_hf import patch_model
from quest_hf.bench import random_llama


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--length", type=int, default=131072)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--bounds", default="key_dtype", help="QuestConfig.bounds (key_dtype, int8, int8_channel)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    model = random_llama(a.shape, torch.float16, torch.device("cuda"), a.length + 64)
    ids = torch.randint(1, 1000, (1, a.length), device="cuda")
    patch_model(model, budget=a.budget, bounds=a.bounds)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    state = model._quest_state
    cache, graph = state.kept, state.graph.graph
    for layer in cache.layers:
        layer.pos.fill_(a.length)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            for layer in cache.layers:
                layer.pos.fill_(a.length)  # rewrite the same slot: the cache never fills up
            graph.replay()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        # The probe's own position fills (one a layer, above) are not the step's: left out (kernel "FillFunctor").
        if e.device_type == torch.autograd.DeviceType.CUDA and "fill" not in e.name.lower():
            per[e.name][0] += e.device_time / a.steps
            per[e.name][1] += 1
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])
    total = sum(v[0] for _, v in rows)
    print(f"{a.shape} L={a.length} budget={a.budget} bounds={a.bounds}: {total / 1e3:.3f} ms of kernels a step")
    for name, (us, n) in rows[: a.rows]:
        print(f"{us:9.1f} us  {n // a.steps:4d}/step  {us / total * 100:5.1f}%  {name[:110]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(args=vars(a), total_us=total,
                           kernels=[dict(name=k, us_per_step=v[0], calls_per_step=v[1] / a.steps) for k, v in rows]),
                      f, indent=1)


if __name__ == "__main__":
    main()
