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


# Keys per register tile ([GROUP_PAD, BLOCK_P]): 8192 fp32 keys over 8 warps is 32 keys a thread, held in
# registers across the 4 passes. Longer rows (or wide groups) loop over tiles re-read from L2 on every pass.
MAX_TILE = 8192
NUM_WARPS = 8
# -inf pages are never chosen; INT_MIN is no real key (it would be a NaN).
NEG_INF_KEY = tl.constexpr(-2139095041)  # _order_key(-inf)
INT_MIN = tl.constexpr(-2147483648)


def tile_for(P: int, rows: int, max_tile: int):
    """(GROUP_PAD, BLOCK_P, SINGLE_TILE) of a radix select over `rows` rows of P keys in one program."""
    group_pad = next_pow2(rows)
    block_p = min(next_pow2(P), max(16, max_tile // group_pad))
    return group_pad, block_p, P <= block_p


@triton.jit
def _order_key(x):
    # fp32 -> int32 whose signed order is the float order (negative floats: flip the magnitude bits).
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _load_keys(p_rows, o_r, o_p, stride_r, stride_p, N_ROWS: tl.constexpr, P, CACHE: tl.constexpr):
    # [GROUP_PAD, BLOCK_P] keys; lanes past P or N_ROWS get INT_MIN, below every real key, so a threshold
    # above INT_MIN never counts them.
    m = (o_r < N_ROWS)[:, None] & (o_p < P)[None, :]
    b_s = tl.load(p_rows + o_r[:, None] * stride_r + o_p[None, :] * stride_p, mask=m, other=float("-inf"),
                  cache_modifier=CACHE)
    return tl.where(m, _order_key(b_s), INT_MIN)


@triton.jit
def _digit_hist(b_key, b_pre, o_r, SHIFT: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_P: tl.constexpr):
    # Per-row histogram of the 8-bit digit at SHIFT of the keys that share the row's prefix (the digits above
    # SHIFT found so far), as one flat [GROUP_PAD * 256] histogram: bin = row * 256 + digit.
    b_u = b_key ^ INT_MIN  # unsigned order, kept in int32 bits
    b_digit = (b_u >> SHIFT) & 255
    if SHIFT == 24:
        m = b_u == b_u
    else:
        m = ((b_u ^ b_pre[:, None]) >> (SHIFT + 8)) == 0
    b_bin = tl.reshape(o_r[:, None] * 256 + b_digit, [GROUP_PAD * BLOCK_P])
    return tl.histogram(b_bin, GROUP_PAD * 256, mask=tl.reshape(m, [GROUP_PAD * BLOCK_P]))


@triton.jit
def _select_union(p_rows, stride_r, stride_p, p_out, stride_ok, P, KK, K_OUT,
                  N_ROWS: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_P: tl.constexpr,
                  SINGLE_TILE: tl.constexpr, CACHE: tl.constexpr):
    """Write the ascending union of the KK best pages of N_ROWS score rows (then -1) to `p_out[:K_OUT]`."""
    o_r = tl.arange(0, GROUP_PAD)
    o_n = tl.arange(0, BLOCK_P)
    o_bin = tl.arange(0, 256)
    if SINGLE_TILE:  # every row stays in registers across the passes
        b_key1 = _load_keys(p_rows, o_r, o_n, stride_r, stride_p, N_ROWS, P, CACHE)

    # Phase 1, all rows at once: each row's KK-th largest key T by a radix select, 8 bits a pass (4 passes,
    # one histogram each, instead of 16-32 serial compare-and-count passes), and how many keys equal to T
    # it still needs after all keys above T.
    b_pre = tl.zeros([GROUP_PAD], dtype=tl.int32)  # T's digits found so far, unsigned order
    b_need = tl.zeros([GROUP_PAD], dtype=tl.int32) + KK
    for i_pass in tl.static_range(4):
        if SINGLE_TILE:
            b_hist = _digit_hist(b_key1, b_pre, o_r, 24 - 8 * i_pass, GROUP_PAD, BLOCK_P)
        else:
            b_hist = tl.zeros([GROUP_PAD * 256], dtype=tl.int32)
            for i_p0 in range(0, P, BLOCK_P):
                b_key = _load_keys(p_rows, o_r, i_p0 + o_n, stride_r, stride_p, N_ROWS, P, CACHE)
                b_hist += _digit_hist(b_key, b_pre, o_r, 24 - 8 * i_pass, GROUP_PAD, BLOCK_P)
        b_hist = tl.reshape(b_hist, [GROUP_PAD, 256])
        # b_suf[r, d]: keys of row r (with the prefix) whose digit is >= d; it falls with d and b_suf[r, 0]
        # >= need always holds (padding lanes count too, as the smallest keys): the digit is the last d
        # that still holds `need` keys.
        b_suf = tl.cumsum(b_hist, axis=1, reverse=True)
        b_digit = tl.sum((b_suf >= b_need[:, None]).to(tl.int32), axis=1) - 1
        b_need -= tl.sum(tl.where(o_bin[None, :] == b_digit[:, None], b_suf - b_hist, 0), axis=1)
        b_pre = b_pre | (b_digit << (24 - 8 * i_pass))
    b_thr = b_pre ^ INT_MIN  # back to the signed key order

    # Phase 2: per tile, each row picks keys above T plus its lowest-index ties at T; the tile's union over
    # the rows is compacted (ascending by construction) after the ids already written.
    i_out = tl.zeros([], dtype=tl.int32)
    b_seen = tl.zeros([GROUP_PAD], dtype=tl.int32)
    m_r = o_r < N_ROWS
    for i_p0 in range(0, P, BLOCK_P):
        o_p = i_p0 + o_n
        if SINGLE_TILE:
            b_key = b_key1
        else:
            b_key = _load_keys(p_rows, o_r, o_p, stride_r, stride_p, N_ROWS, P, CACHE)
        m = m_r[:, None] & (o_p < P)[None, :]
        b_eq = ((b_key == b_thr[:, None]) & m).to(tl.int32)
        b_rank = tl.cumsum(b_eq, axis=1) - 1 + b_seen[:, None]
        m_pick = (b_key > b_thr[:, None]) | ((b_eq != 0) & (b_rank < b_need[:, None]))
        m_pick = m_pick & (b_key != NEG_INF_KEY) & m
        b_union = tl.max(m_pick.to(tl.int32), axis=0)
        b_pos = i_out + tl.cumsum(b_union, axis=0) - 1
        tl.store(p_out + b_pos * stride_ok, o_p, mask=b_union != 0)
        i_out += tl.sum(b_union, axis=0)
        b_seen += tl.sum(b_eq, axis=1)
    for i_k0 in range(0, K_OUT, BLOCK_P):
        o_k = i_k0 + o_n
        tl.store(p_out + o_k * stride_ok, tl.full([BLOCK_P], -1, tl.int32), mask=(o_k >= i_out) & (o_k < K_OUT))


@triton.jit
def _topk_pages_kernel(
    s_ptr, out_ptr,
    stride_sb, stride_sr, stride_sp,
    stride_ob, stride_or, stride_ok,
    R_OUT, P, KK, K_OUT,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_P: tl.constexpr, SINGLE_TILE: tl.constexpr,
):
    i_bg = tl.program_id(0).to(tl.int64)
    i_b = i_bg // R_OUT
    i_g = i_bg % R_OUT
    _select_union(s_ptr + i_b * stride_sb + i_g * GROUP * stride_sr, stride_sr, stride_sp,
                  out_ptr + i_b * stride_ob + i_g * stride_or, stride_ok, P, KK, K_OUT,
                  N_ROWS=GROUP, GROUP_PAD=GROUP_PAD, BLOCK_P=BLOCK_P, SINGLE_TILE=SINGLE_TILE, CACHE="")


def topk_pages(scores, k: int, group: int = 1):
    """Triton twin of `topk_pages_ref`.

    scores fp32 `[B, R, P]` (any strides; NaN-free). Returns a fresh int32 `[B, R // group, min(group * k, P)]`.
    Ties at the k-th score go to the lowest page ids. No torch.topk: one program per (b, group) finds every
    row's k-th largest score at once by an 8-bit radix select on the fp32 bit pattern (4 histogram passes),
    then writes the union compacted.
    """
    require_triton()
    B, R, P, K_out = _check(scores, k, group)
    out = torch.empty(B, R // group, K_out, dtype=torch.int32, device=scores.device)
    group_pad, block_p, single = tile_for(P, group, MAX_TILE)
    _topk_pages_kernel[(B * (R // group),)](
        scores, out,
        scores.stride(0), scores.stride(1), scores.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        R // group, P, min(k, P), K_out,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_P=block_p, SINGLE_TILE=single,
        num_warps=NUM_WARPS if group_pad * block_p >= 2048 else 4,
    )
    return out
