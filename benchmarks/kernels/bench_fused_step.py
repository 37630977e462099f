"""The one-launch Quest step (`triton_kernels.fused_step.quest_step`) against the three-stage step and SDPA.

Per layer shape: the separate kernels (score -> Top-K -> attention, `scripts/bench_kernels.py`'s step) and the
fused launch under each `--configs` StepLaunch, 20 steps back to back in one CUDA graph (`time_graph_chain`,
rotating over input sets that exceed L2), SDPA the same way; the fused kernel's profiler duration; and a check
first: the fused launch's ids equal the separate kernels' and its output matches theirs (fp16 tolerance), with
the workspace back to zero after graph replays.

    python benchmarks/kernels/bench_fused_step.py --out results/fused_step
    python benchmarks/kernels/bench_fused_step.py --rows 7b-32k --configs num_warps=4 num_warps=8,score_block=64
"""
import argparse
import dataclasses
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import bench_kernels as bk  # noqa: E402

from quest_hf.bench import copy_bandwidth, environment, kernel_durations, rotating, time_graph_chain  # noqa: E402
from triton_kernels import fused_step as fs  # noqa: E402

# name: (shape, L, B, mode, bounds)
ROWS = {
    "7b-32k": ("llama2-7b", 32768, 1, "union", "key_dtype"),
    "7b-32k-alloc": ("llama2-7b", 32768, 1, "union", "key_dtype", 5),
    "7b-128k": ("llama2-7b", 131072, 1, "union", "key_dtype"),
    "7b-32k-int8c": ("llama2-7b", 32768, 1, "union", "int8_channel"),
    "7b-128k-int8c": ("llama2-7b", 131072, 1, "union", "int8_channel"),
    "8b-32k-max": ("llama3-8b", 32768, 1, "max", "key_dtype"),
    "8b-128k-max": ("llama3-8b", 131072, 1, "max", "key_dtype"),
    "7b-32k-b8": ("llama2-7b", 32768, 8, "union", "key_dtype"),
}


def sdpa(layer, q, L):
    """Dense SDPA of `q` over the layer's first L tokens (the same q/K/V as the Quest step)."""
    kc, vc = layer[0][:, :, :L], layer[1][:, :, :L]
    gqa = q.shape[1] != kc.shape[1]
    return lambda: torch.nn.functional.scaled_dot_product_attention(q[:, :, None], kc, vc, enable_gqa=gqa)


def parse_config(text):
    kw = {}
    for item in filter(None, text.split(",")):
        name, value = item.split("=")
        kw[name] = None if value == "None" else (value == "True" if value in ("True", "False") else int(value))
    return dataclasses.replace(fs.STEP_LAUNCH, **kw)


class Fused:
    """`quest_step` on one of bench_kernels' Step input sets, with its own zeroed workspace."""

    def __init__(self, step, launch):
        self.s, self.launch = step, launch
        B, H = step.kc.shape[:2]
        self.ws = fs.step_workspace(B, H, step.q.device)
        lo, hi, kw = step.kmin, step.kmax, {}
        if step.bounds8 is not None:
            lo, hi, kw = *step.bounds8[:2], dict(scale=step.bounds8[2], chan=step.chan)
        if step.C > step.L:
            kw["pos"] = step.pos
        self.args = (step.q, lo, hi, step.kc, step.vc, step.valid, step.C, bk.PAGE, step.k, step.scale, step.reduce)
        self.kw = kw

    def __call__(self):
        return fs.quest_step(*self.args, **self.kw, workspace=self.ws, launch=self.launch)


def one(vals):
    """A value per compiled kernel: the value itself for one kernel."""
    return vals[0] if len(vals) == 1 else vals


def check(step, fused):
    out_ref = step.full()
    ids_ref = step.topk()
    out, ids = fused()
    torch.cuda.synchronize()
    same = torch.equal(ids, ids_ref)
    err = (out.float() - out_ref.float()).abs().max().item()
    return dict(ids_equal=same, max_abs_err=err, workspace_zero=bool((fused.ws == 0).all().item()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", default=["7b-32k", "8b-32k-max", "7b-128k", "7b-32k-b8"], choices=ROWS)
    p.add_argument("--configs", nargs="+", default=[""], help="StepLaunch fields, e.g. num_warps=8,score_block=64")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--out", default="results/fused_step")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    results = dict(env=environment("cuda"), copy_GBps=bw / 1e9, rows=[])
    for name in args.rows:
        shape, L, B, mode, bounds, *extra = ROWS[name]
        bk.EXTRA_PAGES = extra[0] if extra else 0
        H_q, H_kv, D = bk.SHAPES[shape]
        dtype = torch.float16
        touched = 2 * B * H_kv * D * 2 * (L // bk.PAGE + min(L, args.budget))
        n_sets = max(1, min(4, math.ceil(3 * bk.L2_BYTES / touched)))
        layers = [bk.make_layer(B, H_kv, L, D, dtype, seed, bk.EXTRA_PAGES) for seed in range(n_sets)]
        qs = [torch.randn(B, H_q, D, device="cuda", dtype=dtype) for _ in range(n_sets)]
        steps = [bk.Step(layers[i], qs[i], args.budget // bk.PAGE, mode, bounds=bounds) for i in range(n_sets)]
        t_sdpa = time_graph_chain([sdpa(layers[i], qs[i], L) for i in range(n_sets)], bk.CHAIN)
        t_sep = time_graph_chain([s.full for s in steps], bk.CHAIN)
        nbytes, _ = steps[0].bytes_read()
        row = dict(row=name, shape=shape, L=L, B=B, mode=mode, bounds=bounds, sdpa_chain_us=t_sdpa,
                   separate_chain_us=t_sep, separate_x=t_sdpa / t_sep, byte_limit_us=nbytes / bw * 1e6, fused=[])
        print(f"{name}: SDPA {t_sdpa:.1f} us, separate {t_sep:.1f} us ({t_sdpa / t_sep:.2f}x)", flush=True)
        for text in args.configs:
            launch = parse_config(text)
            why = fs.fused_step_supported(steps[0].scores.shape[2], H_q // H_kv, steps[0].reduce, launch=launch)
            if why:
                print(f"  [{text}] not supported: {why}", flush=True)
                continue
            fused = [Fused(s, launch) for s in steps]
            ok = check(steps[0], fused[0])
            c = fs.quest_step.compiled  # the pipelined step's are a tuple (one a launch): one value each
            cs = c if isinstance(c, tuple) else (c,)
            ok.update(n_regs=one([getattr(x, "n_regs", None) for x in cs]),
                      n_spills=one([getattr(x, "n_spills", None) for x in cs]),
                      shared=one([getattr(getattr(x, "metadata", None), "shared", None) for x in cs]),
                      overlapped=fs.quest_step.overlapped)
            t = time_graph_chain(fused, bk.CHAIN)
            ok_after = bool(all((f.ws == 0).all().item() for f in fused))
            kern = kernel_durations(rotating(fused))
            r = dict(config=text or "default", chain_us=t, x=t_sdpa / t, frac_of_limit=row["byte_limit_us"] / t,
                     kernels=kern, workspace_zero_after_replays=ok_after, **ok)
            row["fused"].append(r)
            print(f"  [{text or 'default'}] {t:.1f} us ({t_sdpa / t:.2f}x SDPA, {r['frac_of_limit']:.0%} of bytes) "
                  f"ids_equal={ok['ids_equal']} err={ok['max_abs_err']:.2e} ws0={ok['workspace_zero']}/{ok_after} "
                  f"regs={ok['n_regs']} spills={ok['n_spills']} smem={ok['shared']} overlapped={ok['overlapped']} "
                  f"kernels={ {k[:40]: round(v, 1) for k, v in kern.items()} }", flush=True)
            del fused
        results["rows"].append(row)
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "fused_step.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
