"""Decode attention over the chosen pages only (exact softmax over exactly their valid tokens)."""
from dataclasses import dataclass

import torch

from ._common import as_u8, cdiv, check_query, interpreting, next_pow2, num_sms, require_triton, tl, triton
from .score import _check_pos, check_rows, window_start_at

__all__ = ["prefix_decode_attention_ref", "sparse_decode_attention", "sparse_decode_attention_ref"]


def _check(q, k_cache, v_cache, page_ids, valid, seq_len, page_size, window_start, pos=None, window=0,
           softcap=0.0, sinks=None):
    B, H, C, D = k_cache.shape
    G = check_query(q, H, D, B)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache must match k_cache ({k_cache.dtype} {tuple(k_cache.shape)}: one head dim for keys and "
                         f"values), got {v_cache.dtype} {tuple(v_cache.shape)}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0: no cap), got {softcap}")
    if sinks is not None and (sinks.shape != (H * G,) or sinks.dtype != torch.float32 or sinks.device != q.device):
        raise ValueError(f"sinks must be fp32 [H_q={H * G}] on {q.device}, got {sinks.dtype} {tuple(sinks.shape)} "
                         f"on {sinks.device}")
    if page_ids.dim() != 3 or page_ids.shape[:2] != (B, H) or page_ids.dtype != torch.int32:
        raise ValueError(f"page_ids must be int32 [B={B}, H_kv={H}, K], got {page_ids.dtype} {tuple(page_ids.shape)}")
    if valid.shape != (B, C) or valid.dtype not in (torch.bool, torch.uint8):
        raise ValueError(f"valid must be a bool [B={B}, C={C}] tensor (or its uint8 view), got {valid.dtype} "
                         f"{tuple(valid.shape)}")
    if not 1 <= seq_len <= C or C % page_size:
        raise ValueError(f"seq_len {seq_len} must be in [1, {C}] and the capacity a multiple of page_size {page_size}")
    if not 0 <= window_start < seq_len:
        raise ValueError(f"window_start {window_start} must be in [0, seq_len={seq_len})")
    _check_pos(pos, q.device, window, window_start)
    return B, H, G, D


def sparse_decode_attention_ref(q, k_cache, v_cache, page_ids, valid, seq_len: int, page_size: int,
                                scale: float, window_start: int = 0, pos=None, window: int = 0,
                                softcap: float = 0.0, sinks=None, rows=None):
    """Attention of one decode query per row over the tokens of the chosen pages.

    q `[B, H_q, D]`; caches `[B, H_kv, C, D]`; page_ids int32 `[B, H_kv, K]` (-1 unused); valid `[B, C]`.
    A token takes part when its page is chosen for the query head's KV head, it is `< seq_len`,
    `>= window_start` and valid. Returns `[B, H_q, D]` in q's dtype; fp32 math; all-masked rows give 0.
    `pos` / `window` (the captured step's device position and a sliding window, see `score_pages`): the
    window's first slot `max(0, pos - window)` is read on the device instead of `window_start`.
    `softcap` > 0: logits become `softcap * tanh(logit / softcap)` (Gemma 2) before the mask. `sinks` fp32 `[H_q]`:
    one extra logit per query head in the softmax denominator, attending nothing (GPT-OSS), i.e. the output is
    scaled by `sigmoid(lse - sink)`. `rows` (int32 `[B, C // S]`, beam search's page table): page `p` of sequence
    `b` is read from batch row `rows[b, p]` (keys, values and valid slots).
    """
    B, H, G, D = _check(q, k_cache, v_cache, page_ids, valid, seq_len, page_size, window_start, pos, window,
                        softcap, sinks)
    S, C = page_size, k_cache.shape[2]
    P = C // S
    check_rows(rows, B, P, q.device)
    valid = valid if valid.dtype == torch.bool else valid.bool()  # a uint8 view (quest_hf.compiled's traced step)
    K = page_ids.shape[2]
    page = page_ids.long()
    live = page >= 0
    page = page.clamp_min(0)  # [B, H, K]
    # Whole pages by one index_select each (a contiguous copy of S * D values a page): the batch row holding
    # each chosen page (its own, or the one the page table names), its KV head, the page.
    row = torch.arange(B, device=q.device)[:, None, None] if rows is None else \
        torch.gather(rows.long(), 1, page.reshape(B, H * K)).reshape(B, H, K)
    head = torch.arange(H, device=q.device)[None, :, None]
    flat = ((row * H + head) * P + page).reshape(-1)
    keys = k_cache.reshape(B * H * P, S * D).index_select(0, flat).view(B, H, K * S, D).float()
    vals = v_cache.reshape(B * H * P, S * D).index_select(0, flat).view(B, H, K * S, D).float()
    slots = (page[..., None] * S + torch.arange(S, device=q.device)).reshape(B, H, K * S)
    ok = valid.reshape(B * P, S).index_select(0, (row * P + page).reshape(-1)).view(B, H, K * S)
    ok = ok & live[..., None].expand(B, H, K, S).reshape(B, H, K * S)
    if seq_len < C:
        ok = ok & (slots < seq_len)
    if window_start:
        ok = ok & (slots >= window_start)
    if window:
        ok = ok & (slots >= window_start_at(pos, window))
    return _softmax_attend(q, keys, vals, ok, scale, softcap, sinks)


def _softmax_attend(q, keys, vals, ok, scale: float, softcap: float, sinks):
    """`q [B, H_q, D]` over `keys/vals [B, H_kv, N, D]` (fp32) where `ok [B, H_kv or 1, N]`: `[B, H_q, D]` in q's
    dtype, fp32 math; a row with no token gives 0."""
    B, H, _, D = keys.shape
    G = q.shape[1] // H
    qf = q.float().reshape(B, H, G, D)
    logits = torch.matmul(qf, keys.mT) * scale  # [B, H, G, N]
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~ok[:, :, None], float("-inf"))
    w = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with no token at all gives 0, not NaN
    out = torch.matmul(w, vals)
    if sinks is not None:  # the sink takes its share of the denominator: sigmoid(lse - sink); no token: 0
        out = out * torch.sigmoid(torch.logsumexp(logits, -1) - sinks.float().reshape(H, G))[..., None]
    return out.reshape(B, H * G, D).to(q.dtype)


def prefix_decode_attention_ref(q, k_cache, v_cache, valid, seq_len: int, scale: float, window_start: int = 0,
                                softcap: float = 0.0, sinks=None):
    """Dense decode attention over the filled prefix `[window_start, seq_len)` of the cache, read in place (no copy
    of K/V in fp32 caches): what `sparse_decode_attention_ref` gives with every page chosen, for a host that knows
    `seq_len` (the eager step on CPU; a captured step reads lengths on the device instead)."""
    B, H, C, D = k_cache.shape
    check_query(q, H, D, B)
    if valid.shape != (B, C) or valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool [B={B}, C={C}] tensor, got {valid.dtype} {tuple(valid.shape)}")
    if not 0 <= window_start < seq_len <= C:
        raise ValueError(f"need 0 <= window_start ({window_start}) < seq_len ({seq_len}) <= capacity {C}")
    keys = k_cache[:, :, window_start:seq_len].float()
    vals = v_cache[:, :, window_start:seq_len].float()
    return _softmax_attend(q, keys, vals, valid[:, None, window_start:seq_len], scale, softcap, sinks)


@dataclass(frozen=True)
class AttentionLaunch:
    """How `sparse_decode_attention` launches; the defaults were picked on an H200 (benchmarks/kernels/NOTES.md).

    block_n: tokens per inner step (2 pages of 16): a 32 x 128 fp16 K tile and V tile are 16 KB in flight; picked
        among 32..128 tokens, 2..8 warps, 2..8 programs per SM, with num_warps. Round 8 (benchmarks/kernels/round8/
        tune_r8.json): 2 warps beat 4 by 3-9% in every configuration timed (7B/8B, 32K/128K, B 1/8); 16-token steps
        and 8-32 programs per SM did not help.
    num_stages: software-pipelining depth of the K/V tile loads: 3 beat 1, 2 and 4 (2 with 64-token tiles won at
        MHA and lost at GQA; benchmarks/kernels/round6/r6_tune_stages.json).
    programs_per_sm: programs per SM aimed at when splitting the page list (flash-decoding): enough to hide HBM
        latency.
    fuse_merge_max_splits: with at most this many splits per row, the last split of each KV head to finish merges
        the partials (atomic ticket, one zeroed int32 per row) instead of a second launch. This won at llama2 B=8
        (3 splits: 74 vs 91 us) and lost at B=1 (17 splits: 20.9 vs 19.7 us; llama3, 64 splits: 18.3 vs 10.1 us),
        where the one merging program serialises over many splits.
    """

    block_n: int = 32
    num_warps: int = 2
    num_stages: int = 3
    programs_per_sm: int = 4
    fuse_merge_max_splits: int = 4


ATTENTION_LAUNCH = AttentionLaunch()
LOG2E = 1.4426950408889634


@triton.jit
def _attn_split(
    q_ptr, k_ptr, v_ptr, ids_ptr, valid_ptr, m_ptr, l_ptr, acc_ptr, i_b, i_h, i_split,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_vb, stride_vh, stride_vc, stride_vd,
    stride_ib, stride_ih, stride_ik,
    stride_vab, stride_vac,
    H_KV, N_IDS, IDS_PER_SPLIT, NUM_SPLITS, SEQ_LEN, WINDOW_START, qk_scale, softcap_log2, rows_ptr, stride_rb,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, USE_FP32_DOT: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    HAS_ROWS: tl.constexpr, IDS_CACHE: tl.constexpr,
):
    """Split `i_split` of KV head (i_b, i_h)'s page list: its G query heads' partial softmax (m, l, acc).
    IDS_CACHE: the page ids' load cache modifier (".cg" where another program of the same launch wrote them).

    Logits in log2 units: `q.k * qk_scale`, or with USE_SOFTCAP `softcap_log2 * tanh(q.k * qk_scale)` (the
    launcher folds scale / softcap into qk_scale). With HAS_ROWS each chosen page is read from the batch row that
    the page table `rows [B, P]` names for it (beam search shares the full pages of a common prefix)."""
    # Inductor types a Python float argument fp64 (torch.compile of a step that calls this kernel): fp32 math.
    qk_scale = tl.cast(qk_scale, tl.float32)
    softcap_log2 = tl.cast(softcap_log2, tl.float32)
    o_g = tl.arange(0, G_PAD)
    o_d = tl.arange(0, BLOCK_D)
    o_n = tl.arange(0, BLOCK_N)
    m_g = o_g < G
    m_d = o_d < D
    # All G query heads of the KV head ride along: each K/V page is read from HBM once per group.
    p_q = q_ptr + i_b * stride_qb + (i_h * G + o_g)[:, None] * stride_qh + o_d[None, :] * stride_qd
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)
    b_q = b_q.to(tl.float32) if USE_FP32_DOT else b_q.to(k_ptr.dtype.element_ty)

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
    i_id0 = i_split * IDS_PER_SPLIT
    i_id1 = tl.minimum(i_id0 + IDS_PER_SPLIT, N_IDS)
    p_ids = ids_ptr + i_b * stride_ib + i_h * stride_ih
    p_k = k_ptr + i_b * stride_kb + i_h * stride_kh
    p_v = v_ptr + i_b * stride_vb + i_h * stride_vh
    # The page ids of the next step are loaded one step ahead, so only the first step pays the dependent
    # id -> K/V latency.
    i_t1 = i_id1 * PAGE
    o_t = i_id0 * PAGE + o_n
    b_page = tl.load(p_ids + (o_t // PAGE) * stride_ik, mask=o_t < i_t1, other=-1, cache_modifier=IDS_CACHE)
    p_row = rows_ptr + i_b * stride_rb
    if HAS_ROWS:  # loaded one step ahead too, right after the page id it depends on
        b_row = tl.load(p_row + b_page, mask=b_page >= 0, other=0).to(tl.int64)
    else:
        b_row = tl.zeros([BLOCK_N], dtype=tl.int64) + i_b
    for i_t0 in range(i_id0 * PAGE, i_t1, BLOCK_N):
        o_t = i_t0 + o_n  # position in this row's list of chosen tokens
        o_slot = b_page * PAGE + o_t % PAGE
        if HAS_ROWS:
            p_kn = k_ptr + b_row[:, None] * stride_kb + i_h * stride_kh
            p_vn = v_ptr + b_row[:, None] * stride_vb + i_h * stride_vh
            p_okn = valid_ptr + b_row * stride_vab
        else:
            p_kn, p_vn, p_okn = p_k, p_v, valid_ptr + i_b * stride_vab
        # Fetch only slots that exist; validity and the window join the mask on the logits, so the
        # K/V loads do not wait for the valid[] load.
        m_n = (b_page >= 0) & (o_slot < SEQ_LEN)
        o_tn = o_t + BLOCK_N
        b_page = tl.load(p_ids + (o_tn // PAGE) * stride_ik, mask=o_tn < i_t1, other=-1, cache_modifier=IDS_CACHE)
        b_ok = tl.load(p_okn + o_slot * stride_vac, mask=m_n, other=0)
        m_tok = m_n & (b_ok != 0) & (o_slot >= WINDOW_START)
        m_nd = m_n[:, None] & m_d[None, :]
        b_k = tl.load(p_kn + o_slot[:, None] * stride_kc + o_d[None, :] * stride_kd, mask=m_nd, other=0.0)
        b_v = tl.load(p_vn + o_slot[:, None] * stride_vc + o_d[None, :] * stride_vd, mask=m_nd, other=0.0)
        if HAS_ROWS:
            b_row = tl.load(p_row + b_page, mask=b_page >= 0, other=0).to(tl.int64)
        if USE_FP32_DOT:
            b_s = tl.dot(b_q, tl.trans(b_k.to(tl.float32)), input_precision="ieee")
        else:
            b_s = tl.dot(b_q, tl.trans(b_k))
        if USE_SOFTCAP:
            # tanh from exp2 of -2|x| (never overflows): tanh|x| = (1 - t) / (1 + t), t = exp(-2|x|).
            b_x = b_s * qk_scale
            b_t = tl.exp2(-2.8853900817779268 * tl.abs(b_x))
            b_th = (1.0 - b_t) / (1.0 + b_t)
            b_s = softcap_log2 * tl.where(b_x < 0, -b_th, b_th)
        else:
            b_s = b_s * qk_scale
        b_s = tl.where(m_tok[None, :], b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
        # A tile with no live token keeps m at -inf; subtracting 0 instead avoids -inf - -inf = NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        b_p = tl.exp2(b_s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(b_p, axis=1)
        if USE_FP32_DOT:
            b_pv = tl.dot(b_p, b_v.to(tl.float32), input_precision="ieee")
        else:
            b_pv = tl.dot(b_p.to(b_v.dtype), b_v)
        acc = acc * alpha[:, None] + b_pv
        m_i = m_new

    o_row = (i_b * H_KV + i_h) * G + o_g  # flat (b, query head)
    tl.store(m_ptr + o_row * NUM_SPLITS + i_split, m_i, mask=m_g)
    tl.store(l_ptr + o_row * NUM_SPLITS + i_split, l_i, mask=m_g)
    p_acc = acc_ptr + (o_row * NUM_SPLITS + i_split)[:, None] * D + o_d[None, :]
    tl.store(p_acc, acc, mask=m_g[:, None] & m_d[None, :])


@triton.jit
def _sparse_attn_split_kernel(
    q_ptr, k_ptr, v_ptr, ids_ptr, valid_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr, out_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_vb, stride_vh, stride_vc, stride_vd,
    stride_ib, stride_ih, stride_ik,
    stride_vab, stride_vac,
    stride_ob, stride_oh, stride_od,
    H_KV, N_IDS, IDS_PER_SPLIT, NUM_SPLITS, SEQ_LEN, WINDOW_START, WINDOW, qk_scale, pos_ptr,
    softcap_log2, sinks_ptr, rows_ptr, stride_rb,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, USE_FP32_DOT: tl.constexpr,
    FUSE_MERGE: tl.constexpr, BLOCK_S: tl.constexpr, HAS_WINDOW_POS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr, HAS_ROWS: tl.constexpr,
):
    i_bh = tl.program_id(0).to(tl.int64)  # batch x head offsets pass 2^31 elements on large caches
    i_b = i_bh // H_KV
    i_h = i_bh % H_KV
    if HAS_WINDOW_POS:  # a sliding window in a captured step: its first slot from the device position
        WINDOW_START = tl.maximum(tl.load(pos_ptr).to(tl.int32) - WINDOW, 0)
    _attn_split(q_ptr, k_ptr, v_ptr, ids_ptr, valid_ptr, m_ptr, l_ptr, acc_ptr, i_b, i_h, tl.program_id(1),
                stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kc, stride_kd,
                stride_vb, stride_vh, stride_vc, stride_vd, stride_ib, stride_ih, stride_ik, stride_vab, stride_vac,
                H_KV, N_IDS, IDS_PER_SPLIT, NUM_SPLITS, SEQ_LEN, WINDOW_START, qk_scale, softcap_log2,
                rows_ptr, stride_rb, G, G_PAD, D, BLOCK_D, PAGE, BLOCK_N, USE_FP32_DOT, USE_SOFTCAP, HAS_ROWS, "")
    if FUSE_MERGE:
        # Every thread's partial stores are ordered before the ticket by the barrier and the atomic's release;
        # the last split's acquire orders its L2 reads (.cg) of the other splits' partials after them.
        tl.debug_barrier()
        i_ticket = tl.atomic_add(cnt_ptr + i_bh, 1, sem="acq_rel")
        if i_ticket == NUM_SPLITS - 1:
            _merge_group(m_ptr, l_ptr, acc_ptr, out_ptr, sinks_ptr, i_b, i_h, H_KV, stride_ob, stride_oh,
                         stride_od, NUM_SPLITS, G, D, BLOCK_D, BLOCK_S, USE_SINKS)


@triton.jit
def _merge_group(m_ptr, l_ptr, acc_ptr, out_ptr, sinks_ptr, i_b, i_h, H_KV, stride_ob, stride_oh, stride_od,
                 NUM_SPLITS, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                 USE_SINKS: tl.constexpr):
    """Merge the G query heads of KV head (i_b, i_h), reading the other programs' partials from L2 (.cg)."""
    for g in tl.static_range(G):
        _merge_row(m_ptr, l_ptr, acc_ptr, out_ptr, sinks_ptr, (i_b * H_KV + i_h) * G + g, i_b, i_h * G + g,
                   stride_ob, stride_oh, stride_od, NUM_SPLITS, D, BLOCK_D, BLOCK_S, ".cg", USE_SINKS)


@triton.jit
def _merge_row(m_ptr, l_ptr, acc_ptr, out_ptr, sinks_ptr, i_row, i_b, i_hq, stride_ob, stride_oh, stride_od,
               NUM_SPLITS, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, CACHE: tl.constexpr,
               USE_SINKS: tl.constexpr):
    o_s = tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    m_s = o_s < NUM_SPLITS
    m_d = o_d < D
    b_m = tl.load(m_ptr + i_row * NUM_SPLITS + o_s, mask=m_s, other=float("-inf"), cache_modifier=CACHE)
    b_l = tl.load(l_ptr + i_row * NUM_SPLITS + o_s, mask=m_s, other=0.0, cache_modifier=CACHE)
    b_acc = tl.load(acc_ptr + (i_row * NUM_SPLITS + o_s)[:, None] * D + o_d[None, :],
                    mask=m_s[:, None] & m_d[None, :], other=0.0, cache_modifier=CACHE)
    # Log-sum-exp merge of the splits' partial softmaxes (m is already in log2 units).
    i_m = tl.max(b_m, axis=0)
    if USE_SINKS:  # the head's sink logit joins the denominator (log2 units: x LOG2E), attending nothing
        b_sink = tl.load(sinks_ptr + i_hq).to(tl.float32) * 1.4426950408889634
        i_m = tl.maximum(i_m, b_sink)
    i_m = tl.where(i_m == float("-inf"), 0.0, i_m)
    b_w = tl.exp2(b_m - i_m)
    i_l = tl.sum(b_l * b_w, axis=0)
    if USE_SINKS:
        i_l += tl.exp2(b_sink - i_m)
    b_o = tl.sum(b_acc * b_w[:, None], axis=0)
    # A head whose chosen pages hold no live token gets 0, as in the reference.
    b_o = tl.where(i_l > 0, b_o / tl.where(i_l > 0, i_l, 1.0), 0.0)
    tl.store(out_ptr + i_b * stride_ob + i_hq * stride_oh + o_d * stride_od,
             b_o.to(out_ptr.dtype.element_ty), mask=m_d)


@triton.jit
def _sparse_attn_merge_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, sinks_ptr,
    stride_ob, stride_oh, stride_od,
    H_Q, NUM_SPLITS,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, USE_SINKS: tl.constexpr,
):
    i_row = tl.program_id(0).to(tl.int64)
    _merge_row(m_ptr, l_ptr, acc_ptr, out_ptr, sinks_ptr, i_row, i_row // H_Q, i_row % H_Q, stride_ob, stride_oh,
               stride_od, NUM_SPLITS, D, BLOCK_D, BLOCK_S, "", USE_SINKS)


def _num_splits(device, rows: int, n_ids: int, page_size: int, launch: AttentionLaunch) -> tuple[int, int]:
    """Split each row's page list so that about `programs_per_sm` programs run per SM; (splits, ids each)."""
    ids_per_step = max(1, launch.block_n // page_size)
    steps = max(1, cdiv(n_ids, ids_per_step))
    splits = max(1, min(steps, cdiv(launch.programs_per_sm * num_sms(device), rows)))
    ids_each = cdiv(steps, splits) * ids_per_step
    return max(1, cdiv(max(n_ids, 1), ids_each)), ids_each


def sparse_decode_attention(q, k_cache, v_cache, page_ids, valid, seq_len: int, page_size: int,
                            scale: float, window_start: int = 0, pos=None, window: int = 0,
                            softcap: float = 0.0, sinks=None, rows=None, *,
                            launch: AttentionLaunch = ATTENTION_LAUNCH):
    """Triton twin of `sparse_decode_attention_ref` (flash-decoding over the chosen pages).

    q `[B, H_q, D]`; k_cache/v_cache `[B, H_kv, C, D]` (any strides, unit stride on D is fastest);
    page_ids int32 `[B, H_kv, K]`, -1 ignored wherever it sits; valid bool `[B, C]`. Returns a fresh
    `[B, H_q, D]` in q's dtype. Workspace: fp32 partials of `B * H_q * splits * (D + 2)` floats per call and,
    with few splits (`launch.fuse_merge_max_splits`), `B * H_kv` int32 tickets (zeroed). `softcap` and `sinks` as in the
    reference (constexpr flags USE_SOFTCAP / USE_SINKS: without them the kernel is the plain one).
    """
    require_triton()
    B, H, G, D = _check(q, k_cache, v_cache, page_ids, valid, seq_len, page_size, window_start, pos, window,
                        softcap, sinks)
    check_rows(rows, B, k_cache.shape[2] // page_size, q.device)
    K = page_ids.shape[2]
    splits, ids_each = _num_splits(q.device, B * H, K, page_size, launch)
    m_part = torch.empty(B * H * G, splits, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(B * H * G, splits, D, dtype=torch.float32, device=q.device)
    out = torch.empty(B, H * G, D, dtype=q.dtype, device=q.device)
    fuse = splits <= launch.fuse_merge_max_splits
    cnt = torch.zeros(B * H, dtype=torch.int32, device=q.device) if fuse else m_part
    valid_u8 = as_u8(valid)
    block_d = max(16, next_pow2(D))
    block_s = max(2, next_pow2(splits))
    _sparse_attn_split_kernel[(B * H, splits)](
        q, k_cache, v_cache, page_ids, valid_u8, m_part, l_part, acc_part, cnt, out,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *page_ids.stride(), *valid_u8.stride(), *out.stride(),
        H, K, ids_each, splits, seq_len, window_start, window,
        scale / softcap if softcap else scale * LOG2E, pos if window else valid_u8,
        softcap * LOG2E, sinks if sinks is not None else m_part, rows if rows is not None else page_ids,
        rows.stride(0) if rows is not None else 0,
        G=G, G_PAD=max(16, next_pow2(G)), D=D, BLOCK_D=block_d, PAGE=page_size, BLOCK_N=launch.block_n,
        # fp32 caches keep fp32 products (no tf32); the interpreter's bf16 dot is broken (triton 3.9), so
        # interpreted bf16 takes the fp32 path too.
        USE_FP32_DOT=k_cache.dtype == torch.float32 or (interpreting() and k_cache.dtype == torch.bfloat16),
        FUSE_MERGE=fuse, BLOCK_S=block_s, HAS_WINDOW_POS=window > 0,
        USE_SOFTCAP=softcap > 0, USE_SINKS=sinks is not None, HAS_ROWS=rows is not None,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    if not fuse:
        _sparse_attn_merge_kernel[(B * H * G,)](
            m_part, l_part, acc_part, out, sinks if sinks is not None else m_part,
            out.stride(0), out.stride(1), out.stride(2),
            H * G, splits,
            D=D, BLOCK_D=block_d, BLOCK_S=block_s, USE_SINKS=sinks is not None, num_warps=4,
        )
    return out
