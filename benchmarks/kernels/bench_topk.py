"""Top-K kernel alone on one GPU: launch configurations, and optionally another implementation side by side.

Rows are the score matrices a decode step hands to `topk_pages` (fp32 `[B, R, P]`, random bounds, the last
page forced to +inf): MHA (R = 32 KV heads, group 1), GQA union (R = 32 query heads, groups of 4) and GQA
shared score (R = 8), at P = 2048 (32K tokens), 2053 (a static cache of 32K + 128 tokens + a spare page:
what the captured decode sees), 8192 (128K) and 8197 (its captured decode's), batch 1 and 8. Each kernel is
timed in CUDA-graph replays (quest_hf.bench's timer, median, 20 calls back to back in one graph rotating over 4
input sets) and checked against `topk_pages_ref`.

    python benchmarks/kernels/bench_topk.py [--other path/to/old_topk.py] [--configs KEYS_PER_THREAD=32,...]

Writes bench_topk.json and .md into --out (default results/bench_topk/); round 3's are in kernels/round3/.
"""
import argparse
import datetime
import importlib.util
import json
import os
import sys
from functools import partial

import torch

import triton_kernels as tk
from quest_hf.bench import results_dir, time_graph_chain, topk_launch_fields
from triton_kernels import topk as topk_mod

CASES = [  # name, B, R, P, k, group
    ("mha-32K", 1, 32, 2048, 128, 1), ("mha-static-32K", 1, 32, 2053, 129, 1), ("mha-128K", 1, 32, 8192, 128, 1),
    ("mha-static-128K", 1, 32, 8197, 129, 1),
    ("union4-32K", 1, 32, 2048, 128, 4), ("union4-static-32K", 1, 32, 2053, 129, 4),
    ("union4-128K", 1, 32, 8192, 128, 4), ("union4-static-128K", 1, 32, 8197, 129, 4),
    ("shared-32K", 1, 8, 2048, 128, 1), ("mha-32K-B8", 8, 32, 2048, 128, 1), ("union4-32K-B8", 8, 32, 2048, 128, 4),
    ("mha-4K", 1, 32, 256, 128, 1),
]


def graph_us(fn, sets, reps=50):
    """Median us a call of `fn(s)` with 20 calls back to back in one CUDA graph, rotating over the input sets
    (`time_graph_chain`): a one-call graph's replay carries the graph's own launch, which varied by 2-4 us between
    cases of one run (benchmarks/e2e/run18)."""
    return time_graph_chain([lambda s=s: fn(s) for s in sets], 20, iters=reps)


def call(fn, s, k, group):
    return fn(s, k, group)


def same_selection(ids, ref, s, group):
    if torch.equal(ids, ref):
        return True
    if group != 1 or not torch.equal((ids < 0).sum(-1), (ref < 0).sum(-1)):
        return False
    def pick(x):
        return torch.where(x >= 0, s.gather(-1, x.clamp(min=0).long()), 0.0).sort(-1).values

    return torch.equal(pick(ids), pick(ref))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", help="a file defining topk_pages(scores, k, group) to time beside the repo's")
    ap.add_argument("--configs", nargs="*", default=[],
                    help="TopKLaunch settings to try as well, e.g. keys_per_thread=32,max_tile=32768,max_warps=16")
    ap.add_argument("--out", default=None, help="output folder (default results/bench_topk/)")
    args = ap.parse_args(argv)
    impls = {"repo": tk.topk_pages}
    for cfg in args.configs:  # TopKLaunch fields, e.g. keys_per_thread=32,max_tile=32768
        launch = topk_mod.TopKLaunch(**topk_launch_fields(cfg.split(",")))
        impls[cfg] = partial(tk.topk_pages, launch=launch)
    if args.other:
        spec = importlib.util.spec_from_file_location("other_topk", args.other)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        impls["other"] = mod.topk_pages
    rows = []
    for name, B, R, P, k, group in CASES:
        sets = []
        for _ in range(4):
            s = torch.randn(B, R, P, device="cuda") * 3 + 20
            s[..., -1] = float("inf")
            sets.append(s)
        ref = tk.topk_pages_ref(sets[0], k, group)
        row = dict(case=name, B=B, R=R, P=P, k=k, group=group, launch=topk_mod.launch_config(P, group))
        for iname, fn in impls.items():
            try:
                ok = same_selection(fn(sets[0], k, group), ref, sets[0], group)
                row[iname] = graph_us(partial(call, fn, k=k, group=group), sets)
                row[iname + "_ok"] = ok
            except Exception as e:  # a configuration that does not compile is reported, not fatal
                row[iname] = None
                row[iname + "_err"] = f"{type(e).__name__}: {str(e)[:160]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = args.out or str(results_dir("bench_topk"))
    os.makedirs(out, exist_ok=True)
    import triton

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now().isoformat(timespec="seconds"), command=" ".join(sys.argv))
    with open(os.path.join(out, "bench_topk.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(out, "bench_topk.md"), "w") as f:
        f.write(f"# Top-K kernel alone (CUDA-graph replay, us)\n\n{json.dumps(meta)}\n\n")
        f.write("| case | " + " | ".join(impls) + " |\n|---|" + "---|" * len(impls) + "\n")
        for r in rows:
            cells = [f"{r[i]:.1f}{'' if r.get(i + '_ok') else ' (WRONG)'}" if r[i] is not None else "fail"
                     for i in impls]
            f.write(f"| {r['case']} | " + " | ".join(cells) + " |\n")


if __name__ == "__main__":
    main()
