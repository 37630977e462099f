"""Probe: where the compiled uncaptured step (`cuda_graph=False`) loses time with `compile_capacity="exact"` (a
symbolic capacity) against `"bucket"` (static shapes). One mode a process (fresh dynamo and inductor state), a
hand-driven decode loop over a prefilled cache of a random Llama-2-7B-shaped model:
- `wall_ms`: ms a step over `--steps` steps with no synchronisation between them (what generate() sees);
- `synced_ms`: ms a step with a synchronisation after each (host + device latency of one step);
- `gpu_ms`: the profiler's summed CUDA kernel time a step (device work alone);
- `host_ms`: the profiler's CPU time a step inside the compiled region, and dynamo's cache lookup (guards);
and the per-kernel device table and the host table of the profiled steps.

    python benchmarks/probes/capacity_gap.py --mode exact --layers 32 --length 32768 --out results/probes
"""
import argparse
import json
import os
import time

import torch

from quest_hf import QuestCache, patch_model
from quest_hf.bench import MODEL_SHAPES, random_llama


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="exact", choices=["bucket", "exact", "dense"],
                    help="dense: the unpatched model over HF's DynamicCache (the same loop, for a same-machine ratio)")
    ap.add_argument("--shape", default="llama2-7b")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (the timings then mean little)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--cpp-shape-guards", action="store_true",
                    help="torch._dynamo.config.enable_cpp_symbolic_shape_guards (symbolic guards in C++)")
    ap.add_argument("--skip-guards", action="store_true", help="experiment only: compile with every guard dropped")
    ap.add_argument("--inductor", nargs="*", default=[], metavar="KEY=VALUE",
                    help="inductor options for the step's compile, e.g. cpp_wrapper=1")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="results/probes")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tag = a.tag or a.mode
    if a.cpp_shape_guards:
        torch._dynamo.config.enable_cpp_symbolic_shape_guards = True
    extra = {k: bool(int(v)) if v in ("0", "1") else v for k, v in (o.split("=", 1) for o in a.inductor)}
    if a.skip_guards:
        extra["guard_filter_fn"] = torch.compiler.skip_all_guards_unsafe
    if extra:
        real = torch.compile

        def compile_with(fn, **kw):
            kw["options"] = dict(kw.get("options") or {}, **extra)
            kw.pop("dynamic", None) if "guard_filter_fn" in extra else None
            return real(fn, **kw)
        torch.compile = compile_with
    MODEL_SHAPES["probe"] = dict(MODEL_SHAPES[a.shape], num_hidden_layers=a.layers)
    torch.manual_seed(0)
    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = random_llama("probe", torch.float16 if cuda else torch.float32, torch.device(a.device), a.length + 256)
    if a.mode == "dense":
        from transformers import DynamicCache
        cache = DynamicCache(config=model.config)
    else:
        patch_model(model, budget=a.budget, page_size=16, cuda_graph=False, compile_step=True,
                    compile_capacity=a.mode)
        cache = QuestCache.from_model(model)
    ids = torch.randint(2, 900, (1, a.length), device=a.device)
    row = dict(mode=a.mode, tag=tag, layers=a.layers, length=a.length, cpp_shape_guards=a.cpp_shape_guards,
               skip_guards=a.skip_guards, inductor=a.inductor, torch=torch.__version__, budget=a.budget,
               device=torch.cuda.get_device_name() if cuda else "cpu")
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        pos = a.length

        def step():
            nonlocal tok, pos
            o = model(input_ids=tok, position_ids=torch.full_like(tok, pos), past_key_values=cache, use_cache=True)
            tok = o.logits[:, -1:].argmax(-1)
            pos += 1

        t = time.perf_counter()
        step()  # compiles
        sync()
        row["first_step_s"] = time.perf_counter() - t
        for _ in range(4):
            step()
        sync()
        t = time.perf_counter()
        for _ in range(a.steps):
            step()
        sync()
        row["wall_ms"] = (time.perf_counter() - t) / a.steps * 1e3
        lat = []
        for _ in range(8):
            t = time.perf_counter()
            step()
            sync()
            lat.append((time.perf_counter() - t) * 1e3)
        row["synced_ms"] = sorted(lat)[len(lat) // 2]
        n = 8
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                step()
            sync()
    evs = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in evs if e.device_type == torch.autograd.DeviceType.CUDA)
    row["gpu_ms"] = gpu_us / n / 1e3
    named = {e.key: e for e in evs}
    for key, name in (("TorchDynamo Cache Lookup", "lookup_ms"), ("Torch-Compiled Region: 0/0", "region_ms")):
        if key in named:
            row[name] = named[key].cpu_time_total / n / 1e3
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    if a.mode != "dense":
        step_obj = model._quest_state.compiled_step
        row.update(calls=step_obj.calls, traced=step_obj.traced_calls, failed=step_obj.failed,
                   graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"], capacity=cache.layers[-1].capacity,
                   decode_path=cache.decode_path)
    kernels = sorted(((e.key, e.self_device_time_total / n, e.count / n) for e in evs
                      if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0),
                     key=lambda r: -r[1])
    row["kernels_us_per_step"] = [dict(name=k, us=round(us, 2), launches=c) for k, us, c in kernels[:40]]
    print(json.dumps({k: v for k, v in row.items() if k != "kernels_us_per_step"}), flush=True)
    json.dump(row, open(os.path.join(a.out, f"capacity_gap_{tag}.json"), "w"), indent=1)
    with open(os.path.join(a.out, f"capacity_gap_{tag}.txt"), "w") as f:
        f.write(evs.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70) + "\n\n")
        f.write(evs.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70))


if __name__ == "__main__":
    main()
