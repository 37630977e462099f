"""(Ran at commit 31decc9, where the register path existed; it was removed after this probe: no gain.)
Round 13 probe: the attention's register-product path (`AttentionLaunch.register_max_group`, `USE_DOT=False`)
against the tensor-core tiles, over tokens a step, warps, programs per SM and the merge, per stage and for the whole
step (CUDA-graph replays, the bench's timer), on the shapes of issue #16's targets; then the kernels' own durations
(torch profiler) for the default and the fastest setting of each case.

    PYTHONPATH=. python benchmarks/kernels/round13/tune_attn.py --out results/tune_attn.json
"""
import argparse
import dataclasses
import importlib.util
import itertools
import json
import pathlib

import torch

spec = importlib.util.spec_from_file_location("bench_kernels", pathlib.Path("scripts/bench_kernels.py"))
bk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bk)
from triton_kernels import sparse_attention as attn_mod  # noqa: E402

CASES = [("llama2-7b", 32768, 1, "union"), ("llama3-8b", 32768, 1, "max"), ("llama3-8b", 32768, 1, "union"),
         ("llama2-7b", 32768, 8, "union"), ("llama3-8b", 32768, 8, "union")]
BASE = dict(register_max_group=0)
REG = [dict(register_max_group=8, reg_block_n=n, reg_num_warps=w, reg_programs_per_sm=p, reg_num_stages=1,
            fuse_merge_max_splits=f)
       for n, w, p, f in itertools.product((16, 32), (1, 2, 4), (4, 8, 16, 32), (0, 1 << 30))]
REG += [dict(register_max_group=8, reg_block_n=32, reg_num_warps=w, reg_programs_per_sm=p, reg_num_stages=2,
             fuse_merge_max_splits=0) for w in (2, 4) for p in (4, 8)]  # a few steps a program: pipelined


def kernel_us(fn, reps=30):
    """Each kernel's mean device time (us) over `reps` calls of fn, from the torch profiler."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.count:
            out[e.key[:80]] = round(e.device_time_total / reps, 2)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", type=int, nargs="*", help="indices into CASES (default: all)")
    args = ap.parse_args()
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cases=[])
    for ci, (shape, L, B, mode) in enumerate(CASES):
        if args.cases and ci not in args.cases:
            continue
        H_q, H_kv, D = bk.SHAPES[shape]
        sets = [(bk.make_layer(B, H_kv, L, D, torch.float16, i),
                 torch.randn(B, H_q, D, device="cuda", dtype=torch.float16)) for i in range(3)]
        base = [bk.Step(lay, q, 128, mode, dict(attn=dataclasses.replace(attn_mod.ATTENTION_LAUNCH, **BASE)))
                for lay, q in sets]
        want = base[0].attn().float()
        row = dict(shape=shape, L=L, B=B, mode=mode, n_ids=base[0].ids.shape[-1], attn={})
        row["base_attn_us"] = bk.graph_time(base, "attn")
        row["base_full_us"] = bk.graph_time(base, "full")
        print(shape, L, B, mode, "BASE attn", row["base_attn_us"], "full", row["base_full_us"], flush=True)
        for cfg in REG:
            key = json.dumps(cfg)
            launch = dict(attn=dataclasses.replace(attn_mod.ATTENTION_LAUNCH, **cfg))
            try:
                steps = [bk.Step(lay, q, 128, mode, launch) for lay, q in sets]
                err = (steps[0].attn().float() - want).abs().max().item()
                row["attn"][key] = dict(us=bk.graph_time(steps, "attn"), max_err=err)
            except Exception as e:
                row["attn"][key] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            print(shape, L, B, mode, cfg, row["attn"][key], flush=True)
        ok = [(v["us"], k) for k, v in row["attn"].items() if "us" in v and v["max_err"] < 2e-2]
        if ok:
            best_us, best_key = min(ok)
            launch = dict(attn=dataclasses.replace(attn_mod.ATTENTION_LAUNCH, **json.loads(best_key)))
            steps = [bk.Step(lay, q, 128, mode, launch) for lay, q in sets]
            row["best"] = dict(cfg=json.loads(best_key), attn_us=best_us, full_us=bk.graph_time(steps, "full"))
            row["kernels_base"] = kernel_us(base[0].attn)
            row["kernels_best"] = kernel_us(steps[0].attn)
            print(shape, L, B, mode, "BEST", row["best"], "\n  base kernels", row["kernels_base"],
                  "\n  best kernels", row["kernels_best"], flush=True)
        res["cases"].append(row)
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(res, indent=1))
        del sets, base
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
