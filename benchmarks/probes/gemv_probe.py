#!/usr/bin/env python
"""How fast one decode token's weight GEMVs can go: cuBLAS (`F.linear`, what HF runs) against a plain Triton GEMV
(one program a block of output rows, the whole reduction in it: no split-K, no reduce kernel), for a batch-1 row
`x [1, K]` and the projection shapes of Llama-2-7B and Llama-3-8B, fused (q/k/v, gate/up) and not.

Each shape is timed as a decode step runs it: `--rotate` distinct weights one after another in one CUDA graph (so the
L2 holds none of them), as GB/s of weight read, against the device-to-device copy bandwidth of the same run. For
each shape the Triton GEMV's launch settings are swept and the fastest kept, with its largest |difference| from
cuBLAS's output (both fp32-accumulated: rounding only).

    python benchmarks/probes/gemv_probe.py --out $OUT/gemv.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from quest_hf.bench import copy_bandwidth, environment, time_graph_chain  # noqa: E402
from triton_kernels.gemv import GemvLaunch  # noqa: E402
from triton_kernels.gemv import gemv as lib_gemv  # noqa: E402

SHAPES = {  # name: (N, K)
    "7b q|k|v|o 4096x4096": (4096, 4096),
    "7b qkv fused 12288x4096": (12288, 4096),
    "7b gate|up 11008x4096": (11008, 4096),
    "7b gate_up fused 22016x4096": (22016, 4096),
    "7b down 4096x11008": (4096, 11008),
    "8b k|v 1024x4096": (1024, 4096),
    "8b qkv fused 6144x4096": (6144, 4096),
    "8b gate_up fused 28672x4096": (28672, 4096),
    "8b down 4096x14336": (4096, 14336),
}


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr):
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    m_n = o_n < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    p_w = w_ptr + o_n[:, None].to(tl.int64) * stride_wn + o_k[None, :]
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(p_w + k0, mask=m_n[:, None], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + k0 + o_k)
        else:
            m_k = k0 + o_k < K
            w = tl.load(p_w + k0, mask=m_n[:, None] & m_k[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + k0 + o_k, mask=m_k, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + o_n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=m_n)


def gemv(x, w, y, block_n, block_k, warps, stages):
    N, K = w.shape
    _gemv_kernel[(triton.cdiv(N, block_n),)](x, w, y, N, K, w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
                                             EVEN_K=K % block_k == 0, num_warps=warps, num_stages=stages)
    return y


def library_gemv(x, w, y, block_n, block_k, warps, stages):
    """The library's kernel (triton_kernels/gemv.py, launched dependently where PDL exists) at these settings."""
    return lib_gemv(x, w, out=y.view(1, -1), launch=GemvLaunch(block_n=block_n, block_k=block_k, num_warps=warps,
                                                   num_stages=stages))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rotate", type=int, default=6)
    p.add_argument("--shapes", nargs="*", default=list(SHAPES))
    p.add_argument("--out", default="results/gemv_probe.json")
    p.add_argument("--block-n", type=int, nargs="+", default=[4, 8, 16, 32], help="BLOCK_N values swept")
    p.add_argument("--block-k", type=int, nargs="+", default=[256, 512, 1024], help="BLOCK_K values swept")
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8], help="num_warps values swept")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4], help="num_stages values swept")
    p.add_argument("--library", action="store_true",
                   help="sweep the library's GEMV (triton_kernels/gemv.py) instead of this probe's plain kernel")
    a = p.parse_args()
    run = library_gemv if a.library else gemv
    dev, dtype = "cuda", torch.float16
    copy = copy_bandwidth(dev)
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s (read + written)", flush=True)
    grid = list(itertools.product(a.block_n, a.block_k, a.warps, a.stages))
    rows = []
    for name in a.shapes:
        N, K = SHAPES[name]
        torch.manual_seed(0)
        ws = [torch.randn(N, K, device=dev, dtype=dtype) / K**0.5 for _ in range(a.rotate)]
        x = torch.randn(1, K, device=dev, dtype=dtype)
        ys = [torch.empty(N, device=dev, dtype=dtype) for _ in ws]
        nbytes = N * K * 2
        cublas = time_graph_chain([partial(F.linear, x, w) for w in ws], n=2 * a.rotate)
        ref = F.linear(x, ws[0]).view(-1)
        best, swept = None, {}
        for bn, bk, nw, ns in grid:
            if bn * bk // (nw * 32) > 128:  # fp32 accumulator over 128 registers a thread
                continue
            try:
                run(x, ws[0], ys[0], bn, bk, nw, ns)
                us = time_graph_chain([partial(run, x, w, y, bn, bk, nw, ns) for w, y in zip(ws, ys)],
                                      n=2 * a.rotate)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped, and said so
                print(f"  {name} {bn}x{bk} w{nw} s{ns}: {type(e).__name__}", flush=True)
                continue
            swept[f"{bn},{bk},{nw},{ns}"] = us
            if best is None or us < best[0]:
                best = (us, dict(block_n=bn, block_k=bk, warps=nw, stages=ns))
        run(x, ws[0], ys[0], *best[1].values())
        diff = (ys[0].float() - ref.float()).abs().max().item()
        row = dict(shape=name, N=N, K=K, mbytes=nbytes / 1e6, cublas_us=cublas, cublas_gbs=nbytes / cublas / 1e3,
                   triton_us=best[0], triton_gbs=nbytes / best[0] / 1e3, config=best[1], max_abs_diff=diff,
                   ref_max_abs=ref.abs().max().item(), copy_frac_cublas=nbytes / cublas / 1e3 / (copy / 1e9),
                   copy_frac_triton=nbytes / best[0] / 1e3 / (copy / 1e9), swept=swept)
        rows.append(row)
        print(f"{name}: cuBLAS {cublas:.1f} us ({row['cublas_gbs']:.0f} GB/s), Triton {best[0]:.1f} us "
              f"({row['triton_gbs']:.0f} GB/s) {best[1]}, max|diff| {diff:.2e}", flush=True)
        del ws, ys
        torch.cuda.empty_cache()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    kernel = "library" if a.library else "probe"
    d = GemvLaunch()
    default = f"{d.block_n},{d.block_k},{d.num_warps},{d.num_stages}"  # the library's default setting
    # One setting for every shape (a fused weight's outputs equal its parts' only under settings that do not depend
    # on N): the swept setting of least summed time over the shapes (each shape once, as a decoder layer runs them).
    shared = set.intersection(*(set(r["swept"]) for r in rows)) if rows else set()
    common = sorted((sum(r["swept"][c] for r in rows), c) for c in shared)
    if common:
        us, c = common[0]
        bn, bk, nw, ns = map(int, c.split(","))
        common = dict(block_n=bn, block_k=bk, warps=nw, stages=ns, sum_us=us,
                      others=[dict(config=c, sum_us=t) for t, c in common[1:6]],
                      library_default_sum_us=dict((c, t) for t, c in common).get(default))
        print(f"one setting for all shapes: {common}", flush=True)
    out.write_text(json.dumps(dict(env=environment(dev), copy_gbs=copy / 1e9, kernel=kernel, rows=rows,
                                   common=common), indent=1))


if __name__ == "__main__":
    main()
