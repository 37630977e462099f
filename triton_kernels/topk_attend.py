"""Top-K and sparse attention in one launch: each attention program selects its own share of the pages.

At batch 1 the Top-K kernel is pure latency (32 rows, one program each, ~8 serial passes) and the attention
kernel cannot start before it ends (NOTES-kernels.md). Here every attention program of a KV head runs the
same selection over that head's score rows (a few KB, read from L2), keeps only its slice of the ascending
page list, and attends over it; the last split of a head merges the partials. The selection is repeated by
each split of a head instead of waiting for another program: no launch between the two stages, and no
cross-program synchronisation but the merge ticket. Few splits per head (about one program per SM) keep
the repeated work small.
"""
import torch

from . import sparse_attention as _attn
from . import topk as _topk
from ._common import interpreting, next_pow2, num_sms, require_triton, tl, triton

__all__ = ["topk_attention", "topk_attention_ref"]


def topk_attention_ref(scores, k: int, q, k_cache, v_cache, valid, seq_len: int, page_size: int, scale: float,
                       window_start: int = 0, return_ids: bool = False):
    """`topk_pages_ref(scores, k, group)` then `sparse_decode_attention_ref` over the chosen pages.

    scores fp32 `[B, R, P]`, `R = H_kv * group`: `group` score rows per KV head (a query head's each in the
    union mode, one shared row in the max/sum modes); the rest as `sparse_decode_attention_ref`.
    Returns `[B, H_q, D]` (and the page ids `[B, H_kv, min(group * k, P)]` with `return_ids`).
    """
    group = _group(scores, k_cache)
    ids = _topk.topk_pages_ref(scores, k, group)
    out = _attn.sparse_decode_attention_ref(q, k_cache, v_cache, ids, valid, seq_len, page_size, scale, window_start)
    return (out, ids) if return_ids else out


def _group(scores, k_cache):
    if scores.dim() != 3 or scores.shape[0] != k_cache.shape[0] or scores.shape[1] % k_cache.shape[1]:
        raise ValueError(f"scores must be [B={k_cache.shape[0]}, H_kv * group, P] for {k_cache.shape[1]} KV heads, "
                         f"got {tuple(scores.shape)}")
    return scores.shape[1] // k_cache.shape[1]


# Programs per SM aimed at (each repeats its head's selection), and the key tile a selection keeps in
# registers (longer rows loop over tiles re-read from L2). H200 search: NOTES-kernels.md, round 5.
PROGRAMS_PER_SM = 1
MAX_TILE = 4096


@triton.jit
def _topk_attention_kernel(
    s_ptr, q_ptr, k_ptr, v_ptr, ids_ptr, valid_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr, out_ptr,
    stride_sb, stride_sr, stride_sp,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_vb, stride_vh, stride_vc, stride_vd,
    stride_ib, stride_ih, stride_ik,
    stride_vab, stride_vac,
    stride_ob, stride_oh, stride_od,
    H_KV, P, KK, N_IDS, IDS_PER_SPLIT, NUM_SPLITS, SEQ_LEN, WINDOW_START, qk_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOPK_BLOCK: tl.constexpr, SINGLE_TILE: tl.constexpr,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, USE_FP32_DOT: tl.constexpr,
    FUSE_MERGE: tl.constexpr, BLOCK_S: tl.constexpr,
):
    i_bh = tl.program_id(0).to(tl.int64)
    i_split = tl.program_id(1)
    i_b = i_bh // H_KV
    i_h = i_bh % H_KV
    i_lo = i_split * IDS_PER_SPLIT
    # This split's slice of the head's page list, then a block barrier: the attention below reads back (from
    # this SM) the ids its own threads just wrote.
    _topk._topk_rows(s_ptr + i_b * stride_sb + i_h * GROUP * stride_sr, ids_ptr + i_b * stride_ib + i_h * stride_ih,
                     stride_sr, stride_sp, stride_ik, P, KK, i_lo, tl.minimum(i_lo + IDS_PER_SPLIT, N_IDS),
                     GROUP, GROUP_PAD, TOPK_BLOCK, SINGLE_TILE, False)
    tl.debug_barrier()
    _attn._attn_split(q_ptr, k_ptr, v_ptr, ids_ptr, valid_ptr, m_ptr, l_ptr, acc_ptr, i_b, i_h, i_split,
                      stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kc, stride_kd,
                      stride_vb, stride_vh, stride_vc, stride_vd, stride_ib, stride_ih, stride_ik, stride_vab,
                      stride_vac, H_KV, N_IDS, IDS_PER_SPLIT, NUM_SPLITS, SEQ_LEN, WINDOW_START, qk_scale,
                      G, G_PAD, D, BLOCK_D, PAGE, BLOCK_N, USE_FP32_DOT)
    if FUSE_MERGE:
        tl.debug_barrier()
        i_ticket = tl.atomic_add(cnt_ptr + i_bh, 1, sem="acq_rel")
        if i_ticket == NUM_SPLITS - 1:
            _attn._merge_group(m_ptr, l_ptr, acc_ptr, out_ptr, i_b, i_h, H_KV, stride_ob, stride_oh, stride_od,
                               NUM_SPLITS, G, D, BLOCK_D, BLOCK_S)


def topk_attention(scores, k: int, q, k_cache, v_cache, valid, seq_len: int, page_size: int, scale: float,
                   window_start: int = 0, return_ids: bool = False):
    """Triton twin of `topk_attention_ref` (ties at the k-th score go to the lowest page ids, as `topk_pages`).

    Returns a fresh `[B, H_q, D]` in q's dtype (and the ids `[B, H_kv, K_out]` with `return_ids`).
    """
    require_triton()
    group = _group(scores, k_cache)
    B, R, P, K_out = _topk._check(scores, k, group)
    H = k_cache.shape[1]
    ids = torch.empty(B, H, K_out, dtype=torch.int32, device=q.device)
    _, _, G, D = _attn._check(q, k_cache, v_cache, ids, valid, seq_len, page_size, window_start)
    # About PROGRAMS_PER_SM programs per SM, in whole attention steps of BLOCK_N tokens.
    ids_per_step = max(1, _attn.BLOCK_N // page_size)
    steps = triton.cdiv(K_out, ids_per_step)
    want = max(1, min(steps, (PROGRAMS_PER_SM * num_sms(q.device)) // (B * H)))
    ids_each = triton.cdiv(steps, want) * ids_per_step
    splits = triton.cdiv(K_out, ids_each)
    m_part = torch.empty(B * H * G, splits, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(B * H * G, splits, D, dtype=torch.float32, device=q.device)
    out = torch.empty(B, H * G, D, dtype=q.dtype, device=q.device)
    fuse = splits <= _attn.FUSE_MERGE_MAX_SPLITS
    cnt = torch.zeros(B * H, dtype=torch.int32, device=q.device) if fuse else m_part
    g_pad = next_pow2(group)
    single = g_pad * max(16, next_pow2(P)) <= MAX_TILE
    topk_block = max(16, next_pow2(P)) if single else max(16, MAX_TILE // g_pad)
    valid_u8 = valid.view(torch.uint8)
    block_d = max(16, next_pow2(D))
    block_s = max(2, next_pow2(splits))
    _topk_attention_kernel[(B * H, splits)](
        scores, q, k_cache, v_cache, ids, valid_u8, m_part, l_part, acc_part, cnt, out,
        scores.stride(0), scores.stride(1), scores.stride(2),
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        ids.stride(0), ids.stride(1), ids.stride(2),
        valid_u8.stride(0), valid_u8.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        H, P, min(k, P), K_out, ids_each, splits, seq_len, window_start, scale * _attn.LOG2E,
        GROUP=group, GROUP_PAD=g_pad, TOPK_BLOCK=topk_block, SINGLE_TILE=single,
        G=G, G_PAD=max(16, next_pow2(G)), D=D, BLOCK_D=block_d, PAGE=page_size, BLOCK_N=_attn.BLOCK_N,
        USE_FP32_DOT=k_cache.dtype == torch.float32 or (interpreting() and k_cache.dtype == torch.bfloat16),
        FUSE_MERGE=fuse, BLOCK_S=block_s, num_warps=_attn.NUM_WARPS,
    )
    if not fuse:
        _attn._sparse_attn_merge_kernel[(B * H * G,)](
            m_part, l_part, acc_part, out, out.stride(0), out.stride(1), out.stride(2), H * G, splits,
            D=D, BLOCK_D=block_d, BLOCK_S=block_s, num_warps=4,
        )
    return (out, ids) if return_ids else out
