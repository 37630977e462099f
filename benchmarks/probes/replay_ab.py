#!/usr/bin/env python
"""A captured decode step's replay time under two settings of one QuestConfig field, in one process, alternated:
the same random-weight model of `--shape`, batch 1, one generate() of 128 tokens per setting to capture its graph
(and allocate as bench_e2e.py's rows do), then
`--rounds` rounds of `--replays` replays of each graph (the same slot rewritten), timed by CUDA events.

    python benchmarks/probes/replay_ab.py --shape llama2-7b --length 32768 --field fused_step --values false auto
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from quest_hf import patch_model
from quest_hf.bench import random_llama


def _value(text: str):
    return {"true": True, "false": False}.get(text.lower(), text)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama2-7b")
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--field", default="fused_step")
    p.add_argument("--values", nargs=2, default=["false", "auto"])
    p.add_argument("--bounds", default="key_dtype")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    model = random_llama(a.shape, torch.float16, torch.device("cuda"), a.length + 64)
    ids = torch.randint(1, 1000, (1, a.length), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    runs = {}
    for text in a.values:
        patch_model(model, budget=a.budget, bounds=a.bounds, **{a.field: _value(text)})
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, min_new_tokens=128,
                             do_sample=False)
        state = model._quest_state
        cache = state.kept
        sparse = [layer.step_kernels for layer in cache.layers if getattr(layer, "step_kernels", None)]
        runs[text] = dict(cache=cache, graph=state.graph.graph, tokens=out[0, a.length:].tolist(),
                          step_kernels=sorted(set(sparse)), ms=[])
        state.kept = None  # keep this setting's graph and cache alive here, not on the model
        state.graph.graph = None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(a.rounds):
        for run in runs.values():
            for layer in run["cache"].layers:
                layer.pos.fill_(a.length)
            run["graph"].replay()
            torch.cuda.synchronize()
            start.record()
            for _ in range(a.replays):
                run["graph"].replay()  # the position advances: 50 replays stay inside the 128 reserved slots
            end.record()
            torch.cuda.synchronize()
            run["ms"].append(start.elapsed_time(end) / a.replays)
    result = dict(args=vars(a), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  settings={t: dict(median_ms=statistics.median(r["ms"]), ms=r["ms"], step_kernels=r["step_kernels"],
                                    tokens=r["tokens"]) for t, r in runs.items()})
    for t, r in result["settings"].items():
        print(f"{a.field}={t}: replay {r['median_ms']:.3f} ms/step (rounds {', '.join(f'{x:.3f}' for x in r['ms'])}); "
              f"{r['step_kernels']}")
    first, second = (result["settings"][t] for t in a.values)
    print(f"same 128 greedy tokens: {first['tokens'] == second['tokens']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
