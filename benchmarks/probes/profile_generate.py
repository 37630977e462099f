#!/usr/bin/env python
"""Where a captured Quest decode's time goes between graph replays, inside `generate()` (CUDA).

    python benchmarks/probes/profile_generate.py --shape llama3-8b --length 131072 --budget 2048 --tokens 24

scripts/bench_e2e.py reports a token's wall time (ms/token) and the graph replay's GPU time alone; the difference
is what generate() adds per token. This probe profiles one timed generate() call (after a warm-up call that
captures the graph; a streamer as in the bench) with the torch profiler and splits each decode step, from the
start of one replay's first kernel to the next replay's first kernel, into:
  graph      the span of the replay's own kernels (those whose launch is the step's cudaGraphLaunch)
  outside    GPU work launched by anything else between two replays (generate()'s logits processing, argmax,
             stop check, the step wrapper's input copies), by kernel name
  idle       the rest of the gap: the GPU waiting for the host
and says, per step, whether the host launched the next replay before the GPU finished the current one (host
ahead) or after (the GPU waited on the host: `late` steps). Medians over the steps after the first two.
Prints a table; `--out` also writes it as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from quest_hf import patch_model
from quest_hf.bench import Clock, random_llama


def split_steps(trace: dict) -> dict:
    """The per-step split described in the module docstring, from a chrome trace's events."""
    ev = trace["traceEvents"]
    runtime = {e["args"]["correlation"]: e for e in ev if e.get("cat") == "cuda_runtime" and "correlation" in
               e.get("args", {})}
    gpu = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    graph_launch = {c for c, e in runtime.items() if e["name"] == "cudaGraphLaunch"}
    steps = defaultdict(list)  # graph launch correlation -> its kernels
    for e in gpu:
        if e["args"].get("correlation") in graph_launch:
            steps[e["args"]["correlation"]].append(e)
    order = sorted(steps, key=lambda c: steps[c][0]["ts"])
    rows, outside_names = [], defaultdict(float)
    for a, b in zip(order, order[1:]):
        first, last = steps[a][0]["ts"], max(k["ts"] + k["dur"] for k in steps[a])
        nxt = steps[b][0]["ts"]
        between = [e for e in gpu if last <= e["ts"] < nxt and e["args"].get("correlation") not in graph_launch]
        out_us = sum(e["dur"] for e in between)
        for e in between:
            outside_names[e["name"][:90]] += e["dur"]
        launch_b = runtime[b]["ts"]  # host time of the next replay's launch (same clock as the GPU events)
        rows.append(dict(graph_us=last - first, kernels_us=sum(k["dur"] for k in steps[a]), outside_us=out_us,
                         idle_us=nxt - last - out_us, step_us=nxt - first, late=launch_b > last,
                         n_outside=len(between)))
    keep = rows[2:] or rows
    med = {k: statistics.median(r[k] for r in keep) for k in ("graph_us", "kernels_us", "outside_us", "idle_us",
                                                             "step_us", "n_outside")}
    return dict(steps=len(keep), median=med, late_steps=sum(r["late"] for r in keep),
                outside_by_name={k: v / len(rows) for k, v in sorted(outside_names.items(), key=lambda kv: -kv[1])},
                rows=rows)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--length", type=int, default=131072)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    model = random_llama(a.shape, torch.float16, dev, a.length + a.tokens + 64)
    ids = torch.randint(1, 1000, (1, a.length), device=dev)
    patch_model(model, budget=a.budget)

    def run():
        clock = Clock(dev)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.tokens, min_new_tokens=a.tokens,
                       do_sample=False, streamer=clock)
        return clock

    run()  # warm-up: compiles and captures
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # CUPTI only: kernels and runtime calls
        clock = run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            res = split_steps(json.load(f))
    gaps = sorted(b - a for a, b in zip(clock.t[2:], clock.t[3:]))
    res["streamer_ms_per_token"] = 1e3 * gaps[len(gaps) // 2] if gaps else None
    res["args"] = vars(a)
    m = res["median"]
    print(f"{a.shape} L={a.length} budget={a.budget}: {res['steps']} steps (profiled: CUPTI adds host time a launch)")
    print(f"  step {m['step_us']:.0f} us = graph {m['graph_us']:.0f} (its kernels {m['kernels_us']:.0f}) + outside "
          f"{m['outside_us']:.0f} ({m['n_outside']:.0f} launches) + idle {m['idle_us']:.0f}; "
          f"host launched late on {res['late_steps']} of {res['steps']} steps; "
          f"streamer {res['streamer_ms_per_token']:.3f} ms/token")
    print("  outside the graph, us a step:")
    for name, us in list(res["outside_by_name"].items())[:15]:
        print(f"    {us:7.1f}  {name}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({k: v for k, v in res.items()}, f, indent=1)


if __name__ == "__main__":
    main()
