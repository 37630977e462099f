#!/usr/bin/env python
"""How much of a captured Quest decode step is the graph launch (CUDA)?

    python scripts/probe_graph_launch.py --shape llama2-7b --length 4096

For the decode graph that generate() replays, medians over 30 replays of:
  host_ms   the CPU time of one `CUDAGraph.replay()` call (GPU idle before it),
  idle_ms   GPU time from an event recorded just before the call to one just after, GPU idle before (what
            bench_e2e.py's "graph replay" reports: any launch latency the GPU waits through is inside),
  busy_ms   the same for a replay queued behind another one (the GPU is busy while the host launches it,
            so launch latency is hidden),
idle_ms - busy_ms is the launch latency a token pays when the host waits for
the GPU every token, as generate() does.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import build  # noqa: E402
from quest_hf import QuestCache, patch_model  # noqa: E402
from quest_hf.patch import cache_arg_name  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama2-7b")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--budget", type=int, default=2048)
    a = p.parse_args()
    dev = torch.device("cuda")
    model = build(a.shape, torch.float16, dev, a.length + 16)
    patch_model(model, budget=a.budget, cuda_graph=True, compile_decode=True)
    ids = torch.randint(1, 1000, (1, a.length), device=dev)
    cache = QuestCache.from_model(model, max_length=a.length + 16)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                   **{cache_arg_name(model): cache})
    graph = cache.graph.graph
    def reset():
        for layer in cache.layers:
            layer.pos.fill_(a.length)  # rewrite the same slot: the cache never fills up

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
    med = statistics.median
    print(f"{a.shape} L={a.length}: host {med(host):.3f} ms, idle {med(idle):.3f} ms, "
          f"busy {med(busy):.3f} ms, exposed launch {med(idle) - med(busy):.3f} ms")


if __name__ == "__main__":
    main()
