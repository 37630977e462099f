#!/usr/bin/env python
"""Where greedy tokens of two decode paths part, and whether it is rounding: for each path, one greedy `generate()`
with `output_scores=True` on the same random-weight model and prompt; for each pair of paths, the first step whose
token differs, the largest |logit difference| over the steps before it (same inputs there), and the top-1 minus
top-2 logit gap of both paths at that step. A path that is wrong parts early with a large logit difference; one that
rounds differently parts where the gap is within the logit differences seen before.

Paths: HF DynamicCache (`dense`), HF static cache + generate's compile (`static`), and Quest at `--budget`:
captured (`captured`, the defaults), uncaptured compiled whole (`compiled`: cuda_graph=False, the default on CUDA),
uncaptured eager (`eager`: cuda_graph=False, compile_step=False).

    python benchmarks/probes/token_agreement.py --shape llama2-7b --length 32768 --new-tokens 32 --out $OUT/agree.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from quest_hf import patch_model, unpatch_model  # noqa: E402
from quest_hf.bench import random_llama  # noqa: E402

PATHS = {
    "dense": None,
    "static": None,
    "captured": dict(),
    "compiled": dict(cuda_graph=False),
    "eager": dict(cuda_graph=False, compile_step=False),
}


def run(model, ids, path: str, budget: int, new: int):
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, output_scores=True, return_dict_in_generate=True)
    if PATHS[path] is None:
        if hasattr(model, "_quest_state"):
            unpatch_model(model)
        if path == "static":
            kw.update(cache_implementation="static")
        else:
            kw.update(disable_compile=True)
    else:
        patch_model(model, budget=budget, **PATHS[path])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    cache = out.past_key_values
    decode_path = getattr(cache, "decode_path", None)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    scores = torch.stack([s[0].float() for s in out.scores]).cpu()  # [new, vocab]
    del out, cache
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tokens, scores, decode_path


def gap(scores_row: torch.Tensor) -> float:
    top = scores_row.topk(2).values
    return float(top[0] - top[1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama2-7b")
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dev = torch.device(a.device)
    model = random_llama(a.shape, torch.float16, dev, a.length + a.new_tokens)
    ids = torch.randint(1, model.config.vocab_size, (1, a.length), device=dev,
                        generator=torch.Generator(dev).manual_seed(a.length))
    res = {}
    for path in a.paths:
        res[path] = run(model, ids, path, a.budget, a.new_tokens)
        print(path, res[path][2], res[path][0][:8], flush=True)
    pairs = []
    for x, y in itertools.combinations(a.paths, 2):
        tx, sx, _ = res[x]
        ty, sy, _ = res[y]
        first = next((i for i, (u, v) in enumerate(zip(tx, ty)) if u != v), None)
        upto = len(tx) if first is None else first + 1  # the parting step's inputs are still the same
        diff = (sx[:upto] - sy[:upto]).abs().amax(dim=-1)
        pairs.append(dict(a=x, b=y, first_diff=first, max_logit_diff=float(diff.max()),
                          max_logit_diff_before=float(diff[:-1].max()) if upto > 1 else None,
                          gap_a=gap(sx[first]) if first is not None else None,
                          gap_b=gap(sy[first]) if first is not None else None))
        print(pairs[-1], flush=True)
    meta = dict(shape=a.shape, length=a.length, budget=a.budget, new_tokens=a.new_tokens,
                device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", torch=torch.__version__,
                command="python " + " ".join(sys.argv))
    Path(a.out).write_text(json.dumps(dict(meta=meta, decode_paths={k: v[2] for k, v in res.items()},
                                           tokens={k: v[0] for k, v in res.items()}, pairs=pairs), indent=1))


if __name__ == "__main__":
    main()
