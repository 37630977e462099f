#!/usr/bin/env python
"""`QuestConfig(compile_step=True)` on CUDA: does each form compile, give the eager step's tokens, and how fast is it?

For the next GPU session (the form traced into the graph failed to compile on the H200 once, the op form compiled
but was not faster; benchmarks/probes/uncaptured_r11.md). One call, a tiny random Llama first (seconds), then
optionally the 7B shape at a long context (minutes):

    PYTHONPATH=. python benchmarks/probes/compiled_step_gpu.py --out $OUT/compiled_step_gpu.json
    PYTHONPATH=. python benchmarks/probes/compiled_step_gpu.py --shape llama2-7b --length 32768 --out ...

For each form (traced: plain quest; op: a selection hook forces one op a layer) it prints and records whether the
step compiled (`compiled_step.failed`, the whole error with its traceback), the tokens against the eager step's, and
the median ms of one-token forwards over a hand-driven loop (HF DynamicCache beside it).
"""
from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from quest_hf import QuestCache, patch_model, unpatch_model
from quest_hf.bench import random_llama


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def steps(model, cache, ids, n, hook=None):
    """Greedy tokens and per-step ms of `n` one-token forwards after a prefill of `ids` into `cache`."""
    if hook is not None:
        cache.selection_hooks.append(hook)
    L = ids.shape[1]
    with torch.no_grad():
        tok = model(input_ids=ids, past_key_values=cache).logits[:, -1:].argmax(-1)
        toks, times = [tok], []
        for i in range(n):
            sync()
            t = time.perf_counter()
            out = model(input_ids=tok, past_key_values=cache, position_ids=torch.full_like(tok, L + i))
            tok = out.logits[:, -1:].argmax(-1)
            sync()
            times.append((time.perf_counter() - t) * 1e3)
            toks.append(tok)
    steps.first_ms = [round(t, 1) for t in times[:4]]
    return torch.cat(toks, 1).cpu(), sorted(times[2:])[len(times[2:]) // 2] if n > 3 else times[-1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--length", type=int, default=600)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    ap.add_argument("--forms", nargs="+", default=["traced", "op"], choices=["traced", "op"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    model = random_llama(args.shape, dtype, args.device, args.length + args.steps + 16)
    ids = torch.randint(2, 1000, (1, args.length), device=args.device)
    rows = {}
    from transformers import DynamicCache

    _, rows["dense_ms"] = steps(model, DynamicCache(config=model.config), ids, args.steps)
    patch_model(model, budget=args.budget, cuda_graph=False, compile_decode=False)
    eager, rows["eager_ms"] = steps(model, QuestCache.from_model(model), ids, args.steps)
    for form, hook in (("traced", None), ("op", lambda layer, q, page_ids: None)):
        if form not in args.forms:
            continue
        torch._dynamo.reset()
        patch_model(model, budget=args.budget, cuda_graph=False, compile_decode=False, compile_step=True)
        row = rows[form] = {}
        try:
            t = time.perf_counter()
            cache = QuestCache.from_model(model)
            toks, row["ms"] = steps(model, cache, ids, args.steps, hook)
            row["wall_s"] = time.perf_counter() - t
            st = model._quest_state.compiled_step
            row.update(first_steps_ms=steps.first_ms, decode_path=cache.decode_path, calls=st.calls,
                       traced_calls=st.traced_calls, failed=st.failed,
                       tokens_equal_eager=bool(torch.equal(toks, eager)))
            # Seconds in each phase of the compile (dynamo's own accounting): where a slow first step goes.
            row["compile_times"] = torch._dynamo.utils.compile_times(repr="str", aggregate=True)
        except Exception as e:  # noqa: BLE001 - a probe: record the whole error
            row["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        print(form, json.dumps(row, indent=1)[:20000], flush=True)
    unpatch_model(model)
    rows["meta"] = dict(shape=args.shape, length=args.length, budget=args.budget, torch=torch.__version__,
                        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                        date=time.strftime("%Y-%m-%d"))
    print(json.dumps({k: v for k, v in rows.items() if not isinstance(v, dict) or k == "meta"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
