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
from dataclasses import dataclass

import torch

from ._common import cdiv, check_cache, check_query, next_pow2, require_triton, tl, triton

__all__ = ["encode_codes", "encode_codes_ref", "encode_codes_at", "encode_codes_at_ref", "code_scores", "code_scores_ref",
           "CODE_BITS", "MODES"]

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
    H_KV, PAGE_START, pos_ptr,
    D: tl.constexpr, PAGE: tl.constexpr, BITS: tl.constexpr, AT_POS: tl.constexpr,
):
    i_bh = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, PAGE)
    o_d = tl.arange(0, D)
    if AT_POS:  # the page ending at the device position pos, if one does (else every access is masked off)
        i_pos = tl.load(pos_ptr).to(tl.int64)
        i_do = ((i_pos % PAGE == 0) & (i_pos > 0)).to(tl.int32)
        i_p = tl.maximum(i_pos // PAGE - 1, 0)
    else:
        i_do = 1
        i_p = PAGE_START + tl.program_id(1)
    m_do = (o_d * 0 + i_do) != 0  # [D]
    i_b = i_bh // H_KV
    i_h = i_bh % H_KV
    PER: tl.constexpr = 8 // BITS
    NB: tl.constexpr = D // PER
    LEVELS: tl.constexpr = (1 << BITS) - 1
    p_lo = lo_ptr + i_b * stride_lb + i_h * stride_lh + i_p * stride_lp + o_d * stride_ld
    b_lo = tl.load(p_lo, mask=m_do, other=0.0).to(tl.float32)
    b_hi = tl.load(hi_ptr + i_b * stride_lb + i_h * stride_lh + i_p * stride_lp + o_d * stride_ld, mask=m_do,
                   other=0.0).to(tl.float32)
    b_span = b_hi - b_lo
    m_ok = b_span > 0
    b_inv = tl.where(m_ok, LEVELS / tl.where(m_ok, b_span, 1.0), 0.0)
    o_slot = i_p * PAGE + o_s
    b_k = tl.load(k_ptr + i_b * stride_kb + i_h * stride_kh + o_slot[:, None] * stride_kc
                  + o_d[None, :] * stride_kd, mask=m_do[None, :], other=0.0).to(tl.float32)
    b_x = tl.where(m_ok[None, :], (b_k - b_lo[None, :]) * b_inv[None, :], 0.0)
    b_q = tl.minimum(tl.maximum(tl.floor(b_x + 0.5), 0.0), LEVELS).to(tl.int32)
    b_q = tl.reshape(b_q, [PAGE, NB, PER]) << (tl.arange(0, PER) * BITS)[None, None, :]
    b_byte = tl.sum(b_q, axis=2).to(tl.uint8)
    o_byte = tl.arange(0, NB)
    tl.store(c_ptr + i_b * stride_cb + i_h * stride_ch + o_slot[:, None] * stride_cc + o_byte[None, :], b_byte,
             mask=(o_byte * 0 + i_do)[None, :] != 0)


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
        H, page_start, codes,  # (pos_ptr unused)
        D=D, PAGE=S, BITS=bits, AT_POS=False, num_warps=4,
    )


def encode_codes_at_ref(k_cache, kmin, kmax, codes, pos, bits: int = 2) -> None:
    """Encode the page that ends at the device position `pos` (a 0-dim integer tensor: the filled length),
    when `pos` is a positive multiple of the page size; otherwise leave `codes` as they are. No host sync
    (the captured decode step calls it after every append)."""
    B, H, C, D, S = _check_codes(k_cache, kmin, codes, bits)
    page = (pos.reshape(1) // S - 1).clamp(min=0)
    slots = page * S + torch.arange(S, device=pos.device)
    k = k_cache.index_select(2, slots).float()                                   # [B, H, S, D]
    lo, hi = kmin.index_select(2, page).float(), kmax.index_select(2, page).float()
    levels = (1 << bits) - 1
    span = hi - lo
    ok = span > 0
    inv = torch.where(ok, levels / torch.where(ok, span, 1.0), 0.0)
    x = torch.where(ok, (k - lo) * inv, 0.0)
    q = torch.floor(x + 0.5).clamp(0, levels).to(torch.int32)
    per = 8 // bits
    q = (q.reshape(B, H, S, D // per, per) << (torch.arange(per, device=q.device) * bits)).sum(-1).to(torch.uint8)
    do = (pos % S == 0) & (pos > 0)
    codes.index_copy_(2, slots, torch.where(do, q, codes.index_select(2, slots)))


def encode_codes_at(k_cache, kmin, kmax, codes, pos, bits: int = 2) -> None:
    """Triton twin of `encode_codes_at_ref`: one program per (batch x KV head), the position read on device."""
    require_triton()
    B, H, C, D, S = _check_codes(k_cache, kmin, codes, bits)
    if D & (D - 1) or D < 16:
        raise ValueError(f"the Triton path needs a power-of-two head_dim >= 16, got {D}")
    _encode_codes_kernel[(B * H, 1)](
        k_cache, kmin, kmax, codes,
        *k_cache.stride(), *kmin.stride(), codes.stride(0), codes.stride(1), codes.stride(2),
        H, 0, pos,
        D=D, PAGE=S, BITS=bits, AT_POS=True, num_warps=4,
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
                    bits: int = 2, mode: str = "max", scale: float = 1.0, pages=None, out=None, pos=None):
    """Page scores `[B, H_q, P]` fp32 (`P = ceil(seq_len / S)`) of one decode query from the key codes.

    q `[B, H_q, D]`; k_cache `[B, H_kv, C, D]`; kmin/kmax `[B, H_kv, C // S, D]`; codes from `encode_codes`
    for every complete page; valid `[B, C]`. Each token's q.k is estimated from its codes (the current page
    `P - 1` uses its exact keys); tokens that are padding, `>= seq_len` or `< window_start` are left out.
    `mode="max"`: a page's best estimated q.k, the current page `+inf`. `mode="lse"`: the page's log
    attention mass `log sum exp(scale * q.k)` (current page included, exact). Pages with no token: `-inf`.

    `pages` (optional) int32 `[B, H_q, N]`: score only these pages of each query head (ids outside
    `[0, P - 1)`, e.g. -1 padding, are skipped); every other page is `-inf` but the current one, as above.
    Only the listed pages' codes and min/max are read (the second stage of a two-stage selector). `out`
    (optional, with `pages`): fp32 `[B, H_q, P]` written in place and returned instead of a fresh `-inf`
    tensor: only the listed pages' entries and the current page's are written, the rest is left as it is
    (e.g. `-inf` from `topk_pages(..., mask_rest=True)`).

    `pos` (optional; one integer on q's device: the captured step's filled length): page `(pos - 1) // S`,
    whose codes are not written yet, scores `+inf` too under `mode="max"` (where it is scored: with `pages`, when
    listed), and its exact log mass from its keys under `mode="lse"` (whole rows only), as page `P - 1` does: rows
    over a whole allocation (`seq_len` its capacity) with no host length.
    """
    B, H, G, D, P = _check_score(q, k_cache, kmin, kmax, codes, valid, seq_len, page_size, window_start, bits, mode)
    _check_code_pos(pos, mode, q.device, pages)
    if pages is not None:
        out = _listed_code_scores_ref(q, k_cache, kmin, kmax, codes, valid, seq_len, page_size, window_start, bits,
                                      mode, scale, _check_pages(pages, B, G * H), _check_out(out, B, G * H, P), P)
        if pos is not None:
            cur = torch.div(pos - 1, page_size, rounding_mode="floor").view(1, 1, 1).expand(B, G * H, 1)
            listed = (pages == cur).any(-1, keepdim=True)
            out.scatter_(-1, cur, torch.where(listed, float("inf"), out.gather(-1, cur)))
        return out
    if out is not None:
        raise ValueError("out= is only for scores of listed pages (pages=...)")
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
    slot_page = torch.arange(N, device=q.device) // S
    exact = slot_page == P - 1  # the current page's codes are not written: its exact keys
    if pos is not None and mode == "lse":
        exact = exact | (slot_page == torch.div(pos.reshape(1) - 1, S, rounding_mode="floor"))
    k_est = torch.where(exact[:, None], k_cache[:, :, :N].float(), k_est)
    s = torch.einsum("bhgd,bhnd->bhgn", q.float().reshape(B, H, G, D), k_est)
    slot = torch.arange(N, device=q.device)
    ok = valid[:, :N] & (slot < seq_len) & (slot >= window_start)
    s = s.masked_fill(~ok[:, None, None], float("-inf")).reshape(B, H, G, P, S)
    if mode == "max":
        out = s.amax(-1)
        out[..., P - 1] = float("inf")
    else:
        out = torch.logsumexp(s * scale, -1)
    if pos is not None and mode == "max":
        out.index_fill_(-1, torch.div(pos - 1, page_size, rounding_mode="floor").view(1), float("inf"))
    return out.reshape(B, H * G, P)


def _check_code_pos(pos, mode, device, pages=None):
    if pos is None:
        return
    if mode == "lse" and pages is not None:
        raise ValueError("pos= with mode='lse' scores whole rows (pages=None): the current page's exact mass "
                         "is found from the device position")
    if pos.numel() != 1 or pos.dtype.is_floating_point or pos.device != device:
        raise ValueError(f"pos must be one integer tensor on {device}, got {pos.dtype} {tuple(pos.shape)} on {pos.device}")


def _check_pages(pages, B, Hq):
    if pages.dtype != torch.int32 or pages.dim() != 3 or pages.shape[:2] != (B, Hq):
        raise ValueError(f"pages must be int32 [B={B}, H_q={Hq}, N], got {pages.dtype} {tuple(pages.shape)}")
    return pages


def _check_out(out, B, Hq, P):
    if out is not None and (out.dtype != torch.float32 or out.shape != (B, Hq, P)):
        raise ValueError(f"out must be fp32 [B={B}, H_q={Hq}, P={P}], got {out.dtype} {tuple(out.shape)}")
    return out


def _listed_code_scores_ref(q, k_cache, kmin, kmax, codes, valid, seq_len, page_size, window_start, bits, mode,
                            scale, pages, out, P):
    """`code_scores_ref(pages=...)`: gathers the listed pages' codes and min/max only."""
    B, H, C, D = k_cache.shape
    Hq, N, S = q.shape[1], pages.shape[-1], page_size
    G = Hq // H
    per, levels = 8 // bits, (1 << bits) - 1
    listed = (pages >= 0) & (pages < P - 1)
    p = torch.where(listed, pages, 0).long()                               # [B, Hq, N]
    b = torch.arange(B, device=q.device)[:, None, None]
    h = (torch.arange(Hq, device=q.device) // G)[None, :, None]
    raw = codes.view(B, H, C // S, S, codes.shape[-1])[b, h, p].long()     # [B, Hq, N, S, bytes]
    shifts = torch.arange(per, device=q.device) * bits
    c = ((raw[..., None] >> shifts) & levels).reshape(B, Hq, N, S, D).float()
    lo, hi = kmin[b, h, p].float(), kmax[b, h, p].float()                  # [B, Hq, N, D]
    grid = hi >= lo
    step = torch.where(grid, (hi - lo) / levels, 0.0)
    lo = torch.where(grid, lo, 0.0)
    if bits == 1:  # the centres of the page's lower and upper half, as code_scores_ref
        lo, step = lo + 0.25 * step, 0.5 * step
    qf = q.float()[:, :, None]
    s = (lo * qf).sum(-1)[..., None] + (c * (step * qf)[..., None, :]).sum(-1)  # [B, Hq, N, S]
    slot = p[..., None] * S + torch.arange(S, device=q.device)
    ok = valid.gather(1, slot.reshape(B, -1)).reshape(slot.shape) & (slot >= window_start) & listed[..., None]
    s = s.masked_fill(~ok, float("-inf"))
    est = s.amax(-1) if mode == "max" else torch.logsumexp(s * scale, -1)
    if out is None:
        out = q.new_full((B, Hq, P), float("-inf"), dtype=torch.float32)
    # Unlisted entries land on the current page, written last.
    out.scatter_(-1, torch.where(listed, p, P - 1), torch.where(listed, est, 0.0))
    if mode == "max":
        out[..., P - 1] = float("inf")
    else:  # the current page's exact log mass, as without a list
        cur = slice((P - 1) * S, P * S)
        k = k_cache[:, :, cur].float().repeat_interleave(G, 1)                # [B, Hq, S, D]
        slot = torch.arange((P - 1) * S, P * S, device=q.device)
        ok = valid[:, cur][:, None] & (slot < seq_len) & (slot >= window_start)
        sc = torch.einsum("bqd,bqsd->bqs", q.float(), k).masked_fill(~ok, float("-inf"))
        out[..., P - 1] = torch.logsumexp(sc * scale, -1)
    return out


@triton.jit
def _current_page(p_q, p_k, p_val, p_out, stride_qd, stride_kc, stride_kd, stride_vac, I_PAGE, SEQ_LEN, WINDOW_START,
                  scale, D: tl.constexpr, PAGE: tl.constexpr, USE_LSE: tl.constexpr):
    """Page I_PAGE, whose codes are not written yet: +inf, or its exact log mass from the keys."""
    if USE_LSE:
        o_d = tl.arange(0, D)
        o_slot = I_PAGE * PAGE + tl.arange(0, PAGE)
        m_in = o_slot < SEQ_LEN
        b_k = tl.load(p_k + o_slot[:, None] * stride_kc + o_d[None, :] * stride_kd, mask=m_in[:, None],
                      other=0.0).to(tl.float32)
        b_val = tl.load(p_val + o_slot * stride_vac, mask=m_in, other=0)
        m_tok = (b_val != 0) & m_in & (o_slot >= WINDOW_START)
        b_q = tl.load(p_q + o_d * stride_qd).to(tl.float32)
        b_s = tl.where(m_tok, tl.sum(b_k * b_q[None, :], axis=1) * scale, float("-inf"))
        b_m = tl.max(b_s, axis=0)
        b_safe = tl.where(b_m > float("-inf"), b_m, 0.0)
        b_l = tl.sum(tl.exp(b_s - b_safe), axis=0)
        tl.store(p_out, tl.where(b_m > float("-inf"), b_safe + tl.log(tl.maximum(b_l, 1.0)), float("-inf")))
    else:
        tl.store(p_out, float("inf"))


@triton.jit
def _force_pos(b_out, m_p, o_p, pos_ptr, PAGE: tl.constexpr, HAS_POS: tl.constexpr, USE_LSE: tl.constexpr):
    """The page of the captured step's last written token (read on the device), whose codes are unwritten: +inf
    (max), or left to the current-page program, which stores its exact mass (lse). Returns (scores, store mask)."""
    if HAS_POS:
        m_cur = o_p == (tl.load(pos_ptr).to(tl.int32) - 1) // PAGE
        if USE_LSE:
            m_p = m_p & ~m_cur
        else:
            b_out = tl.where(m_cur, float("inf"), b_out)
    return b_out, m_p


@triton.jit
def _current_pages(p_q, p_k, p_val, p_out, pos_ptr, stride_qd, stride_kc, stride_kd, stride_vac, stride_op, P, SEQ_LEN,
                   WINDOW_START, scale, D: tl.constexpr, PAGE: tl.constexpr, USE_LSE: tl.constexpr,
                   HAS_POS: tl.constexpr):
    """The extra program of a row: page P - 1, and under lse with a device position the page it is in."""
    _current_page(p_q, p_k, p_val, p_out + (P - 1) * stride_op, stride_qd, stride_kc, stride_kd, stride_vac, P - 1,
                  SEQ_LEN, WINDOW_START, scale, D, PAGE, USE_LSE)
    if HAS_POS and USE_LSE:
        i_cur = (tl.load(pos_ptr).to(tl.int32) - 1) // PAGE
        _current_page(p_q, p_k, p_val, p_out + i_cur * stride_op, stride_qd, stride_kc, stride_kd, stride_vac, i_cur,
                      SEQ_LEN, WINDOW_START, scale, D, PAGE, USE_LSE)


@triton.jit
def _query_row(q_ptr, out_ptr, stride_qb, stride_qh, stride_ob, stride_oh, H_Q, G: tl.constexpr):
    """(batch, query head, KV head, q row pointer, score row pointer) of a scoring program (axis 0)."""
    i_bq = tl.program_id(0).to(tl.int64)
    i_b = i_bq // H_Q
    i_q = i_bq % H_Q
    return i_b, i_q, i_q // G, q_ptr + i_b * stride_qb + i_q * stride_qh, out_ptr + i_b * stride_ob + i_q * stride_oh


@triton.jit
def _block_pages(o_n, p_list, stride_nn, N_PAGES, P, HAS_PAGES: tl.constexpr):
    """(page ids, mask) of a block's positions o_n: the pages themselves, or entries of the row's page list
    (-1 and ids outside [0, P - 1) masked; their scores then scatter to those ids)."""
    if HAS_PAGES:
        o_p = tl.load(p_list + o_n * stride_nn, mask=o_n < N_PAGES, other=-1)
        m_p = (o_p >= 0) & (o_p < P - 1)
        return tl.where(m_p, o_p, 0), m_p
    else:
        return o_n, o_n < P - 1


@triton.jit
def _code_scores_kernel(
    q_ptr, k_ptr, lo_ptr, hi_ptr, c_ptr, valid_ptr, out_ptr, pages_ptr, pos_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_lb, stride_lh, stride_lp, stride_ld,
    stride_cb, stride_ch, stride_cc,
    stride_vab, stride_vac,
    stride_ob, stride_oh, stride_op,
    stride_nb, stride_nh, stride_nn,
    H_Q, P, SEQ_LEN, WINDOW_START, N_BLOCKS, N_PAGES, ONE, scale,
    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_P: tl.constexpr, BITS: tl.constexpr,
    USE_LSE: tl.constexpr, HAS_PAGES: tl.constexpr, HAS_POS: tl.constexpr,
):
    # One query head per program: the G heads of a KV group are neighbouring programs, so the codes they share
    # come from L2 after the first. (Looping over the heads in one program would hold G heads' accumulators, or
    # the unpacked codes, in registers.)
    scale = tl.cast(scale, tl.float32)  # inductor passes a Python float as fp64
    i_pb = tl.program_id(1)
    i_b, i_q, i_h, p_q, p_out = _query_row(q_ptr, out_ptr, stride_qb, stride_qh, stride_ob, stride_oh, H_Q, G)
    if i_pb == N_BLOCKS:
        _current_pages(p_q, k_ptr + i_b * stride_kb + i_h * stride_kh, valid_ptr + i_b * stride_vab, p_out, pos_ptr,
                       stride_qd, stride_kc, stride_kd, stride_vac, stride_op, P, SEQ_LEN, WINDOW_START, scale, D,
                       PAGE, USE_LSE, HAS_POS)
    else:
        # BLOCK_P complete pages (all before P - 1). Codes are read as bytes [PAGE, BLOCK_P, NB] (NB = D / PER
        # bytes a token) and never expanded to channels: code k of byte j is channel PER * j + k, so for each k
        # the page grid enters as a [BLOCK_P, NB] tile of channels PER * j + k, broadcast over the page's tokens.
        PER: tl.constexpr = 8 // BITS
        NB: tl.constexpr = D // PER
        LEVELS: tl.constexpr = (1 << BITS) - 1
        o_p, m_p = _block_pages(i_pb * BLOCK_P + tl.arange(0, BLOCK_P), pages_ptr + i_b * stride_nb + i_q * stride_nh,
                                stride_nn, N_PAGES, P, HAS_PAGES)
        o_j = tl.arange(0, NB)
        o_slot = o_p[None, :] * PAGE + tl.arange(0, PAGE)[:, None]  # [PAGE, BLOCK_P]
        b_val = tl.load(valid_ptr + i_b * stride_vab + o_slot * stride_vac, mask=m_p[None, :], other=0)
        m_tok = (b_val != 0) & m_p[None, :] & (o_slot >= WINDOW_START)  # complete pages: all below SEQ_LEN
        b_byte = tl.load(c_ptr + i_b * stride_cb + i_h * stride_ch + o_slot[:, :, None] * stride_cc
                         + o_j[None, None, :], mask=m_p[None, :, None], other=0).to(tl.int32)
        p_lo = lo_ptr + i_b * stride_lb + i_h * stride_lh + o_p[:, None] * stride_lp + (PER * o_j)[None, :] * stride_ld
        p_hi = hi_ptr + i_b * stride_lb + i_h * stride_lh + o_p[:, None] * stride_lp + (PER * o_j)[None, :] * stride_ld
        b_acc = tl.zeros([PAGE, BLOCK_P, NB], dtype=tl.float32)
        b_c0 = tl.zeros([BLOCK_P, NB], dtype=tl.float32)
        for k in tl.static_range(PER):
            # Channels PER * j + k of the grid: strided loads, but the lines are shared by the PER passes (L1).
            b_lo = tl.load(p_lo + k * stride_ld, mask=m_p[:, None], other=0.0).to(tl.float32)
            b_hi = tl.load(p_hi + k * stride_ld, mask=m_p[:, None], other=0.0).to(tl.float32)
            b_q = tl.load(p_q + (PER * o_j + k) * stride_qd).to(tl.float32)
            # A page is empty when every channel has min > max (+inf/-inf); its tokens are all padding.
            m_grid = b_hi >= b_lo
            b_step = tl.where(m_grid, (b_hi - b_lo) / LEVELS, 0.0)
            b_lo = tl.where(m_grid, b_lo, 0.0)
            if BITS == 1:  # two levels: the centres of the page's lower and upper half, not its corners
                b_lo = b_lo + 0.25 * b_step
                b_step = 0.5 * b_step
            # The code is read as the float f = 1 + code / 2^BITS (below), so with s = 2^BITS * step:
            # q.(lo + code * step) = q.(lo - s) + (q * s).f
            b_step = b_step * (1 << BITS)
            b_c0 += (b_lo - b_step) * b_q[None, :]
            # f: the code shifted to the top BITS of an fp32 mantissa under exponent 0 (ONE = 1.0f's bits, a
            # runtime value so that mask and or fuse into one LOP3): a shift and a LOP3 per code instead of an
            # int->float conversion, which runs at a quarter of the FMA rate.
            b_f = (((b_byte << (23 - BITS - BITS * k)) & (LEVELS << (23 - BITS))) | ONE).to(tl.float32, bitcast=True)
            b_acc += b_f * (b_step * b_q[None, :])[None, :, :]
        b_s = tl.sum(b_acc, axis=2) + tl.sum(b_c0, axis=1)[None, :]  # [PAGE, BLOCK_P]
        if USE_LSE:
            b_s = tl.where(m_tok, b_s * scale, float("-inf"))
            b_m = tl.max(b_s, axis=0)
            b_safe = tl.where(b_m > float("-inf"), b_m, 0.0)
            b_l = tl.sum(tl.exp(b_s - b_safe[None, :]), axis=0)
            b_out = tl.where(b_m > float("-inf"), b_safe + tl.log(tl.maximum(b_l, 1.0)), float("-inf"))
        else:
            b_out = tl.max(tl.where(m_tok, b_s, float("-inf")), axis=0)
        b_out, m_p = _force_pos(b_out, m_p, o_p, pos_ptr, PAGE, HAS_POS, USE_LSE)
        tl.store(p_out + o_p * stride_op, b_out, mask=m_p)


@triton.jit
def _fma_codes(acc, x, a, I0: tl.constexpr, STEP: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr):
    """acc += code_i(x) * a_i for the N codes i = I0 + STEP * k of word x (code i at bit BITS * i < 16); a's last
    dimensions are N = 2^n entries as n levels of 2 in registers (the last level the lowest bit of k), split here.
    The masked word read as fp32 is code * 2^(BITS * i - 149), a denormal (exact: FFMA keeps denormals), so a
    code costs one LOP3 and one FFMA; a_i carries 2^(149 - BITS * i) (and the sums a 2^-64, see the kernel)."""
    if N == 1:
        f = (x & (((1 << BITS) - 1) << (BITS * I0))).to(tl.float32, bitcast=True)
        acc += f * a[:, :, None]
    else:
        a0, a1 = tl.split(a)
        acc = _fma_codes(acc, x, a0, I0, 2 * STEP, N // 2, BITS)
        acc = _fma_codes(acc, x, a1, I0 + STEP, 2 * STEP, N // 2, BITS)
    return acc


@triton.jit
def _code_scores_words_kernel(
    q_ptr, k_ptr, lo_ptr, hi_ptr, c_ptr, valid_ptr, out_ptr, pages_ptr, pos_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_lb, stride_lh, stride_lp, stride_ld,
    stride_cb, stride_ch, stride_cc,
    stride_vab, stride_vac,
    stride_ob, stride_oh, stride_op,
    stride_nb, stride_nh, stride_nn,
    H_Q, P, SEQ_LEN, WINDOW_START, N_BLOCKS, N_PAGES, ONE, scale,
    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_U: tl.constexpr, BITS: tl.constexpr,
    SEG: tl.constexpr, USE_LSE: tl.constexpr, HAS_PAGES: tl.constexpr, TOK: tl.constexpr, HAS_POS: tl.constexpr,
):
    # One query head x BLOCK_U units (TOK tokens of a complete page) a program (the G heads of a KV group are
    # neighbouring programs: their codes come from L2 after the first). Codes are read as int64, two 32-bit words
    # (2 x 32 / BITS channels) of a token. Tiles are [NW2, BLOCK_U, TOK]: a thread holds one (word pair, unit) for
    # all TOK tokens, so a page's grid value q.step of a channel is computed once for TOK tokens, a token's sum is
    # split over NW2 lanes only, and a code costs a LOP3 and an FFMA (see _fma_codes).
    # (ONE is unused here: the launch arguments are the "bytes" kernel's.)
    scale = tl.cast(scale, tl.float32)  # inductor passes a Python float as fp64
    i_pb = tl.program_id(1)
    i_b, i_q, i_h, p_q, p_out = _query_row(q_ptr, out_ptr, stride_qb, stride_qh, stride_ob, stride_oh, H_Q, G)
    if i_pb == N_BLOCKS:
        _current_pages(p_q, k_ptr + i_b * stride_kb + i_h * stride_kh, valid_ptr + i_b * stride_vab, p_out, pos_ptr,
                       stride_qd, stride_kc, stride_kd, stride_vac, stride_op, P, SEQ_LEN, WINDOW_START, scale, D,
                       PAGE, USE_LSE, HAS_POS)
    else:
        CPW: tl.constexpr = 32 // BITS  # codes a word
        NW2: tl.constexpr = D // (2 * CPW)  # word pairs a token
        NSEG: tl.constexpr = CPW // SEG  # segments of SEG codes (at most 16 bits) a word
        LEVELS: tl.constexpr = (1 << BITS) - 1
        # est = lo + (OFF + code * SC) * (hi - lo); at 1 bit the two levels are the centres of the two halves
        OFF: tl.constexpr = 0.25 if BITS == 1 else 0.0
        SC: tl.constexpr = 0.5 if BITS == 1 else 1.0 / LEVELS
        UNIT: tl.constexpr = 2.0 ** -64
        # Units of TOK tokens: a page is CH = PAGE / TOK units (pages over 16 tokens are split so that more
        # threads share the work); a block is BLOCK_U units = BLOCK_P pages.
        CH: tl.constexpr = PAGE // TOK
        BLOCK_P: tl.constexpr = BLOCK_U // CH
        o_u = tl.arange(0, BLOCK_U)
        o_p, m_p = _block_pages(i_pb * BLOCK_P + o_u // CH, pages_ptr + i_b * stride_nb + i_q * stride_nh,
                                stride_nn, N_PAGES, P, HAS_PAGES)
        o_m = tl.arange(0, NW2)
        o_i = tl.arange(0, SEG)
        o_slot = (o_p * PAGE + (o_u % CH) * TOK)[:, None] + tl.arange(0, TOK)[None, :]  # [BLOCK_U, TOK]
        # Tiles are [NW2, BLOCK_U, TOK or SEG]: where the loads' contiguity ties, the compiler gives the lanes
        # to the leading dimensions, so NW2 x BLOCK_U take the lanes and TOK (SEG) stays in a thread. Every tile
        # derives its layout from these loads (q is read in the min/max tile's shape; no zeros-initialised
        # accumulators), so no layout conversions. Codes: byte offsets, the pointer cast after, so that a
        # thread's word pair stays one 8-byte load.
        p_w = (c_ptr + i_b * stride_cb + i_h * stride_ch + o_slot[None, :, :] * stride_cc
               + 8 * o_m[:, None, None]).to(tl.pointer_type(tl.int64))
        b_x = tl.load(p_w, mask=m_p[None, :, None], other=0)  # [NW2, BLOCK_U, TOK]
        p_lo = lo_ptr + i_b * stride_lb + i_h * stride_lh + o_p[None, :, None] * stride_lp
        p_hi = hi_ptr + i_b * stride_lb + i_h * stride_lh + o_p[None, :, None] * stride_lp
        # The sums run in units of 2^-64 (UNIT): code i of a segment, at bit BITS * i of the (shifted) word, is read
        # as the denormal code * 2^(BITS * i - 149), so its weight carries 2^(149 - 64 - BITS * i) (exact powers
        # of two, built from their bits). The unit keeps those weights finite for |q.step| < 2^43 and the sums
        # normal down to |score| ~ 2^-62.
        b_pow = (SC * ((127 + 85 - BITS * o_i) << 23).to(tl.float32, bitcast=True))[None, None, :]
        for s in tl.static_range(2):
            if s == 0:
                b_w = b_x.to(tl.int32)
            else:
                b_w = (b_x >> 32).to(tl.int32)
            for j in tl.static_range(NSEG):
                o_c = (CPW * (2 * o_m + s) + SEG * j)[:, None, None] + o_i[None, None, :]  # [NW2, 1, SEG] channels
                b_lo = tl.load(p_lo + o_c * stride_ld, mask=m_p[None, :, None], other=0.0).to(tl.float32)
                b_hi = tl.load(p_hi + o_c * stride_ld, mask=m_p[None, :, None], other=0.0).to(tl.float32)
                # q in the min/max tile's shape (the same address over BLOCK_U): the same layout, from L1
                b_q = tl.load(p_q + o_c * stride_qd + 0 * o_p[None, :, None]).to(tl.float32)  # [NW2, BLOCK_U, SEG]
                b_span = b_hi - b_lo
                if OFF != 0.0:
                    b_t = tl.sum((b_lo + OFF * b_span) * b_q, axis=2)  # [NW2, BLOCK_U]
                else:
                    b_t = tl.sum(b_lo * b_q, axis=2)
                if s * NSEG + j == 1:
                    b_c0 = b_t
                elif s * NSEG + j > 1:
                    b_c0 += b_t
                b_a = b_span * (b_q * b_pow)
                if SEG == 8:
                    b_a = tl.reshape(b_a, [NW2, BLOCK_U, 2, 2, 2])
                elif SEG == 4:
                    b_a = tl.reshape(b_a, [NW2, BLOCK_U, 2, 2])
                else:
                    b_a = tl.reshape(b_a, [NW2, BLOCK_U, 2])
                if j == 0:
                    b_xs = b_w
                else:
                    b_xs = b_w >> (BITS * SEG * j)
                if s == 0 and j == 0:  # the first segment's part of sum_c q.lo starts the sums; the rest (b_c0) after
                    b_acc = _fma_codes((b_t * UNIT)[:, :, None], b_xs, b_a, 0, 1, SEG, BITS)
                else:
                    b_acc = _fma_codes(b_acc, b_xs, b_a, 0, 1, SEG, BITS)
        b_s = tl.sum(b_acc, axis=0) * (1.0 / UNIT) + tl.sum(b_c0, axis=0)[:, None]  # [BLOCK_U, TOK]
        b_val = tl.load(valid_ptr + i_b * stride_vab + o_slot * stride_vac, mask=m_p[:, None], other=0)
        m_tok = (b_val != 0) & m_p[:, None] & (o_slot >= WINDOW_START)  # complete pages: all below SEQ_LEN
        if USE_LSE:
            b_s = tl.where(m_tok, b_s * scale, float("-inf"))
            b_m = tl.max(b_s, axis=1)
            b_safe = tl.where(b_m > float("-inf"), b_m, 0.0)
            b_l = tl.sum(tl.exp(b_s - b_safe[:, None]), axis=1)  # [BLOCK_U]
            if CH > 1:  # a page's units: (m, l) pairs merged
                b_m = tl.reshape(b_m, [BLOCK_P, CH])
                b_l = tl.reshape(b_l, [BLOCK_P, CH])
                b_mp = tl.max(b_m, axis=1)
                b_safe = tl.where(b_mp > float("-inf"), b_mp, 0.0)
                b_l = tl.sum(b_l * tl.exp(b_m - b_safe[:, None]), axis=1)
                b_m = b_mp
            b_out = tl.where(b_m > float("-inf"), b_safe + tl.log(tl.maximum(b_l, 1.0)), float("-inf"))
        else:
            b_out = tl.max(tl.where(m_tok, b_s, float("-inf")), axis=1)  # [BLOCK_U]
            if CH > 1:
                b_out = tl.max(tl.reshape(b_out, [BLOCK_P, CH]), axis=1)
        if CH > 1:  # every unit of a page holds its id and mask: keep one a page
            o_p = tl.max(tl.reshape(o_p, [BLOCK_P, CH]), axis=1)
            m_p = tl.max(tl.reshape(m_p.to(tl.int32), [BLOCK_P, CH]), axis=1) != 0
        b_out, m_p = _force_pos(b_out, m_p, o_p, pos_ptr, PAGE, HAS_POS, USE_LSE)
        tl.store(p_out + o_p * stride_op, b_out, mask=m_p)


# Defaults of the two variants (sweep: scripts/bench_qcode_kernel.py). "bytes" (round 1): complete pages per
# program and warps. "words": warps; its BLOCK_P defaults to num_warps x 32 / NW2 (NW2 = word pairs a token: 4
# at D 128, 2 bits), which keeps every thread on one whole page (wider gives a thread more pages, narrower
# splits a page's tokens over lanes). sm_90 build (triton 3.6) at D 128, 2 bits, page 16, 2 warps: 96
# registers, no spills, no shared memory, 1736 instructions a thread for 512 channel-tokens (~3.4 each; the
# code loop 2: LOP3 + FFMA).
VARIANTS = ("words", "bytes")


@dataclass(frozen=True)
class CodeScoreLaunch:
    """How `code_scores` launches (defaults above). variant: "words" (used where the codes allow it: D * bits a
    multiple of 64 and 8-byte aligned rows; else "bytes") or "bytes"; block_p (power of two) and num_warps: None
    for each variant's default; block_p_bytes / num_warps_bytes / num_warps_words: those defaults; words_tok:
    tokens a "words" thread scores at most (larger pages are split into units of this many tokens)."""

    variant: str = "words"
    block_p: int | None = None
    num_warps: int | None = None
    block_p_bytes: int = 16
    num_warps_bytes: int = 4
    num_warps_words: int = 2
    words_tok: int = 16

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")


CODE_SCORE_LAUNCH = CodeScoreLaunch()


def _words_ok(codes, D, bits):
    """The "words" kernel reads a token's codes as 8-byte pairs of 32-bit words."""
    return (D * bits) % 64 == 0 and codes.data_ptr() % 8 == 0 and all(st % 8 == 0 for st in codes.stride()[:3])


def code_scores(q, k_cache, kmin, kmax, codes, valid, seq_len: int, page_size: int, window_start: int = 0,
                bits: int = 2, mode: str = "max", scale: float = 1.0, pages=None, out=None, pos=None, *,
                launch: CodeScoreLaunch = CODE_SCORE_LAUNCH):
    """Triton twin of `code_scores_ref` (kmin and kmax must share strides).

    Programs per (batch x query head): one per BLOCK_P complete pages (listed pages with `pages`), plus one
    for the current page.
    `launch`: a `CodeScoreLaunch` (the kernel variant and its block sizes; benchmarks and tests vary it).
    """
    require_triton()
    B, H, G, D, P = _check_score(q, k_cache, kmin, kmax, codes, valid, seq_len, page_size, window_start, bits, mode)
    _check_code_pos(pos, mode, q.device, pages)
    if D & (D - 1) or D < 16:
        raise ValueError(f"the Triton path needs a power-of-two head_dim >= 16, got {D}")
    if kmin.stride() != kmax.stride():
        raise ValueError(f"kmin and kmax must share strides, got {kmin.stride()} and {kmax.stride()}")
    variant = launch.variant
    if variant == "words" and not _words_ok(codes, D, bits):
        variant = "bytes"
    if pages is None:
        if out is not None:
            raise ValueError("out= is only for scores of listed pages (pages=...)")
        out = torch.empty(B, H * G, P, dtype=torch.float32, device=q.device)
        n_pages, pages_args = P - 1, (out, 0, 0, 0)  # (unused pointer and strides)
    else:
        if _check_out(out, B, H * G, P) is None:
            out = torch.full((B, H * G, P), float("-inf"), dtype=torch.float32, device=q.device)
        pages = _check_pages(pages, B, H * G)
        n_pages, pages_args = pages.shape[-1], (pages, *pages.stride())
    common = (q, k_cache, kmin, kmax, codes, valid, out, pages_args[0], pos if pos is not None else out,
              *q.stride(), *k_cache.stride(), *kmin.stride(), codes.stride(0), codes.stride(1), codes.stride(2),
              *valid.stride(), *out.stride(), *pages_args[1:])
    if variant == "words":
        # One page a thread: a warp's lanes are NW2 word pairs x 32 / NW2 pages. No wider than the complete pages.
        # A thread takes WORDS_TOK tokens of a page at most (pages of 32 are split in two).
        num_warps = launch.num_warps or launch.num_warps_words
        tok = min(page_size, launch.words_tok)
        ch = page_size // tok
        block_p = launch.block_p or max(1, num_warps * 32 // (D * bits // 64) // ch)
        block_p = min(block_p, next_pow2(max(1, n_pages)))
        n_blocks = cdiv(n_pages, block_p)
        _code_scores_words_kernel[(B * H * G, n_blocks + 1)](
            *common, H * G, P, seq_len, window_start, n_blocks, n_pages, 0x3F800000, scale,
            G=G, D=D, PAGE=page_size, BLOCK_U=block_p * ch, BITS=bits, SEG=min(16 // bits, 8),
            USE_LSE=mode == "lse", HAS_PAGES=pages is not None, TOK=tok, HAS_POS=pos is not None, num_warps=num_warps,
        )
        return out
    block_p = launch.block_p or max(1, launch.block_p_bytes * 16 // page_size)
    block_p = min(block_p, next_pow2(max(1, n_pages)))
    n_blocks = cdiv(n_pages, block_p)
    _code_scores_kernel[(B * H * G, n_blocks + 1)](
        *common, H * G, P, seq_len, window_start, n_blocks, n_pages, 0x3F800000, scale,
        G=G, D=D, PAGE=page_size, BLOCK_P=block_p, BITS=bits, USE_LSE=mode == "lse", HAS_PAGES=pages is not None,
        HAS_POS=pos is not None, num_warps=launch.num_warps or launch.num_warps_bytes,
    )
    return out
