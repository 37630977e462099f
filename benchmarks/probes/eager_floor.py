#!/usr/bin/env python
"""What bounds an uncaptured (`cuda_graph=False`) decode step on this host: per-step wall time of

  hf_dense        HF DynamicCache + SDPA, eager (issue #15's reference)
  hf_dense_short  the same at a short context (the GPU barely works: HF's own Python and launches)
  quest_eager     patch_model(cuda_graph=False, compile_decode=False)
  quest_eager_c   patch_model(cuda_graph=False) (compile_decode=True: norms, MLPs, rotary through torch.compile)
  quest_stub      the Quest patch with its decode attention replaced by nothing (no append, no kernel: the
                  floor of an eager step under the patch, HF's own layers alone)
  hf_static_c     HF StaticCache with the model's forward through torch.compile(mode="default"): compiled, no
                  CUDA graph (what a compiled uncaptured step costs on this host)

plus cProfile of the attention launcher. Random-weight model of `--shape`, batch 1.

    python benchmarks/probes/eager_floor.py --length 32768
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

import triton_kernels as tk
from quest_hf import QuestCache, patch_model, unpatch_model
from quest_hf.bench import random_llama


def step_ms(model, ids, cache, n=20, positions=False):
    """Per-step wall ms of `n` one-token forwards after a prefill of `ids` and 3 warm-up steps (`positions`: pass
    position_ids tensors, as generate does)."""
    out = model(input_ids=ids, past_key_values=cache)
    tok = out.logits[:, -1:].argmax(-1)
    L = ids.shape[1]
    pos = [torch.full((1, 1), L + i, device=ids.device) for i in range(n + 3)] if positions else [None] * (n + 3)
    for i in range(3):
        tok = model(input_ids=tok, past_key_values=cache, position_ids=pos[i]).logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        tok = model(input_ids=tok, past_key_values=cache, position_ids=pos[3 + i]).logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama2-7b")
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--short", type=int, default=256)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--skip", nargs="*", default=[])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from transformers import DynamicCache, StaticCache

    model = random_llama(a.shape, torch.float16, torch.device("cuda"), a.length + 64)
    ids = torch.randint(1, 1000, (1, a.length), device="cuda")
    short = ids[:, : a.short]
    res = {}
    with torch.no_grad():
        res["hf_dense"] = step_ms(model, ids, DynamicCache(config=model.config))
        res["hf_dense_short"] = step_ms(model, short, DynamicCache(config=model.config))
        for name, cd in (("quest_eager", False), ("quest_eager_c", True)):
            patch_model(model, budget=a.budget, cuda_graph=False, compile_decode=cd)
            res[name] = step_ms(model, ids, QuestCache.from_model(model))
            unpatch_model(model)
        import quest_hf.attention as qa

        patch_model(model, budget=a.budget, cuda_graph=False, compile_decode=False)
        real = qa.decode_attention
        qa.decode_attention = lambda layer, q, *args, **kw: torch.zeros_like(q)
        res["quest_stub"] = step_ms(model, short, QuestCache.from_model(model))
        qa.decode_attention = real
        cache = QuestCache.from_model(model)
        step_ms(model, ids, cache, n=2)
        layer = cache.layers[-1]
        q = torch.randn(1, model.config.num_attention_heads, layer.keys.shape[-1], device="cuda",
                        dtype=torch.float16)
        C, S = layer.capacity, layer.page_size
        scores = tk.score_pages(q, layer.kmin, layer.kmax, C, S, 0, "none", pos=layer.pos)
        ids_ = tk.topk_pages(scores, a.budget // S + 1, 1)
        fn = lambda: tk.sparse_decode_attention(q, layer.keys, layer.values, ids_, layer.valid, C, S, 0.1)  # noqa
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        res["attention_launcher_us"] = (time.perf_counter() - t0) / 200 * 1e6
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fn()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print(s.getvalue())
        unpatch_model(model)
        del cache, layer
        if "hf_static_c" not in a.skip:
            cache = StaticCache(config=model.config, max_cache_len=a.length + 64)
            fwd = model.forward
            model.forward = torch.compile(fwd, mode="default", fullgraph=True)
            t0 = time.perf_counter()
            try:
                res["hf_static_c"] = step_ms(model, ids, cache, positions=True)
            except Exception as e:  # reported, not hidden
                res["hf_static_c_error"] = f"{type(e).__name__}: {e}"[:400]
            res["hf_static_c_total_s"] = time.perf_counter() - t0
            model.forward = fwd
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(args=vars(a), results=res), f, indent=1)


if __name__ == "__main__":
    main()
