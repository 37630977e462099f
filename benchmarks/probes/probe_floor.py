#!/usr/bin/env python
"""How fast can any three-stage Triton Quest step be at batch 1? Zero-compute probes with Quest's bytes.

A Quest decode step reads the page metadata (stage 1: scores), picks pages (stage 2: Top-K, a few KB), then
reads the chosen pages' K/V (stage 3: attention). This script times, on the GPU, kernels that do only the
memory traffic of each stage, with no math, as CUDA-graph replays timed by quest_hf.bench (the clean timer):
  read_meta    one kernel reading the metadata bytes of a layer (contiguous, summed), best launch setting
  gather_kv    one kernel reading the chosen pages' K and V through a page-id list, as the attention does
  boundary     one tiny dependent kernel (reads one value the previous kernel wrote): a graph kernel boundary
  chain3       read_meta -> boundary -> gather_kv in one graph: the floor of a 3-stage step that does no math
and compares them with the whole Quest step (`score_pages` + `topk_pages` + `sparse_decode_attention`) and
with the time that the kernels issue's ratio targets need (SDPA / target).

    python benchmarks/probes/probe_floor.py --lengths 32768 131072
    python benchmarks/probes/probe_floor.py --shape llama3-8b --lengths 32768 --targets 4 --mode max

Writes probe_floor.json and .md to --out (default results/probe_floor/probe_floor.json). The committed ones
beside this file were written by it when it lived in scripts/ (benchmarks/README.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

import triton_kernels as tk
from quest_hf.bench import copy_bandwidth, results_dir, time_graph

PAGE = 16


def make_layer(H, L, D, seed):
    """A full batch-1 fp16 layer cache of L tokens (every page valid), its page min/max reduced from the keys."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    kc = torch.randn(1, H, L, D, device="cuda", dtype=torch.float16, generator=g)
    vc = torch.randn(1, H, L, D, device="cuda", dtype=torch.float16, generator=g)
    pages = kc.view(1, H, L // PAGE, PAGE, D)
    return kc, vc, pages.amin(3), pages.amax(3), torch.ones(1, L, dtype=torch.bool, device="cuda")


def quest_step(probe, q, k, mode):
    """The whole Quest step on a probe's layer (as scripts/bench_kernels.py's `Step.full`): union or max mode."""
    G = q.shape[1] // probe.H
    reduce, group = ("none", G) if mode == "union" else ("max", 1)
    scale = q.shape[-1] ** -0.5

    def full():
        s = tk.score_pages(q, probe.kmin, probe.kmax, probe.L, PAGE, 0, reduce)
        ids = tk.topk_pages(s, k, group)
        return tk.sparse_decode_attention(q, probe.kc, probe.vc, ids, probe.valid, probe.L, PAGE, scale)

    return full


@triton.jit
def _read_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """Grid-stride sum of x (fp16), one partial per program: pure streaming read."""
    pid, n_prog = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, N, n_prog * BLOCK):
        o = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + o, mask=o < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


@triton.jit
def _boundary_kernel(src_ptr, dst_ptr):
    """One dependent value: what a stage boundary costs with no work on either side."""
    tl.store(dst_ptr + tl.program_id(0), tl.load(src_ptr) + 1.0)


@triton.jit
def _gather_kernel(k_ptr, v_ptr, ids_ptr, out_ptr, C, N_IDS, IDS_PER_SPLIT, NUM_SPLITS,
                   D: tl.constexpr, PAGE_: tl.constexpr, BLOCK_N: tl.constexpr):
    """The attention's byte pattern (ids -> K/V page tiles of [BLOCK_N, D]) with the math replaced by a sum."""
    i_h, i_s = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_n, o_d = tl.arange(0, BLOCK_N), tl.arange(0, D)
    i_t0 = i_s * IDS_PER_SPLIT * PAGE_
    i_t1 = tl.minimum((i_s + 1) * IDS_PER_SPLIT, N_IDS) * PAGE_
    acc = tl.zeros([D], dtype=tl.float32)
    base = i_h * C * D
    for t in range(i_t0, i_t1, BLOCK_N):
        o_t = t + o_n
        page = tl.load(ids_ptr + i_h * N_IDS + o_t // PAGE_, mask=o_t < i_t1, other=-1)
        slot = page * PAGE_ + o_t % PAGE_
        m = (page >= 0)[:, None]
        k = tl.load(k_ptr + base + slot[:, None] * D + o_d[None, :], mask=m, other=0.0)
        v = tl.load(v_ptr + base + slot[:, None] * D + o_d[None, :], mask=m, other=0.0)
        acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), 0)
    tl.store(out_ptr + (i_h * NUM_SPLITS + i_s) * D + o_d, acc)


class Probe:
    """One input set: a layer (MHA, batch 1) and random chosen pages per head."""

    def __init__(self, H, L, D, budget, seed):
        self.kc, self.vc, self.kmin, self.kmax, self.valid = make_layer(H, L, D, seed)
        P, K = L // PAGE, budget // PAGE
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.ids = torch.rand(H, P, device="cuda", generator=g).argsort(1)[:, :K].sort(1).values.int().contiguous()
        self.meta = torch.cat([self.kmin.flatten(), self.kmax.flatten()])  # the score stage's bytes, contiguous
        self.flag = torch.zeros(4096, device="cuda")  # one partial per program (<= 8 per SM) + the boundary's
        self.H, self.L, self.D, self.K = H, L, D, K

    def read_meta(self, programs, warps, block):
        _read_kernel[(programs,)](self.meta, self.flag, self.meta.numel(), BLOCK=block, num_warps=warps)

    def boundary(self):
        _boundary_kernel[(1,)](self.flag, self.flag[4095:])

    def gather(self, splits, block_n, warps):
        per = triton.cdiv(self.K, splits)
        n_split = triton.cdiv(self.K, per)
        out = torch.empty(self.H, n_split, self.D, device="cuda")
        _gather_kernel[(self.H, n_split)](self.kc, self.vc, self.ids, out, self.L, self.K, per, n_split,
                                          D=self.D, PAGE_=PAGE, BLOCK_N=block_n, num_warps=warps)
        return out


def timed(probes, make_fn):
    """Median us of one graph replay, one graph per probe (input set), replays rotated."""
    return time_graph([make_fn(p) for p in probes], rep_ms=100)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--targets", type=float, nargs="+", default=[7.5, 11.0],
                    help="the kernels issue's MHA B=1 ratio targets, one per length")
    ap.add_argument("--shape", default="llama2-7b", choices=["llama2-7b", "llama3-8b"],
                    help="layer shape: 32 query heads and 32 (MHA) or 8 (GQA) KV heads, head_dim 128")
    ap.add_argument("--mode", default="union", choices=["union", "max"],
                    help="the Quest step timed beside the probes (max: one choice per KV head, the probes' bytes)")
    ap.add_argument("--out", default=None,
                    help="JSON path, .md beside it (default results/probe_floor/probe_floor.json)")
    args = ap.parse_args(argv)
    args.out = args.out or str(results_dir("probe_floor") / "probe_floor.json")
    Hq, H, D = 32, 32 if args.shape == "llama2-7b" else 8, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth("cuda")
    rows = []
    for L, target in zip(args.lengths, args.targets, strict=False):
        probes = [Probe(H, L, D, args.budget, seed) for seed in range(3)]  # rotated: what one replay reads > L2
        meta_bytes = probes[0].meta.numel() * 2
        kv_bytes = 2 * H * args.budget * D * 2
        assert 8 * sms < 4095, "flag buffer too small for this GPU"
        read = {(n, w, b): timed(probes, lambda p, n=n, w=w, b=b: (lambda: p.read_meta(n, w, b)))
                for n in (sms, 2 * sms, 4 * sms, 8 * sms) for w in (4, 8) for b in (1024, 4096)}
        best_read = min(read, key=read.get)
        gather = {(s, bn, w): timed(probes, lambda p, s=s, bn=bn, w=w: (lambda: p.gather(s, bn, w)))
                  for s in (8, 16, 32) for bn in (32, 64) for w in (4, 8)}
        best_gather = min(gather, key=gather.get)
        boundary = timed(probes, lambda p: p.boundary)

        def chain(p, best_read=best_read, best_gather=best_gather):
            def run():
                p.read_meta(*best_read)
                p.boundary()
                return p.gather(*best_gather)
            return run

        chain3 = timed(probes, chain)
        quest = timed(probes, lambda p: quest_step(p, torch.randn(1, Hq, D, device="cuda", dtype=torch.float16),
                                                   args.budget // PAGE, args.mode))
        q = torch.randn(1, Hq, 1, D, device="cuda", dtype=torch.float16)
        sdpa = timed(probes, lambda p, q=q: partial(torch.nn.functional.scaled_dot_product_attention,
                                                    q, p.kc, p.vc, enable_gqa=Hq != H))
        row = dict(shape=args.shape, mode=args.mode, length=L, budget=args.budget, meta_MB=meta_bytes / 1e6,
                   kv_MB=kv_bytes / 1e6,
                   copy_GBps=bw / 1e9, byte_limit_us=(meta_bytes + kv_bytes) / bw * 1e6,
                   read_meta_us=read[best_read], read_meta_setting=list(best_read),
                   read_meta_GBps=meta_bytes / read[best_read] / 1e3,
                   gather_kv_us=gather[best_gather], gather_setting=list(best_gather),
                   gather_kv_GBps=kv_bytes / gather[best_gather] / 1e3,
                   boundary_us=boundary, chain3_us=chain3, quest_step_us=quest, sdpa_us=sdpa,
                   target_x=target, target_us=sdpa / target, x_quest=sdpa / quest, x_chain3=sdpa / chain3,
                   read_all={str(k): v for k, v in read.items()}, gather_all={str(k): v for k, v in gather.items()})
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
        del probes
        torch.cuda.empty_cache()
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__,
                command="python benchmarks/probes/probe_floor.py " + " ".join(sys.argv[1:]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"{args.shape}, Quest step in {args.mode} mode", "",
             "| L | byte limit us | read meta us (GB/s) | gather K/V us (GB/s) | boundary us | chain3 us "
             "| Quest step us | SDPA us | target us | x chain3 | x Quest |", "|---" * 11 + "|"]
    for r in rows:
        lines.append(f"| {r['length']} | {r['byte_limit_us']:.1f} "
                     f"| {r['read_meta_us']:.1f} ({r['read_meta_GBps']:.0f}) | "
                     f"{r['gather_kv_us']:.1f} ({r['gather_kv_GBps']:.0f}) | {r['boundary_us']:.1f} "
                     f"| {r['chain3_us']:.1f} | "
                     f"{r['quest_step_us']:.1f} | {r['sdpa_us']:.1f} | {r['target_us']:.1f} | {r['x_chain3']:.2f} | "
                     f"{r['x_quest']:.2f} |")
    md = "\n".join(lines)
    out.with_suffix(".md").write_text("# Zero-compute floor of a 3-stage Quest step (batch 1)\n\n"
                                      + "\n".join(f"- {k}: {v}" for k, v in meta.items()) + "\n\n" + md + "\n")
    print(md)


if __name__ == "__main__":
    main()
