#!/usr/bin/env python
"""Where generate()'s host time goes per token on the captured Quest path (CUDA).

    python benchmarks/probes/profile_host.py --shape llama2-7b --length 4096 --tokens 64

The GPU replays the whole decode step, so every microsecond the host spends between replays (generate()'s own
work, quest_hf's step wrapper) is a microsecond the GPU idles: generate() synchronises on every token. This
times a generate() call's tokens (median per token, as scripts/bench_e2e.py), the graph replay alone
(quest_hf.bench's timer, median of 20), and prints the
Python functions with the most own time per token under cProfile (which inflates Python time: read it as
shares, not absolute costs). Host time barely depends on the context length, so short prompts do.

It also times the graph launch itself, medians over 30 replays: `host` the CPU time of one `replay()` call,
`idle` the GPU time between events recorded around a replay launched onto an idle GPU, `busy` the same for a
replay queued behind another (launch latency hidden; both by quest_hf.bench.time_calls without its GPU spin);
idle - busy is the launch latency a token pays when the host waits for the GPU every token.
Prints only (the committed output, benchmarks/probes/profile_host_7b_r6.txt, is this script's stdout).
"""
import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from quest_hf import QuestCache, patch_model
from quest_hf.bench import Clock, random_llama, time_calls
from quest_hf.patch import cache_arg_name


def launch_probe(model, ids, length):
    """(replay, host, idle, busy) medians in ms for the decode graph of a fresh cache (see the module docstring)."""
    cache = QuestCache.from_model(model, max_length=length + 16)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                   **{cache_arg_name(model): cache})
    graph = cache.graph.graph

    def reset():
        for layer in cache.layers:
            layer.pos.fill_(length)  # rewrite the same slot: the cache never fills up

    replay = time_calls(graph.replay, before=reset, warmup=1, iters=20) * 1e-3
    host = []
    for _ in range(30):
        reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        host.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()

    def idle_gpu():
        reset()
        torch.cuda.synchronize()

    def busy_gpu():
        reset()
        graph.replay()  # keeps the GPU busy while the timed one is launched

    idle = time_calls(graph.replay, before=idle_gpu, warmup=0, iters=30, spin_cycles=0) * 1e-3
    busy = time_calls(graph.replay, before=busy_gpu, warmup=0, iters=30, spin_cycles=0) * 1e-3
    return replay, statistics.median(host), idle, busy


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama2-7b")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--rows", type=int, default=30)
    a = p.parse_args()
    dev = torch.device("cuda")
    model = random_llama(a.shape, torch.float16, dev, a.length + a.tokens)
    patch_model(model, budget=a.budget, cuda_graph=True, compile_decode=True)
    ids = torch.randint(1, 1000, (1, a.length), device=dev)

    def run(**kw):
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.tokens,
                              min_new_tokens=a.tokens, do_sample=False, **kw)

    run()
    clock = Clock(dev)
    run(streamer=clock)
    steps = sorted(b - x for x, b in zip(clock.t[1:], clock.t[2:], strict=False))
    step = steps[len(steps) // 2] * 1e3
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    run()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.rows)
    print(s.getvalue())
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(a.rows)
    print(s.getvalue())
    replay, host, idle, busy = launch_probe(model, ids, a.length)
    print(f"{a.shape} L={a.length}: {step:.3f} ms/token in generate(), graph replay {replay:.3f} ms, "
          f"host gap {step - replay:.3f} ms/token")
    print(f"graph launch: host {host:.3f} ms, idle {idle:.3f} ms, busy {busy:.3f} ms, "
          f"exposed launch {idle - busy:.3f} ms")


if __name__ == "__main__":
    main()
