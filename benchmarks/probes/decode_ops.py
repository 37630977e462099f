#!/usr/bin/env python
"""Which tensor ops one eager decode step of a patched model runs, and from where: every aten op dispatched during
the step (a TorchDispatchMode), counted by op, output dtype and the innermost frames of quest_hf / transformers /
triton_kernels that called it. To find the small kernels of a captured step (its graph holds the same launches as
this eager step with `compile_decode=False`, minus the compiled norms/MLPs/rotary) by name and caller.

    python benchmarks/probes/decode_ops.py --device cuda --layers 4 --length 4096 --budget 512
"""
from __future__ import annotations

import argparse
import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from quest_hf import patch_model
from quest_hf.bench import random_llama

KEEP = ("quest_hf", "transformers", "triton_kernels")
VIEWS = {"view", "t", "transpose", "unsqueeze", "squeeze", "slice", "select", "_unsafe_view", "expand", "as_strided",
         "detach", "alias", "permute", "reshape", "split", "split_with_sizes", "unbind", "_reshape_alias"}


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in VIEWS:  # metadata only: no kernel
            return out
        frames = [f for f in traceback.extract_stack()[:-1] if any(k in f.filename for k in KEEP)]
        where = " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}:{f.name}" for f in frames[-3:][::-1])
        dtype = str(out.dtype).replace("torch.", "") if isinstance(out, torch.Tensor) else ""
        self.counts[(str(func), dtype, where)] += 1
        return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="llama2-7b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--budget", type=int, default=512)
    a = p.parse_args()
    dev = torch.device(a.device)
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    from quest_hf.bench import MODEL_SHAPES

    MODEL_SHAPES["_probe"] = dict(MODEL_SHAPES[a.shape], num_hidden_layers=a.layers)
    model = random_llama("_probe", dtype, dev, a.length + 16)
    patch_model(model, budget=a.budget, cuda_graph=False, compile_step=False, compile_decode=False)
    ids = torch.randint(1, 1000, (1, a.length), device=dev)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        model(nxt, past_key_values=cache, use_cache=True)  # first decode step: kernels compile, workspaces made
        log = OpLog()
        with log:
            model(nxt, past_key_values=cache, use_cache=True)
    print(f"{a.shape} cut to {a.layers} layers, {a.length} tokens, budget {a.budget}, {dev}: "
          f"{sum(log.counts.values())} aten ops (views left out) in one eager decode step")
    for (op, dtype, where), n in sorted(log.counts.items(), key=lambda kv: -kv[1]):
        print(f"{n:4d}  {op:40s} {dtype:8s} {where}")


if __name__ == "__main__":
    main()
