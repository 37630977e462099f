"""Probe: the compiled uncaptured step (`cuda_graph=False`) with `compile_capacity="exact"` (symbolic capacity) vs
`"bucket"` (static shapes), on a Llama-2-7B-shaped model cut to a few layers: ms per decode step and a profiler
table of one short generate() (host and device time per op), to attribute the difference.

    python benchmarks/probes/compile_capacity.py --layers 6 --length 32768 --out results/probes
"""
import argparse
import json
import os
import time

import torch

from quest_hf import patch_model
from quest_hf.bench import MODEL_SHAPES, random_llama


def step_ms(model, ids, short=8, long=40):
    def run(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    run(short)  # compiles
    run(short)
    a, b = min(run(short) for _ in range(2)), min(run(long) for _ in range(2))
    return (b - a) / (long - short) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--modes", nargs="+", default=["bucket", "exact"])
    ap.add_argument("--out", default="results/probes")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    MODEL_SHAPES["probe"] = dict(MODEL_SHAPES["llama2-7b"], num_hidden_layers=args.layers)
    torch.manual_seed(0)
    model = random_llama("probe", torch.float16, torch.device("cuda"), args.length + 64)
    ids = torch.randint(2, 30000, (1, args.length), device="cuda")
    rows = {}
    for mode in args.modes:
        torch._dynamo.reset()
        patch_model(model, budget=2048, page_size=16, cuda_graph=False, compile_capacity=mode)
        ms = step_ms(model, ids)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                           do_sample=False)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        table_dev = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25)
        step = model._quest_state.compiled_step
        rows[mode] = dict(step_ms=ms, calls=step.calls, traced=step.traced_calls, failed=step.failed,
                          graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"])
        print(mode, rows[mode], flush=True)
        with open(os.path.join(args.out, f"profile_{mode}.txt"), "w") as f:
            f.write(table + "\n\n" + table_dev)
        print(table[:6000], flush=True)
    json.dump(rows, open(os.path.join(args.out, "compile_capacity.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
