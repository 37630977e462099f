"""The whole Quest decode step of one layer in one persistent launch: score -> Top-K -> sparse attention.

At batch 1 each of the three kernels costs more in fixed latency (launch, ramp-up, tail, dependent loads)
than in bytes: at 32K the step reads 67 MB (16 us on an H200) but took ~39 us as four launches
(NOTES-kernels.md). Here one grid of resident programs pulls work items from a global ticket counter, in an
order where every item only depends on items with smaller tickets:

    wave w:  score chunks of row w  |  Top-K of row w - 1  |  attention splits of row w - LAG

(a row is one KV head of one sequence). A Top-K item waits (spinning on an acquire load) until its row's
score chunks are counted in; an attention split waits until its row's page ids are published; the last split
of a row to finish merges the row. Tickets go to running programs only, so the smallest unfinished ticket
always has its inputs done: no deadlock whatever the grid, and the interpreter (programs run one after the
other) runs every item in ticket order. While one program selects a row's pages, the others stream the next
rows' metadata and earlier rows' K/V, so the Top-K's serial passes hide behind memory traffic.

Synchronisation counters live in a per-device workspace and are returned to zero by the launch itself (the
Top-K item zeroes its row's score count, the merging split the row's flags, the last program to leave the
work counters), so a captured CUDA graph replays the step with no memset.
"""
import torch

from . import score as _score
from . import sparse_attention as _attn
from . import topk as _topk
from ._common import interpreting, next_pow2, num_sms, require_triton, tl, triton

__all__ = ["quest_decode", "quest_decode_ref", "clear_workspaces"]


def quest_decode_ref(q, k_cache, v_cache, kmin, kmax, valid, seq_len: int, page_size: int, k: int, scale: float,
                     window_start: int = 0, reduce: str = "none", pos: torch.Tensor | None = None,
                     return_ids: bool = False):
    """One Quest decode step: `score_pages_ref` -> `topk_pages_ref` -> `sparse_decode_attention_ref`.

    q `[B, H_q, D]`; caches `[B, H_kv, C, D]`; kmin/kmax `[B, H_kv, C // S, D]`; valid `[B, C]`. Pages of the
    first `seq_len` tokens are scored (the last one is forced); `pos` (a device scalar, the captured step's
    write position) forces page `(pos - 1) // S` too. `k` pages per score row: per query head united over its
    group (`reduce="none"`) or one shared row per KV head (`"max"`/`"sum"`). Returns `[B, H_q, D]` (and the
    page ids `[B, H_kv, K_out]` with `return_ids`).
    """
    scores = _score.score_pages_ref(q, kmin, kmax, seq_len, page_size, window_start, reduce)
    if pos is not None:
        cur = torch.div(pos - 1, page_size, rounding_mode="floor").view(1)
        scores.index_fill_(-1, cur.to(scores.device), float("inf"))
    group = q.shape[1] // kmin.shape[1] if reduce == "none" else 1
    ids = _topk.topk_pages_ref(scores, k, group)
    out = _attn.sparse_decode_attention_ref(q, k_cache, v_cache, ids, valid, seq_len, page_size, scale,
                                            window_start)
    return (out, ids) if return_ids else out


# Launch settings (H200 search in benchmarks/NOTES-kernels.md, round 5).
CHUNK_P = 64  # pages a score item covers, in blocks of SCORE_BLOCK_P
SCORE_BLOCK_P = 32
SPLIT_TOKENS = 64  # chosen tokens an attention item covers
SPIN_LOAD = False
_PHASES = 3  # benchmarks only: 1 = score items only, 2 = + Top-K, 3 = the whole step
LAST_LAUNCH = None
NUM_WARPS = 4
PROGRAMS_PER_SM = 3
TOPK_MAX_TILE = 4096  # keys a Top-K item keeps in registers; longer rows loop over tiles (re-read from L2)

_workspaces: dict = {}


def clear_workspaces() -> None:
    """Free the cached per-device scratch buffers (scores, ids, partials, counters)."""
    _workspaces.clear()


def _workspace(device, B, H, rows, P, K_out, Hq, splits, D):
    key = (device, B, H, rows, P, K_out, Hq, splits, D)
    ws = _workspaces.get(key)
    if ws is None:
        f32 = dict(dtype=torch.float32, device=device)
        ws = _workspaces[key] = dict(
            scores=torch.empty(B, rows, P, **f32),
            ids=torch.empty(B, H, K_out, dtype=torch.int32, device=device),
            m=torch.empty(B * Hq, splits, **f32), l=torch.empty(B * Hq, splits, **f32),
            acc=torch.empty(B * Hq, splits, D, **f32),
            # [work ticket, programs out, score chunks done per row, ids ready per row, merge tickets per row]
            sync=torch.zeros(2 + 3 * B * H, dtype=torch.int32, device=device),
        )
    return ws


@triton.jit
def _wait_at_least(p, target, SPIN_LOAD: tl.constexpr):
    if SPIN_LOAD:  # spin on plain volatile loads (no L2 atomics), then one acquire
        i_c = tl.load(p, volatile=True)
        while i_c < target:
            i_c = tl.load(p, volatile=True)
    i_c = tl.atomic_add(p, 0, sem="acquire")
    while i_c < target:
        i_c = tl.atomic_add(p, 0, sem="acquire")


@triton.jit
def _quest_step_kernel(
    q_ptr, kmin_ptr, kmax_ptr, k_ptr, v_ptr, valid_ptr, pos_ptr,
    s_ptr, ids_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, sync_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_nb, stride_nh, stride_np, stride_nd,
    stride_xb, stride_xh, stride_xp, stride_xd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_vb, stride_vh, stride_vc, stride_vd,
    stride_vab, stride_vac,
    stride_ob, stride_oh, stride_od,
    R, H_KV, P, P_DEAD, SEQ_LEN, WINDOW_START, KK, K_OUT, qk_scale,
    NC, NS, IDS_PER_SPLIT, T_SCORE, TOTAL,
    G: tl.constexpr, G_PAD: tl.constexpr, SROWS: tl.constexpr, SROWS_PAD: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, CHUNK_P: tl.constexpr, BLOCK_P: tl.constexpr,
    REDUCE: tl.constexpr, HAS_POS: tl.constexpr, TOPK_BLOCK: tl.constexpr, TOPK_SINGLE: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_FP32_DOT: tl.constexpr, BLOCK_S: tl.constexpr, SPIN_LOAD: tl.constexpr,
    PHASES: tl.constexpr,
):
    p_done = sync_ptr + 2  # score chunks counted in, per row
    p_ready = p_done + R  # page ids published, per row
    p_merge = p_ready + R  # attention splits finished, per row
    # Scores [B, H_KV * SROWS, P] and ids [B, H_KV, K_OUT], both contiguous.
    stride_sr = P
    stride_sh = SROWS * P
    cur = P - 1
    if HAS_POS:
        cur = (tl.load(pos_ptr).to(tl.int32) - 1) // PAGE

    i_t = tl.atomic_add(sync_ptr, 1)
    while i_t < TOTAL:
        i_w = i_t // (NC + 1)
        i_j = i_t % (NC + 1)
        if i_t >= T_SCORE:  # attention split of row (i_t - T_SCORE) // NS
            i_r = ((i_t - T_SCORE) // NS).to(tl.int64)
            i_split = (i_t - T_SCORE) % NS
            i_b = i_r // H_KV
            i_h = i_r % H_KV
            if PHASES >= 3:
                _wait_at_least(p_ready + i_r, 1, SPIN_LOAD)
                _attn._attn_split(
                    q_ptr, k_ptr, v_ptr, ids_ptr, valid_ptr, m_ptr, l_ptr, acc_ptr, i_b, i_h, i_split,
                    stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kc, stride_kd,
                    stride_vb, stride_vh, stride_vc, stride_vd, H_KV * K_OUT, K_OUT, 1, stride_vab, stride_vac,
                    H_KV, K_OUT, IDS_PER_SPLIT, NS, SEQ_LEN, WINDOW_START, qk_scale,
                    G, G_PAD, D, BLOCK_D, PAGE, BLOCK_N, USE_FP32_DOT, ".cg")
                tl.debug_barrier()
                i_ticket = tl.atomic_add(p_merge + i_r, 1, sem="acq_rel")
                if i_ticket == NS - 1:
                    _attn._merge_group(m_ptr, l_ptr, acc_ptr, out_ptr, i_b, i_h, H_KV, stride_ob, stride_oh,
                                       stride_od, NS, G, D, BLOCK_D, BLOCK_S)
                    tl.atomic_xchg(p_merge + i_r, 0)
                    tl.atomic_xchg(p_ready + i_r, 0)
        elif i_j < NC:  # score chunk i_j of row i_w
            if i_w < R:
                i_r = i_w.to(tl.int64)
                i_b = i_r // H_KV
                i_h = i_r % H_KV
                for i_p0 in range(i_j * CHUNK_P, tl.minimum(i_j * CHUNK_P + CHUNK_P, P), BLOCK_P):
                    _score._score_block(
                        q_ptr, kmin_ptr, kmax_ptr, s_ptr, i_b, i_h, i_p0 + tl.arange(0, BLOCK_P),
                        stride_qb, stride_qh, stride_qd, stride_nb, stride_nh, stride_np, stride_nd,
                        stride_xb, stride_xh, stride_xp, stride_xd, H_KV * stride_sh, stride_sr, 1,
                        P, P_DEAD, cur, G, D, BLOCK_D, BLOCK_P, REDUCE)
                tl.debug_barrier()
                tl.atomic_add(p_done + i_r, 1, sem="release")
        elif PHASES >= 2:  # Top-K of row i_w - 1 (its chunks were handed out in the wave before)
            i_r = (i_w - 1).to(tl.int64)
            if i_r >= 0:
                _wait_at_least(p_done + i_r, NC, SPIN_LOAD)
                tl.atomic_xchg(p_done + i_r, 0)
                _topk._topk_rows(s_ptr + i_r * stride_sh, ids_ptr + i_r * K_OUT, stride_sr, 1, 1, P, KK, K_OUT,
                                 SROWS, SROWS_PAD, TOPK_BLOCK, TOPK_SINGLE, False, ".cg")
                tl.debug_barrier()
                tl.atomic_xchg(p_ready + i_r, 1, sem="release")
        i_t = tl.atomic_add(sync_ptr, 1)
    # Every program has taken its last ticket once all have counted out: the last one rewinds the counters.
    i_out = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel")
    if i_out == tl.num_programs(0) - 1:
        tl.atomic_xchg(sync_ptr, 0)
        tl.atomic_xchg(sync_ptr + 1, 0)


def quest_decode(q, k_cache, v_cache, kmin, kmax, valid, seq_len: int, page_size: int, k: int, scale: float,
                 window_start: int = 0, reduce: str = "none", pos: torch.Tensor | None = None,
                 return_ids: bool = False):
    """Triton twin of `quest_decode_ref`: the same step in one persistent launch.

    Ties at the k-th score go to the lowest page ids (as `topk_pages`). The scores, ids and partials live in a
    workspace cached per device and shape (`clear_workspaces()` frees them), so calls on one device must not
    run concurrently on two streams. Returns a fresh `[B, H_q, D]` (and a copy of the ids with `return_ids`).
    """
    require_triton()
    B, H, P_cap, D = kmin.shape
    _, _, G, _, P = _score._check(q, kmin, kmax, seq_len, page_size, window_start, reduce)
    if k_cache.shape[:2] != (B, H) or k_cache.shape[3] != D or k_cache.shape[2] != P_cap * page_size:
        raise ValueError(f"k_cache must be [B={B}, H_kv={H}, {P_cap * page_size}, D={D}] to match kmin "
                         f"{tuple(kmin.shape)} at page_size {page_size}, got {tuple(k_cache.shape)}")
    if pos is not None and (pos.numel() != 1 or pos.dtype.is_floating_point or pos.device != q.device):
        raise ValueError(f"pos must be one integer on {q.device}, got {pos.dtype} {tuple(pos.shape)} on {pos.device}")
    if k < 1:
        raise ValueError(f"k must be >= 1 page, got {k}")
    srows = G if reduce == "none" else 1
    K_out = min(srows * k, P)
    ids_per_split = max(1, SPLIT_TOKENS // page_size)
    NS = triton.cdiv(K_out, ids_per_split)
    NC = triton.cdiv(P, CHUNK_P)
    ws = _workspace(q.device, B, H, H * srows, P, K_out, H * G, NS, D)
    out = torch.empty(B, H * G, D, dtype=q.dtype, device=q.device)
    ids = ws["ids"]
    # The attention reads the page ids as [B, H_kv, K_out] through the same checks as the standalone kernel.
    _attn._check(q, k_cache, v_cache, ids, valid, seq_len, page_size, window_start)
    R = B * H
    t_score = (R + 1) * (NC + 1)  # waves of a row's score chunks + the previous row's Top-K
    total = t_score + R * NS
    programs = 2 if interpreting() else min(total, PROGRAMS_PER_SM * num_sms(q.device))
    tile = max(16, next_pow2(P)) * next_pow2(srows)
    topk_single = tile <= TOPK_MAX_TILE
    topk_block = max(16, next_pow2(P)) if topk_single else max(16, TOPK_MAX_TILE // next_pow2(srows))
    valid_u8 = valid.view(torch.uint8)
    pos_arg = pos if pos is not None else ws["sync"]
    global LAST_LAUNCH
    LAST_LAUNCH = _quest_step_kernel[(programs,)](
        q, kmin, kmax, k_cache, v_cache, valid_u8, pos_arg,
        ws["scores"], ids, ws["m"], ws["l"], ws["acc"], out, ws["sync"],
        q.stride(0), q.stride(1), q.stride(2),
        kmin.stride(0), kmin.stride(1), kmin.stride(2), kmin.stride(3),
        kmax.stride(0), kmax.stride(1), kmax.stride(2), kmax.stride(3),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        valid_u8.stride(0), valid_u8.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        R, H, P, window_start // page_size, seq_len, window_start, min(k, P), K_out, scale * _attn.LOG2E,
        NC, NS, ids_per_split, t_score, total,
        G=G, G_PAD=max(16, next_pow2(G)), SROWS=srows, SROWS_PAD=next_pow2(srows),
        D=D, BLOCK_D=max(16, next_pow2(D)), PAGE=page_size, CHUNK_P=CHUNK_P, BLOCK_P=SCORE_BLOCK_P,
        REDUCE=_score._REDUCE_CODE[reduce], HAS_POS=pos is not None, TOPK_BLOCK=topk_block,
        TOPK_SINGLE=topk_single, BLOCK_N=_attn.BLOCK_N,
        USE_FP32_DOT=k_cache.dtype == torch.float32 or (interpreting() and k_cache.dtype == torch.bfloat16),
        BLOCK_S=max(2, next_pow2(NS)), SPIN_LOAD=SPIN_LOAD, PHASES=_PHASES, num_warps=NUM_WARPS,
    )
    return (out, ids.clone()) if return_ids else out
