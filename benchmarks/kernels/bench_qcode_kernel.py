"""Micro-benchmark of the qcode page scoring kernel (`code_scores`) against plain Quest scoring (`score_pages`).

One random fp16 layer per shape and length (page 16, keys with outlier channels, every slot valid, the last page
scored exactly as the current page), its kmin/kmax and its codes from `encode_codes`. Per (shape, L, bits, mode):
`code_scores` is checked against `code_scores_ref` (finite entries allclose, same -inf/+inf pattern, max abs diff
reported), then timed next to `score_pages` (reduce "none", same layer): each call captured in a CUDA graph,
replays timed by quest_hf.bench, median of --iters replays after warm-up, rotating over input sets (clones of codes,
kmin, kmax and q) that together exceed L2 three times, so no timed call finds its inputs in L2. A sweep of
(variant, block_p, num_warps) runs for bits 2 and mode "max" (each config checked first); the rest use the
defaults (`*` in the table).

    python benchmarks/kernels/bench_qcode_kernel.py --out DIR           # ~1-2 minutes on an H200
    python benchmarks/kernels/bench_qcode_kernel.py --out DIR --quick   # 32K only, no 1-bit rows
    python benchmarks/kernels/bench_qcode_kernel.py --out DIR --tiny    # CPU smoke test (interpreter, L=512)

Bytes: what a call must read (codes of the complete pages, their kmin/kmax, the current page's keys) plus the
fp32 scores written; "frac" is that over the device-to-device copy bandwidth measured in the same run, over the
measured time (1.0 = at copy speed). Writes bench_qcode_kernel.json and .md into --out (default
results/bench_qcode_kernel/; round 3's are in benchmarks/kernels/round3/).
"""
import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time
from functools import partial

if "--tiny" in sys.argv:  # CPU smoke test: Triton reads TRITON_INTERPRET when first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton

import triton_kernels as tk
from quest_hf.bench import LAYER_SHAPES, copy_bandwidth, results_dir, time_graph, wall_time_us
from triton_kernels import key_codes

SHAPES = LAYER_SHAPES  # (H_q, H_kv, D)
PAGE = 16
L2_BYTES = 60e6  # H200: 50 MB; a margin
DEV = "cuda"
# (variant, block_p, num_warps) at bits 2, mode "max"; block_p None = the variant's default for those warps.
# "words" at D 128, 2 bits: 8 pages a warp is one page a thread (the default); 2x that gives a thread 2 pages.
SWEEP = [("words", None, 1), ("words", None, 2), ("words", None, 4), ("words", None, 8), ("words", 64, 4),
         ("bytes", None, None), ("bytes", 8, 4)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="output folder (default results/bench_qcode_kernel/)")
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--bits", type=int, nargs="+", default=[2, 1], choices=[1, 2, 4])
    p.add_argument("--modes", nargs="+", default=["max", "lse"], choices=["max", "lse"])
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--no-sweep", action="store_true", help="default (block_p, num_warps) only")
    p.add_argument("--quick", action="store_true", help="32K only, bits 2 only")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: interpreter, L=512, wall clock, 2 iters")
    return p.parse_args(argv)


def build_layer(H, L, D, seed):
    """Keys [1, H, L, D] fp16 with outlier channels (as scripts/bench_selector.py), kmin/kmax, valid, codes per bits."""
    chan = torch.logspace(-1, 0.7, D)[torch.randperm(D, generator=torch.Generator().manual_seed(seed))].to(DEV)
    g = torch.Generator(device=DEV).manual_seed(seed)
    keys = (torch.randn(1, H, L, D, device=DEV, generator=g) * chan).half()
    pages = keys.view(1, H, L // PAGE, PAGE, D)
    kmin, kmax = pages.amin(3).contiguous(), pages.amax(3).contiguous()
    valid = torch.ones(1, L, dtype=torch.bool, device=DEV)
    return keys, kmin, kmax, valid, chan


def encode(keys, kmin, kmax, bits):
    """Codes of every page with `encode_codes`, checked against `encode_codes_ref` on the first 64 pages."""
    _, H, L, D = keys.shape
    codes = torch.zeros(1, H, L, D * bits // 8, dtype=torch.uint8, device=DEV)
    tk.encode_codes(keys, kmin, kmax, codes, 0, L // PAGE, bits)
    n = min(64, L // PAGE) * PAGE
    ref = torch.zeros_like(codes[:, :, :n])
    tk.encode_codes_ref(keys[:, :, :n], kmin[:, :, :n // PAGE], kmax[:, :, :n // PAGE], ref, 0, n // PAGE, bits)
    per = 8 // bits
    def unpack(c):
        return (c.long()[..., None] >> (torch.arange(per, device=DEV) * bits)) & ((1 << bits) - 1)

    diff = (unpack(codes[:, :, :n]) - unpack(ref)).abs()
    assert diff.max() <= 1 and (diff != 0).float().mean() < 1e-3, "encode_codes differs from encode_codes_ref"
    return codes


def compare(mine, ref):
    """(ok, max abs diff on finite entries, max |ref|): same -inf/+inf pattern and allclose where finite."""
    fin = ref.isfinite()
    same_inf = torch.equal(fin, mine.isfinite()) and torch.equal(mine[~fin], ref[~fin])
    if not fin.any():
        return same_inf, 0.0, 0.0
    a, b = mine[fin], ref[fin]
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    ok = same_inf and not mine.isnan().any().item() and torch.allclose(a, b, rtol=1e-4, atol=1e-5 * max(scale, 1.0))
    return ok, diff, scale


def time_graphs(fns, warmup, iters):
    """Median microseconds of one call: each fn captured in its own CUDA graph, replays rotated over the fns."""
    if DEV == "cpu":  # --tiny: wall clock, only to exercise the script
        return wall_time_us(fns[0], warmup=warmup, iters=iters)
    return time_graph(fns, warmup=warmup, iters=iters)


def cpu_copy_bandwidth():
    """--tiny only: a 1 MB host copy by wall clock, so the script runs end to end on CPU."""
    x = torch.empty(1 << 20, dtype=torch.uint8).random_()
    y = torch.empty_like(x)
    return 2 * x.numel() / (wall_time_us(lambda: y.copy_(x)) * 1e-6)


def run_shape(shape, L, args, bw, rows):
    H_q, H, D = SHAPES[shape]
    S, scale = PAGE, D ** -0.5
    keys, kmin, kmax, valid, chan = build_layer(H, L, D, seed=L + H)
    P = L // S
    quest_bytes = 2 * H * P * D * 2 + H_q * P * 4
    bits_list = [2] if args.quick else args.bits
    for bits in bits_list:
        codes = encode(keys, kmin, kmax, bits)
        nbytes = H * (P - 1) * S * D * bits // 8 + 2 * H * (P - 1) * D * 2 + H * S * D * 2 + H_q * P * 4
        n_sets = max(3, min(8, math.ceil(3 * L2_BYTES / nbytes)))
        sets = [(codes, kmin, kmax)] + [(codes.clone(), kmin.clone(), kmax.clone()) for _ in range(n_sets - 1)]
        qs = [(torch.randn(1, H_q, D, device=DEV) * chan).half() for _ in range(n_sets)]
        t_quest = time_graphs([partial(tk.score_pages, qs[i], sets[i][1], sets[i][2], L, S, 0, "none")
                               for i in range(n_sets)], args.warmup, args.iters)
        for mode in args.modes:
            ref = tk.code_scores_ref(qs[0], keys, kmin, kmax, codes, valid, L, S, 0, bits, mode, scale)
            configs = [(None, None, None)]
            if bits == 2 and mode == "max" and not args.no_sweep:
                default = key_codes.CODE_SCORE_LAUNCH
                configs += [c for c in SWEEP if c != (default.variant, None, default.num_warps_words)]
            for var, bp, nw in configs:
                is_default = var is None
                d = key_codes.CODE_SCORE_LAUNCH
                kw = dict(launch=key_codes.CodeScoreLaunch(variant=var or d.variant, block_p=bp, num_warps=nw))
                var = var or d.variant
                if var == "words":
                    nw = nw or d.num_warps_words
                    bp = bp or max(1, nw * 32 // (D * bits // 64))
                else:
                    nw, bp = nw or d.num_warps_bytes, bp or d.block_p_bytes
                mine = tk.code_scores(qs[0], keys, kmin, kmax, codes, valid, L, S, 0, bits, mode, scale, **kw)
                ok, diff, mag = compare(mine, ref)
                t = time_graphs([partial(tk.code_scores, qs[i], keys, sets[i][1], sets[i][2], sets[i][0], valid,
                                         L, S, 0, bits, mode, scale, **kw)
                                 for i in range(n_sets)], args.warmup, args.iters)
                rows.append(dict(
                    shape=shape, L=L, bits=bits, mode=mode, variant=var, block_p=bp, num_warps=nw,
                    default=is_default, code_us=t, quest_us=t_quest,
                    ratio_to_quest=t / t_quest, bytes=nbytes, GBps=nbytes / (t * 1e-6) / 1e9,
                    frac_of_copy_bw=nbytes / bw / (t * 1e-6), quest_frac_of_copy_bw=quest_bytes / bw / (t_quest * 1e-6),
                    ok=ok, max_abs_diff=diff, max_abs_ref=mag, n_input_sets=n_sets,
                ))
                print(fmt_row(rows[-1]), flush=True)
            del ref
        del sets, qs, codes
        torch.cuda.empty_cache()
    del keys, kmin, kmax, valid
    torch.cuda.empty_cache()


HEADER = ("| shape | L | bits | mode | variant | block_p | warps | code us | quest us | x quest | MB | GB/s | frac "
          "| quest frac | ok | max abs diff (max abs ref) |\n|" + "---|" * 16)


def fmt_row(r):
    return (f"| {r['shape']} | {r['L']} | {r['bits']} | {r['mode']} | {r['variant']}{'*' if r['default'] else ''} "
            f"| {r['block_p']} "
            f"| {r['num_warps']} | {r['code_us']:.1f} | {r['quest_us']:.1f} | {r['ratio_to_quest']:.2f} "
            f"| {r['bytes'] / 1e6:.1f} | {r['GBps']:.0f} | {r['frac_of_copy_bw']:.2f} "
            f"| {r['quest_frac_of_copy_bw']:.2f} "
            f"| {'yes' if r['ok'] else 'NO'} | {r['max_abs_diff']:.1e} ({r['max_abs_ref']:.1f}) |")


def write(out, meta, rows):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_qcode_kernel.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(out, "bench_qcode_kernel.md"), "w") as f:
        f.write(f"# qcode page scoring (code_scores) vs Quest (score_pages)\n\n{json.dumps(meta)}\n\n"
                "CUDA-graph replays, median; `*` = the module defaults; "
                "frac = bytes over copy bandwidth over time.\n\n")
        f.write(HEADER + "\n" + "\n".join(fmt_row(r) for r in rows) + "\n")


def main(argv=None):
    global DEV
    args = parse_args(argv)
    args.out = args.out or str(results_dir("bench_qcode_kernel"))
    if args.tiny:
        DEV, args.lengths, args.warmup, args.iters = "cpu", [512], 0, 2
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark needs a GPU (or --tiny for a CPU smoke test)")
    if args.quick:
        args.lengths = [32768]
    t0 = time.time()
    torch.manual_seed(0)
    bw = copy_bandwidth(DEV) if DEV == "cuda" else cpu_copy_bandwidth()
    device = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (--tiny)"
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device=device, torch=torch.__version__,
                copy_bandwidth_GBps=bw / 1e9, page=PAGE, dtype="float16", B=1,
                defaults=dataclasses.asdict(key_codes.CODE_SCORE_LAUNCH), iters=args.iters,
                command="python " + " ".join(sys.argv))
    meta["triton"] = triton.__version__
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write)\n{HEADER}", flush=True)
    rows = []
    for L in args.lengths:
        for shape in args.shapes:
            run_shape(shape, L, args, bw, rows)
            write(args.out, meta, rows)
    meta["wall_s"] = time.time() - t0
    write(args.out, meta, rows)
    bad = [r for r in rows if not r["ok"]]
    print(f"done in {meta['wall_s']:.0f} s; {len(bad)} configuration(s) differ from code_scores_ref", flush=True)
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
