#!/usr/bin/env python
"""Host cost per decode step on CPU (a tiny model: every step is host-bound): HF dense, Quest eager, and the two
modes of the compiled-step experiment. The record of the run in uncaptured_r11.md: it needs a tree of 9c6ba7e with
`compiled_step_attempt.diff` applied (there `_compile_devices=("cpu",)` turned the step on, and `traceable()` returned
False when `QUEST_OP=1`); in today's tree the step is `QuestConfig(compile_step=True)` and
`compiled_step_gpu.py --device cpu` runs both forms. Run from that tree's root:

    TRITON_INTERPRET=1 python benchmarks/probes/compiled_step_cpu_host.py {dense,eager,op,traced} [backend] [prof]
"""
import cProfile
import io
import os
import pstats
import sys
import time

import torch
from transformers import DynamicCache

from quest_hf import QuestCache, patch_model
from tests.conftest import tiny_model


def steps(model, ids, cache, n=40, prof=False):
    """Per-step ms of `n` one-token forwards after a prefill of `ids` and 3 warm-up steps."""
    out = model(input_ids=ids, past_key_values=cache, attention_mask=torch.ones(1, ids.shape[1], dtype=torch.long))
    tok = out.logits[:, -1:].argmax(-1)
    L = ids.shape[1]
    for i in range(3):
        tok = model(input_ids=tok, past_key_values=cache, position_ids=torch.full((1, 1), L + i)).logits[:, -1:]
        tok = tok.argmax(-1)
    p = cProfile.Profile() if prof else None
    if p:
        p.enable()
    t0 = time.perf_counter()
    for i in range(n):
        tok = model(input_ids=tok, past_key_values=cache, position_ids=torch.full((1, 1), L + 3 + i)).logits[:, -1:]
        tok = tok.argmax(-1)
    dt = (time.perf_counter() - t0) / n * 1e3
    if p:
        p.disable()
        s = io.StringIO()
        pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(22)
        print(s.getvalue()[-5000:])
    return dt


def main():
    torch.set_num_threads(1)
    model = tiny_model("llama", heads=8, kv_heads=4, layers=16)
    ids = torch.randint(2, 90, (1, 600))
    mode = sys.argv[1]
    with torch.no_grad():
        if mode == "dense":
            print("dense", steps(model, ids, DynamicCache(config=model.config)))
        elif mode == "eager":
            patch_model(model, budget=64, page_size=16, cuda_graph=False, compile_decode=False)
            print("eager", steps(model, ids, QuestCache.from_model(model)))
        else:
            os.environ["QUEST_OP"] = "1" if mode == "op" else "0"
            backend = sys.argv[2] if len(sys.argv) > 2 else "inductor"
            patch_model(model, budget=64, page_size=16, cuda_graph=False, _compile_devices=("cpu",),
                        compile_backend=backend)
            cache = QuestCache.from_model(model)
            print(mode, steps(model, ids, cache))
            st = model._quest_state.compiled_step
            print("calls", st.calls, "traced", st.traced_calls, "failed", (st.failed or "")[:300])
            print(mode, "again", steps(model, ids, cache, prof="prof" in sys.argv))


if __name__ == "__main__":
    main()
