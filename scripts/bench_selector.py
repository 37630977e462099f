#!/usr/bin/env python
"""Per-layer decode step of each page selector (select + sparse_decode_attention) vs plain quest, on the GPU.

One sparse layer of a real model shape holds `--length` random fp16 tokens in a QuestCache layer (the
selectors' own code buffers built by their append path). A step is exactly what the patched attention runs
per layer and token: `SELECTORS[policy].select(layer, q, 0)` then `layer.ops.sparse_decode_attention`. It is
captured once as a CUDA graph and replayed; each replay is timed by CUDA events, the median reported, with
the bytes the step reads (quest_hf.eval.accounting, from the pages actually chosen) and achieved GB/s. The
selection alone (`select`) is timed the same way, and dense SDPA over the whole context as the reference.

    python scripts/bench_selector.py                    # GPU: 32K, budget 2048, llama2-7b and llama3-8b layers
    python scripts/bench_selector.py --tiny             # CPU smoke test (torch path, small sizes, wall clock)
    python scripts/bench_selector.py --policies quest qcode1_2s/32 --check   # POLICY/PAGE: its own page size;
                                                        # --check: the kernels' pages vs the PyTorch path's

Timed by quest_hf.bench (the one CUDA timer of every benchmark). Writes bench_selector.json and .md into --out
(default results/bench_selector/).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from quest_hf import QuestCache, QuestConfig
from quest_hf.bench import LAYER_SHAPES, results_dir, time_calls, time_graph, wall_time_us
from quest_hf.eval.accounting import dense_bytes, step_bytes
from quest_hf.ops import TORCH
from quest_hf.selectors import SELECTORS

SHAPES = LAYER_SHAPES  # H_q, H_kv, D
TINY_SHAPES = {"tiny-mha": (4, 4, 64), "tiny-gqa": (8, 2, 64)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--policies", nargs="+", default=["quest", "qcode", "qcode1", "qcode_topp"],
                   help="POLICY or POLICY/PAGE_SIZE (a page size other than --page-size for that row)")
    p.add_argument("--profile", action="store_true",
                   help="also print each policy's GPU kernels (torch.profiler, self CUDA time per eager step)")
    p.add_argument("--check", action="store_true",
                   help="also select with the PyTorch reference ops on the same layer and report the share of "
                        "(KV head) page sets that equal the kernels' (ties may order differently)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--no-graph", action="store_true", help="time eager launches instead of CUDA-graph replay")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: 1K tokens, budget 128, small heads, torch path")
    p.add_argument("--out", default=None, help="output folder (default results/bench_selector/)")
    return p.parse_args(argv)


def build_layer(policy, Hq, H, D, L, budget, S, device, dtype, backend, seed=0):
    """A one-layer QuestCache holding L random tokens (keys with outlier channels, like real models)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    cfg = QuestConfig(budget=budget, page_size=S, dense_layers=0, backend=backend, policy=policy, cuda_graph=False)
    cache = QuestCache(cfg, num_layers=1)
    chan = torch.logspace(-1, 0.7, D)[torch.randperm(D, generator=g)]
    keys = (torch.randn(1, H, L, D, generator=g) * chan).to(device, dtype)
    vals = torch.randn(1, H, L, D, generator=g).to(device, dtype)
    cache.begin_step(None, L)
    layer = cache.layers[0]
    chunk = 8192  # the prefill appends in chunks, as a chunked prefill would
    for t in range(0, L, chunk):
        layer.update(keys[:, :, t:t + chunk], vals[:, :, t:t + chunk])
    q = (torch.randn(1, Hq, D, generator=g) * chan).to(device, dtype)
    return cache, layer, q


def step_fn(policy, layer, q, scale, with_attention=True):
    sel = SELECTORS[policy]
    S = layer.page_size

    def step():
        ids = sel.select(layer, q, 0)
        if not with_attention:
            return ids
        return ids, layer.ops.sparse_decode_attention(q, layer.keys, layer.values, ids, layer.valid, layer.seq_len,
                                                      S, scale, 0)
    return step


def time_cuda(fn, warmup, iters, graph):
    """Median us of one step: a CUDA-graph replay (or eager launches), timed by quest_hf.bench."""
    if graph:
        return time_graph(fn, warmup=warmup, iters=iters)
    return time_calls(fn, warmup=warmup, iters=iters)


def kernel_table(fn, steps=20):
    """Self CUDA time per step of each kernel `fn` launches (eager), largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.self_device_time_total / steps, e.count // steps) for e in prof.key_averages()
            if e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def time_cpu(fn, warmup, iters):
    return wall_time_us(fn, warmup=warmup, iters=iters)


def time_dense(Hq, H, D, L, device, dtype, cuda, args):
    """Dense reference: SDPA of one decode query over the whole context (GQA by repeated KV heads)."""
    k = torch.randn(1, H, L, D, device=device, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(1, Hq, 1, D, device=device, dtype=dtype)

    def dense():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=Hq != H)
    if cuda:
        return time_cuda(dense, args.warmup, args.iters, not args.no_graph)
    return time_cpu(dense, args.warmup, args.iters)


def main(argv=None):
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        sys.exit("no CUDA device: run with --tiny for the CPU smoke test")
    if args.tiny:
        args.length, args.budget = min(args.length, 1024), min(args.budget, 128)
        args.warmup, args.iters = 2, 5
        shapes = TINY_SHAPES
    else:
        shapes = {k: SHAPES[k] for k in args.shapes}
    device, dtype = ("cuda", torch.float16) if cuda else ("cpu", torch.float32)
    backend = "auto" if cuda else "torch"
    elt = 2 if cuda else 4
    L, S = args.length, args.page_size
    rows = []
    for shape, (Hq, H, D) in shapes.items():
        scale = D ** -0.5
        t_dense = time_dense(Hq, H, D, L, device, dtype, cuda, args)
        base_bytes = dense_bytes(L, H, D, elt)
        rows.append(dict(shape=shape, policy="dense (SDPA)", us=t_dense, select_us=None, bytes=base_bytes,
                         pages_per_kv_head=None))
        for name in args.policies:
            policy, _, page = name.partition("/")
            S = int(page or args.page_size)
            cache, layer, q = build_layer(policy, Hq, H, D, L, args.budget, S, device, dtype, backend)
            full, sel_only = step_fn(policy, layer, q, scale), step_fn(policy, layer, q, scale, with_attention=False)
            ids, _ = full()
            same = None
            if args.check and layer.ops is not TORCH:
                kernel_ops, layer.ops = layer.ops, TORCH
                ref = SELECTORS[policy].select(layer, q, 0)
                layer.ops = kernel_ops
                sets = [(set(a.tolist()) - {-1}, set(b.tolist()) - {-1})
                        for a, b in zip(ids.flatten(0, 1), ref.flatten(0, 1), strict=True)]
                same = sum(a == b for a, b in sets) / len(sets)
            if cuda:
                t = time_cuda(full, args.warmup, args.iters, not args.no_graph)
                t_sel = time_cuda(sel_only, args.warmup, args.iters, not args.no_graph)
            else:
                t, t_sel = time_cpu(full, args.warmup, args.iters), time_cpu(sel_only, args.warmup, args.iters)
            if cuda and args.profile:
                print(f"\n{shape} {name}: kernels of one step (self CUDA us, launches)")
                for key, us, n in kernel_table(full):
                    print(f"  {us:8.2f}  x{n}  {key[:90]}")
            pages = int((ids >= 0).sum())
            nbytes = step_bytes(policy, L, H, D, elt, S, pages, args.budget, Hq // H)
            rows.append(dict(shape=shape, policy=name, page_size=S, us=t, select_us=t_sel, bytes=nbytes,
                             pages_per_kv_head=pages / H, backend=layer.ops.name, same_pages_as_ref=same))
            del cache, layer
            if cuda:
                torch.cuda.empty_cache()
        t_quest = next((r["us"] for r in rows if r["shape"] == shape and r["policy"] == "quest"), None)
        for r in rows:
            if r["shape"] == shape:
                r["ratio_to_quest"] = r["us"] / t_quest if t_quest else None
                r["ratio_to_dense"] = r["us"] / t_dense
                r["gbps"] = r["bytes"] / (r["us"] * 1e-6) / 1e9
                r["bytes_frac"] = r["bytes"] / base_bytes
    device_name = torch.cuda.get_device_name() if cuda else "cpu (torch path, --tiny)"
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device=device_name, length=L,
                budget=args.budget, page_size=args.page_size, dtype=str(dtype), graph=cuda and not args.no_graph,
                timing=f"quest_hf.bench: CUDA events, median of {args.iters} calls" if cuda
                else "wall clock median (CPU)",
                torch=torch.__version__, command="python scripts/bench_selector.py " + " ".join(argv or sys.argv[1:]))
    md = ["# Selector decode step per layer (select + sparse attention)\n"] + [f"- {k}: {v}" for k, v in meta.items()]
    md += ["", "| shape | policy | step us | select us | x dense | x quest | pages/KV head | bytes frac | GB/s | "
           "same pages as ref |", "|---|---|---|---|---|---|---|---|---|---|"]
    def fmt(v, f):
        return "-" if v is None else format(v, f)

    for r in rows:
        md.append(f"| {r['shape']} | {r['policy']} | {r['us']:.1f} | {fmt(r['select_us'], '.1f')} | "
                  f"{r['ratio_to_dense']:.2f} | {fmt(r.get('ratio_to_quest'), '.2f')} | "
                  f"{fmt(r['pages_per_kv_head'], '.1f')} | {r['bytes_frac']:.3f} | {r['gbps']:.0f} | "
                  f"{fmt(r.get('same_pages_as_ref'), '.3f')} |")
    text = "\n".join(md)
    print(text)
    out = Path(args.out) if args.out else results_dir("bench_selector")
    out.mkdir(parents=True, exist_ok=True)
    name = "bench_selector_tiny" if args.tiny else "bench_selector"
    (out / f"{name}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (out / f"{name}.md").write_text(text + "\n")
    print(f"wrote {out / name}.json and .md")


if __name__ == "__main__":
    main()
