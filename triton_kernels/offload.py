"""K/V pages in host memory, a pool of resident pages on the device (quest_hf/offload.py builds on these).

A host-offloaded layer keeps its K/V `[B, H_kv, C, D]` in (pinned) host memory and, on the device, a pool of
`R` resident pages per (sequence, KV head) plus one scratch page:

    pool_k, pool_v  [B * H_kv, 1, (R + 1) * S, D]  resident page r = slots [r*S, (r+1)*S); page R is scratch
    pool_valid      [B * H_kv, (R + 1) * S] bool    which resident tokens a step may attend to (rebuilt each step)
    slot_of         [B, H_kv, P + 1] int32          logical page -> resident slot, -1 absent (column P: scratch)
    page_of         [B, H_kv, R + 1] int32          resident slot -> logical page, -1 empty (column R: scratch)
    stamp           [B, H_kv, R + 1] int64          the write position when the slot was last used (LRU)

One decode step: `assign_slots` maps the chosen page ids to slots (hits keep theirs, misses take the least
recently used slots that no hit holds, evicting their pages), `fetch_pages` copies the missing pages into their
slots (the current page from the device's `tail`, where the decode token was just written, every other page
from host memory) and writes every chosen slot's valid bits, and attention reads the pool through the slot ids
(`sparse_decode_attention` over the pool viewed as `B * H_kv` rows of one KV head). All fixed shapes, device
tensors only: the step can be captured in a CUDA graph.

The Triton kernels read and write host memory directly: a pinned (page-locked) host tensor has a device address
under unified virtual addressing, which Triton resolves from its `data_ptr()` (zero-copy over PCIe). Their
`_ref` twins are plain PyTorch with host and device on one device (the CPU path).
"""
import torch

from ._common import next_pow2, require_triton, tl, triton

__all__ = ["assign_slots", "assign_slots_ref", "fetch_pages", "fetch_pages_ref", "write_token_at",
           "write_token_at_ref"]


def assign_slots_ref(ids, slot_of, page_of, stamp, pos, page_size: int, counters=None):
    """Resident slots of the chosen pages `ids` int32 `[B, H_kv, K]` (-1 unused), LRU eviction, in place.

    Returns `(slots int32 [B, H_kv, K], fetch bool [B, H_kv, K])`: the slot holding each chosen page after this
    step (-1 where the id is -1 or the spare last page `P - 1`, which holds no token) and whether it must be
    copied in (a miss, or the current page `(pos - 1) // S`, which changes every step). Needs `R >= K`: then the
    misses' slots are the oldest among those no hit of this step holds (hits are stamped with `pos` first, every
    other slot is older). `counters` int64 `[4]` (or None) accumulates: steps, hits, misses (both over chosen
    pages other than the current one), pages fetched. Plain tensor ops on the device: no host sync. The ids of a
    row must be distinct (the selection contract): two misses of one page would take two slots.
    """
    B, H, K = ids.shape
    P, R = slot_of.shape[2] - 1, page_of.shape[2] - 1
    if K > R:
        raise ValueError(f"a decode step chose {K} pages per KV head but the resident pool holds {R}: give the pool "
                         f"at least {K} pages (QuestConfig.offload_pages)")
    now = pos.view(1, 1, 1).long().expand(B, H, K)
    i = ids.long()
    live = (i >= 0) & (i < P - 1)  # the spare last page is never written: nothing to read
    cur = live & (i == torch.div(pos.long() - 1, page_size, rounding_mode="floor"))
    pid = torch.where(live, i, P)
    slot = slot_of.gather(2, pid).long()
    hit = live & (slot >= 0)
    miss = live & (slot < 0)
    stamp.scatter_(2, torch.where(hit, slot, R), now)
    # The K oldest slots, oldest first (ties: the lower slot); the misses take them in order (rank among misses).
    key = (stamp[..., :R] + 1) * (R + 1) + torch.arange(R, device=stamp.device)
    oldest = torch.topk(key, K, dim=2, largest=False, sorted=True).indices
    victim = oldest.gather(2, (miss.long().cumsum(2) - 1).clamp_min(0))
    vslot = torch.where(miss, victim, R)
    evicted = page_of.gather(2, vslot).long()
    slot_of.scatter_(2, torch.where(miss & (evicted >= 0), evicted, P), -1)
    slot_of.scatter_(2, torch.where(miss, pid, P), victim.to(slot_of.dtype))
    page_of.scatter_(2, vslot, pid.to(page_of.dtype))
    stamp.scatter_(2, vslot, now)
    slot_of[..., P] = -1  # the scratch columns took the masked writes
    page_of[..., R] = -1
    stamp[..., R] = -1
    slots = torch.where(live, torch.where(miss, victim, slot), -1).to(torch.int32)
    fetch = miss | cur
    if counters is not None:
        other = ~cur
        counters.add_(torch.stack([counters.new_ones(()), (hit & other).sum(), (miss & other).sum(), fetch.sum()]))
    return slots, fetch


class _Mapped:
    """A host tensor seen from the device: Triton takes any object with `data_ptr()` and `dtype`, and resolves a
    page-locked host address to its device alias (unified virtual addressing); this keeps a CPU tensor from being
    taken for a device one by any check on `.device`."""

    def __init__(self, t: torch.Tensor):
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


def _mapped(t: torch.Tensor, device: torch.device):
    """`t` as a kernel argument for a launch on `device`: itself, or a `_Mapped` host tensor for a CUDA launch."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t
    if not (getattr(t, "_page_locked", False) or t.is_pinned()):
        raise ValueError("host K/V read by a CUDA kernel must be page-locked (pinned or cudaHostRegister'd)")
    return _Mapped(t)


@triton.jit
def _assign_slots_kernel(
    ids_ptr, slot_of_ptr, page_of_ptr, stamp_ptr, pos_ptr, slots_ptr, fetch_ptr, scratch_ptr, cnt_ptr,
    stride_ib, stride_ih, stride_ik,
    stride_sb, stride_sh, stride_sp,
    stride_pb, stride_ph, stride_pr,
    stride_tb, stride_th, stride_tr,
    stride_ob, stride_oh, stride_ok,
    H_KV, K, P, R,
    PAGE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, HAS_COUNTERS: tl.constexpr,
):
    """One (sequence, KV head): the whole LRU step of `assign_slots_ref` (hits stamped, the slots sorted by last use
    with the slot as tie-break, the i-th miss takes the i-th oldest, its page evicted) in one program."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_b = i_bh // H_KV
    i_h = i_bh % H_KV
    i_now = tl.load(pos_ptr).to(tl.int64)
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < K
    b_id = tl.load(ids_ptr + i_b * stride_ib + i_h * stride_ih + o_k * stride_ik, mask=m_k, other=-1).to(tl.int64)
    m_live = (b_id >= 0) & (b_id < P - 1)  # the spare last page holds no token
    m_cur = m_live & (b_id == (i_now - 1) // PAGE)
    p_so = slot_of_ptr + i_b * stride_sb + i_h * stride_sh
    p_po = page_of_ptr + i_b * stride_pb + i_h * stride_ph
    p_st = stamp_ptr + i_b * stride_tb + i_h * stride_th
    b_slot = tl.load(p_so + tl.maximum(b_id, 0) * stride_sp, mask=m_live, other=-1).to(tl.int64)
    m_hit = m_live & (b_slot >= 0)
    m_miss = m_live & (b_slot < 0)
    b_now = tl.zeros([BLOCK_K], dtype=tl.int64) + i_now
    tl.store(p_st + tl.maximum(b_slot, 0) * stride_tr, b_now, mask=m_hit)
    tl.debug_barrier()  # the hits' stamps are seen by the sort below (one program, global memory)
    o_r = tl.arange(0, BLOCK_R)
    m_r = o_r < R
    b_st = tl.load(p_st + o_r * stride_tr, mask=m_r, other=0)
    b_key = tl.where(m_r, (b_st + 1) * (R + 1) + o_r, 9223372036854775807)
    b_sorted = tl.sort(b_key)
    p_scr = scratch_ptr + i_bh * BLOCK_R
    tl.store(p_scr + o_r, (b_sorted % (R + 1)).to(tl.int32))
    tl.debug_barrier()
    b_rank = tl.cumsum(m_miss.to(tl.int32), axis=0) - 1
    b_victim = tl.load(p_scr + tl.maximum(b_rank, 0), mask=m_miss, other=0).to(tl.int64)
    b_evicted = tl.load(p_po + b_victim * stride_pr, mask=m_miss, other=-1).to(tl.int64)
    tl.store(p_so + tl.maximum(b_evicted, 0) * stride_sp, tl.zeros([BLOCK_K], dtype=tl.int32) - 1,
             mask=m_miss & (b_evicted >= 0))
    tl.store(p_so + tl.maximum(b_id, 0) * stride_sp, b_victim.to(tl.int32), mask=m_miss)
    tl.store(p_po + b_victim * stride_pr, b_id.to(tl.int32), mask=m_miss)
    tl.store(p_st + b_victim * stride_tr, b_now, mask=m_miss)
    b_out = tl.where(m_live, tl.where(m_miss, b_victim, b_slot), -1)
    o_out = i_b * stride_ob + i_h * stride_oh + o_k * stride_ok
    tl.store(slots_ptr + o_out, b_out.to(tl.int32), mask=m_k)
    tl.store(fetch_ptr + o_out, (m_miss | m_cur).to(tl.uint8), mask=m_k)
    if HAS_COUNTERS:
        tl.atomic_add(cnt_ptr + 1, tl.sum((m_hit & ~m_cur).to(tl.int64), axis=0))
        tl.atomic_add(cnt_ptr + 2, tl.sum((m_miss & ~m_cur).to(tl.int64), axis=0))
        tl.atomic_add(cnt_ptr + 3, tl.sum((m_miss | m_cur).to(tl.int64), axis=0))
        if i_bh == 0:
            tl.atomic_add(cnt_ptr, 1)


def assign_slots(ids, slot_of, page_of, stamp, pos, page_size: int, counters=None):
    """Triton twin of `assign_slots_ref` (same slots, same tables, same counters): one program per (sequence, KV
    head) instead of some fifty small tensor ops a layer and step. Workspace: `B * H_kv * next_pow2(R)` int32."""
    require_triton()
    B, H, K = ids.shape
    P, R = slot_of.shape[2] - 1, page_of.shape[2] - 1
    if K > R:
        raise ValueError(f"a decode step chose {K} pages per KV head but the resident pool holds {R}: give the pool "
                         f"at least {K} pages (QuestConfig.offload_pages)")
    block_r = max(16, next_pow2(R))
    slots = torch.empty(B, H, K, dtype=torch.int32, device=ids.device)
    fetch = torch.empty(B, H, K, dtype=torch.bool, device=ids.device)
    scratch = torch.empty(B * H, block_r, dtype=torch.int32, device=ids.device)
    _assign_slots_kernel[(B * H,)](
        ids, slot_of, page_of, stamp, pos, slots, fetch.view(torch.uint8), scratch,
        counters if counters is not None else stamp,
        *ids.stride(), *slot_of.stride(), *page_of.stride(), *stamp.stride(), *slots.stride(),
        H, K, P, R,
        PAGE=page_size, BLOCK_K=max(16, next_pow2(K)), BLOCK_R=block_r, HAS_COUNTERS=counters is not None,
        num_warps=8 if block_r >= 2048 else 4,
    )
    return slots, fetch


def _check_fetch(host_k, host_v, tail_k, tail_v, valid, ids, slots, fetch, pool_k, pool_v, pool_valid, pos,
                 page_size):
    B, H, C, D = host_k.shape
    S = page_size
    if host_v.shape[:3] != (B, H, C) or host_v.dtype != host_k.dtype or C % S:
        raise ValueError(f"host K/V must be [B, H_kv, C, D] of one dtype, C a multiple of {S}; got "
                         f"{tuple(host_k.shape)} {host_k.dtype} and {tuple(host_v.shape)} {host_v.dtype}")
    Dv = host_v.shape[3]
    if tail_k.shape != (B, H, S, D) or tail_v.shape != (B, H, S, Dv):
        raise ValueError(f"tail_k/tail_v must be [B={B}, H_kv={H}, S={S}, D], got {tuple(tail_k.shape)} and "
                         f"{tuple(tail_v.shape)}")
    if pool_k.dim() != 4 or pool_k.shape[:2] != (B * H, 1) or pool_k.shape[2] % S or pool_k.shape[3] != D:
        raise ValueError(f"pool_k must be [B*H_kv={B * H}, 1, (R+1)*S, D={D}], got {tuple(pool_k.shape)}")
    if pool_v.shape != (*pool_k.shape[:3], Dv) or pool_valid.shape != (B * H, pool_k.shape[2]):
        raise ValueError(f"pool_v / pool_valid must match pool_k {tuple(pool_k.shape)}, got {tuple(pool_v.shape)} "
                         f"and {tuple(pool_valid.shape)}")
    if valid.shape != (B, C) or valid.dtype != torch.bool or pool_valid.dtype != torch.bool:
        raise ValueError(f"valid must be bool [B={B}, C={C}] and pool_valid bool, got {valid.dtype} "
                         f"{tuple(valid.shape)} and {pool_valid.dtype}")
    K = ids.shape[2]
    for name, t, dt in (("ids", ids, torch.int32), ("slots", slots, torch.int32), ("fetch", fetch, torch.bool)):
        if t.shape != (B, H, K) or t.dtype != dt:
            raise ValueError(f"{name} must be {dt} [B={B}, H_kv={H}, K={K}], got {t.dtype} {tuple(t.shape)}")
    if pos.numel() != 1 or pos.dtype.is_floating_point:
        raise ValueError(f"pos must be one integer tensor, got {pos.dtype} {tuple(pos.shape)}")
    return B, H, C, D, Dv, K


def fetch_pages_ref(host_k, host_v, tail_k, tail_v, valid, ids, slots, fetch, pool_k, pool_v, pool_valid, pos,
                    page_size: int, window: int = 0) -> None:
    """Fill the resident slots of one decode step, in place.

    host_k/host_v `[B, H_kv, C, D]` (host memory), tail_k/tail_v `[B, H_kv, S, D]` (the current page, on the
    device), valid bool `[B, C]` (device), ids/slots int32 and fetch bool `[B, H_kv, K]` (`assign_slots`),
    pool_k/pool_v `[B * H_kv, 1, (R + 1) * S, D]`, pool_valid bool `[B * H_kv, (R + 1) * S]`, pos the device
    write position. Where `fetch`: the page's K/V are copied into its slot (the current page `(pos - 1) // S` from
    the tail, others from the host). Every chosen slot (`slots >= 0`) gets its tokens' valid bits, cleared before
    `pos - window` with a sliding `window` (0: none), so attention over the pool needs no window of its own.
    Plain PyTorch with every tensor on one device.
    """
    B, H, C, D, Dv, K = _check_fetch(host_k, host_v, tail_k, tail_v, valid, ids, slots, fetch, pool_k, pool_v,
                                     pool_valid, pos, page_size)
    S, R = page_size, pool_k.shape[2] // page_size - 1
    page = ids.long().clamp_min(0)
    cur = page == torch.div(pos.long() - 1, S, rounding_mode="floor")
    src_k = host_k.reshape(B, H, C // S, S, D).gather(2, page[..., None, None].expand(B, H, K, S, D))
    src_v = host_v.reshape(B, H, C // S, S, Dv).gather(2, page[..., None, None].expand(B, H, K, S, Dv))
    src_k = torch.where(cur[..., None, None], tail_k[:, :, None], src_k)
    src_v = torch.where(cur[..., None, None], tail_v[:, :, None], src_v)
    dst = torch.where(fetch & (slots >= 0), slots.long(), R)  # the scratch page takes what is not copied
    pool_k.view(B, H, R + 1, S, D).scatter_(2, dst[..., None, None].expand(B, H, K, S, D), src_k.to(pool_k.dtype))
    pool_v.view(B, H, R + 1, S, Dv).scatter_(2, dst[..., None, None].expand(B, H, K, S, Dv), src_v.to(pool_v.dtype))
    tok = page[..., None] * S + torch.arange(S, device=ids.device)  # [B, H, K, S]
    ok = valid.gather(1, tok.reshape(B, -1).clamp_max(C - 1)).reshape(B, H, K, S)
    if window:
        ok = ok & (tok >= pos.long() - window)
    dst = torch.where(slots >= 0, slots.long(), R)
    pool_valid.view(B, H, R + 1, S).scatter_(2, dst[..., None].expand(B, H, K, S), ok)


@triton.jit
def _fetch_pages_kernel(
    hk_ptr, hv_ptr, tk_ptr, tv_ptr, valid_ptr, ids_ptr, slots_ptr, fetch_ptr, pk_ptr, pv_ptr, pvalid_ptr, pos_ptr,
    stride_hkb, stride_hkh, stride_hkc, stride_hkd,
    stride_hvb, stride_hvh, stride_hvc, stride_hvd,
    stride_tkb, stride_tkh, stride_tks, stride_tkd,
    stride_tvb, stride_tvh, stride_tvs, stride_tvd,
    stride_vab, stride_vac,
    stride_ib, stride_ih, stride_ik,
    stride_pkr, stride_pkc, stride_pkd,
    stride_pvr, stride_pvc, stride_pvd,
    stride_par, stride_pac,
    H_KV, C, WINDOW,
    PAGE: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """One chosen page (i_bh, i_k): its valid bits into its slot and, when fetched, its K/V (host or tail)."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_k = tl.program_id(1)
    i_b = i_bh // H_KV
    i_h = i_bh % H_KV
    o_id = i_b * stride_ib + i_h * stride_ih + i_k * stride_ik
    i_page = tl.load(ids_ptr + o_id).to(tl.int64)
    i_slot = tl.load(slots_ptr + o_id).to(tl.int64)
    i_fetch = tl.load(fetch_ptr + o_id)
    i_pos = tl.load(pos_ptr).to(tl.int64)
    o_t = tl.arange(0, PAGE)
    # Scalars enter masks in vector form: the interpreter rejects bool scalars there.
    m_live = (o_t * 0 + i_slot) >= 0
    m_get = m_live & ((o_t * 0 + i_fetch) != 0)
    m_cur = (o_t * 0 + i_page) == (i_pos - 1) // PAGE
    o_tok = tl.maximum(i_page, 0) * PAGE + o_t
    b_ok = tl.load(valid_ptr + i_b * stride_vab + o_tok * stride_vac, mask=m_live & (o_tok < C), other=0) != 0
    if HAS_WINDOW:
        b_ok = b_ok & (o_tok >= i_pos - WINDOW)
    o_dst = tl.maximum(i_slot, 0) * PAGE + o_t
    tl.store(pvalid_ptr + i_bh * stride_par + o_dst * stride_pac, b_ok.to(tl.uint8), mask=m_live)

    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m_host = (m_get & ~m_cur)[:, None] & m_d[None, :]
    m_tail = (m_get & m_cur)[:, None] & m_d[None, :]
    b_k = tl.load(hk_ptr + i_b * stride_hkb + i_h * stride_hkh + o_tok[:, None] * stride_hkc
                  + o_d[None, :] * stride_hkd, mask=m_host, other=0.0)
    b_kt = tl.load(tk_ptr + i_b * stride_tkb + i_h * stride_tkh + o_t[:, None] * stride_tks
                   + o_d[None, :] * stride_tkd, mask=m_tail, other=0.0)
    b_k = tl.where(m_tail, b_kt, b_k)
    tl.store(pk_ptr + i_bh * stride_pkr + o_dst[:, None] * stride_pkc + o_d[None, :] * stride_pkd,
             b_k.to(pk_ptr.dtype.element_ty), mask=m_get[:, None] & m_d[None, :])
    o_e = tl.arange(0, BLOCK_DV)
    m_e = o_e < DV
    m_host = (m_get & ~m_cur)[:, None] & m_e[None, :]
    m_tail = (m_get & m_cur)[:, None] & m_e[None, :]
    b_v = tl.load(hv_ptr + i_b * stride_hvb + i_h * stride_hvh + o_tok[:, None] * stride_hvc
                  + o_e[None, :] * stride_hvd, mask=m_host, other=0.0)
    b_vt = tl.load(tv_ptr + i_b * stride_tvb + i_h * stride_tvh + o_t[:, None] * stride_tvs
                   + o_e[None, :] * stride_tvd, mask=m_tail, other=0.0)
    b_v = tl.where(m_tail, b_vt, b_v)
    tl.store(pv_ptr + i_bh * stride_pvr + o_dst[:, None] * stride_pvc + o_e[None, :] * stride_pvd,
             b_v.to(pv_ptr.dtype.element_ty), mask=m_get[:, None] & m_e[None, :])


def fetch_pages(host_k, host_v, tail_k, tail_v, valid, ids, slots, fetch, pool_k, pool_v, pool_valid, pos,
                page_size: int, window: int = 0) -> None:
    """Triton twin of `fetch_pages_ref`: one program per chosen page; host K/V read in place (zero-copy).

    `host_k/host_v` may be pinned host tensors (their device address is taken from `data_ptr()` under unified
    virtual addressing); everything else is on the device. Copies only the fetched pages: the bytes crossing
    PCIe are `fetch.sum() * S * (D + Dv) * elt`, less the current page's (read from the device tail)."""
    require_triton()
    B, H, C, D, Dv, K = _check_fetch(host_k, host_v, tail_k, tail_v, valid, ids, slots, fetch, pool_k, pool_v,
                                     pool_valid, pos, page_size)
    if K == 0:
        return
    valid_u8, pvalid_u8, fetch_u8 = valid.view(torch.uint8), pool_valid.view(torch.uint8), fetch.view(torch.uint8)
    pk, pv = pool_k[:, 0], pool_v[:, 0]
    _fetch_pages_kernel[(B * H, K)](
        _mapped(host_k, ids.device), _mapped(host_v, ids.device), tail_k, tail_v, valid_u8, ids, slots, fetch_u8, pk, pv, pvalid_u8, pos,
        *host_k.stride(), *host_v.stride(), *tail_k.stride(), *tail_v.stride(), *valid_u8.stride(),
        *ids.stride(), *pk.stride(), *pv.stride(), *pvalid_u8.stride(),
        H, C, window,
        PAGE=page_size, D=D, DV=Dv, BLOCK_D=max(16, next_pow2(D)), BLOCK_DV=max(16, next_pow2(Dv)),
        HAS_WINDOW=window > 0, num_warps=4,
    )


def _check_write(host_k, host_v, tail_k, tail_v, k_new, v_new, pos):
    B, H, C, D = host_k.shape
    if k_new.shape != (B, H, 1, D) or v_new.shape != (B, H, 1, host_v.shape[3]):
        raise ValueError(f"k_new/v_new must be one token [B={B}, H_kv={H}, 1, D], got {tuple(k_new.shape)} and "
                         f"{tuple(v_new.shape)}")
    if tail_k.shape[:2] != (B, H) or tail_v.shape[:3] != tail_k.shape[:3]:
        raise ValueError(f"tail_k/tail_v must be [B={B}, H_kv={H}, S, D], got {tuple(tail_k.shape)} and "
                         f"{tuple(tail_v.shape)}")
    if pos.numel() != 1 or pos.dtype.is_floating_point:
        raise ValueError(f"pos must be one integer tensor, got {pos.dtype} {tuple(pos.shape)}")
    return B, H, C, D, tail_k.shape[2]


def write_token_at_ref(host_k, host_v, tail_k, tail_v, k_new, v_new, pos) -> None:
    """One decode token `k_new/v_new [B, H_kv, 1, D]` into host slot `pos` and tail slot `pos % S`, in place
    (host `[B, H_kv, C, D]`, tail `[B, H_kv, S, D]`; `pos` on the device). Index ops, every tensor on one device."""
    _check_write(host_k, host_v, tail_k, tail_v, k_new, v_new, pos)
    idx = pos.view(1).long()
    host_k.index_copy_(2, idx, k_new.to(host_k.dtype))
    host_v.index_copy_(2, idx, v_new.to(host_v.dtype))
    t = idx % tail_k.shape[2]
    tail_k.index_copy_(2, t, k_new.to(tail_k.dtype))
    tail_v.index_copy_(2, t, v_new.to(tail_v.dtype))


@triton.jit
def _write_token_kernel(
    hk_ptr, hv_ptr, tk_ptr, tv_ptr, kn_ptr, vn_ptr, pos_ptr,
    stride_hkb, stride_hkh, stride_hkc, stride_hkd,
    stride_hvb, stride_hvh, stride_hvc, stride_hvd,
    stride_tkb, stride_tkh, stride_tks, stride_tkd,
    stride_tvb, stride_tvh, stride_tvs, stride_tvd,
    stride_knb, stride_knh, stride_knd,
    stride_vnb, stride_vnh, stride_vnd,
    H_KV, PAGE: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    i_bh = tl.program_id(0).to(tl.int64)
    i_b = i_bh // H_KV
    i_h = i_bh % H_KV
    i_pos = tl.load(pos_ptr).to(tl.int64)
    i_t = i_pos % PAGE
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_k = tl.load(kn_ptr + i_b * stride_knb + i_h * stride_knh + o_d * stride_knd, mask=m_d)
    tl.store(hk_ptr + i_b * stride_hkb + i_h * stride_hkh + i_pos * stride_hkc + o_d * stride_hkd,
             b_k.to(hk_ptr.dtype.element_ty), mask=m_d)
    tl.store(tk_ptr + i_b * stride_tkb + i_h * stride_tkh + i_t * stride_tks + o_d * stride_tkd,
             b_k.to(tk_ptr.dtype.element_ty), mask=m_d)
    o_e = tl.arange(0, BLOCK_DV)
    m_e = o_e < DV
    b_v = tl.load(vn_ptr + i_b * stride_vnb + i_h * stride_vnh + o_e * stride_vnd, mask=m_e)
    tl.store(hv_ptr + i_b * stride_hvb + i_h * stride_hvh + i_pos * stride_hvc + o_e * stride_hvd,
             b_v.to(hv_ptr.dtype.element_ty), mask=m_e)
    tl.store(tv_ptr + i_b * stride_tvb + i_h * stride_tvh + i_t * stride_tvs + o_e * stride_tvd,
             b_v.to(tv_ptr.dtype.element_ty), mask=m_e)


def write_token_at(host_k, host_v, tail_k, tail_v, k_new, v_new, pos) -> None:
    """Triton twin of `write_token_at_ref`: one program per (b, KV head); the host slot written in place."""
    require_triton()
    B, H, C, D, S = _check_write(host_k, host_v, tail_k, tail_v, k_new, v_new, pos)
    kn, vn = k_new[:, :, 0], v_new[:, :, 0]
    Dv = host_v.shape[3]
    _write_token_kernel[(B * H,)](
        _mapped(host_k, k_new.device), _mapped(host_v, k_new.device), tail_k, tail_v, kn, vn, pos,
        *host_k.stride(), *host_v.stride(), *tail_k.stride(), *tail_v.stride(), *kn.stride(), *vn.stride(),
        H, PAGE=S, D=D, DV=Dv, BLOCK_D=max(16, next_pow2(D)), BLOCK_DV=max(16, next_pow2(Dv)), num_warps=1,
    )
