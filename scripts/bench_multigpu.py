#!/usr/bin/env python
"""Quest on a model spread over several GPUs with an accelerate device_map, against the same model on one GPU.

Random-weight Llama-2-7B shape, fp16, a 32K prompt, budget 2048: greedy tokens on one GPU, then the same
weights dispatched layer-wise over every visible GPU; tokens must be equal. Reports decode latency of both
(from generate's per-token timestamps), where the cache layers live, and which backend ran.

    python scripts/bench_multigpu.py --length 32768 --new-tokens 32
"""
import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import transformers
from accelerate import dispatch_model

from quest_hf import patch_model
from quest_hf.bench import Clock, random_llama, results_dir


def run(model, ids, n):
    clock = Clock(torch.device("cuda", 0))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, streamer=clock, return_dict_in_generate=True)
    steps = sorted(b - a for a, b in zip(clock.t[1:], clock.t[2:], strict=False))
    return out.sequences[:, ids.shape[1]:], steps[len(steps) // 2] * 1e3, out.past_key_values


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama2-7b")
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", default=None, help="JSON path (default results/bench_multigpu/multigpu.json)")
    a = p.parse_args()
    a.out = a.out or str(results_dir("bench_multigpu") / "multigpu.json")
    n_gpu = torch.cuda.device_count()
    torch.manual_seed(0)
    model = random_llama(a.shape, torch.float16, torch.device("cuda", 0), a.length + a.new_tokens)
    ids = torch.randint(1, 32000, (1, a.length), device="cuda:0", generator=torch.Generator("cuda").manual_seed(1))
    rows = {}
    # cuda_graph=False on one GPU too, so both runs take the same (growing-cache) code path.
    patch_model(model, budget=a.budget, cuda_graph=False)
    run(model, ids[:, :1024], 4)  # warm-up: Triton compilation
    one, one_ms, cache = run(model, ids, a.new_tokens)
    rows["one_gpu"] = dict(step_ms=one_ms, backends=sorted(cache.backends),
                           cache_devices=sorted({str(layer.keys.device) for layer in cache.layers}))
    del cache
    layers = model.config.num_hidden_layers
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0}
    device_map |= {f"model.layers.{i}": i * n_gpu // layers for i in range(layers)}
    device_map |= {"model.norm": n_gpu - 1, "lm_head": n_gpu - 1}
    model = dispatch_model(model, device_map=device_map)
    patch_model(model, budget=a.budget)  # "auto": a model over several GPUs runs the uncaptured step
    run(model, ids[:, :1024], 4)
    multi, multi_ms, cache = run(model, ids, a.new_tokens)
    rows["device_map"] = dict(step_ms=multi_ms, backends=sorted(cache.backends), gpus=n_gpu,
                              graph=cache.graph is not None,
                              cache_devices=sorted({str(layer.keys.device) for layer in cache.layers}),
                              layer_devices_match=all(str(layer.keys.device) == f"cuda:{i * n_gpu // layers}"
                                                      for i, layer in enumerate(cache.layers)))
    rows["same_tokens"] = bool(torch.equal(one.cpu(), multi.cpu()))
    meta = dict(date=datetime.date.today().isoformat(), gpus=[torch.cuda.get_device_name(i) for i in range(n_gpu)],
                torch=torch.__version__, transformers=transformers.__version__, shape=a.shape, length=a.length,
                budget=a.budget, new_tokens=a.new_tokens,
                command="python scripts/bench_multigpu.py " + " ".join(sys.argv[1:]))
    print(json.dumps(dict(meta=meta, **rows), indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(dict(meta=meta, **rows), indent=1))


if __name__ == "__main__":
    main()
