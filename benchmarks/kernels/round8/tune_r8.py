"""Round 8 probe: Top-K radix width (2 / 4 / 8 bits a pass) and the attention's split count, per stage and for
the whole step (CUDA-graph replays, the bench's timer), on the shapes of issue #16's targets.

    PYTHONPATH=. python benchmarks/kernels/round8/tune_r8.py --out results/tune_r8.json
"""
import argparse
import dataclasses
import importlib.util
import json
import pathlib

import torch

spec = importlib.util.spec_from_file_location("bench_kernels", pathlib.Path("scripts/bench_kernels.py"))
bk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bk)
from triton_kernels import sparse_attention as attn_mod  # noqa: E402
from triton_kernels import topk as topk_mod  # noqa: E402

CASES = [("llama2-7b", 32768, 1, "union"), ("llama2-7b", 131072, 1, "union"), ("llama3-8b", 32768, 1, "union"),
         ("llama3-8b", 32768, 1, "max"), ("llama3-8b", 131072, 1, "union"), ("llama2-7b", 32768, 8, "union"),
         ("llama3-8b", 32768, 8, "union")]
# Run 1 (tune_r8.json, commit 65bb1e9) timed radix_bits 2 / 4 / 8 (a tl.histogram of 4 or 8 bits a pass: slower
# everywhere, removed) and 16 attention launches; run 2 (tune_r8_2.json) times the rank-first search.
TOPK = [dict(rank_bits=b) for b in (0, 12, 16, 20)] + [dict(rank_bits=b, split_union=False) for b in (0, 16)]
ATTN = [dict(programs_per_sm=p, block_n=32, num_warps=w) for p in (4, 8) for w in (2, 4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cases=[])
    for shape, L, B, mode in CASES:
        H_q, H_kv, D = bk.SHAPES[shape]
        sets = [(bk.make_layer(B, H_kv, L, D, torch.float16, i), torch.randn(B, H_q, D, device="cuda",
                                                                             dtype=torch.float16)) for i in range(3)]
        row = dict(shape=shape, L=L, B=B, mode=mode, topk={}, attn={})
        for cfg in TOPK:
            launch = dict(topk=dataclasses.replace(topk_mod.TOPK_LAUNCH, **cfg))
            try:
                steps = [bk.Step(lay, q, 128, mode, launch) for lay, q in sets]
                ref = bk.Step(sets[0][0], sets[0][1], 128, mode)
                same = torch.equal(steps[0].ids, ref.ids)
                row["topk"][json.dumps(cfg)] = dict(us=bk.graph_time(steps, "topk"), same_ids=same)
            except Exception as e:
                row["topk"][json.dumps(cfg)] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            print(shape, L, B, mode, "topk", cfg, row["topk"][json.dumps(cfg)], flush=True)
        for cfg in ATTN:
            launch = dict(attn=dataclasses.replace(attn_mod.ATTENTION_LAUNCH, **cfg))
            try:
                steps = [bk.Step(lay, q, 128, mode, launch) for lay, q in sets]
                row["attn"][json.dumps(cfg)] = dict(us=bk.graph_time(steps, "attn"))
            except Exception as e:
                row["attn"][json.dumps(cfg)] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            print(shape, L, B, mode, "attn", cfg, row["attn"][json.dumps(cfg)], flush=True)
        best_t = min((v["us"], k) for k, v in row["topk"].items() if "us" in v and v["same_ids"])
        best_a = min((v["us"], k) for k, v in row["attn"].items() if "us" in v)
        launch = dict(topk=dataclasses.replace(topk_mod.TOPK_LAUNCH, **json.loads(best_t[1])),
                      attn=dataclasses.replace(attn_mod.ATTENTION_LAUNCH, **json.loads(best_a[1])))
        steps = [bk.Step(lay, q, 128, mode, launch) for lay, q in sets]
        base = [bk.Step(lay, q, 128, mode) for lay, q in sets]
        row["full_default_us"] = bk.graph_time(base, "full")
        row["full_best_us"] = bk.graph_time(steps, "full")
        row["best"] = dict(topk=best_t[1], attn=best_a[1])
        print(shape, L, B, mode, "FULL default", row["full_default_us"], "best", row["full_best_us"], row["best"],
              flush=True)
        res["cases"].append(row)
        pathlib.Path(args.out).write_text(json.dumps(res, indent=1))
        del sets, steps, base
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
