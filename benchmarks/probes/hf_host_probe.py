"""Where a `generate()` token's time goes: GPU kernels vs the GPU waiting on the host.

HF's static cache + compile measured 9.61-10.22 ms/token at Llama-2-7B/32K on H200s in rounds 22-25 and 12.13 in
round 30, with the same versions; on H100s 12.97-13.49 (rounds 26-28) and 14.6 in round 31, HF alone in its own
process included. The Quest rows on the same machines moved by under 3%. HF's static path checks its stop
criteria on the host every step (a sync) and runs generate()'s Python between steps, so its per-token time is the
GPU's work plus whatever host time does not overlap it: a machine's CPU would move it.

For each method, one process: a warm-up call (compiles), a timed call (per-token median from the streamer's
timestamps, as `scripts/bench_e2e.py`), then a profiled call (CUDA activity only): the kernels' summed device time
per token. The difference is the time per token the GPU ran no kernel. The host CPU and nvidia-smi's clocks are
printed with it.

    PYTHONPATH=. python benchmarks/probes/hf_host_probe.py --shape llama2-7b --length 32768 \
        --methods static quest_graph_c
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import bench_e2e as be  # noqa: E402

from quest_hf import patch_model, unpatch_model  # noqa: E402
from quest_hf.bench import environment, gpu_state, gpu_state_line, random_llama  # noqa: E402


def gpu_kernel_ms(model, ids, new_tokens, kw):
    """Summed device time of every kernel (and memcpy/memset) of one generate() call, ms, the top kernels and how
    many were recorded. On a CPU (a smoke test of this script) the ops' own CPU time stands in for kernels."""
    cuda = ids.device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, **kw)
        sync()
    wall = time.perf_counter() - t0
    events = [e for e in prof.key_averages() if e.device_type == kind and e.count]
    if not events:  # e.g. a profiler that does not see kernels replayed inside CUDA graphs: no figure, not a zero
        raise RuntimeError("the profiler recorded no kernels for this generate() call")
    per = {e.key: (e.device_time_total if cuda else e.self_cpu_time_total) * 1e-3 for e in events}
    top = sorted(per.items(), key=lambda kv: -kv[1])[:6]
    return sum(per.values()), wall * 1e3, top, sum(e.count for e in events)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama2-7b")
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--methods", nargs="+", default=["static", "static_defer", "quest_graph_c"],
                   choices=["static", "static_defer", "quest_graph_c"])
    p.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test the script")
    p.add_argument("--out", default=None, help="a JSON file for the rows (default: print only)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    env = environment(device)
    print(json.dumps(env), flush=True)
    print(f"host CPU: {env.get('machine')}; GPU: {gpu_state_line(gpu_state(device))}", flush=True)
    torch.manual_seed(0)
    model = random_llama(args.shape, torch.float16, device, args.length + args.new_tokens)
    ids = torch.randint(1, model.config.vocab_size, (1, args.length), device=device,
                        generator=torch.Generator(device).manual_seed(args.length))
    rows = []
    for method in args.methods:
        kw = {}
        if method.startswith("static"):
            kw.update(cache_implementation="static")
        else:
            patch_model(model, budget=2048)
        deferred = method != "static"
        with be.hf_deferred_stop(method == "static_defer"):
            _, median, mean, first, _, _ = be.measure(model, ids, args.new_tokens, device, deferred=deferred, **kw)
            # the profiled call: prefill + new_tokens steps; the prefill's kernels are counted apart by a 1-token call
            k_full, wall_full, top, n_full = gpu_kernel_ms(model, ids, args.new_tokens, kw)
            k_one, wall_one, _, n_one = gpu_kernel_ms(model, ids, 1, kw)
        n = args.new_tokens - 1
        k_tok, wall_tok = (k_full - k_one) / n, (wall_full - wall_one) / n
        row = dict(method=method, ms_per_token=median * 1e3, mean_ms=mean * 1e3,
                   first_steps_ms=[round(t * 1e3, 2) for t in first], profiled_wall_ms_per_token=wall_tok,
                   kernel_ms_per_token=k_tok, gpu_idle_ms_per_token=median * 1e3 - k_tok,
                   # kernels recorded a token: a count far below the model's launches a step means the profiler
                   # missed some (those replayed inside CUDA graphs), and the kernel time is then too low
                   kernels_per_token=(n_full - n_one) / n,
                   top_kernels_ms_per_call=[(name[:60], round(ms, 2)) for name, ms in top],
                   gpu_after=gpu_state(device))
        rows.append(row)
        print(f"{method}: {median * 1e3:.2f} ms/token (mean {mean * 1e3:.2f}); kernels {k_tok:.2f} ms/token "
              f"({row['kernels_per_token']:.0f} a token), so the "
              f"GPU ran no kernel {median * 1e3 - k_tok:.2f} ms/token; profiled call {wall_tok:.2f} ms/token; "
              f"top kernels of the profiled call (ms): {row['top_kernels_ms_per_call']}", flush=True)
        print(f"  GPU after: {gpu_state_line(row['gpu_after'])}", flush=True)
        if not method.startswith("static"):
            unpatch_model(model)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(env=env, args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
