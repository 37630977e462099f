"""Perplexity at 8K (7680 dense + 512 decoded, scripts/ppl.py's text and protocol) of queued configs, one prefill.

A queue driver used once to compare calibration objectives (see README.md here): every `*.json` in the queue
folder (`{"name", "config"}`, written by alloc.py) is decoded from a copy of one dense prefill and its result
written beside it as `*.out`. The dense row is not decoded again (8.292, ppl_smollm2.md: fp32 CPU is
deterministic). `touch QUEUE/STOP` ends it.

    OMP_NUM_THREADS=1 python evalppl.py QUEUE [PAGE_SIZE]
"""
import glob
import json
import math
import os
import sys
import time

import torch

from quest_hf import QuestConfig
from quest_hf.eval.accounting import dense_bytes, model_step_bytes
from quest_hf.eval.ppl import DENSE_BUDGET, decode_nlls, fork_cache, prefill_cache, stdlib_text
from quest_hf.models import load_model
from quest_hf.patch import patched

torch.set_num_threads(1)
model, tok = load_model(None, torch.float32, "cpu")
ids = tok(stdlib_text()[0], return_tensors="pt").input_ids[:, :8193]
prefix = 7680
queue = sys.argv[1]
page = int(sys.argv[2]) if len(sys.argv) > 2 else 16
text = model.config.get_text_config()
n, kv = text.num_hidden_layers, text.num_key_value_heads
hd = text.hidden_size // text.num_attention_heads
group = text.num_attention_heads // kv
base = QuestConfig(budget=DENSE_BUDGET, page_size=page, cuda_graph=False, compile_decode=False)
with patched(model, config=base):
    cache, _ = prefill_cache(model, ids[:, :prefix])
    print("prefilled", flush=True)
    idle = 0
    while idle < 3000:
        todo = sorted(f for f in glob.glob(os.path.join(queue, "*.json")) if not os.path.exists(f[:-5] + ".out"))
        if not todo:
            time.sleep(2)
            idle += 2
            if os.path.exists(os.path.join(queue, "STOP")):
                break
            continue
        idle = 0
        f = todo[0]
        e = json.load(open(f))
        cfg = QuestConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in e["config"].items()})
        t = time.time()
        fork, pages = fork_cache(cache, cfg), {}
        fork.selection_hooks.append(
            lambda i, q, x, pages=pages: pages.setdefault(i, []).append(float((x >= 0).sum()) / x.shape[0]))
        nll = decode_nlls(model, fork, ids[:, prefix:])
        read = model_step_bytes(cfg, n, 8193, kv, hd, 4, group, {i: sum(v) / len(v) for i, v in pages.items()})
        mean = float(nll.double().mean())
        res = dict(name=e["name"], nll=mean, ppl=math.exp(mean), rel=math.exp(mean) / 8.292, bytes_mib=read / 2**20,
                   frac=read / (n * dense_bytes(8193, kv, hd, 4)), seconds=time.time() - t, nlls=nll.tolist())
        json.dump(res, open(f[:-5] + ".out", "w"))
        print(e["name"], f"ppl {res['ppl']:.3f} ({res['rel']:.4f}) {res['bytes_mib']:.2f} MiB", flush=True)
