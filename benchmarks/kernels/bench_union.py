"""The split union's pass 2 on one GPU: the serial kernel (one program per group) against the chunk-parallel one
(`TopKLaunch.chunked_union_min_pages`, three launches over (group, chunk) programs), alone and inside the whole
`topk_pages`.

Rows are score matrices of a GQA decode step (fp32 `[B, 32, P]`, groups of 4 as Llama-3-8B's 32/8 heads, 10%
-inf pages, the last page +inf), k = 129, at P = 2053, 4101, 8197, 16389 (32K-256K tokens + 128 + a spare
page), batch 1 and 8. Every time is a CUDA-graph replay (quest_hf.bench's `time_graph`, i.e. `time_calls`,
median, rotating over 4 input sets); the chunked ids are checked equal to the serial ones before timing.
The profile that asked for it: benchmarks/probes/profile_replay_8b_128k.txt (87 us a layer of serial pass 2
at P = 8197).

    python benchmarks/kernels/bench_union.py [--chunks 512 1024 2048] [--out results/bench_union/bench_union.json]
"""
import argparse
import json

import torch

import triton_kernels as tk
from quest_hf.bench import environment, results_dir, time_graph, write_report
from triton_kernels import topk as topk_mod

PAGES = (2053, 4101, 8197, 16389)
BATCHES = (1, 8)
R, GROUP, K = 32, 4, 129
SERIAL = topk_mod.TOPK_LAUNCH


def row_sets(B, P, n=4):
    sets = []
    for i in range(n):
        g = torch.Generator("cuda").manual_seed(i)
        s = torch.randn(B, R, P, generator=g, device="cuda") * 3 + 20
        s.masked_fill_(torch.rand(B, 1, P, generator=g, device="cuda") < 0.1, float("-inf"))
        s[..., -1] = float("inf")
        sets.append(s)
    return sets


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, nargs="+", default=[512, 1024, 2048], help="union_chunk values to time")
    ap.add_argument("--out", default=None, help="JSON path (default results/bench_union/bench_union.json)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_union times CUDA kernels: no CUDA device here")
    rows = []
    for B in BATCHES:
        for P in PAGES:
            sets = row_sets(B, P)
            # Pass 1 once per input set: pass 2 alone reads these thresholds.
            thr = [topk_mod._thresholds(s, K, SERIAL)[:2] for s in sets]
            outs = [torch.empty(B, R // GROUP, min(GROUP * K, P), dtype=torch.int32, device="cuda") for _ in sets]
            want = tk.topk_pages(sets[0], K, GROUP)
            row = dict(B=B, P=P, R=R, group=GROUP, k=K)
            row["pass2_serial_us"] = time_graph(
                [lambda s=s, t=t, o=o: topk_mod._serial_union(s, *t, o, GROUP, SERIAL)
                 for s, t, o in zip(sets, thr, outs)])
            row["topk_serial_us"] = time_graph([lambda s=s, o=o: tk.topk_pages(s, K, GROUP, out=o)
                                                for s, o in zip(sets, outs)])
            for ch in args.chunks:
                launch = topk_mod.TopKLaunch(chunked_union_min_pages=1, union_chunk=ch)
                row[f"ok_{ch}"] = torch.equal(tk.topk_pages(sets[0], K, GROUP, launch=launch), want)
                row[f"pass2_chunk{ch}_us"] = time_graph(
                    [lambda s=s, t=t, o=o, la=launch: topk_mod._chunked_union(s, *t, o, GROUP, la)
                     for s, t, o in zip(sets, thr, outs)])
                row[f"topk_chunk{ch}_us"] = time_graph(
                    [lambda s=s, o=o, la=launch: tk.topk_pages(s, K, GROUP, launch=la, out=o)
                     for s, o in zip(sets, outs)])
            rows.append(row)
            print(json.dumps(row), flush=True)
    cols = ["pass2_serial_us"] + [f"pass2_chunk{c}_us" for c in args.chunks]
    cols += ["topk_serial_us"] + [f"topk_chunk{c}_us" for c in args.chunks]
    lines = ["| B | P | " + " | ".join(c.removesuffix("_us") for c in cols) + " |", "|---|---|" + "---|" * len(cols)]
    for r in rows:
        wrong = "" if all(r[f"ok_{c}"] for c in args.chunks) else " (chunked WRONG)"
        lines.append(f"| {r['B']} | {r['P']}{wrong} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + " |")
    print("\n".join(lines))
    out = args.out or str(results_dir("bench_union") / "bench_union.json")
    write_report(out, dict(env=environment("cuda"), rows=rows), "Split union pass 2: serial vs chunked (us)",
                 [f"- R = {R} rows, groups of {GROUP}, k = {K}; CUDA-graph replay, median"], lines)


if __name__ == "__main__":
    main()
