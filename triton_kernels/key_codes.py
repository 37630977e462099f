"""Per-token key codes on the page's own min/max grid, and page scores read from them (quest-hf "qcode").

Quest (arXiv 2406.10774) keeps the element-wise min/max of each page's keys. `encode_codes` adds, for every
token of a complete page, `BITS` bits per channel: the index of the nearest of `2^BITS` levels evenly spread
over `[kmin, kmax]` of that page and channel. `code_scores` then estimates every token's q.k from the codes
(`sum_c q_c * (kmin_c + code_c * (kmax_c - kmin_c) / (2^BITS - 1))`; at 1 bit the two levels are the
centres of the lower and upper half, `kmin + (kmax - kmin) * (1 + 2 * code) / 4`) and reduces each page to its best token
(`mode="max"`) or to its log attention mass (`mode="lse"`, for top-p budgets). At 2 bits, D=128 and fp16
keys the codes are 32 bytes a token: as many as Quest's min/max metadata at page_size 16.

Layout: codes uint8 `[B, H_kv, C, D * BITS // 8]`, channel `c` in byte `c // (8 // BITS)` at bit
`BITS * (c % (8 // BITS))`; slot order like the keys. Codes of the current (partial) page are never read.
"""
import torch

from ._common import check_cache, check_query, next_pow2, require_triton, tl, triton

__all__ = ["encode_codes", "encode_codes_ref", "code_scores", "code_scores_ref", "CODE_BITS", "MODES"]

CODE_BITS = (1, 2, 4)
MODES = ("max", "lse")


def code_bytes(head_dim: int, bits: int) -> int:
    """Bytes of one token's codes."""
    return head_dim * bits // 8


def _check_codes(k_cache, kmin, codes, bits):
    B, H, C, D = k_cache.shape
    if bits not in CODE_BITS:
        raise ValueError(f"bits must be one of {CODE_BITS}, got {bits}")
    if (D * bits) % 8:
        raise ValueError(f"head_dim {D} x {bits} bits is not a whole number of bytes")
    if codes.dtype != torch.uint8 or codes.shape != (B, H, C, code_bytes(D, bits)):
        raise ValueError(f"codes must be uint8 [B={B}, H_kv={H}, C={C}, {code_bytes(D, bits)}], "
                         f"got {codes.dtype} {tuple(codes.shape)}")
    if codes.stride(-1) != 1:
        raise ValueError("codes must be contiguous in the last dimension")
    return B, H, C, D, C // kmin.shape[2]


# ---------------------------------------------------------------------------------------------- encoding

def encode_codes_ref(k_cache, kmin, kmax, codes, page_start: int, num_pages: int, bits: int = 2) -> None:
    """Write the codes of pages `[page_start, page_start + num_pages)` into `codes` (in place).

    k_cache `[B, H_kv, C, D]`; kmin/kmax `[B, H_kv, C // S, D]` (the pages must be complete: their min/max
    final); codes uint8 `[B, H_kv, C, D * bits // 8]`. Padding tokens get codes too (scores mask them by
    `valid`); an empty page (min > max) gets zeros.
    """
    B, H, C, D, S = _check_codes(k_cache, kmin, codes, bits)
    if num_pages <= 0:
        return
    if page_start < 0 or page_start + num_pages > kmin.shape[2]:
        raise ValueError(f"pages [{page_start}, {page_start + num_pages}) outside the {kmin.shape[2]} of the cache")
    p0, p1 = page_start, page_start + num_pages
    k = k_cache[:, :, p0 * S:p1 * S].float().reshape(B, H, num_pages, S, D)
    lo, hi = kmin[:, :, p0:p1, None].float(), kmax[:, :, p0:p1, None].float()
    levels = (1 << bits) - 1
    span = hi - lo
    ok = span > 0  # also False for empty pages (inf - inf is NaN, -inf - inf is -inf)
    inv = torch.where(ok, levels / torch.where(ok, span, 1.0), 0.0)
    x = torch.where(ok, (k - lo) * inv, 0.0)
    # Round half up, like the kernel (torch.round would round half to even).
    q = torch.floor(x + 0.5).clamp(0, levels).to(torch.int32).reshape(B, H, num_pages * S, D)
    per = 8 // bits
    q = q.reshape(B, H, num_pages * S, D // per, per) << (torch.arange(per, device=q.device) * bits)
    codes[:, :, p0 * S:p1 * S] = q.sum(-1).to(torch.uint8)


@triton.jit
def _encode_codes_kernel(
    k_ptr, lo_ptr, hi_ptr, c_ptr,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_lb, stride_lh, stride_lp, stride_ld,
    stride_cb, stride_ch, stride_cc,
    H_KV, PAGE_START,
    D: tl.constexpr, PAGE: tl.constexpr, BITS: tl.constexpr,
):
    i_bh = tl.program_id(0).to(tl.int64)
    i_p = PAGE_START + tl.program_id(1)
    i_b = i_bh // H_KV
    i_h = i_bh % H_KV
    PER: tl.constexpr = 8 // BITS
    NB: tl.constexpr = D // PER
    LEVELS: tl.constexpr = (1 << BITS) - 1
    o_s = tl.arange(0, PAGE)
    o_d = tl.arange(0, D)
    p_lo = lo_ptr + i_b * stride_lb + i_h * stride_lh + i_p * stride_lp + o_d * stride_ld
    b_lo = tl.load(p_lo).to(tl.float32)
    b_hi = tl.load(hi_ptr + i_b * stride_lb + i_h * stride_lh + i_p * stride_lp + o_d * stride_ld).to(tl.float32)
    b_span = b_hi - b_lo
    m_ok = b_span > 0
    b_inv = tl.where(m_ok, LEVELS / tl.where(m_ok, b_span, 1.0), 0.0)
    o_slot = i_p * PAGE + o_s
    b_k = tl.load(k_ptr + i_b * stride_kb + i_h * stride_kh + o_slot[:, None] * stride_kc
                  + o_d[None, :] * stride_kd).to(tl.float32)
    b_x = tl.where(m_ok[None, :], (b_k - b_lo[None, :]) * b_inv[None, :], 0.0)
    b_q = tl.minimum(tl.maximum(tl.floor(b_x + 0.5), 0.0), LEVELS).to(tl.int32)
    b_q = tl.reshape(b_q, [PAGE, NB, PER]) << (tl.arange(0, PER) * BITS)[None, None, :]
    b_byte = tl.sum(b_q, axis=2).to(tl.uint8)
    o_byte = tl.arange(0, NB)
    tl.store(c_ptr + i_b * stride_cb + i_h * stride_ch + o_slot[:, None] * stride_cc + o_byte[None, :], b_byte)


def encode_codes(k_cache, kmin, kmax, codes, page_start: int, num_pages: int, bits: int = 2) -> None:
    """Triton twin of `encode_codes_ref`: one program per (batch x KV head, page)."""
    require_triton()
    B, H, C, D, S = _check_codes(k_cache, kmin, codes, bits)
    if num_pages <= 0:
        return
    if page_start < 0 or page_start + num_pages > kmin.shape[2]:
        raise ValueError(f"pages [{page_start}, {page_start + num_pages}) outside the {kmin.shape[2]} of the cache")
    if D & (D - 1) or D < 16:
        raise ValueError(f"the Triton path needs a power-of-two head_dim >= 16, got {D}")
    _encode_codes_kernel[(B * H, num_pages)](
        k_cache, kmin, kmax, codes,
        *k_cache.stride(), *kmin.stride(), codes.stride(0), codes.stride(1), codes.stride(2),
        H, page_start,
        D=D, PAGE=S, BITS=bits, num_warps=4,
    )


# ----------------------------------------------------------------------------------------------- scoring

def _check_score(q, k_cache, kmin, kmax, codes, valid, seq_len, page_size, window_start, bits, mode):
    B, H, C, D = check_cache(k_cache, k_cache, kmin, kmax, valid)
    G = check_query(q, H, D, B)
    _, _, _, _, S = _check_codes(k_cache, kmin, codes, bits)
    if S != page_size:
        raise ValueError(f"kmin holds pages of {S} slots, page_size says {page_size}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not 1 <= seq_len <= C:
        raise ValueError(f"seq_len {seq_len} must be in [1, {C}]")
    if not 0 <= window_start < seq_len:
        raise ValueError(f"window_start {window_start} must be in [0, seq_len={seq_len})")
    return B, H, G, D, -(-seq_len // page_size)


def code_scores_ref(q, k_cache, kmin, kmax, codes, valid, seq_len: int, page_size: int, window_start: int = 0,
                    bits: int = 2, mode: str = "max", scale: float = 1.0):
    """Page scores `[B, H_q, P]` fp32 (`P = ceil(seq_len / S)`) of one decode query from the key codes.

    q `[B, H_q, D]`; k_cache `[B, H_kv, C, D]`; kmin/kmax `[B, H_kv, C // S, D]`; codes from `encode_codes`
    for every complete page; valid `[B, C]`. Each token's q.k is estimated from its codes (the current page
    `P - 1` uses its exact keys); tokens that are padding, `>= seq_len` or `< window_start` are left out.
    `mode="max"`: a page's best estimated q.k, the current page `+inf`. `mode="lse"`: the page's log
    attention mass `log sum exp(scale * q.k)` (current page included, exact). Pages with no token: `-inf`.
    """
    B, H, G, D, P = _check_score(q, k_cache, kmin, kmax, codes, valid, seq_len, page_size, window_start, bits, mode)
    S, N = page_size, P * page_size
    per, levels = 8 // bits, (1 << bits) - 1
    raw = codes[:, :, :N].long()
    shifts = torch.arange(per, device=q.device) * bits
    c = ((raw[..., None] >> shifts) & levels).reshape(B, H, N, D).float()
    lo, hi = kmin[:, :, :P].float(), kmax[:, :, :P].float()
    grid = hi >= lo  # False on empty pages (+inf/-inf): their tokens are padding, masked below
    step = torch.where(grid, (hi - lo) / levels, 0.0)
    lo = torch.where(grid, lo, 0.0)
    if bits == 1:  # two levels: the centres of the page's lower and upper half, not its corners
        lo, step = lo + 0.25 * step, 0.5 * step
    k_est = lo.repeat_interleave(S, 2) + c * step.repeat_interleave(S, 2)  # [B, H, N, D]
    cur = slice((P - 1) * S, N)
    k_est[:, :, cur] = k_cache[:, :, cur].float()
    s = torch.einsum("bhgd,bhnd->bhgn", q.float().reshape(B, H, G, D), k_est)
    slot = torch.arange(N, device=q.device)
    ok = valid[:, :N] & (slot < seq_len) & (slot >= window_start)
    s = s.masked_fill(~ok[:, None, None], float("-inf")).reshape(B, H, G, P, S)
    if mode == "max":
        out = s.amax(-1)
        out[..., P - 1] = float("inf")
    else:
        out = torch.logsumexp(s * scale, -1)
    return out.reshape(B, H * G, P)


@triton.jit
def _code_scores_kernel(
    q_ptr, k_ptr, lo_ptr, hi_ptr, c_ptr, valid_ptr, out_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_lb, stride_lh, stride_lp, stride_ld,
    stride_cb, stride_ch, stride_cc,
    stride_vab, stride_vac,
    stride_ob, stride_oh, stride_op,
    H_KV, P, SEQ_LEN, WINDOW_START, scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_P: tl.constexpr,
    BITS: tl.constexpr, USE_LSE: tl.constexpr,
):
    i_bh = tl.program_id(0).to(tl.int64)
    i_b = i_bh // H_KV
    i_h = i_bh % H_KV
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    N: tl.constexpr = BLOCK_P * PAGE
    o_g = tl.arange(0, G_PAD)
    o_d = tl.arange(0, D)
    o_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, N)
    o_slot = tl.program_id(1) * N + o_n
    o_pn = o_slot // PAGE  # page of each token
    m_g = o_g < G
    b_q = tl.load(q_ptr + i_b * stride_qb + (i_h * G + o_g[:, None]) * stride_qh + o_d[None, :] * stride_qd,
                  mask=m_g[:, None], other=0.0).to(tl.float32)
    # Per token: its page's grid (re-read per token from L1: a page row is D elements) and its codes.
    m_n = o_pn < P
    p_lo = lo_ptr + i_b * stride_lb + i_h * stride_lh + o_pn[:, None] * stride_lp + o_d[None, :] * stride_ld
    b_lo = tl.load(p_lo, mask=m_n[:, None], other=0.0).to(tl.float32)
    b_hi = tl.load(hi_ptr + i_b * stride_lb + i_h * stride_lh + o_pn[:, None] * stride_lp + o_d[None, :] * stride_ld,
                   mask=m_n[:, None], other=0.0).to(tl.float32)
    # A page is empty when every channel has min > max (+inf/-inf); its tokens are all padding anyway.
    m_grid = b_hi >= b_lo
    b_step = tl.where(m_grid, (b_hi - b_lo) / LEVELS, 0.0)
    b_lo = tl.where(m_grid, b_lo, 0.0)
    if BITS == 1:  # two levels: the centres of the page's lower and upper half, not its corners
        b_lo = b_lo + 0.25 * b_step
        b_step = 0.5 * b_step
    m_cur = o_pn == P - 1
    m_code = m_n & (o_pn < P - 1)
    b_byte = tl.load(c_ptr + i_b * stride_cb + i_h * stride_ch + o_slot[:, None] * stride_cc + (o_d // PER)[None, :],
                     mask=m_code[:, None], other=0).to(tl.int32)
    b_code = (b_byte >> ((o_d % PER) * BITS)[None, :]) & LEVELS
    b_k = b_lo + b_code.to(tl.float32) * b_step
    # The current page's codes are not written yet: read its exact keys (at most one page, one program).
    b_kx = tl.load(k_ptr + i_b * stride_kb + i_h * stride_kh + o_slot[:, None] * stride_kc + o_d[None, :] * stride_kd,
                   mask=(m_cur & (o_slot < SEQ_LEN))[:, None], other=0.0).to(tl.float32)
    b_k = tl.where(m_cur[:, None], b_kx, b_k)
    b_s = tl.dot(b_k, tl.trans(b_q), input_precision="ieee")  # [N, G_PAD]
    b_val = tl.load(valid_ptr + i_b * stride_vab + o_slot * stride_vac, mask=o_slot < SEQ_LEN, other=0)
    m_tok = (b_val != 0) & (o_slot < SEQ_LEN) & (o_slot >= WINDOW_START)
    b_s = tl.where(m_tok[:, None], b_s, float("-inf"))
    b_s = tl.reshape(b_s, [BLOCK_P, PAGE, G_PAD])
    b_m = tl.max(b_s, axis=1)  # [BLOCK_P, G_PAD]
    if USE_LSE:
        b_m = b_m * scale
        b_safe = tl.where(b_m > float("-inf"), b_m, 0.0)
        b_l = tl.sum(tl.exp(b_s * scale - b_safe[:, None, :]), axis=1)
        b_out = tl.where(b_m > float("-inf"), b_safe + tl.log(b_l), float("-inf"))
    else:
        b_out = tl.where((o_p == P - 1)[:, None], float("inf"), b_m)
    p_out = out_ptr + i_b * stride_ob + (i_h * G + o_g[None, :]) * stride_oh + o_p[:, None] * stride_op
    tl.store(p_out, b_out, mask=(o_p < P)[:, None] & m_g[None, :])


# Pages per program: 8 pages of 16 tokens = a 128 x D tile of estimated keys; at 32K and 8 KV heads this is
# 256 programs per KV head row.
BLOCK_P = 8


def code_scores(q, k_cache, kmin, kmax, codes, valid, seq_len: int, page_size: int, window_start: int = 0,
                bits: int = 2, mode: str = "max", scale: float = 1.0):
    """Triton twin of `code_scores_ref`: one program per (batch x KV head, BLOCK_P pages), all G query heads."""
    require_triton()
    B, H, G, D, P = _check_score(q, k_cache, kmin, kmax, codes, valid, seq_len, page_size, window_start, bits, mode)
    if D & (D - 1) or D < 16:
        raise ValueError(f"the Triton path needs a power-of-two head_dim >= 16, got {D}")
    out = torch.empty(B, H * G, P, dtype=torch.float32, device=q.device)
    block_p = max(1, min(BLOCK_P, 256 // page_size))
    _code_scores_kernel[(B * H, triton.cdiv(P, block_p))](
        q, k_cache, kmin, kmax, codes, valid, out,
        *q.stride(), *k_cache.stride(), *kmin.stride(), codes.stride(0), codes.stride(1), codes.stride(2),
        *valid.stride(), *out.stride(),
        H, P, seq_len, window_start, scale,
        G=G, G_PAD=max(16, next_pow2(G)), D=D, PAGE=page_size, BLOCK_P=block_p, BITS=bits,
        USE_LSE=mode == "lse", num_warps=4,
    )
    return out
