#!/usr/bin/env python
"""Where generate()'s host time goes per token on the captured Quest path (CUDA).

    python scripts/profile_host.py --shape llama2-7b --length 4096 --tokens 64

The GPU replays the whole decode step, so every microsecond the host spends between replays (generate()'s own
work, quest_hf's step wrapper) is a microsecond the GPU idles: generate() synchronises on every token. This
times a generate() call's tokens (median per token, as bench_e2e.py), the graph replay alone, and prints the
Python functions with the most own time per token under cProfile (which inflates Python time: read it as
shares, not absolute costs). Host time barely depends on the context length, so short prompts do.

It also times the graph launch itself, medians over 30 replays: `host` the CPU time of one `replay()` call,
`idle` the GPU time between events recorded around a replay launched onto an idle GPU (what bench_e2e.py's
"graph replay" reports), `busy` the same for a replay queued behind another (launch latency hidden);
idle - busy is the launch latency a token pays when the host waits for the GPU every token.
"""
import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import Clock, build, replay_ms  # noqa: E402
from quest_hf import QuestCache, patch_model  # noqa: E402
from quest_hf.patch import cache_arg_name  # noqa: E402


def launch_probe(model, ids, length):
    """(host, idle, busy) medians in ms for the decode graph of a fresh cache (see the module docstring)."""
    cache = QuestCache.from_model(model, max_length=length + 16)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                   **{cache_arg_name(model): cache})
    graph = cache.graph.graph

    def reset():
        for layer in cache.layers:
            layer.pos.fill_(length)  # rewrite the same slot: the cache never fills up

    host, idle, busy = [], [], []
    for _ in range(30):
        reset()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t0 = time.perf_counter()
        graph.replay()
        host.append((time.perf_counter() - t0) * 1e3)
        e.record()
        torch.cuda.synchronize()
        idle.append(s.elapsed_time(e))
        reset()
        graph.replay()  # keeps the GPU busy while the next one is launched
        s2, e2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s2.record()
        graph.replay()
        e2.record()
        torch.cuda.synchronize()
        busy.append(s2.elapsed_time(e2))
    return tuple(statistics.median(x) for x in (host, idle, busy))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama2-7b")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--rows", type=int, default=30)
    a = p.parse_args()
    dev = torch.device("cuda")
    model = build(a.shape, torch.float16, dev, a.length + a.tokens)
    patch_model(model, budget=a.budget, cuda_graph=True, compile_decode=True)
    ids = torch.randint(1, 1000, (1, a.length), device=dev)
    run = lambda **kw: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.tokens,  # noqa
                                      min_new_tokens=a.tokens, do_sample=False, **kw)
    run()
    clock = Clock(dev)
    run(streamer=clock)
    steps = sorted(b - x for x, b in zip(clock.t[1:], clock.t[2:]))
    step = steps[len(steps) // 2] * 1e3
    replay = replay_ms(model, ids, a.tokens, dev)
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
    print(f"{a.shape} L={a.length}: {step:.3f} ms/token in generate(), graph replay {replay:.3f} ms, "
          f"host gap {step - replay:.3f} ms/token")
    host, idle, busy = launch_probe(model, ids, a.length)
    print(f"graph launch: host {host:.3f} ms, idle {idle:.3f} ms, busy {busy:.3f} ms, "
          f"exposed launch {idle - busy:.3f} ms")


if __name__ == "__main__":
    main()
