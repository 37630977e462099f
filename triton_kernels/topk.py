"""Top-K page ids per score row, with the union over the query heads of a KV group."""
from dataclasses import dataclass

import torch

from ._common import cdiv, check_due, check_out, due_arg, due_flag, interpreting, next_pow2, require_triton, tl, triton

__all__ = ["topk_pages", "topk_pages_ref", "top_p_mask", "top_p_mask_ref"]


def _check(scores, k, group, due=None, out=None):
    if scores.dim() != 3 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be fp32 [B, R, P], got {scores.dtype} {tuple(scores.shape)}")
    B, R, P = scores.shape
    if k < 1 or group < 1 or R % group:
        raise ValueError(f"need k >= 1 and group >= 1 dividing {R} rows, got k={k}, group={group}")
    if P >= 1 << 16:
        raise ValueError(f"at most {(1 << 16) - 1} pages a row (16-bit counters), got {P}")
    check_due(due, scores.device)
    check_out(out, (B, R // group, min(group * k, P)), torch.int32, scores.device)
    return B, R, P, min(group * k, P)


def topk_pages_ref(scores, k: int, group: int = 1, mask_rest: bool = False, *, due=None, out=None):
    """Choose the `k` best pages of each row of `scores [B, R, P]`, then unite each `group` consecutive rows.

    Pages scoring `-inf` are never chosen. Returns int32 `[B, R // group, min(group * k, P)]`: the chosen ids
    of each group in ascending order, then `-1`. Ties at the k-th score are broken arbitrarily.
    `mask_rest=True` also sets, in place, every score that its own row did not choose to `-inf` (a two-stage
    selector then rewrites only its candidates' entries; no second buffer to fill).
    `out`: int32 of that shape, written and returned instead of a fresh tensor. `due` (one device integer or bool,
    selection reuse's flag, `QuestConfig.reselect_every`): where it is 0 `out` and `scores` keep their values
    (without `out=` the returned ids are then unspecified: `topk_pages` leaves its fresh tensor unwritten; these
    are the ids of `scores`). Device ops only, no host sync.
    """
    B, R, P, K_out = _check(scores, k, group, due, out)
    top = scores.topk(min(k, P), dim=-1)
    chosen = torch.zeros(B, R, P, dtype=torch.bool, device=scores.device)
    chosen.scatter_(-1, top.indices, top.values > float("-inf"))
    now = None if due is None else due.view(()) != 0
    if mask_rest:
        scores.masked_fill_(~chosen if now is None else ~chosen & now, float("-inf"))
    chosen = chosen.reshape(B, R // group, group, P).any(2)
    ids = torch.arange(P, device=scores.device).expand_as(chosen)
    # Unchosen pages sort after every chosen one, keeping the chosen ones ascending.
    key = torch.where(chosen, ids, ids + P)
    ids = key.sort(-1).values[..., :K_out]
    ids = torch.where(ids < P, ids, -1).to(torch.int32)
    if out is None:
        return ids
    return out.copy_(ids if now is None else torch.where(now, ids, out))


@dataclass(frozen=True)
class TopKLaunch:
    """How `topk_pages` launches; the defaults were picked on an H200 (benchmarks/kernels/NOTES.md).

    max_tile: a group's [G, P] scores stay in registers up to this many keys (P = 2053 capacity pages at 32K +
        128 new tokens is one 4096-wide tile; a union of 4 rows at 128K is 4 x 8192); longer rows loop over
        tiles re-read from L1/L2 on every pass.
    keys_per_thread / max_warps: set num_warps: 16 keys a thread (4 warps at P = 2048, 8 at 4096) beat 1-2 warps
        by 1.2-3.8x and tied 8 warps at 2048 (benchmarks/kernels/round3/topk_log.txt).
    big_tile_warps: tiles over 16384 keys: 16 warps in one tile beat 8 warps over 4 tiles (58 vs 74 us).
    split_union: unions of group > 1 rows in two launches (each row's threshold by its own program, then one
        program per group writes the union); False: one launch.
    block_p / num_warps: force the one-launch kernel's tile width / warps (benchmarks; None: derived).
    tail_tile: rows at most this many pages past a power of two B >= 256 (the captured 32K decode's 2053, 128K's
        8197) are held as a B-key tile and a small tail tile instead of one 2B-wide tile (`tail_config`); every
        reduction and the compaction cover both; 0: off. Same ids as one tile (tests/test_kernels.py,
        tests/gpu/test_gpu_topk_chunked.py). On an H200 (benchmarks/kernels/round14) the Top-K alone at 8197 pages
        took 38.4 -> 19.9 us (32 rows) and 26.2 -> 20.3 (unions of 4), at 2053 10.3 -> 8.8; a 7B layer step over
        the captured 128K allocation 108.5 -> 71.9 us; hence on (64).
    rank_bits: rows held in one tile are first ranked by a `rank_bits`-bit quantisation of their finite scores over
        the row's own range (monotonic, so the pages it ranks above the k-th bucket are exactly the best ones): a
        radix search over 16 bits instead of up to 32; only a row whose k-th pick falls inside a bucket it does
        not take whole then searches that bucket's exact keys. 0: search the scores' 32 bits directly (the
        tiled path always does). Even, 2..30.
    chunked_union_min_pages / union_chunk: the split union's pass 2 chunk-parallel from rows of this many pages
        (None: never): three launches over (group, chunk of `union_chunk` pages) programs, tie counts, union
        counts, compacted writes (same ids as the serial pass 2, which loops over a row's tiles in one program per
        group). Built for the 128K union: Llama-3-8B (groups of 4), P = 8197, spent 87 us a layer in the serial
        pass 2 with 8 programs (benchmarks/probes/profile_replay_8b_128k.txt). Exact (tests/test_topk_chunked.py,
        tests/gpu/test_gpu_topk_chunked.py). On an H200 (benchmarks/kernels/round10/bench_union_h200.md; 32 rows in
        groups of 4, k = 129) chunks of 512 beat the serial pass 2 at every size timed, P = 2053 to 16389, B = 1
        and 8 (B = 1, P = 8197: 11.0 vs 74.6 us; 2053: 9.3 vs 14.4), 1024 is slower than 512: hence on from 2048
        pages, chunks of 512 (below 2048 not timed). `union_chunk`: a power of two >= 16.
    lean: rows searched one a program in one tile of at most this many keys (MHA rows and shared scores, the split
        union's thresholds; 0: never) take the lean path (`lean_config`): the row's count, least and largest key in
        one three-operand reduction (not three), and a row whose k-th pick is alone in its rank bucket (nearly every
        row) takes exactly the keys ranked at or above it, compacted by one scan: no threshold key, tie count or tie
        ranks. Same ids as the path it replaces (tests/test_kernels.py). On an H200 (benchmarks/kernels/round15) it
        took the 32K rows' Top-K from 9.0 to 8.1 us (2053 pages), shared scores 7.1 -> 6.5, and the 8B shared-score
        layer step 21.5 -> 20.3 us; at 8192-key tiles the layer steps were 1.5-2.5 us slower in two calls: hence
        4096.
    """

    def __post_init__(self):
        if self.rank_bits and (self.rank_bits % 2 or not 2 <= self.rank_bits <= 30):
            raise ValueError(f"rank_bits must be 0 or even in [2, 30], got {self.rank_bits}")
        if self.union_chunk < 16 or self.union_chunk & (self.union_chunk - 1):
            raise ValueError(f"union_chunk must be a power of two >= 16, got {self.union_chunk}")

    max_tile: int = 32768
    keys_per_thread: int = 16
    max_warps: int = 8
    big_tile_warps: int = 16
    split_union: bool = True
    block_p: int | None = None
    num_warps: int | None = None
    rank_bits: int = 16
    chunked_union_min_pages: int | None = 2048
    union_chunk: int = 512
    tail_tile: int = 64
    lean: int = 4096
    onepass_union: bool = True


TOPK_LAUNCH = TopKLaunch()
# -inf pages are never chosen; INT_MIN is no real key (it would be a NaN) and marks lanes past P.
NEG_INF_KEY = tl.constexpr(-2139095041)  # _order_key(-inf)
POS_INF_KEY = tl.constexpr(2139095040)  # _order_key(+inf)
INT_MIN = tl.constexpr(-2147483648)
INT_MAX = tl.constexpr(2147483647)


@triton.jit
def _order_key(x):
    # fp32 -> int32 whose signed order is the float order (negative floats: flip the magnitude bits).
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _load_keys(p_rows, o_r, o_p, stride_sr, stride_sp, G, P):
    # [G_PAD, BLOCK_P] keys; lanes past P or G get INT_MIN, below every real key.
    return _load_keys_from(p_rows, o_r, o_p, stride_sr, stride_sp, G, P, "")


@triton.jit
def _load_keys_from(p_rows, o_r, o_p, stride_sr, stride_sp, G, P, CACHE: tl.constexpr):
    # `_load_keys` with a cache modifier (".cg": scores another program of the same launch wrote, read from L2).
    m = (o_r[:, None] < G) & (o_p[None, :] < P)
    b_key = _order_key(tl.load(p_rows + o_r[:, None] * stride_sr + o_p[None, :] * stride_sp, mask=m,
                               other=float("-inf"), cache_modifier=CACHE))
    return tl.where(m, b_key, INT_MIN)


@triton.jit
def _tail_keys(p_rows, o_r, stride_sr, stride_sp, GROUP, GROUP_PAD: tl.constexpr, P, BLOCK_P: tl.constexpr,
               TAIL: tl.constexpr, CACHE: tl.constexpr):
    # The [GROUP_PAD, TAIL] keys of the pages from BLOCK_P on (TopKLaunch.tail_tile); TAIL 0: an unused placeholder.
    if TAIL > 0:
        b_key2 = _load_keys_from(p_rows, o_r, BLOCK_P + tl.arange(0, TAIL), stride_sr, stride_sp, GROUP, P, CACHE)
    else:
        b_key2 = tl.zeros([GROUP_PAD, 16], dtype=tl.int32)
    return b_key2


@triton.jit
def _counts_ge(b_key, t1, t2, t3):
    # Three counts (keys >= t_j per row) packed 16 bits apart in one int64: one reduction, not three.
    one = (b_key >= t1[:, None]).to(tl.int64)
    two = (b_key >= t2[:, None]).to(tl.int64) << 16
    three = (b_key >= t3[:, None]).to(tl.int64) << 32
    return tl.sum(one + two + three, axis=1)


@triton.jit
def _key_float(key):
    # The inverse of _order_key (it is its own inverse on the bit pattern), as fp32.
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _prefix_start(i_min, i_max, m_search):
    """Start of a radix search for the keys in [i_min, i_max]: the common prefix of the two (i_lo) and the bits
    below it still to settle (i_shift, whole 2-bit digits); rows not searching (m_search false) get (-inf, 0)."""
    i_diff = i_min ^ i_max
    # Bit length of the difference from its float exponent (rounding up only over-estimates it: harmless),
    # rounded up to whole 2-bit digits; keys of both signs (negative xor) search all 32 bits.
    i_len = ((i_diff.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126
    i_len = tl.where(i_diff == 0, 0, i_len)
    i_shift = tl.where(i_diff < 0, 32, tl.minimum((i_len + 1) // 2 * 2, 32))
    i_sh = tl.minimum(i_shift, 30)
    i_lo = tl.where(i_shift >= 32, INT_MIN, (i_max >> i_sh) << i_sh)
    return tl.where(m_search, i_lo, NEG_INF_KEY), tl.where(m_search, i_shift, 0)


@triton.jit
def _radix_tile(b_key, i_lo, i_shift, i_cnt, KK, b_tail, HAS_TAIL: tl.constexpr):
    """Radix search, 2 bits a pass, over one tile `b_key [G, N]` held in registers (with HAS_TAIL also the row's
    tail tile `b_tail [G, T]`), every row in the same passes: the KK-th largest key T of each row stays in
    [i_lo, i_lo + 2^i_shift); `i_cnt` keys are >= i_lo. A row stops as soon as exactly KK keys are >= i_lo (then
    every key >= i_lo is chosen). Returns (i_lo, i_cnt)."""
    while tl.max(i_shift, axis=0) > 0:
        i_s = tl.maximum(i_shift - 2, 0)
        # Wrapping int32 arithmetic: i_lo + 3 << i_s stays below i_lo + 2^i_shift <= 2^31.
        t1, t2, t3 = i_lo + (1 << i_s), i_lo + (2 << i_s), i_lo + (3 << i_s)
        i_pack = _counts_ge(b_key, t1, t2, t3)
        if HAS_TAIL:
            i_pack += _counts_ge(b_tail, t1, t2, t3)
        i_lo, i_cnt, i_shift = _radix_digit(i_pack, i_lo, i_shift, i_cnt, KK)
    return i_lo, i_cnt


@triton.jit
def _tail_max(x, b_tail, HAS_TAIL: tl.constexpr):
    # x, joined by the row-wise max of the tail tile (reductions over a row held as a tile and its tail)
    if HAS_TAIL:
        x = tl.maximum(x, tl.max(b_tail, axis=1))
    return x


@triton.jit
def _tail_min(x, b_tail, HAS_TAIL: tl.constexpr):
    if HAS_TAIL:
        x = tl.minimum(x, tl.min(b_tail, axis=1))
    return x


@triton.jit
def _tail_sum(x, b_tail, HAS_TAIL: tl.constexpr):
    if HAS_TAIL:
        x += tl.sum(b_tail, axis=1)
    return x


@triton.jit
def _radix_digit(i_pack, i_lo, i_shift, i_cnt, KK):
    """One pass of the radix search from its three packed counts (keys >= i_lo + j << i_s, j = 1, 2, 3):
    the next (i_lo, i_cnt, i_shift) of each row (rows already done, i_shift 0, stay as they are)."""
    m_act = i_shift > 0
    i_s = tl.maximum(i_shift - 2, 0)
    c1 = (i_pack & 0xFFFF).to(tl.int32)
    c2 = ((i_pack >> 16) & 0xFFFF).to(tl.int32)
    c3 = ((i_pack >> 32) & 0xFFFF).to(tl.int32)
    # Counts fall with the threshold; the digit is the last one still holding KK keys.
    i_digit = (c1 >= KK).to(tl.int32) + (c2 >= KK).to(tl.int32) + (c3 >= KK).to(tl.int32)
    c_new = tl.where(i_digit == 3, c3, tl.where(i_digit == 2, c2, tl.where(i_digit == 1, c1, i_cnt)))
    i_lo = tl.where(m_act, i_lo + (i_digit << i_s), i_lo)
    i_cnt = tl.where(m_act, c_new, i_cnt)
    return i_lo, i_cnt, tl.where(m_act & (c_new != KK), i_s, 0)


@triton.jit
def _ranks(b_key, i_min, scale, Q_TOP: tl.constexpr):
    """A tile's ranks (see `_ranked_threshold`)."""
    m_fin = b_key > NEG_INF_KEY
    m_real = m_fin & (b_key < POS_INF_KEY)
    f_lo = _key_float(i_min)
    b_r = tl.minimum(tl.maximum((_key_float(b_key) - f_lo[:, None]) * scale[:, None], 0.0), Q_TOP - 1.0)
    return tl.where(m_real, b_r.to(tl.int32), tl.where(m_fin, Q_TOP, -1))


@triton.jit
def _ranked_threshold(b_key, n_fin, i_min, m_search, KK, RANK_BITS: tl.constexpr, b_tail, HAS_TAIL: tl.constexpr):
    """Each row's KK-th largest key T of one tile `b_key [G, N]` (rows with at most KK finite keys: -inf), searched
    first on ranks: `rank = floor((score - lo) * (2^RANK_BITS - 2) / (hi - lo))` over the row's finite scores in
    [lo, hi], +inf -> 2^RANK_BITS - 1, -inf and padding -> -1. The map never decreases, so keys of a higher rank are
    higher keys: every key ranked above the KK-th pick's bucket is chosen, none below it, and only a row taking
    part of that bucket searches its exact keys (rare at 16 bits: a bucket is ~2^-14 of the row's range).
    HAS_TAIL: the row's keys past the tile are `b_tail`, ranked and searched with it."""
    i_hi = _tail_max(tl.max(tl.where((b_key > NEG_INF_KEY) & (b_key < POS_INF_KEY), b_key, INT_MIN), axis=1),
                     tl.where((b_tail > NEG_INF_KEY) & (b_tail < POS_INF_KEY), b_tail, INT_MIN), HAS_TAIL)
    b_rank, t_rank, r_lo, r_cnt = _rank_search(b_key, n_fin, i_min, i_hi, m_search, KK, RANK_BITS, b_tail, HAS_TAIL)
    return _rank_key(b_key, b_rank, r_lo, r_cnt, m_search, KK, b_tail, t_rank, HAS_TAIL)


@triton.jit
def _rank_search(b_key, n_fin, i_min, i_hi, m_search, KK, RANK_BITS: tl.constexpr, b_tail, HAS_TAIL: tl.constexpr):
    """`_ranked_threshold`'s search on ranks, given each row's least finite key `i_min` and largest finite key
    below +inf `i_hi`: (the tile's ranks, the tail's, r_lo, r_cnt): `r_cnt` keys rank >= r_lo, the KK-th pick's
    rank; a row with r_cnt == KK takes exactly the keys ranked >= r_lo."""
    Q_TOP: tl.constexpr = (1 << RANK_BITS) - 1
    span = _key_float(i_hi) - _key_float(i_min)
    scale = (Q_TOP - 1) / tl.where(i_hi > i_min, span, 1.0)
    # No spread, an overflowing span or a denormal one: every finite key in rank 0 (the bucket search decides).
    scale = tl.where((i_hi > i_min) & (span < float("inf")) & (scale < float("inf")), scale, 0.0)
    b_rank = _ranks(b_key, i_min, scale, Q_TOP)
    t_rank = _ranks(b_tail, i_min, scale, Q_TOP) if HAS_TAIL else b_tail
    r_lo, r_cnt = _radix_tile(b_rank, tl.where(m_search, 0, -1), tl.where(m_search, RANK_BITS, 0), n_fin, KK,
                              t_rank, HAS_TAIL)
    return b_rank, t_rank, r_lo, r_cnt


@triton.jit
def _rank_key(b_key, b_rank, r_lo, r_cnt, m_search, KK, b_tail, t_rank, HAS_TAIL: tl.constexpr):
    """The threshold key T of each row from `_rank_search`'s result: the least key ranked >= r_lo, or, for a row
    that takes only part of rank r_lo's bucket, the bucket's exact KK-th key by a radix search over its keys."""
    i_lo = tl.min(tl.where((b_key > NEG_INF_KEY) & (b_rank >= r_lo[:, None]), b_key, INT_MAX), axis=1)
    if HAS_TAIL:
        i_lo = tl.minimum(i_lo, tl.min(tl.where((b_tail > NEG_INF_KEY) & (t_rank >= r_lo[:, None]), b_tail, INT_MAX),
                                       axis=1))
    m_part = m_search & (r_cnt > KK)
    if tl.max(m_part.to(tl.int32), axis=0) > 0:
        c_gt = tl.sum((b_rank > r_lo[:, None]).to(tl.int32), axis=1)
        b_bucket = tl.where(m_part[:, None] & (b_rank == r_lo[:, None]), b_key, INT_MIN)
        i_bmax = tl.max(b_bucket, axis=1)
        i_bmin = tl.min(tl.where(b_bucket > INT_MIN, b_bucket, INT_MAX), axis=1)
        if HAS_TAIL:
            c_gt += tl.sum((t_rank > r_lo[:, None]).to(tl.int32), axis=1)
            t_bucket = tl.where(m_part[:, None] & (t_rank == r_lo[:, None]), b_tail, INT_MIN)
            i_bmax = tl.maximum(i_bmax, tl.max(t_bucket, axis=1))
            i_bmin = tl.minimum(i_bmin, tl.min(tl.where(t_bucket > INT_MIN, t_bucket, INT_MAX), axis=1))
        else:
            t_bucket = b_tail
        b_lo, b_shift = _prefix_start(i_bmin, i_bmax, m_part)
        b_lo, _ = _radix_tile(b_bucket, b_lo, b_shift, r_cnt - c_gt, KK - c_gt, t_bucket, HAS_TAIL)
        i_lo = tl.where(m_part, b_lo, i_lo)
    return tl.where(m_search, i_lo, NEG_INF_KEY)


@triton.jit
def _stats3(n0, lo0, hi0, n1, lo1, hi1):
    return n0 + n1, tl.minimum(lo0, lo1), tl.maximum(hi0, hi1)


@triton.jit
def _lean_keys(p_row, stride_sp, P, BLOCK_P: tl.constexpr, TAIL: tl.constexpr, CACHE: tl.constexpr):
    """One score row as `[1, BLOCK_P]` keys and, with TAIL > 0, its `[1, TAIL]` keys from BLOCK_P on
    (`TopKLaunch.tail_tile`; else a placeholder). A tail folded into a second tile of the tile's shape (one
    reduction for both) measured slower on an H200: twice the keys a thread (benchmarks/kernels/round15).
    CACHE: the loads' cache modifier (the fused step reads scores written in the same launch: ".cg")."""
    o_r = tl.arange(0, 1)
    b_key1 = _load_keys_from(p_row, o_r, tl.arange(0, BLOCK_P), 0, stride_sp, 1, P, CACHE)
    b_key2 = _tail_keys(p_row, o_r, 0, stride_sp, 1, 1, P, BLOCK_P, TAIL, CACHE)
    return b_key1, b_key2


@triton.jit
def _row_stats(b_key, ONE_REDUCE: tl.constexpr):
    # Per row of a tile: its finite count, least finite key and largest finite key below +inf, in one reduction
    # (ONE_REDUCE; the interpreter runs a tuple reduction's combine in Python, ~5x the whole Top-K's time on CPU,
    # so it takes the same three values by three plain reductions).
    fin = b_key > NEG_INF_KEY
    n = fin.to(tl.int32)
    lo = tl.where(fin, b_key, INT_MAX)
    hi = tl.where(fin & (b_key < POS_INF_KEY), b_key, INT_MIN)
    if ONE_REDUCE:
        n, lo, hi = tl.reduce((n, lo, hi), 1, _stats3)
    else:
        n, lo, hi = tl.sum(n, axis=1), tl.min(lo, axis=1), tl.max(hi, axis=1)
    return n, lo, hi


@triton.jit
def _lean_search(b_key1, b_key2, KK, RANK_BITS: tl.constexpr, HAS_TAIL: tl.constexpr, ONE_REDUCE: tl.constexpr):
    """`_row_thresholds`' search for one row held by `_lean_keys`: its finite count, least finite key and largest
    finite key below +inf in one three-operand reduction (a second for the tail), then the rank search.
    Returns (n_fin, m_search, ranks, tail ranks, r_lo, r_cnt) as `_rank_search`."""
    n_fin, i_min, i_hi = _row_stats(b_key1, ONE_REDUCE)
    if HAS_TAIL:
        n2, lo2, hi2 = _row_stats(b_key2, ONE_REDUCE)
        n_fin, i_min, i_hi = _stats3(n_fin, i_min, i_hi, n2, lo2, hi2)
    m_search = n_fin > KK
    b_rank, t_rank, r_lo, r_cnt = _rank_search(b_key1, n_fin, i_min, i_hi, m_search, KK, RANK_BITS, b_key2, HAS_TAIL)
    return n_fin, m_search, b_rank, t_rank, r_lo, r_cnt


@triton.jit
def _lean_cut(b_key1, b_key2, i_lo, KK, m_search, BLOCK_P: tl.constexpr, HAS_TAIL: tl.constexpr):
    """For a row held by `_lean_keys` whose KK-th largest key is T = `i_lo`: the largest page id among the ties at T
    that it takes (ties go to the lowest ids: KK - #(keys > T) of them), so it takes key > T, and key == T up to
    that page; and that number of ties. Rows not searching (at most KK finite keys): (INT_MAX, KK)."""
    o_n = tl.arange(0, BLOCK_P)[None, :]
    need = KK - _tail_sum(tl.sum((b_key1 > i_lo[:, None]).to(tl.int32), axis=1), (b_key2 > i_lo[:, None]).to(tl.int32),
                          HAS_TAIL)
    e1 = (b_key1 == i_lo[:, None]).to(tl.int32)
    r1 = tl.cumsum(e1, axis=1) - 1
    cut = tl.max(tl.where((e1 != 0) & (r1 < need[:, None]), o_n, -1), axis=1)
    if HAS_TAIL:  # the tail's ties rank after the tile's
        e2 = (b_key2 == i_lo[:, None]).to(tl.int32)
        r2 = tl.sum(e1, axis=1)[:, None] + tl.cumsum(e2, axis=1) - 1
        o_t = BLOCK_P + tl.arange(0, b_key2.shape[1])[None, :]
        cut = tl.maximum(cut, tl.max(tl.where((e2 != 0) & (r2 < need[:, None]), o_t, -1), axis=1))
    return tl.where(m_search, cut, INT_MAX), tl.where(m_search, need, KK)


@triton.jit
def _lean_topk_row(p_row, p_out, stride_sp, stride_ok, P, KK, K_OUT, BLOCK_P: tl.constexpr, MASK_REST: tl.constexpr,
                   RANK_BITS: tl.constexpr, TAIL: tl.constexpr, ONE_REDUCE: tl.constexpr, CACHE: tl.constexpr):
    """`_topk_rows` for one row (GROUP 1) with fewer block-wide steps (`TopKLaunch.lean`): a row whose KK-th pick
    does not share its rank bucket (nearly all) takes exactly the keys ranked at or above it, compacted by one
    scan; only otherwise are its threshold key and the page id up to which it takes ties found."""
    HAS_TAIL: tl.constexpr = TAIL > 0
    o_n = tl.arange(0, BLOCK_P)[None, :]
    b_key1, b_key2 = _lean_keys(p_row, stride_sp, P, BLOCK_P, TAIL, CACHE)
    o_t = BLOCK_P + tl.arange(0, b_key2.shape[1])[None, :]  # the tail's pages (TAIL 0: unused)
    n_fin, m_search, b_rank, t_rank, r_lo, r_cnt = _lean_search(b_key1, b_key2, KK, RANK_BITS, HAS_TAIL,
                                                                ONE_REDUCE)
    r_pick = tl.where(m_search, r_lo, 0)  # rows not searching take every finite key (rank >= 0)
    pick1 = b_rank >= r_pick[:, None]
    pick2 = t_rank >= r_pick[:, None]
    if tl.max((m_search & (r_cnt != KK)).to(tl.int32), axis=0) > 0:
        i_lo = _rank_key(b_key1, b_rank, r_lo, r_cnt, m_search, KK, b_key2, t_rank, HAS_TAIL)
        i_cut, _ = _lean_cut(b_key1, b_key2, i_lo, KK, m_search, BLOCK_P, HAS_TAIL)
        pick1 = _cut_pick(b_key1, o_n, i_lo, i_cut)
        pick2 = _cut_pick(b_key2, o_t, i_lo, i_cut)
    total = tl.where(m_search, KK, n_fin)  # how many the row takes
    tl.store(p_out + (tl.cumsum(pick1.to(tl.int32), axis=1) - 1) * stride_ok, o_n, mask=pick1)
    if HAS_TAIL:  # the tail's picks are the last ones
        pos2 = total[:, None] - tl.sum(pick2.to(tl.int32), axis=1)[:, None] + tl.cumsum(pick2.to(tl.int32), axis=1) - 1
        tl.store(p_out + pos2 * stride_ok, o_t, mask=pick2)
    if MASK_REST:  # the row's keys are read for the last time: overwrite the unchosen ones with -inf
        tl.store(p_row + o_n * stride_sp, tl.full([1, BLOCK_P], float("-inf"), tl.float32), mask=(o_n < P) & ~pick1)
        if HAS_TAIL:
            tl.store(p_row + o_t * stride_sp, tl.full(b_key2.shape, float("-inf"), tl.float32), mask=(o_t < P) & ~pick2)
    for i_k0 in range(0, K_OUT, BLOCK_P):
        o_k = i_k0 + o_n
        tl.store(p_out + o_k * stride_ok, tl.full([1, BLOCK_P], -1, tl.int32), mask=(o_k >= total[:, None]) & (o_k < K_OUT))


@triton.jit
def _cut_pick(b_key, o_p, i_lo, i_cut):
    # A row's picks given its threshold key T and tie cutoff page (`_lean_cut`): keys above T, ties up to the cutoff.
    return ((b_key > i_lo[:, None]) | ((b_key == i_lo[:, None]) & (o_p <= i_cut[:, None]))) & (b_key > NEG_INF_KEY)


@triton.jit
def _topk_rows(
    p_rows, p_out, stride_sr, stride_sp, stride_ok, P, KK, K_OUT,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_P: tl.constexpr, SINGLE_TILE: tl.constexpr,
    MASK_REST: tl.constexpr, RANK_BITS: tl.constexpr, TAIL: tl.constexpr,
):
    """The KK best of each of the GROUP score rows at `p_rows`, united, ascending, -1 padded to K_OUT at `p_out`."""
    i_lo, i_need, b_key1, b_key2 = _row_thresholds(p_rows, stride_sr, stride_sp, P, KK, GROUP, GROUP_PAD, BLOCK_P,
                                                   SINGLE_TILE, RANK_BITS, TAIL)
    _pick_union(p_rows, p_out, b_key1, i_lo, i_need, stride_sr, stride_sp, stride_ok, P, K_OUT,
                GROUP, GROUP_PAD, BLOCK_P, SINGLE_TILE, MASK_REST, b_key2, TAIL)


@triton.jit
def _row_thresholds(p_rows, stride_sr, stride_sp, P, KK,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_P: tl.constexpr, SINGLE_TILE: tl.constexpr,
                    RANK_BITS: tl.constexpr, TAIL: tl.constexpr):
    """Per row of the GROUP at `p_rows`: its KK-th largest key T and how many keys equal to T it takes (after
    all keys above T); and, with SINGLE_TILE, the [GROUP_PAD, BLOCK_P] keys (else a placeholder) and, with TAIL > 0
    (a single tile whose row runs past it: `TopKLaunch.tail_tile`), the [GROUP_PAD, TAIL] keys from BLOCK_P on
    (else a placeholder)."""
    o_r = tl.arange(0, GROUP_PAD)
    o_n = tl.arange(0, BLOCK_P)
    HAS_TAIL: tl.constexpr = TAIL > 0
    b_key2 = _tail_keys(p_rows, o_r, stride_sr, stride_sp, GROUP, GROUP_PAD, P, BLOCK_P, TAIL, "")

    # Phase 1, all rows of the group at once: each row's KK-th largest key T.
    # (a) Only the bits where the row's finite keys differ need searching: start from the common prefix of
    #     its largest and smallest finite key. A row with at most KK finite keys takes them all (T = -inf).
    if SINGLE_TILE:
        b_key1 = _load_keys(p_rows, o_r, o_n, stride_sr, stride_sp, GROUP, P)
        m_fin = b_key1 > NEG_INF_KEY
        n_fin = _tail_sum(tl.sum(m_fin.to(tl.int32), axis=1), (b_key2 > NEG_INF_KEY).to(tl.int32), HAS_TAIL)
        i_max = _tail_max(tl.max(b_key1, axis=1), b_key2, HAS_TAIL)
        i_min = _tail_min(tl.min(tl.where(m_fin, b_key1, INT_MAX), axis=1),
                          tl.where(b_key2 > NEG_INF_KEY, b_key2, INT_MAX), HAS_TAIL)
    else:
        b_key1 = tl.zeros([GROUP_PAD, BLOCK_P], dtype=tl.int32)  # unused: the tiles are re-read
        n_fin = tl.zeros([GROUP_PAD], dtype=tl.int32)
        i_max = tl.zeros([GROUP_PAD], dtype=tl.int32) + INT_MIN
        i_min = tl.zeros([GROUP_PAD], dtype=tl.int32) + INT_MAX
        for i_p0 in range(0, P, BLOCK_P):
            b_key = _load_keys(p_rows, o_r, i_p0 + o_n, stride_sr, stride_sp, GROUP, P)
            m_fin = b_key > NEG_INF_KEY
            n_fin += tl.sum(m_fin.to(tl.int32), axis=1)
            i_max = tl.maximum(i_max, tl.max(b_key, axis=1))
            i_min = tl.minimum(i_min, tl.min(tl.where(m_fin, b_key, INT_MAX), axis=1))
    m_search = n_fin > KK
    if SINGLE_TILE and RANK_BITS > 0:
        i_lo = _ranked_threshold(b_key1, n_fin, i_min, m_search, KK, RANK_BITS, b_key2, HAS_TAIL)
    else:
        i_lo, i_shift = _prefix_start(i_min, i_max, m_search)
        # keys >= i_lo, or fewer when i_lo = INT_MIN (only ever compared with KK, which it exceeds)
        i_cnt = n_fin
        if SINGLE_TILE:
            i_lo, i_cnt = _radix_tile(b_key1, i_lo, i_shift, i_cnt, KK, b_key2, HAS_TAIL)
        else:
            # (b) Radix search, 2 bits a pass, every row in the same passes, re-reading the tiles each pass.
            while tl.max(i_shift, axis=0) > 0:
                i_s = tl.maximum(i_shift - 2, 0)
                t1 = i_lo + (1 << i_s)
                t2 = i_lo + (2 << i_s)
                t3 = i_lo + (3 << i_s)
                i_pack = tl.zeros([GROUP_PAD], dtype=tl.int64)
                for i_p0 in range(0, P, BLOCK_P):
                    i_pack += _counts_ge(_load_keys(p_rows, o_r, i_p0 + o_n, stride_sr, stride_sp, GROUP, P),
                                         t1, t2, t3)
                i_lo, i_cnt, i_shift = _radix_digit(i_pack, i_lo, i_shift, i_cnt, KK)

    # (c) How many keys equal to T each row still needs after all keys above it.
    if SINGLE_TILE:
        i_gt = _tail_sum(tl.sum((b_key1 > i_lo[:, None]).to(tl.int32), axis=1),
                         (b_key2 > i_lo[:, None]).to(tl.int32), HAS_TAIL)
    else:
        i_gt = tl.zeros([GROUP_PAD], dtype=tl.int32)
        for i_p0 in range(0, P, BLOCK_P):
            b_key = _load_keys(p_rows, o_r, i_p0 + o_n, stride_sr, stride_sp, GROUP, P)
            i_gt += tl.sum((b_key > i_lo[:, None]).to(tl.int32), axis=1)
    return i_lo, KK - i_gt, b_key1, b_key2


@triton.jit
def _pick_tile(p_rows, p_out, b_key, o_p, i_lo, i_need, i_out, b_seen, stride_sr, stride_sp, stride_ok, P,
               GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK: tl.constexpr, MASK_REST: tl.constexpr):
    """One tile of `_pick_union` (keys `b_key` of pages `o_p`): its picks written after the `i_out` ids already
    there, the rows' ties ranked after the `b_seen` of earlier tiles. Returns the new (i_out, b_seen)."""
    o_r = tl.arange(0, GROUP_PAD)
    b_eq = (b_key == i_lo[:, None]).to(tl.int32)
    b_rank = tl.cumsum(b_eq, axis=1) - 1 + b_seen[:, None]
    m_pick = (b_key > i_lo[:, None]) | ((b_eq != 0) & (b_rank < i_need[:, None]))
    m_pick = m_pick & (b_key > NEG_INF_KEY)
    if MASK_REST:  # this tile's keys are read for the last time: overwrite the unchosen ones with -inf
        m_in = (o_r[:, None] < GROUP) & (o_p[None, :] < P)
        tl.store(p_rows + o_r[:, None] * stride_sr + o_p[None, :] * stride_sp,
                 tl.full([GROUP_PAD, BLOCK], float("-inf"), tl.float32), mask=m_in & ~m_pick)
    b_union = tl.max(m_pick.to(tl.int32), axis=0)
    b_pos = i_out + tl.cumsum(b_union, axis=0) - 1
    tl.store(p_out + b_pos * stride_ok, o_p, mask=b_union != 0)
    return i_out + tl.sum(b_union, axis=0), b_seen + tl.sum(b_eq, axis=1)


@triton.jit
def _pick_union(p_rows, p_out, b_key1, i_lo, i_need, stride_sr, stride_sp, stride_ok, P, K_OUT,
                GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_P: tl.constexpr, SINGLE_TILE: tl.constexpr,
                MASK_REST: tl.constexpr, b_key2, TAIL: tl.constexpr):
    """Given each row's threshold T (`i_lo`) and ties to take (`i_need`): the union of the rows' picks (TAIL > 0:
    the single tile `b_key1`, then the tail tile `b_key2` of the pages from BLOCK_P on)."""
    o_r = tl.arange(0, GROUP_PAD)
    o_n = tl.arange(0, BLOCK_P)
    # Phase 2: per tile, each row picks keys above T plus its lowest-index ties at T; the tile's union over
    # the group is compacted (ascending by construction) after the ids already written.
    i_out = tl.zeros([], dtype=tl.int32)
    b_seen = tl.zeros([GROUP_PAD], dtype=tl.int32)
    if SINGLE_TILE and TAIL > 0:
        i_out, b_seen = _pick_tile(p_rows, p_out, b_key1, o_n, i_lo, i_need, i_out, b_seen, stride_sr, stride_sp,
                                   stride_ok, P, GROUP, GROUP_PAD, BLOCK_P, MASK_REST)
        i_out, b_seen = _pick_tile(p_rows, p_out, b_key2, BLOCK_P + tl.arange(0, TAIL), i_lo, i_need, i_out,
                                   b_seen, stride_sr, stride_sp, stride_ok, P, GROUP, GROUP_PAD, TAIL, MASK_REST)
    else:
        for i_p0 in range(0, P, BLOCK_P):
            o_p = i_p0 + o_n
            if SINGLE_TILE:
                b_key = b_key1
            else:
                b_key = _load_keys(p_rows, o_r, o_p, stride_sr, stride_sp, GROUP, P)
            i_out, b_seen = _pick_tile(p_rows, p_out, b_key, o_p, i_lo, i_need, i_out, b_seen, stride_sr, stride_sp,
                                       stride_ok, P, GROUP, GROUP_PAD, BLOCK_P, MASK_REST)
    for i_k0 in range(0, K_OUT, BLOCK_P):
        o_k = i_k0 + o_n
        tl.store(p_out + o_k * stride_ok, tl.full([BLOCK_P], -1, tl.int32), mask=(o_k >= i_out) & (o_k < K_OUT))


@triton.jit
def _topk_pages_kernel(
    s_ptr, out_ptr, due_ptr,
    stride_sb, stride_sr, stride_sp,
    stride_ob, stride_or, stride_ok,
    R_OUT, P, KK, K_OUT,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_P: tl.constexpr, SINGLE_TILE: tl.constexpr,
    MASK_REST: tl.constexpr, RANK_BITS: tl.constexpr, HAS_DUE: tl.constexpr, TAIL: tl.constexpr,
    LEAN: tl.constexpr, ONE_REDUCE: tl.constexpr,
):
    # HAS_DUE (selection reuse): on a step that reuses its stored pages every program returns here, having read
    # one flag and nothing of its row, so the launch (fixed grid: a captured step) is nearly empty.
    if due_flag(due_ptr, HAS_DUE) != 0:
        i_bg = tl.program_id(0).to(tl.int64)
        i_b = i_bg // R_OUT
        i_g = i_bg % R_OUT
        p_rows = s_ptr + i_b * stride_sb + i_g * GROUP * stride_sr
        p_out = out_ptr + i_b * stride_ob + i_g * stride_or
        if LEAN:  # one row a program, held in one tile (and a tail): `lean_config`
            _lean_topk_row(p_rows, p_out, stride_sp, stride_ok, P, KK, K_OUT, BLOCK_P, MASK_REST, RANK_BITS, TAIL,
                           ONE_REDUCE, "")
        else:
            _topk_rows(p_rows, p_out, stride_sr, stride_sp, stride_ok, P, KK, K_OUT, GROUP, GROUP_PAD, BLOCK_P,
                       SINGLE_TILE, MASK_REST, RANK_BITS, TAIL)


@triton.jit
def _topk_thresholds_kernel(
    s_ptr, thr_ptr, need_ptr, cut_ptr, due_ptr, stride_sb, stride_sr, stride_sp, R, P, KK, zero_ptr, N_ZERO,
    BLOCK_P: tl.constexpr, SINGLE_TILE: tl.constexpr, RANK_BITS: tl.constexpr, HAS_DUE: tl.constexpr,
    TAIL: tl.constexpr, LEAN: tl.constexpr, CUT: tl.constexpr, GROUP: tl.constexpr, ZERO_PAD: tl.constexpr,
    ONE_REDUCE: tl.constexpr,
):
    """Split union, pass 1: one program per score row finds its threshold (as `_topk_rows` does for a group).
    With CUT (single-tile rows) also the page id up to which the row takes its ties at the threshold (`_lean_cut`;
    INT_MAX: all of them), and the first program of each group of GROUP rows zeroes the group's N_ZERO int32 at
    `zero_ptr` (the one-pass union's ticket and counts). A reusing step (HAS_DUE, flag 0) writes nothing: pass
    2 reads the same flag and none of it."""
    if due_flag(due_ptr, HAS_DUE) != 0:
        i_row = tl.program_id(0).to(tl.int64)
        p_row = s_ptr + (i_row // R) * stride_sb + (i_row % R) * stride_sr
        o_1 = tl.arange(0, 1)
        HAS_TAIL: tl.constexpr = TAIL > 0
        if LEAN:
            b_key1, b_key2 = _lean_keys(p_row, stride_sp, P, BLOCK_P, TAIL, "")
            _, m_search, b_rank, t_rank, r_lo, r_cnt = _lean_search(b_key1, b_key2, KK, RANK_BITS, HAS_TAIL,
                                                                    ONE_REDUCE)
            i_lo = _rank_key(b_key1, b_rank, r_lo, r_cnt, m_search, KK, b_key2, t_rank, HAS_TAIL)
            # A row taking all of its ranks >= r_lo takes every tie at T: need KK (>= their count), no cutoff.
            i_need = o_1 * 0 + KK
            i_cut = o_1 * 0 + INT_MAX
            if tl.max((m_search & (r_cnt != KK)).to(tl.int32), axis=0) > 0:
                i_cut, i_need = _lean_cut(b_key1, b_key2, i_lo, KK, m_search, BLOCK_P, HAS_TAIL)
        else:
            i_lo, i_need, b_key1, b_key2 = _row_thresholds(p_row, stride_sr, stride_sp, P, KK, 1, 1, BLOCK_P,
                                                           SINGLE_TILE, RANK_BITS, TAIL)
            i_cut = o_1 * 0 + INT_MAX
            if CUT:  # a row with more ties at T than it takes: the page of its last tie taken
                n_eq = _tail_sum(tl.sum((b_key1 == i_lo[:, None]).to(tl.int32), axis=1),
                                 (b_key2 == i_lo[:, None]).to(tl.int32), HAS_TAIL)
                if tl.max((n_eq > i_need).to(tl.int32), axis=0) > 0:
                    i_cut, _ = _lean_cut(b_key1, b_key2, i_lo, KK, i_lo > NEG_INF_KEY, BLOCK_P, HAS_TAIL)
        tl.store(thr_ptr + i_row + o_1, i_lo)
        tl.store(need_ptr + i_row + o_1, i_need)
        if CUT:
            tl.store(cut_ptr + i_row + o_1, i_cut)
            o_z = tl.arange(0, ZERO_PAD)
            tl.store(zero_ptr + (i_row // GROUP) * N_ZERO + o_z, tl.zeros([ZERO_PAD], dtype=tl.int32),
                     mask=(o_z < N_ZERO) & ((o_z * 0 + i_row % GROUP) == 0))  # vector form, as append.py's m_old


@triton.jit
def _union_onepass_kernel(
    s_ptr, thr_ptr, cut_ptr, state_ptr, out_ptr, due_ptr,
    stride_sb, stride_sr, stride_sp, stride_ob, stride_or, stride_ok, R_OUT, P, NCHUNK, K_OUT,
    GROUP: tl.constexpr, CHUNK: tl.constexpr, NCHUNK_PAD: tl.constexpr, HAS_DUE: tl.constexpr,
):
    """Split union, pass 2 in one launch (`TopKLaunch.onepass_union`), over (group, chunk of pages) programs. A
    program takes the next chunk of its group by a ticket (so every earlier chunk's program has started), unites
    its rows' picks there (keys above each row's threshold, ties up to the row's cutoff page: nothing depends on
    other chunks), publishes the chunk's union count, adds up the earlier chunks' counts (waiting for any not yet
    published) and writes its ids compacted after theirs; the last chunk writes the -1 tail. The group's state
    `[1 + NCHUNK]` int32 (ticket, counts + 1) was zeroed by the thresholds pass."""
    if due_flag(due_ptr, HAS_DUE) != 0:
        i_bg = tl.program_id(0).to(tl.int64)
        p_state = state_ptr + i_bg * (1 + NCHUNK)
        i_c = tl.atomic_add(p_state, 1)
        p_rows = s_ptr + (i_bg // R_OUT) * stride_sb + (i_bg % R_OUT) * GROUP * stride_sr
        o_n = tl.arange(0, CHUNK)
        o_p = i_c * CHUNK + o_n
        m_p = o_p < P
        b_u = o_n < 0
        for g in tl.static_range(GROUP):
            i_lo = tl.load(thr_ptr + i_bg * GROUP + g)
            i_cut = tl.load(cut_ptr + i_bg * GROUP + g)
            b_key = _order_key(tl.load(p_rows + g * stride_sr + o_p * stride_sp, mask=m_p, other=float("-inf")))
            b_u = b_u | (((b_key > i_lo) | ((b_key == i_lo) & (o_p <= i_cut))) & (b_key > NEG_INF_KEY))
        b_u = b_u.to(tl.int32)
        i_own = tl.sum(b_u, axis=0)
        tl.atomic_xchg(p_state + 1 + i_c, i_own + 1)  # published: the count + 1 (0: not yet)
        o_c = tl.arange(0, NCHUNK_PAD)
        m_c = o_c < i_c
        b_f = tl.atomic_add(p_state + 1 + o_c, 0, mask=m_c)
        while tl.min(tl.where(m_c, b_f, 1), axis=0) == 0:
            b_f = tl.atomic_add(p_state + 1 + o_c, 0, mask=m_c)
        i_out = tl.sum(tl.where(m_c, b_f - 1, 0), axis=0)
        p_out = out_ptr + (i_bg // R_OUT) * stride_ob + (i_bg % R_OUT) * stride_or
        tl.store(p_out + (i_out + tl.cumsum(b_u, axis=0) - 1) * stride_ok, o_p, mask=b_u != 0)
        if i_c == NCHUNK - 1:  # every other chunk is counted: the -1 tail after the group's ids
            i_total = i_out + i_own
            for i_k0 in range(0, K_OUT, CHUNK):
                o_k = i_k0 + o_n
                tl.store(p_out + o_k * stride_ok, tl.full([CHUNK], -1, tl.int32),
                         mask=(o_k >= i_total) & (o_k < K_OUT))


@triton.jit
def _topk_union_kernel(
    s_ptr, thr_ptr, need_ptr, out_ptr, due_ptr,
    stride_sb, stride_sr, stride_sp, stride_ob, stride_or, stride_ok,
    R_OUT, P, K_OUT,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_P: tl.constexpr, SINGLE_TILE: tl.constexpr,
    HAS_DUE: tl.constexpr, TAIL: tl.constexpr,
):
    """Split union, pass 2: one program per group unites its rows' picks given their thresholds (none on a
    reusing step: HAS_DUE, flag 0, returns before reading them or the scores)."""
    if due_flag(due_ptr, HAS_DUE) != 0:
        i_bg = tl.program_id(0).to(tl.int64)
        i_b = i_bg // R_OUT
        i_g = i_bg % R_OUT
        p_rows = s_ptr + i_b * stride_sb + i_g * GROUP * stride_sr
        o_r = tl.arange(0, GROUP_PAD)
        m_r = o_r < GROUP
        i_lo = tl.load(thr_ptr + i_bg * GROUP + o_r, mask=m_r, other=INT_MAX)
        i_need = tl.load(need_ptr + i_bg * GROUP + o_r, mask=m_r, other=0)
        if SINGLE_TILE:
            b_key1 = _load_keys(p_rows, o_r, tl.arange(0, BLOCK_P), stride_sr, stride_sp, GROUP, P)
        else:
            b_key1 = tl.zeros([GROUP_PAD, BLOCK_P], dtype=tl.int32)
        b_key2 = _tail_keys(p_rows, o_r, stride_sr, stride_sp, GROUP, GROUP_PAD, P, BLOCK_P, TAIL, "")
        _pick_union(p_rows, out_ptr + i_b * stride_ob + i_g * stride_or, b_key1, i_lo, i_need, stride_sr,
                    stride_sp, stride_ok, P, K_OUT, GROUP, GROUP_PAD, BLOCK_P, SINGLE_TILE, False, b_key2, TAIL)


@triton.jit
def _chunk_picks(s_ptr, thr_ptr, need_ptr, ties_ptr, i_bg, i_c, stride_sb, stride_sr, stride_sp, R_OUT, P, NCHUNK,
                 GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, CHUNK: tl.constexpr, NCHUNK_PAD: tl.constexpr,
                 TIES: tl.constexpr):
    """Chunk `i_c` of group `i_bg`: (its rows' picks [GROUP_PAD, CHUNK] as `_pick_union` makes them, its rows'
    ties at T [GROUP_PAD, CHUNK], its page ids [CHUNK]). With TIES the ties of the earlier chunks (`ties_ptr`,
    `[B * R_OUT, NCHUNK, GROUP]`) rank this chunk's; without, the picks are not formed (pass (a) needs none)."""
    i_b = i_bg // R_OUT
    i_g = i_bg % R_OUT
    o_r = tl.arange(0, GROUP_PAD)
    m_r = o_r < GROUP
    o_p = i_c * CHUNK + tl.arange(0, CHUNK)
    i_lo = tl.load(thr_ptr + i_bg * GROUP + o_r, mask=m_r, other=INT_MAX)
    b_key = _load_keys(s_ptr + i_b * stride_sb + i_g * GROUP * stride_sr, o_r, o_p, stride_sr, stride_sp, GROUP, P)
    b_eq = (b_key == i_lo[:, None]).to(tl.int32)
    m_pick = b_eq != 0
    if TIES:
        i_need = tl.load(need_ptr + i_bg * GROUP + o_r, mask=m_r, other=0)
        o_c = tl.arange(0, NCHUNK_PAD)
        b_prev = tl.load(ties_ptr + (i_bg * NCHUNK + o_c[:, None]) * GROUP + o_r[None, :],
                         mask=(o_c[:, None] < i_c) & m_r[None, :], other=0)
        # A tie's rank among its row's ties: those of the earlier chunks, then this chunk's lower ids.
        b_rank = tl.cumsum(b_eq, axis=1) - 1 + tl.sum(b_prev, axis=0)[:, None]
        m_pick = (b_key > i_lo[:, None]) | ((b_eq != 0) & (b_rank < i_need[:, None]))
        m_pick = m_pick & (b_key > NEG_INF_KEY)
    return m_pick, b_eq, o_p


@triton.jit
def _union_ties_kernel(
    s_ptr, thr_ptr, ties_ptr, due_ptr, stride_sb, stride_sr, stride_sp, R_OUT, P, NCHUNK,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, CHUNK: tl.constexpr, HAS_DUE: tl.constexpr,
):
    """Chunked pass 2, (a): per (group, chunk), each row's count of keys equal to its threshold T."""
    if due_flag(due_ptr, HAS_DUE) != 0:
        i_bg = tl.program_id(0).to(tl.int64)
        i_c = tl.program_id(1)
        _, b_eq, _ = _chunk_picks(s_ptr, thr_ptr, thr_ptr, ties_ptr, i_bg, i_c, stride_sb, stride_sr, stride_sp,
                                  R_OUT, P, NCHUNK, GROUP, GROUP_PAD, CHUNK, 1, False)
        o_r = tl.arange(0, GROUP_PAD)
        tl.store(ties_ptr + (i_bg * NCHUNK + i_c) * GROUP + o_r, tl.sum(b_eq, axis=1), mask=o_r < GROUP)


@triton.jit
def _union_count_kernel(
    s_ptr, thr_ptr, need_ptr, ties_ptr, cnt_ptr, due_ptr, stride_sb, stride_sr, stride_sp, R_OUT, P, NCHUNK,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, CHUNK: tl.constexpr, NCHUNK_PAD: tl.constexpr,
    HAS_DUE: tl.constexpr,
):
    """Chunked pass 2, (b): per (group, chunk), how many pages of the chunk the group's union takes."""
    if due_flag(due_ptr, HAS_DUE) != 0:
        i_bg = tl.program_id(0).to(tl.int64)
        i_c = tl.program_id(1)
        m_pick, _, _ = _chunk_picks(s_ptr, thr_ptr, need_ptr, ties_ptr, i_bg, i_c, stride_sb, stride_sr, stride_sp,
                                    R_OUT, P, NCHUNK, GROUP, GROUP_PAD, CHUNK, NCHUNK_PAD, True)
        o_1 = tl.arange(0, 1)
        tl.store(cnt_ptr + i_bg * NCHUNK + i_c + o_1, tl.sum(tl.max(m_pick.to(tl.int32), axis=0), axis=0))


@triton.jit
def _union_write_kernel(
    s_ptr, thr_ptr, need_ptr, ties_ptr, cnt_ptr, out_ptr, due_ptr,
    stride_sb, stride_sr, stride_sp, stride_ob, stride_or, stride_ok, R_OUT, P, NCHUNK, K_OUT,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, CHUNK: tl.constexpr, NCHUNK_PAD: tl.constexpr,
    HAS_DUE: tl.constexpr,
):
    """Chunked pass 2, (c): per (group, chunk), the chunk's union ids compacted after the earlier chunks' (so
    ascending), and the -1 tail's slots among this chunk's [i_c * CHUNK, i_c * CHUNK + CHUNK) (K_OUT <= P)."""
    if due_flag(due_ptr, HAS_DUE) != 0:
        i_bg = tl.program_id(0).to(tl.int64)
        i_c = tl.program_id(1)
        m_pick, _, o_p = _chunk_picks(s_ptr, thr_ptr, need_ptr, ties_ptr, i_bg, i_c, stride_sb, stride_sr,
                                      stride_sp, R_OUT, P, NCHUNK, GROUP, GROUP_PAD, CHUNK, NCHUNK_PAD, True)
        b_union = tl.max(m_pick.to(tl.int32), axis=0)
        o_c = tl.arange(0, NCHUNK_PAD)
        b_cnt = tl.load(cnt_ptr + i_bg * NCHUNK + o_c, mask=o_c < NCHUNK, other=0)
        i_out = tl.sum(tl.where(o_c < i_c, b_cnt, 0), axis=0)
        i_total = tl.sum(b_cnt, axis=0)
        p_out = out_ptr + (i_bg // R_OUT) * stride_ob + (i_bg % R_OUT) * stride_or
        b_pos = i_out + tl.cumsum(b_union, axis=0) - 1
        tl.store(p_out + b_pos * stride_ok, o_p, mask=b_union != 0)
        tl.store(p_out + o_p * stride_ok, tl.full([CHUNK], -1, tl.int32), mask=(o_p >= i_total) & (o_p < K_OUT))


def tail_config(P: int, group: int, launch: TopKLaunch | None = None) -> tuple[int, int]:
    """(BLOCK_P, TAIL) for a row held in registers as a power-of-two tile and a tail tile (`TopKLaunch.tail_tile`),
    or (0, 0) where the row is one tile: a row of P pages at most `tail_tile` past a power of two B >= 256 is held
    as B keys and next_pow2(P - B) (>= 16) keys, instead of 2B. `launch` None: the module's `TOPK_LAUNCH`."""
    launch = launch or TOPK_LAUNCH
    if not launch.tail_tile or P < 256:
        return 0, 0
    block = 1 << (P.bit_length() - 1)
    tail = max(16, next_pow2(P - block))
    if P == block or P - block > launch.tail_tile or next_pow2(group) * (block + tail) > launch.max_tile:
        return 0, 0
    return block, tail


def launch_config(P: int, group: int, launch: TopKLaunch | None = None):
    """(BLOCK_P, num_warps, single_tile) for rows of P pages in groups of `group` (with `tail_config`'s tail:
    BLOCK_P is the power-of-two part, the warps are its)."""
    launch = launch or TOPK_LAUNCH
    g_pad = next_pow2(group)
    tail_block, _ = tail_config(P, group, launch)
    if tail_block:
        keys = g_pad * tail_block
        warps = max(1, min(launch.max_warps, keys // (32 * launch.keys_per_thread)))
        return tail_block, warps, True
    block_p = max(16, next_pow2(P))
    single = g_pad * block_p <= launch.max_tile
    if not single:
        block_p = max(16, launch.max_tile // g_pad)
    keys = g_pad * block_p
    warps = launch.big_tile_warps if keys > 16384 else max(1, min(launch.max_warps,
                                                                    keys // (32 * launch.keys_per_thread)))
    return block_p, warps, single


def topk_pages(scores, k: int, group: int = 1, mask_rest: bool = False, *, launch: TopKLaunch | None = None,
               due=None, out=None):
    """Triton twin of `topk_pages_ref`.

    scores fp32 `[B, R, P]` (any strides; NaN-free). Returns a fresh int32 `[B, R // group, min(group * k, P)]`
    (or `out`, of that shape, any strides). Ties at the k-th score go to the lowest page ids. No torch.topk: one
    program per (b, group) finds the k-th
    largest score of each of its rows together, by a radix search on the fp32 bit pattern that starts at the
    bits where the row's scores differ and stops once the threshold is unique, then writes the union compacted.
    Unions (group > 1, `launch.split_union`) take two launches instead: a program per row finds its threshold
    (and tie cutoff page), then programs per (group, chunk of pages) write the union (`launch.onepass_union`; same
    ids; without it a program per group, or from `launch.chunked_union_min_pages` pages a row programs per (group,
    chunk) in three launches). `launch`: a `TopKLaunch` (benchmarks and tests vary it);
    None: the module's `TOPK_LAUNCH`, read at each call (the benchmarks' `--topk-launch` replaces it).
    `due` (HAS_DUE: selection reuse's device flag, the one `score_pages(due=)` read): every program loads it first
    and, where it is 0, returns before loading its row: nothing is read or written (`out`, the scores under
    `mask_rest` and the split union's thresholds keep their values; a fresh result stays unwritten), so a reusing
    step, captured or not, costs a nearly empty launch. `reuse_pages` reads this result only where the flag is 1.
    """
    require_triton()
    B, R, P, K_out = _check(scores, k, group, due, out)
    launch = launch or TOPK_LAUNCH
    if out is None:
        out = torch.empty(B, R // group, K_out, dtype=torch.int32, device=scores.device)
    if group > 1 and launch.split_union and not mask_rest and launch.num_warps is None and launch.block_p is None:
        _split_union(scores, out, k, group, launch, due)
        return out
    block_p, warps, single = launch_config(P, group, launch)
    _, tail = tail_config(P, group, launch)
    if launch.block_p is not None:
        block_p, single, tail = launch.block_p, launch.block_p >= P, 0
    _topk_pages_kernel[(B * (R // group),)](
        scores, out, due_arg(due, out),
        scores.stride(0), scores.stride(1), scores.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        R // group, P, min(k, P), K_out,
        GROUP=group, GROUP_PAD=next_pow2(group), BLOCK_P=block_p, SINGLE_TILE=single, MASK_REST=mask_rest,
        RANK_BITS=launch.rank_bits, HAS_DUE=due is not None, TAIL=tail,
        LEAN=lean_config(P, group, launch) and launch.block_p is None, ONE_REDUCE=not interpreting(),
        num_warps=launch.num_warps or warps,
    )
    return out


def lean_config(P: int, group: int, launch: TopKLaunch | None = None) -> bool:
    """Whether rows of P pages in groups of `group` take `TopKLaunch.lean`'s path: one row a program (group 1),
    held in one register tile and its tail, ranked first."""
    launch = launch or TOPK_LAUNCH
    block_p, _, single = launch_config(P, 1, launch)
    return group == 1 and launch.rank_bits > 0 and single and block_p <= launch.lean


def _split_union(scores, out, k, group, launch, due=None):
    P = scores.shape[2]
    if onepass_config(P, launch):
        _onepass_union(scores, out, k, group, launch, due)
        return
    thr, need, _ = _thresholds(scores, k, launch, due)
    if launch.chunked_union_min_pages is not None and P >= launch.chunked_union_min_pages:
        _chunked_union(scores, thr, need, out, group, launch, due)
    else:
        _serial_union(scores, thr, need, out, group, launch, due)


def onepass_config(P: int, launch: TopKLaunch | None = None) -> bool:
    """Whether a split union of rows of P pages takes `TopKLaunch.onepass_union`'s two launches (the rows' tiles
    held in registers: their thresholds pass finds each row's tie cutoff)."""
    launch = launch or TOPK_LAUNCH
    return launch.onepass_union and launch_config(P, 1, launch)[2]


def _thresholds(scores, k, launch, due=None, group=1, zero=0):
    """Split union, pass 1: each row's threshold key, ties to take and (with `zero`, or on the lean path; else None)
    tie cutoff page, int32 `[B * R]` each; with `zero` > 0 also a `[B * R // group, zero]` int32 that the kernel
    zeroes (the one-pass union's state)."""
    B, R, P = scores.shape
    thr = torch.empty(B * R, dtype=torch.int32, device=scores.device)
    need = torch.empty_like(thr)
    lean = lean_config(P, 1, launch)
    block_p, warps, single = launch_config(P, 1, launch)
    cut_on = (lean or zero > 0) and single
    cut = torch.empty_like(thr) if cut_on else None
    state = torch.empty(B * R // group, max(zero, 1), dtype=torch.int32, device=scores.device) if zero else None
    _topk_thresholds_kernel[(B * R,)](
        scores, thr, need, cut if cut_on else thr, due_arg(due, thr), scores.stride(0), scores.stride(1),
        scores.stride(2), R, P, min(k, P), state if zero else thr, zero, BLOCK_P=block_p, SINGLE_TILE=single,
        RANK_BITS=launch.rank_bits, HAS_DUE=due is not None, TAIL=tail_config(P, 1, launch)[1], LEAN=lean,
        ONE_REDUCE=not interpreting(),
        CUT=cut_on, GROUP=group, ZERO_PAD=next_pow2(max(zero, 1)), num_warps=warps,
    )
    return (thr, need, cut, state) if zero else (thr, need, cut)


def _onepass_union(scores, out, k, group, launch, due=None):
    """Split union in two launches (`TopKLaunch.onepass_union`): the thresholds pass (with tie cutoffs), then one
    launch over (group, chunk of `union_chunk` pages) programs. Workspace: int32 thresholds, ties and cutoffs
    `[B * R]` and the groups' state `[B * R // group, 1 + NCHUNK]` (zeroed by the thresholds pass)."""
    B, R, P = scores.shape
    R_OUT = R // group
    chunk = min(launch.union_chunk, max(16, next_pow2(P)))
    nchunk = cdiv(P, chunk)
    thr, _, cut, state = _thresholds(scores, k, launch, due, group=group, zero=1 + nchunk)
    warps = max(1, min(launch.max_warps, next_pow2(group) * chunk // (32 * launch.keys_per_thread)))
    _union_onepass_kernel[(B * R_OUT, nchunk)](
        scores, thr, cut, state, out, due_arg(due, thr),
        scores.stride(0), scores.stride(1), scores.stride(2), out.stride(0), out.stride(1), out.stride(2),
        R_OUT, P, nchunk, out.shape[2], GROUP=group, CHUNK=chunk, NCHUNK_PAD=next_pow2(nchunk),
        HAS_DUE=due is not None, num_warps=warps,
    )


def _serial_union(scores, thr, need, out, group, launch, due=None):
    """Split union, pass 2: one program per group, looping over the row's tiles."""
    B, R, P = scores.shape
    flag = due_arg(due, thr)
    block_p, warps, single = launch_config(P, group, launch)
    _topk_union_kernel[(B * (R // group),)](
        scores, thr, need, out, flag,
        scores.stride(0), scores.stride(1), scores.stride(2), out.stride(0), out.stride(1), out.stride(2),
        R // group, P, out.shape[2],
        GROUP=group, GROUP_PAD=next_pow2(group), BLOCK_P=block_p, SINGLE_TILE=single, HAS_DUE=due is not None,
        TAIL=tail_config(P, group, launch)[1], num_warps=warps,
    )


def _chunked_union(scores, thr, need, out, group, launch, due=None):
    """Split union, pass 2 over (group, chunk) programs (`TopKLaunch.chunked_union_min_pages`): the same ids as
    `_serial_union`. Workspace: int32 tie counts `[B * R_OUT, NCHUNK, group]` and union counts `[B * R_OUT,
    NCHUNK]`, written and read only where the `due` flag is 1."""
    B, R, P = scores.shape
    R_OUT = R // group
    chunk = min(launch.union_chunk, max(16, next_pow2(P)))
    nchunk = cdiv(P, chunk)
    ties = torch.empty(B * R_OUT, nchunk, group, dtype=torch.int32, device=scores.device)
    cnt = torch.empty(B * R_OUT, nchunk, dtype=torch.int32, device=scores.device)
    flag = due_arg(due, thr)
    g_pad = next_pow2(group)
    warps = max(1, min(launch.max_warps, g_pad * chunk // (32 * launch.keys_per_thread)))
    grid = (B * R_OUT, nchunk)
    strides = (scores.stride(0), scores.stride(1), scores.stride(2))
    meta = dict(GROUP=group, GROUP_PAD=g_pad, CHUNK=chunk, HAS_DUE=due is not None, num_warps=warps)
    _union_ties_kernel[grid](scores, thr, ties, flag, *strides, R_OUT, P, nchunk, **meta)
    meta["NCHUNK_PAD"] = next_pow2(nchunk)
    _union_count_kernel[grid](scores, thr, need, ties, cnt, flag, *strides, R_OUT, P, nchunk, **meta)
    _union_write_kernel[grid](scores, thr, need, ties, cnt, out, flag, *strides,
                              out.stride(0), out.stride(1), out.stride(2), R_OUT, P, nchunk, out.shape[2], **meta)


# ------------------------------------------------------------------------------------------- top-p mask

def _check_top_p(log_mass, top_p, k, pos, page_size):
    if log_mass.dim() != 3 or log_mass.dtype != torch.float32:
        raise ValueError(f"log_mass must be fp32 [B, R, P], got {log_mass.dtype} {tuple(log_mass.shape)}")
    if not 0.0 < top_p <= 1.0 or k < 1:
        raise ValueError(f"need 0 < top_p <= 1 and k >= 1, got top_p={top_p}, k={k}")
    if pos is not None and (pos.numel() != 1 or pos.dtype.is_floating_point or pos.device != log_mass.device
                            or not isinstance(page_size, int) or page_size < 1):
        raise ValueError(f"pos must be one integer tensor on {log_mass.device} with an int page_size >= 1, got "
                         f"{pos.dtype} {tuple(pos.shape)} on {pos.device}, page_size={page_size!r}")


def top_p_mask_ref(log_mass, top_p: float, k: int, pos=None, page_size: int | None = None):
    """Scores `[B, R, P]` for `topk_pages` that keep, per row, the fewest pages whose mass reaches `top_p`.

    `log_mass` fp32 `[B, R, P]`: each page's log attention mass (`-inf`: never chosen), the last page the
    current one (always kept: `+inf` in the result). A page is kept when its mass is at least that of the
    page completing `top_p` of the row's total (ties kept); `topk_pages(result, k)` then caps it at `k`
    (`k` is only validated here: capping before or after choosing gives the same pages).
    `pos` (optional; one integer on the device: the captured step's filled length) with `page_size`: the current
    page is `(pos - 1) // page_size` instead of the last (rows over a whole allocation; no host sync).
    """
    _check_top_p(log_mass, top_p, k, pos, page_size)
    mass = torch.softmax(log_mass, dim=-1)
    srt = mass.sort(-1, descending=True).values
    before = srt.cumsum(-1) - srt  # mass of the better pages
    need = (before < top_p).sum(-1, keepdim=True).clamp(min=1)
    thr = srt.gather(-1, need - 1)
    keep = (mass >= thr) & (mass > 0)
    out = torch.where(keep, log_mass, float("-inf"))
    if pos is None:
        out[..., -1] = float("inf")
    else:
        out.index_fill_(-1, torch.div(pos.reshape(1) - 1, page_size, rounding_mode="floor"), float("inf"))
    return out


@triton.jit
def _top_p_mask_kernel(
    s_ptr, out_ptr, pos_ptr, stride_sr, stride_sp, stride_or, stride_op, P, top_p,
    BLOCK_P: tl.constexpr, PAGE: tl.constexpr, HAS_POS: tl.constexpr,
):
    top_p = tl.cast(top_p, tl.float32)  # inductor passes a Python float as fp64
    i_r = tl.program_id(0).to(tl.int64)
    o_p = tl.arange(0, BLOCK_P)
    m_p = o_p < P
    b_s = tl.load(s_ptr + i_r * stride_sr + o_p * stride_sp, mask=m_p, other=float("-inf"))
    b_key = tl.where(m_p, _order_key(b_s), INT_MIN)
    m_fin = b_key > NEG_INF_KEY
    b_max = tl.max(tl.where(m_fin, b_s, float("-inf")), axis=0)
    b_w = tl.where(m_fin, tl.exp(b_s - b_max), 0.0)
    target = top_p * tl.sum(b_w, axis=0)
    # The kept pages are those >= T, T the largest score whose pages at or above it hold `target`: a radix
    # search like topk_pages' with mass sums in place of counts (2 bits a pass, from the sign bit).
    i_lo = tl.zeros([], dtype=tl.int32) + INT_MIN
    for i_pass in tl.static_range(16):
        i_d = tl.full([], 1, tl.int32) << (30 - 2 * i_pass)  # wrapping int32 steps, as in topk_pages
        t1 = i_lo + i_d
        t2 = t1 + i_d
        t3 = t2 + i_d
        w1 = tl.sum(tl.where(b_key >= t1, b_w, 0.0), axis=0)
        w2 = tl.sum(tl.where(b_key >= t2, b_w, 0.0), axis=0)
        w3 = tl.sum(tl.where(b_key >= t3, b_w, 0.0), axis=0)
        i_digit = (w1 >= target).to(tl.int32) + (w2 >= target).to(tl.int32) + (w3 >= target).to(tl.int32)
        i_lo = i_lo + i_digit * i_d
    keep = (b_key >= i_lo) & (b_w > 0)
    b_out = tl.where(keep, b_s, float("-inf"))
    if HAS_POS:  # the current page from the device position (rows over a whole allocation)
        i_cur = (tl.load(pos_ptr).to(tl.int32) - 1) // PAGE
    else:
        i_cur = P - 1
    b_out = tl.where(o_p == i_cur, float("inf"), b_out)
    tl.store(out_ptr + i_r * stride_or + o_p * stride_op, b_out, mask=m_p)


def top_p_mask(log_mass, top_p: float, k: int, pos=None, page_size: int | None = None):
    """Triton twin of `top_p_mask_ref` (one program per row; rows up to 16384 pages). The mass sums are
    reduced in another order than the reference's sorted cumsum: a page whose cumulative mass lands within
    float rounding of `top_p` may be kept by one and not the other."""
    require_triton()
    _check_top_p(log_mass, top_p, k, pos, page_size)
    B, R, P = log_mass.shape
    if P > 16384:
        raise ValueError(f"top_p_mask takes rows of at most 16384 pages, got {P}")
    s = log_mass.reshape(B * R, P)
    out = torch.empty(B, R, P, dtype=torch.float32, device=log_mass.device)
    o = out.view(B * R, P)
    block = max(16, next_pow2(P))
    _top_p_mask_kernel[(B * R,)](s, o, pos if pos is not None else o, s.stride(0), s.stride(1), o.stride(0),
                                 o.stride(1), P, float(top_p), BLOCK_P=block, PAGE=page_size or 1,
                                 HAS_POS=pos is not None, num_warps=max(1, min(8, block // 512)))
    return out
