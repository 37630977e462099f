#!/usr/bin/env python
"""Quest on a model spread over several GPUs with an accelerate device_map, against the same model on one GPU.

Random-weight Llama-2-7B shape, fp16, a 32K prompt, budget 2048. Rows, all from one run and one set of weights:

- `one_gpu`: the model on GPU 0, decode steps captured as one CUDA graph (`cuda_graph="auto"`);
- `split_<layers>` (with `--split-at`): the same model on GPU 0, its decoder layers cut into segments before the
  given layers and captured per segment, as a device_map captures them (`quest_hf.graph.SegmentGraph`): what
  the per-segment capture costs over the one graph, measurable on a single GPU;
- `device_map` (with 2 or more GPUs): the weights dispatched layer-wise over every visible GPU, captured per
  device segment;
- with `--eager`, `one_gpu_eager` / `device_map_eager`: the same steps uncaptured (`cuda_graph=False`).

Every row's greedy tokens must equal `one_gpu`'s (`same_tokens`). Reports decode latency (median of generate's
per-token timestamps), its ratio to `one_gpu`, the decode path, graphs captured / replayed, where the cache
layers live, and which backend ran.

    python scripts/bench_multigpu.py --length 32768 --new-tokens 32                 # 2+ GPUs: device_map
    python scripts/bench_multigpu.py --length 32768 --new-tokens 32 --split-at 16   # 1 GPU: 2 segments vs 1 graph
"""
import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import transformers
from accelerate import dispatch_model

from quest_hf import patch_model, unpatch_model
from quest_hf.bench import Clock, random_llama, results_dir
from quest_hf.patch import _force_segments

DEV = torch.device("cuda", 0)  # where the one-GPU model lives (and the device_map's first device)


def run(model, ids, n):
    clock = Clock(DEV)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, streamer=clock, return_dict_in_generate=True)
    steps = sorted(b - a for a, b in zip(clock.t[1:], clock.t[2:], strict=False))
    return out.sequences[:, ids.shape[1]:], steps[len(steps) // 2] * 1e3, out.past_key_values


def measure(model, ids, n, ref=None, layer_devices=None):
    """Warm-up (Triton compilation, torch.compile), then one timed generate: its row (`same_tokens` against `ref`;
    `layer_devices_match`: each cache layer on its decoder layer's device), and its tokens."""
    run(model, ids[:, :1024], 4)
    graph = model._quest_state.graph
    before = graph.captures, graph.replays
    tokens, ms, cache = run(model, ids, n)
    graph_now = model._quest_state.graph
    if graph_now is not graph:
        before = (0, 0)
    row = dict(step_ms=round(ms, 3), decode_path=cache.decode_path, backends=sorted(cache.backends),
               graphs_captured=graph_now.captures - before[0], graphs_replayed=graph_now.replays - before[1],
               cache_devices=sorted({str(layer.keys.device) for layer in cache.layers}))
    if ref is not None:
        row["same_tokens"] = bool(torch.equal(ref.cpu(), tokens.cpu()))
    if layer_devices is not None:
        row["layer_devices_match"] = [str(layer.keys.device) for layer in cache.layers] == layer_devices
    del cache
    torch.cuda.empty_cache()
    return row, tokens


def split_list(text: str) -> tuple[int, ...]:
    return tuple(int(k) for k in text.split(","))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama2-7b")
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--split-at", type=split_list, action="append", default=[], metavar="K[,K...]",
                   help="also time the one-GPU model cut into segments before these decoder layers (repeatable: "
                        "--split-at 16 --split-at 8,16,24)")
    p.add_argument("--eager", action="store_true", help="also time the uncaptured step (cuda_graph=False)")
    p.add_argument("--out", default=None, help="JSON path (default results/bench_multigpu/multigpu.json, or "
                                               "segments_1gpu.json on one GPU)")
    a = p.parse_args()
    n_gpu = torch.cuda.device_count()
    a.out = a.out or str(results_dir("bench_multigpu") / ("multigpu.json" if n_gpu > 1 else "segments_1gpu.json"))
    torch.manual_seed(0)
    model = random_llama(a.shape, torch.float16, DEV, a.length + a.new_tokens)
    ids = torch.randint(1, model.config.vocab_size, (1, a.length), device=DEV,
                        generator=torch.Generator(DEV).manual_seed(1))
    rows = {}
    patch_model(model, budget=a.budget)
    rows["one_gpu"], ref = measure(model, ids, a.new_tokens)
    for split in a.split_at:
        _force_segments(model, split)
        rows["split_" + ",".join(map(str, split))], _ = measure(model, ids, a.new_tokens, ref)
    _force_segments(model, None)
    if a.eager:
        patch_model(model, budget=a.budget, cuda_graph=False, compile_step=False)
        rows["one_gpu_eager"], _ = measure(model, ids, a.new_tokens, ref)
    if n_gpu > 1:
        layers = model.config.num_hidden_layers
        device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0}
        device_map |= {f"model.layers.{i}": i * n_gpu // layers for i in range(layers)}
        device_map |= {"model.norm": n_gpu - 1, "lm_head": n_gpu - 1}
        unpatch_model(model)  # then patched after dispatch: each layer's interception sits outside accelerate's hook
        model = dispatch_model(model, device_map=device_map)
        patch_model(model, budget=a.budget)  # "auto": captured per device segment
        expect = [f"cuda:{i * n_gpu // layers}" for i in range(layers)]
        rows["device_map"], _ = measure(model, ids, a.new_tokens, ref, expect)
        rows["device_map"]["gpus"] = n_gpu
        if a.eager:
            patch_model(model, budget=a.budget, cuda_graph=False, compile_step=False)
            rows["device_map_eager"], _ = measure(model, ids, a.new_tokens, ref)
    for row in rows.values():
        row["vs_one_gpu"] = round(row["step_ms"] / rows["one_gpu"]["step_ms"], 3)
    meta = dict(date=datetime.date.today().isoformat(), gpus=[torch.cuda.get_device_name(i) for i in range(n_gpu)],
                torch=torch.__version__, transformers=transformers.__version__, shape=a.shape, length=a.length,
                budget=a.budget, new_tokens=a.new_tokens,
                command="python scripts/bench_multigpu.py " + " ".join(sys.argv[1:]))
    print(json.dumps(dict(meta=meta, **rows), indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(dict(meta=meta, **rows), indent=1))


if __name__ == "__main__":
    main()
