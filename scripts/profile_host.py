#!/usr/bin/env python
"""Where generate()'s host time goes per token on the captured Quest path (CUDA).

    python scripts/profile_host.py --shape llama2-7b --length 4096 --tokens 64

The GPU replays the whole decode step, so every microsecond the host spends between replays (generate()'s own
work, quest_hf's step wrapper) is a microsecond the GPU idles: generate() synchronises on every token. This
times a generate() call's tokens (median per token, as bench_e2e.py), the graph replay alone, and prints the
Python functions with the most own time per token under cProfile (which inflates Python time: read it as
shares, not absolute costs). Host time barely depends on the context length, so short prompts do.
"""
import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import Clock, build, replay_ms  # noqa: E402
from quest_hf import patch_model  # noqa: E402


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


if __name__ == "__main__":
    main()
