"""One row times a weight: `y = x @ W.T (+ b)` for a batch-1 decode token, the whole reduction in one program.

At batch 1 a decode step reads every projection weight once, and cuBLAS's GEMV kernels (a split-K product and a
reduce kernel for the square and down projections) read the 7B/8B shapes at 71-96% of the copy bandwidth on an
H100 (a 1024-row k/v weight at 33%); this kernel, one program a block of `BLOCK_N` output rows streaming their
weights along K, read them at 84-102% (53%), faster on every shape by 5-37% (benchmarks/kernels/round21: 13.3 vs
15.7 us for a 4096 x 4096 weight, 34.4 vs 40.2 for the fused 12288 x 4096). Every output row is reduced in the same
order whatever N is (fixed launch settings, one accumulator lane per K position of a tile, one sum at the end), so a
weight concatenated along N (fused q/k/v, gate/up) gives bitwise the outputs of its parts.
"""
from dataclasses import dataclass

import torch

from ._common import check_out, interpreting, next_pow2, pdl_available, require_triton, tl, triton

__all__ = ["gemv", "gemv_ref", "GemvLaunch", "GEMV_LAUNCH", "gemv_takes"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class GemvLaunch:
    """How `gemv` launches; the defaults were the fastest settings (or within 1 us of them) for the 7B and 8B
    projection shapes on an H100 (`benchmarks/probes/gemv_probe.py`, round21/out/call1_gemv.json). The settings must
    not depend on N: a fused weight's outputs then equal its parts' bitwise."""

    block_n: int = 4
    block_k: int = 1024
    num_warps: int = 8
    num_stages: int = 3
    # Launched programmatically dependent on the kernel before (Hopper or newer, `pdl_available`): the programs start
    # as that kernel's last ones end and load their first weight tile before waiting for its output.
    pdl: bool = True


GEMV_LAUNCH = GemvLaunch()


def _check(x, weight, bias, out):
    if weight.dim() != 2 or weight.dtype not in DTYPES:
        raise ValueError(f"weight must be a [N, K] {DTYPES} matrix, got {weight.dtype} {tuple(weight.shape)}")
    N, K = weight.shape
    if x.shape[-1] != K or x.numel() != K:
        raise ValueError(f"x must hold one row of K={K} (shape [..., {K}] with every other dim 1), got "
                         f"{tuple(x.shape)}; more rows go through F.linear")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise TypeError(f"x ({x.dtype}, {x.device}) must match the weight ({weight.dtype}, {weight.device})")
    if weight.stride(1) != 1:
        raise ValueError(f"the weight's rows must be contiguous (stride(1) == 1), got strides {weight.stride()}")
    if bias is not None and (bias.shape != (N,) or bias.dtype != weight.dtype or bias.device != weight.device):
        raise ValueError(f"bias must be [{N}] {weight.dtype} on {weight.device}, got {bias.dtype} {tuple(bias.shape)}")
    check_out(out, (*x.shape[:-1], N), weight.dtype, weight.device)
    return N, K


def gemv_ref(x, weight, bias=None, *, out=None):
    """`F.linear(x, weight, bias)` for one row `x [..., K]`: the reference (`gemv` rounds the sum in another order)."""
    _check(x, weight, bias, out)
    y = torch.nn.functional.linear(x, weight, bias)
    return y if out is None else out.copy_(y)


def gemv_takes(x, weight) -> bool:
    """Whether `gemv` serves `F.linear(x, weight)`: one row on a CUDA device (or the interpreter), the weight's
    dtype, rows contiguous, no gradient wanted."""
    return (x.numel() == x.shape[-1] == weight.shape[-1] and weight.dim() == 2 and x.dtype == weight.dtype
            and weight.dtype in DTYPES and weight.stride(1) == 1 and x.device == weight.device
            and (x.is_cuda or interpreting()) and not (torch.is_grad_enabled() and (x.requires_grad
                                                                                    or weight.requires_grad)))


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_x, stride_wn, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    # One program: BLOCK_N output rows. Each K position of a tile keeps its own fp32 partial sum across the tiles,
    # summed once at the end: the order of a row's sum depends on K and the launch settings only, never on N.
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    m_n = o_n < N
    p_w = w_ptr + o_n[:, None].to(tl.int64) * stride_wn + o_k[None, :]
    # The first tile apart: its weights do not depend on the kernel before, so under a programmatic dependent launch
    # they are loaded before waiting for that kernel (which wrote x). Same sums in the same order either way.
    m_k = o_k < K
    if EVEN_K:
        w = tl.load(p_w, mask=m_n[:, None], other=0.0, eviction_policy="evict_first")
    else:
        w = tl.load(p_w, mask=m_n[:, None] & m_k[None, :], other=0.0, eviction_policy="evict_first")
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + o_k * stride_x, mask=m_k, other=0.0)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(p_w + k0, mask=m_n[:, None], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + (k0 + o_k) * stride_x)
        else:
            m_k = k0 + o_k < K
            w = tl.load(p_w + k0, mask=m_n[:, None] & m_k[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + (k0 + o_k) * stride_x, mask=m_k, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + o_n, y.to(y_ptr.dtype.element_ty), mask=m_n)


def gemv(x, weight, bias=None, *, out=None, launch: GemvLaunch | None = None):
    """Triton twin of `gemv_ref`: `x [..., K]` holding one row (every dim but the last 1; any stride along K),
    `weight [N, K]` (rows contiguous), optional `bias [N]`, all of one dtype (fp16, bf16, fp32) on one device.
    Returns `[..., N]` (or writes `out`, contiguous). fp32 accumulation; the sum's order differs from cuBLAS's, so
    outputs differ from `F.linear`'s by rounding (one fp16 ulp at most on the 7B/8B shapes of round 21)."""
    require_triton()
    N, K = _check(x, weight, bias, out)
    launch = launch or GEMV_LAUNCH
    if out is None:
        out = torch.empty(*x.shape[:-1], N, dtype=weight.dtype, device=weight.device)
    elif not out.is_contiguous():
        raise ValueError("out must be contiguous")
    block_k = min(launch.block_k, next_pow2(K))
    pdl = launch.pdl and pdl_available(weight.device)
    _gemv_kernel[(triton.cdiv(N, launch.block_n),)](
        x, weight, weight if bias is None else bias, out, N, K, x.stride(-1), weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=launch.block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0, PDL=pdl,
        num_warps=launch.num_warps, num_stages=launch.num_stages, **({"launch_pdl": True} if pdl else {}),
    )
    return out
