#!/usr/bin/env python
"""Host cost of one uncaptured (`cuda_graph=False`) decode step: where the Python and launch time goes.

Builds a random-weight model of a real layer shape with few layers (host cost per layer does not depend on the
context or the layer count), runs decode steps eagerly, and prints (1) per-step wall time of HF's dense path and
of Quest's eager step, with and without compile_decode, (2) cProfile's top functions of Quest's eager step, and
(3) the host cost of each Triton launcher alone (tiny inputs, so the GPU never limits).

    python benchmarks/probes/profile_eager.py --layers 8 --length 4096
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import triton_kernels as tk
from quest_hf import QuestCache, patch_model, unpatch_model
from quest_hf.bench import MODEL_SHAPES, random_llama


def steps_per_s(model, ids, cache_fn, n=30):
    cache = cache_fn()
    out = model(input_ids=ids, past_key_values=cache)
    tok = out.logits[:, -1:].argmax(-1)
    for _ in range(3):
        tok = model(input_ids=tok, past_key_values=cache).logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        tok = model(input_ids=tok, past_key_values=cache).logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3, cache, tok


def launcher_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama2-7b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--rows", type=int, default=45)
    a = p.parse_args()
    MODEL_SHAPES["_probe"] = dict(MODEL_SHAPES[a.shape], num_hidden_layers=a.layers)
    model = random_llama("_probe", torch.float16, torch.device("cuda"), a.length + 256)
    ids = torch.randint(1, 1000, (1, a.length), device="cuda")
    from transformers import DynamicCache

    with torch.no_grad():
        dense_ms, _, _ = steps_per_s(model, ids, lambda: DynamicCache(config=model.config))
        print(f"HF dense eager: {dense_ms:.2f} ms/step ({dense_ms / a.layers * 1e3:.0f} us/layer)")
        for compile_decode in (False, True):
            patch_model(model, budget=a.budget, cuda_graph=False, compile_decode=compile_decode)
            ms, cache, tok = steps_per_s(model, ids, lambda: QuestCache.from_model(model))
            print(f"quest eager compile_decode={compile_decode}: {ms:.2f} ms/step ({ms / a.layers * 1e3:.0f} us/layer)")
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20):
                tok = model(input_ids=tok, past_key_values=cache).logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.rows)
            print(s.getvalue()[-9000:])
            unpatch_model(model)
        layer = cache.layers[-1]
        q = torch.randn(1, model.config.num_attention_heads, layer.keys.shape[-1], device="cuda", dtype=torch.float16)
        C, S = layer.capacity, layer.page_size
        k1 = torch.randn(1, layer.keys.shape[1], 1, layer.keys.shape[-1], device="cuda", dtype=torch.float16)
        scores = tk.score_pages(q, layer.kmin, layer.kmax, C, S, 0, "none", pos=layer.pos)
        group = q.shape[1] // layer.kmin.shape[1]
        ids_ = tk.topk_pages(scores, 65, group)
        for name, fn in [
            ("score_pages", lambda: tk.score_pages(q, layer.kmin, layer.kmax, C, S, 0, "none", pos=layer.pos)),
            ("topk_pages", lambda: tk.topk_pages(scores, 65, group)),
            ("sparse_decode_attention", lambda: tk.sparse_decode_attention(q, layer.keys, layer.values, ids_,
                                                                           layer.valid, C, S, 0.1)),
            ("append_token_at", lambda: tk.append_token_at(layer.keys, layer.values, layer.kmin, layer.kmax,
                                                           layer.valid, k1, k1, None, layer.pos.clone())),
            ("torch.empty x1", lambda: torch.empty(8, device="cuda")),
            ("pos += 1", lambda: layer.pos.add_(0)),
        ]:
            print(f"launcher {name}: {launcher_us(fn):.1f} us")


if __name__ == "__main__":
    main()
