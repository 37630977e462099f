"""Top-K page ids per score row, with the union over the query heads of a KV group."""
import torch

from ._common import next_pow2, require_triton, tl, triton

__all__ = ["topk_pages", "topk_pages_ref"]


def _check(scores, k, group):
    if scores.dim() != 3 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be fp32 [B, R, P], got {scores.dtype} {tuple(scores.shape)}")
    B, R, P = scores.shape
    if k < 1 or group < 1 or R % group:
        raise ValueError(f"need k >= 1 and group >= 1 dividing {R} rows, got k={k}, group={group}")
    return B, R, P, min(group * k, P)


def topk_pages_ref(scores, k: int, group: int = 1):
    """Choose the `k` best pages of each row of `scores [B, R, P]`, then unite each `group` consecutive rows.

    Pages scoring `-inf` are never chosen. Returns int32 `[B, R // group, min(group * k, P)]`: the chosen ids
    of each group in ascending order, then `-1`. Ties at the k-th score are broken arbitrarily.
    """
    B, R, P, K_out = _check(scores, k, group)
    top = scores.topk(min(k, P), dim=-1)
    chosen = torch.zeros(B, R, P, dtype=torch.bool, device=scores.device)
    chosen.scatter_(-1, top.indices, top.values > float("-inf"))
    chosen = chosen.reshape(B, R // group, group, P).any(2)
    ids = torch.arange(P, device=scores.device).expand_as(chosen)
    # Unchosen pages sort after every chosen one, keeping the chosen ones ascending.
    key = torch.where(chosen, ids, ids + P)
    out = key.sort(-1).values[..., :K_out]
    return torch.where(out < P, out, -1).to(torch.int32)


# Scores per register tile: 2048 fp32 keys over 8 warps is 8 keys a thread, held in registers across all
# passes. Longer rows (P = 8192 at 128K tokens) loop over tiles re-read from L2 on every pass.
MAX_BLOCK_P = 2048
NUM_WARPS = 8
# 4-way search, 16 passes of 3 compares a key, beat 2-way (32 x 1) and 16-way (8 x 15) at 32K and 128K on an
# H200 (benchmarks/NOTES-kernels.md); short rows, where the passes' serial latency dominates, go 16-way.
RADIX_BITS = 2
SHORT_ROW = 512
# -inf pages are never chosen; INT_MIN is no real key (it would be a NaN).
NEG_INF_KEY = tl.constexpr(-2139095041)  # _order_key(-inf)
INT_MIN = tl.constexpr(-2147483648)


@triton.jit
def _order_key(x):
    # fp32 -> int32 whose signed order is the float order (negative floats: flip the magnitude bits).
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _load_keys(p_row, o_p, stride_sp, P):
    # Lanes past P get INT_MIN: below every real key, so no threshold above INT_MIN ever counts them.
    b_key = _order_key(tl.load(p_row + o_p * stride_sp, mask=o_p < P, other=float("-inf")))
    return tl.where(o_p < P, b_key, INT_MIN)


@triton.jit
def _topk_pages_kernel(
    s_ptr, out_ptr,
    stride_sb, stride_sr, stride_sp,
    stride_ob, stride_or, stride_ok,
    R_OUT, P, KK, K_OUT,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_P: tl.constexpr, RADIX_BITS: tl.constexpr,
    SINGLE_TILE: tl.constexpr,
):
    i_bg = tl.program_id(0).to(tl.int64)
    i_b = i_bg // R_OUT
    i_g = i_bg % R_OUT
    p_rows = s_ptr + i_b * stride_sb + i_g * GROUP * stride_sr
    o_r = tl.arange(0, GROUP_PAD)
    o_j = tl.arange(0, 1 << RADIX_BITS)
    o_n = tl.arange(0, BLOCK_P)

    # Phase 1, per row: the KK-th largest key T by a radix search over the 32 key bits, RADIX_BITS a pass
    # (2^RADIX_BITS - 1 thresholds tested at once), then how many keys equal to T are still needed after
    # all keys above T.
    b_thr = tl.zeros([GROUP_PAD], dtype=tl.int32)
    b_need = tl.zeros([GROUP_PAD], dtype=tl.int32)
    for r in range(GROUP):
        p_row = p_rows + r * stride_sr
        if SINGLE_TILE:  # the whole row stays in registers across the passes
            b_key1 = _load_keys(p_row, o_n, stride_sp, P)
        i_lo = tl.zeros([], dtype=tl.int32) + INT_MIN
        for i_pass in tl.static_range(32 // RADIX_BITS):
            # Wrapping int32 arithmetic: i_lo + j << shift stays below i_lo + 2^(shift+RADIX_BITS) <= 2^31.
            b_t = i_lo + (o_j << (32 - RADIX_BITS * (i_pass + 1)))
            if SINGLE_TILE:
                b_cnt = tl.sum((b_key1[None, :] >= b_t[:, None]).to(tl.int32), axis=1)
            else:
                b_cnt = tl.zeros([1 << RADIX_BITS], dtype=tl.int32)
                for i_p0 in range(0, P, BLOCK_P):
                    b_key = _load_keys(p_row, i_p0 + o_n, stride_sp, P)
                    b_cnt += tl.sum((b_key[None, :] >= b_t[:, None]).to(tl.int32), axis=1)
            # Counts fall with j and j = 0 always holds KK keys: the digit is the last j that still does.
            i_digit = tl.sum(((b_cnt >= KK) & (o_j > 0)).to(tl.int32), axis=0)
            i_lo = i_lo + (i_digit << (32 - RADIX_BITS * (i_pass + 1)))
        if SINGLE_TILE:
            i_gt = tl.sum((b_key1 > i_lo).to(tl.int32), axis=0)
        else:
            i_gt = tl.zeros([], dtype=tl.int32)
            for i_p0 in range(0, P, BLOCK_P):
                i_gt += tl.sum((_load_keys(p_row, i_p0 + o_n, stride_sp, P) > i_lo).to(tl.int32), axis=0)
        b_thr = tl.where(o_r == r, i_lo, b_thr)
        b_need = tl.where(o_r == r, KK - i_gt, b_need)

    # Phase 2: per tile, each row picks keys above T plus its lowest-index ties at T; the tile's union over
    # the group is compacted (ascending by construction) after the ids already written.
    i_out = tl.zeros([], dtype=tl.int32)
    b_seen = tl.zeros([GROUP_PAD], dtype=tl.int32)
    p_out = out_ptr + i_b * stride_ob + i_g * stride_or
    for i_p0 in range(0, P, BLOCK_P):
        o_p = i_p0 + o_n
        m_p = o_p < P
        b_union = tl.zeros([BLOCK_P], dtype=tl.int32)
        for r in range(GROUP):
            b_key = _load_keys(p_rows + r * stride_sr, o_p, stride_sp, P)
            i_thr = tl.sum(tl.where(o_r == r, b_thr, 0), axis=0)
            i_need = tl.sum(tl.where(o_r == r, b_need, 0), axis=0)
            i_seen = tl.sum(tl.where(o_r == r, b_seen, 0), axis=0)
            b_eq = ((b_key == i_thr) & m_p).to(tl.int32)
            b_rank = tl.cumsum(b_eq, axis=0) - 1 + i_seen
            m_pick = (b_key > i_thr) | ((b_eq != 0) & (b_rank < i_need))
            m_pick = m_pick & (b_key != NEG_INF_KEY) & m_p
            b_union = b_union | m_pick.to(tl.int32)
            b_seen = tl.where(o_r == r, i_seen + tl.sum(b_eq, axis=0), b_seen)
        b_pos = i_out + tl.cumsum(b_union, axis=0) - 1
        tl.store(p_out + b_pos * stride_ok, o_p, mask=b_union != 0)
        i_out += tl.sum(b_union, axis=0)
    for i_k0 in range(0, K_OUT, BLOCK_P):
        o_k = i_k0 + o_n
        tl.store(p_out + o_k * stride_ok, tl.full([BLOCK_P], -1, tl.int32), mask=(o_k >= i_out) & (o_k < K_OUT))


def topk_pages(scores, k: int, group: int = 1):
    """Triton twin of `topk_pages_ref`.

    scores fp32 `[B, R, P]` (any strides; NaN-free). Returns a fresh int32 `[B, R // group, min(group * k, P)]`.
    Ties at the k-th score go to the lowest page ids. No torch.topk: one program per (b, group) finds each
    row's k-th largest score by a radix search on the fp32 bit pattern, then writes the union compacted.
    """
    require_triton()
    B, R, P, K_out = _check(scores, k, group)
    out = torch.empty(B, R // group, K_out, dtype=torch.int32, device=scores.device)
    _topk_pages_kernel[(B * (R // group),)](
        scores, out,
        scores.stride(0), scores.stride(1), scores.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        R // group, P, min(k, P), K_out,
        GROUP=group, GROUP_PAD=next_pow2(group), BLOCK_P=min(MAX_BLOCK_P, max(16, next_pow2(P))),
        RADIX_BITS=4 if P <= SHORT_ROW else RADIX_BITS, SINGLE_TILE=P <= MAX_BLOCK_P,
        num_warps=NUM_WARPS,
    )
    return out
