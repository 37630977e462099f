"""The zero-math floor of one Quest decode step at any layer shape: the step's bytes moved by kernels that do no math.

For a layer of `H_kv` KV heads (head dim D, fp16, pages of S tokens, L tokens, batch B) a Quest step reads
1. every page's key min and max (2 x B x H_kv x P x D x 2 bytes), then
2. after a dependent decision (a tiny one-program kernel here), the K and V of the chosen pages: `pages` per KV head
   (budget / S for an MHA or shared-score step; up to `group` times that for a GQA union, whose query heads choose
   their own pages and the KV head reads their union).
Each stage is swept over launch shapes and the fastest is kept; `chain` runs read -> tiny -> gather back to back, 20
steps in one CUDA graph, rotating over input sets larger than L2 (`quest_hf.bench.time_graph_chain`, as
`bench_kernels.py` times the real step). Beside it, in the same run: SDPA over the same K/V (chained the same way),
a device copy of the stage's bytes, and the copy bandwidth, so each figure says whether the probe ran near the
memory's rate (a floor counts only then).

    python benchmarks/probes/floor_step.py --rows 8b-32k-shared 8b-32k-union --out results/floor_step
"""
import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from quest_hf.bench import copy_bandwidth, environment, time_graph_chain  # noqa: E402

D, S, K = 128, 16, 128  # head dim, page size, pages a query head chooses (budget 2048)


def union_pages(L, group):
    """Pages a GQA union reads per KV head when its `group` query heads choose K of P pages independently (the
    expectation for the random scores `bench_kernels.py` times: P (1 - (1 - K/P)^group)); real models' heads overlap
    more, so read fewer."""
    P = L // S
    return round(P * (1 - (1 - K / P) ** group))


# name: (KV heads, query heads, L, batch, pages gathered per KV head)
ROWS = {
    "7b-32k": (32, 32, 32768, 1, K),
    "7b-128k": (32, 32, 131072, 1, K),
    "8b-32k-shared": (8, 32, 32768, 1, K),
    "8b-32k-union": (8, 32, 32768, 1, union_pages(32768, 4)),
    "8b-128k-union": (8, 32, 131072, 1, union_pages(131072, 4)),
    "7b-32k-b8": (32, 32, 32768, 8, K),
    "8b-32k-union-b8": (8, 32, 32768, 8, union_pages(32768, 4)),
}


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # Sum ITERS blocks of fp16 (the page bounds' bytes; no score math), one partial a program.
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(ITERS):
        o = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + o, mask=o < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _tiny_kernel(x_ptr, y_ptr):
    # The dependent decision between the stages: one program, one load, one store.
    tl.store(y_ptr, tl.load(x_ptr) + 1.0)


@triton.jit
def _gather_kernel(k_ptr, v_ptr, ids_ptr, out_ptr, C, KP, PER: tl.constexpr, S: tl.constexpr, D: tl.constexpr):
    # Program (row, chunk): PER chosen pages of one (batch, KV head) row, each page's K and V (S x D fp16, contiguous)
    # loaded after its id, summed (no attention math).
    i_r = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    o = tl.arange(0, S)[:, None] * D + tl.arange(0, D)[None, :]
    acc = tl.zeros([S, D], dtype=tl.float32)
    for j in tl.static_range(PER):
        p = tl.load(ids_ptr + i_r * KP + i_c * PER + j).to(tl.int64)
        off = (i_r * C + p * S) * D
        acc += tl.load(k_ptr + off + o).to(tl.float32) + tl.load(v_ptr + off + o).to(tl.float32)
    tl.store(out_ptr + i_r * tl.num_programs(1) + i_c, tl.sum(tl.sum(acc, axis=1), axis=0))


class Layer:
    """One input set: page bounds, a K/V cache of L tokens, chosen page ids (distinct, random) and scratch."""

    def __init__(self, H, L, B, pages, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        P = L // S
        self.meta = torch.randn(2 * B * H * P * D, device="cuda", generator=g).half()
        self.k = torch.randn(B, H, L, D, device="cuda", generator=g).half()
        self.v = torch.randn_like(self.k)
        self.kp = -(-pages // 4) * 4  # ids a row, padded to whole chunks of every `per` swept (repeats: same bytes)
        self.ids = torch.stack([torch.randperm(P, device="cuda", generator=g)[:pages].sort().values
                                for _ in range(B * H)]).int()
        self.ids = torch.cat([self.ids, self.ids[:, :self.kp - pages]], 1).contiguous()
        self.part = torch.empty(1 << 20, device="cuda")
        self.flag = torch.zeros(2, device="cuda")
        self.rows, self.C, self.pages = B * H, L, pages

    def read(self, block, iters, warps):
        n = self.meta.numel()
        _read_kernel[(triton.cdiv(n, block * iters),)](self.meta, self.part, n, BLOCK=block, ITERS=iters,
                                                      num_warps=warps)

    def tiny(self):
        _tiny_kernel[(1,)](self.part, self.flag)

    def gather(self, per, warps):
        # (a union's page count need not divide by `per`: the last chunk's pages come from the id list's padding)
        _gather_kernel[(self.rows, -(-self.pages // per))](self.k, self.v, self.ids, self.part, self.C, self.kp,
                                                            PER=per, S=S, D=D, num_warps=warps)


# (elements a block, blocks a program, warps); small stages (the GQA rows' 8 MB) favour more, smaller programs.
READS = [(1024, 4, 4), (2048, 4, 8), (1024, 8, 4), (4096, 2, 8), (512, 8, 4), (2048, 8, 8), (512, 4, 4), (512, 2, 2),
         (256, 4, 2), (1024, 2, 4)]
GATHERS = [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (4, 4)]  # (pages a program, warps)


def best(fn_of_cfg, sets, cfgs):
    times = {cfg: time_graph_chain([lambda s=s, c=cfg: fn_of_cfg(s, c) for s in sets]) for cfg in cfgs}
    cfg = min(times, key=times.get)
    return cfg, times[cfg]


def run_row(name, bw):
    H, Hq, L, B, pages = ROWS[name]
    meta_bytes = 2 * B * H * (L // S) * D * 2
    gather_bytes = B * H * pages * S * D * 2 * 2
    # Enough input sets that a step's bytes come back to the same set only after > 3x the L2 (60 MB) has passed.
    n_sets = max(2, -(-3 * 60 * 2**20 // (meta_bytes + gather_bytes)))
    sets = [Layer(H, L, B, pages, seed) for seed in range(n_sets)]
    rcfg, t_read = best(lambda s, c: s.read(*c), sets, READS)
    gcfg, t_gather = best(lambda s, c: s.gather(*c), sets, GATHERS)
    t_tiny = time_graph_chain([s.tiny for s in sets])

    def step(s):
        s.read(*rcfg)
        s.tiny()
        s.gather(*gcfg)

    t_chain = time_graph_chain([lambda s=s: step(s) for s in sets])
    # The same bytes by a plain device copy (read + write counted; rotating over buffers beyond L2 like the sets),
    # so a small stage's ramp is visible: a probe stage near this rate is as fast as the memory moves those bytes.
    src = torch.empty(n_sets, meta_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t_copy = time_graph_chain([lambda i=i: dst[i].copy_(src[i]) for i in range(n_sets)])
    qs = [torch.randn(B, Hq, 1, D, device="cuda").half() for _ in sets]
    t_sdpa = time_graph_chain([lambda s=s, q=q: torch.nn.functional.scaled_dot_product_attention(
        q, s.k, s.v, enable_gqa=Hq != H) for s, q in zip(sets, qs)])
    return dict(row=name, kv_heads=H, q_heads=Hq, L=L, B=B, pages_per_head=pages, meta_MB=meta_bytes / 1e6,
                gather_MB=gather_bytes / 1e6, read_us=t_read, read_cfg=rcfg, read_TBps=meta_bytes / t_read / 1e6,
                gather_us=t_gather, gather_cfg=gcfg, gather_TBps=gather_bytes / t_gather / 1e6, tiny_us=t_tiny,
                chain_us=t_chain, copy_same_bytes_us=t_copy, copy_same_bytes_TBps=2 * meta_bytes / t_copy / 1e6,
                copy_TBps=bw / 1e12, sdpa_us=t_sdpa, sdpa_over_chain=t_sdpa / t_chain)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--out", default="results/floor_step")
    args = p.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    results = []
    for name in args.rows:
        r = run_row(name, bw)
        results.append(r)
        print(f"{name}: chain {r['chain_us']:.1f} us (SDPA {r['sdpa_us']:.1f}: {r['sdpa_over_chain']:.2f}x); "
              f"read {r['meta_MB']:.1f} MB {r['read_us']:.1f} us ({r['read_TBps']:.2f} TB/s, same-size copy "
              f"{r['copy_same_bytes_TBps']:.2f}); tiny {r['tiny_us']:.1f}; gather {r['gather_MB']:.1f} MB "
              f"{r['gather_us']:.1f} us ({r['gather_TBps']:.2f} TB/s)", flush=True)
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "floor_step.json"), "w") as f:
        json.dump(dict(environment=environment("cuda"), copy_GBps=bw / 1e9, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
