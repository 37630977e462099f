"""Append new K/V tokens to a paged layer cache and update the pages' key min/max in one pass.

Layouts follow `_contract.md`: caches `[B, H_kv, C, D]`, metadata `[B, H_kv, C // S, D]`, `valid [B, C]`.
"""
import torch

from ._common import as_u8, check_cache, next_pow2, pdl_available, require_triton, tl, triton
from .bounds8 import check_chan, quantize_bounds_at_ref, quantize_bounds_ref, quantize_tile, quantize_tile_chan

__all__ = ["append_kv", "append_kv_ref", "append_ticket", "append_token_at", "append_token_at_ref"]


def _check(k_cache, v_cache, kmin, kmax, valid, k_new, v_new, valid_new, start):
    B, H, C, D = check_cache(k_cache, v_cache, kmin, kmax, valid)
    if k_new.shape != v_new.shape or k_new.shape[:2] != (B, H) or k_new.shape[3] != D:
        raise ValueError(f"new keys/values must be [B={B}, H_kv={H}, T, D={D}], got {tuple(k_new.shape)} and {tuple(v_new.shape)}")
    T = k_new.shape[2]
    if start < 0 or start + T > C:
        raise ValueError(f"appending {T} tokens at slot {start} overflows the capacity {C}; grow the cache first")
    if valid_new is not None and (valid_new.shape != (B, T) or valid_new.dtype not in (torch.bool, torch.uint8)):
        raise ValueError(f"valid_new must be a bool (or its uint8 view) [B={B}, T={T}] tensor, got {valid_new.dtype} "
                         f"{tuple(valid_new.shape)}")
    return B, H, C, D, T


def _split_bounds8(bounds8, H, D, device):
    """(kmin8, kmax8, kscale) or (kmin8, kmax8, kscale, chan): the codes and the channel scales (None: per-page)."""
    if bounds8 is None:
        return None, None
    if len(bounds8) not in (3, 4):
        raise ValueError(f"bounds8 is (kmin8, kmax8, kscale) or (kmin8, kmax8, kscale, chan), got {len(bounds8)} items")
    chan = bounds8[3] if len(bounds8) == 4 else None
    check_chan(chan, H, D, device)
    return tuple(bounds8[:3]), chan


def append_kv_ref(k_cache, v_cache, kmin, kmax, valid, k_new, v_new, valid_new, start: int, bounds8=None) -> None:
    """Write `k_new/v_new [B, H_kv, T, D]` into slots `[start, start+T)` and fold the valid ones into min/max.

    In place on every cache tensor; `valid_new [B, T]` bool (None: all valid). Plain PyTorch; also the CPU path.
    `bounds8` (kmin8, kmax8, kscale; QuestConfig(bounds="int8")): the touched pages' 8-bit bounds are requantized
    from the new min/max (triton_kernels/bounds8.py), in the same launch in the Triton twin; a fourth item, the
    channel scales `chan [H_kv, D]` (bounds="int8_channel"), quantizes on them.
    """
    B, H, C, D, T = _check(k_cache, v_cache, kmin, kmax, valid, k_new, v_new, valid_new, start)
    bounds8, chan = _split_bounds8(bounds8, H, D, k_cache.device)
    if T == 0:
        return
    S = C // kmin.shape[2]
    end = start + T
    k_cache[:, :, start:end] = k_new
    v_cache[:, :, start:end] = v_new
    valid[:, start:end] = True if valid_new is None else valid_new
    # Re-reduce every touched page from the stored keys: a page's min/max only depend on its own slots.
    p0, p1 = start // S, (end - 1) // S + 1
    keys = k_cache[:, :, p0 * S:p1 * S].reshape(B, H, p1 - p0, S, D)
    ok = valid[:, p0 * S:p1 * S].reshape(B, 1, p1 - p0, S, 1)
    slot = torch.arange(p0 * S, p1 * S, device=valid.device).reshape(1, 1, p1 - p0, S, 1)
    ok = ok & (slot < end)  # slots past the write are empty
    inf = torch.tensor(float("inf"), dtype=k_cache.dtype, device=k_cache.device)
    kmin[:, :, p0:p1] = torch.where(ok, keys, inf).amin(dim=3)
    kmax[:, :, p0:p1] = torch.where(ok, keys, -inf).amax(dim=3)
    if bounds8 is not None:
        quantize_bounds_ref(kmin, kmax, *bounds8, p0, p1 - p0, chan=chan)


@triton.jit
def _append_kv_kernel(
    kc_ptr, vc_ptr, kmin_ptr, kmax_ptr, valid_ptr, kn_ptr, vn_ptr, vnew_ptr, start_ptr,
    stride_kcb, stride_kch, stride_kcc, stride_kcd,
    stride_vcb, stride_vch, stride_vcc, stride_vcd,
    stride_nb, stride_nh, stride_np, stride_nd,
    stride_xb, stride_xh, stride_xp, stride_xd,
    stride_vab, stride_vac,
    stride_knb, stride_knh, stride_knt, stride_knd,
    stride_vnb, stride_vnh, stride_vnt, stride_vnd,
    stride_wb, stride_wt,
    H_KV, START, T,
    lo8_ptr, hi8_ptr, sc8_ptr, stride_lb, stride_lh, stride_lp, stride_ld, stride_hb, stride_hh, stride_hp, stride_hd,
    stride_sb, stride_sh, stride_sp, chan_ptr, stride_ch, stride_cd,
    ticket_ptr, N_PROGRAMS,
    PAGE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, USE_VALID_NEW: tl.constexpr,
    START_ON_DEVICE: tl.constexpr, USE_BOUNDS8: tl.constexpr, USE_CHAN: tl.constexpr, ADVANCE: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched dependently: resident before the kernel before it ends; nothing is read until it has
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if START_ON_DEVICE:  # a captured decode step: the write position is device data (one token, one page)
        START = tl.load(start_ptr)
        if ADVANCE:
            # The position moves on by one in this launch (not in a launch of its own): the last program to take a
            # ticket writes it, after every program has read it (each read is ordered before its ticket by the
            # atomic's release), and puts the ticket back to 0 for the next launch.
            if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == N_PROGRAMS - 1:
                tl.store(ticket_ptr, 0)
                tl.store(start_ptr, START + 1)
    i_bh = tl.program_id(0).to(tl.int64)  # batch x head offsets pass 2^31 elements on large caches
    i_b = i_bh // H_KV
    i_h = i_bh % H_KV
    i_page = START // PAGE + tl.program_id(1)
    o_slot = i_page * PAGE + tl.arange(0, PAGE)
    o_t = o_slot - START  # index into the new tokens
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m_t = (o_t >= 0) & (o_t < T)
    m_td = m_t[:, None] & m_d[None, :]
    b_k = tl.load(kn_ptr + i_b * stride_knb + i_h * stride_knh + o_t[:, None] * stride_knt + o_d[None, :] * stride_knd,
                  mask=m_td, other=0.0)
    b_v = tl.load(vn_ptr + i_b * stride_vnb + i_h * stride_vnh + o_t[:, None] * stride_vnt + o_d[None, :] * stride_vnd,
                  mask=m_td, other=0.0)
    tl.store(kc_ptr + i_b * stride_kcb + i_h * stride_kch + o_slot[:, None] * stride_kcc + o_d[None, :] * stride_kcd,
             b_k.to(kc_ptr.dtype.element_ty), mask=m_td)
    tl.store(vc_ptr + i_b * stride_vcb + i_h * stride_vch + o_slot[:, None] * stride_vcc + o_d[None, :] * stride_vcd,
             b_v.to(vc_ptr.dtype.element_ty), mask=m_td)
    if USE_VALID_NEW:
        m_ok = m_t & (tl.load(vnew_ptr + i_b * stride_wb + o_t * stride_wt, mask=m_t, other=0) != 0)
    else:
        m_ok = m_t
    # valid[] is shared by the KV heads: head 0 writes it; no program reads the slots being written.
    tl.store(valid_ptr + i_b * stride_vab + o_slot * stride_vac, m_ok.to(tl.uint8), mask=m_t & ((o_t * 0 + i_h) == 0))  # vector form, see m_old

    b_kf = b_k.to(kc_ptr.dtype.element_ty).to(tl.float32)
    b_lo = tl.min(tl.where(m_ok[:, None], b_kf, float("inf")), axis=0)
    b_hi = tl.max(tl.where(m_ok[:, None], b_kf, float("-inf")), axis=0)
    # Slots of this page before START were folded in by earlier appends, so their old min/max stand for them
    # (a decode step reads 2 x D values, not the page). A page starting at or after START begins empty.
    m_old = m_d & ((o_d * 0 + i_page * PAGE) < START)  # vector form: the interpreter rejects bool scalars in masks
    p_lo = kmin_ptr + i_b * stride_nb + i_h * stride_nh + i_page * stride_np + o_d * stride_nd
    p_hi = kmax_ptr + i_b * stride_xb + i_h * stride_xh + i_page * stride_xp + o_d * stride_xd
    b_lo = tl.minimum(b_lo, tl.load(p_lo, mask=m_old, other=float("inf")).to(tl.float32))
    b_hi = tl.maximum(b_hi, tl.load(p_hi, mask=m_old, other=float("-inf")).to(tl.float32))
    tl.store(p_lo, b_lo.to(kmin_ptr.dtype.element_ty), mask=m_d)
    tl.store(p_hi, b_hi.to(kmax_ptr.dtype.element_ty), mask=m_d)
    if USE_BOUNDS8:  # the page's 8-bit codes from the bounds just stored (bounds8.py's rule): no second launch
        b_lo_q = b_lo.to(kmin_ptr.dtype.element_ty).to(tl.float32)
        b_hi_q = b_hi.to(kmax_ptr.dtype.element_ty).to(tl.float32)
        if USE_CHAN:
            b_cs = tl.load(chan_ptr + i_h * stride_ch + o_d * stride_cd, mask=m_d, other=1.0)
            b_lo8, b_hi8, b_sc = quantize_tile_chan(b_lo_q, b_hi_q, b_cs, m_d)
        else:
            b_lo8, b_hi8, b_sc = quantize_tile(b_lo_q, b_hi_q, m_d)
        tl.store(lo8_ptr + i_b * stride_lb + i_h * stride_lh + i_page * stride_lp + o_d * stride_ld,
                 b_lo8.to(tl.int8), mask=m_d)
        tl.store(hi8_ptr + i_b * stride_hb + i_h * stride_hh + i_page * stride_hp + o_d * stride_hd,
                 b_hi8.to(tl.int8), mask=m_d)
        tl.store(sc8_ptr + i_b * stride_sb + i_h * stride_sh + i_page * stride_sp, b_sc)


def append_kv(k_cache, v_cache, kmin, kmax, valid, k_new, v_new, valid_new, start: int, bounds8=None) -> None:
    """Triton twin of `append_kv_ref` (same signature, same in-place effect).

    k_cache/v_cache `[B, H_kv, C, D]`, kmin/kmax `[B, H_kv, C // S, D]`, valid bool `[B, C]`, k_new/v_new
    `[B, H_kv, T, D]`, valid_new bool `[B, T]` or None; any strides. One program per (b, KV head, touched
    page). Unlike the reference it trusts the existing min/max of a page already partly filled before
    `start` (true whenever every write went through these functions) instead of re-reading its keys.
    """
    require_triton()
    B, H, C, D, T = _check(k_cache, v_cache, kmin, kmax, valid, k_new, v_new, valid_new, start)
    if T == 0:
        return
    S = C // kmin.shape[2]
    pages = (start + T - 1) // S - start // S + 1
    _launch(k_cache, v_cache, kmin, kmax, valid, k_new, v_new, valid_new, start, None, pages, bounds8)


def _launch(k_cache, v_cache, kmin, kmax, valid, k_new, v_new, valid_new, start, start_dev, pages, bounds8=None,
            ticket=None):
    B, H, _, D = k_cache.shape
    valid_u8 = as_u8(valid)
    vnew = valid_u8 if valid_new is None else as_u8(valid_new)  # unused when None
    bounds8, chan = _split_bounds8(bounds8, H, D, k_cache.device)
    lo8, hi8, sc8 = bounds8 if bounds8 is not None else (valid_u8, valid_u8, valid_u8)
    s8 = (*lo8.stride(), *hi8.stride(), *sc8.stride()) if bounds8 is not None else (0,) * 11
    # The captured decode's append (the position on the device) launches dependently where PDL is available: its
    # programs wait, resident, for the kernel before it to end, instead of being launched after it.
    pdl = start_dev is not None and pdl_available(k_cache.device)
    _append_kv_kernel[(B * H, pages)](
        k_cache, v_cache, kmin, kmax, valid_u8, k_new, v_new, vnew, start_dev if start_dev is not None else valid_u8,
        *k_cache.stride(), *v_cache.stride(), *kmin.stride(), *kmax.stride(), *valid_u8.stride(),
        *k_new.stride(), *v_new.stride(), vnew.stride(0), vnew.stride(1),
        H, start, k_new.shape[2], lo8, hi8, sc8, *s8,
        chan if chan is not None else valid_u8, *(chan.stride() if chan is not None else (0, 0)),
        ticket if ticket is not None else valid_u8, B * H * pages,
        PAGE=k_cache.shape[2] // kmin.shape[2], D=D, BLOCK_D=max(16, next_pow2(D)),
        USE_VALID_NEW=valid_new is not None, START_ON_DEVICE=start_dev is not None, USE_BOUNDS8=bounds8 is not None,
        USE_CHAN=chan is not None, ADVANCE=ticket is not None, PDL=pdl, num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )


def _check_at(k_cache, v_cache, kmin, kmax, valid, k_new, v_new, valid_new, pos, ticket=None):
    B, H, C, D, T = _check(k_cache, v_cache, kmin, kmax, valid, k_new, v_new, valid_new, 0)
    if T != 1:
        raise ValueError(f"append_token_at writes one token a sequence, got {T}; use append_kv for more")
    if pos.numel() != 1 or pos.dtype not in (torch.int32, torch.int64) or pos.device != k_cache.device:
        raise ValueError(f"pos must be one int32/int64 element on {k_cache.device}, got {pos.dtype} "
                         f"{tuple(pos.shape)} on {pos.device}")
    if ticket is not None and (ticket.numel() != 1 or ticket.dtype != torch.int32 or ticket.device != k_cache.device):
        raise ValueError(f"ticket must be one zeroed int32 element on {k_cache.device} (append_ticket(device)), got "
                         f"{ticket.dtype} {tuple(ticket.shape)} on {ticket.device}")


def append_ticket(device) -> torch.Tensor:
    """The zeroed int32 that `append_token_at(ticket=)` counts its programs on (each launch leaves it zeroed): one
    per cache layer, so that no two launches in flight share it."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def append_token_at_ref(k_cache, v_cache, kmin, kmax, valid, k_new, v_new, valid_new, pos, bounds8=None,
                        ticket=None) -> None:
    """`append_kv_ref` of one token at the slot held by the device scalar `pos` (no host sync; the caller
    keeps `pos` inside the capacity). Index ops only, so a CUDA graph can capture it. With `ticket`
    (`append_ticket`) `pos` also moves on by one, in place (the kernel does it in its own launch); without it the
    caller advances `pos`."""
    _check_at(k_cache, v_cache, kmin, kmax, valid, k_new, v_new, valid_new, pos, ticket)
    valid_new = valid_new.bool() if valid_new is not None else None
    S = k_cache.shape[2] // kmin.shape[2]
    idx = pos.view(1).long()
    page = torch.div(idx, S, rounding_mode="floor")
    k_cache.index_copy_(2, idx, k_new.to(k_cache.dtype))
    v_cache.index_copy_(2, idx, v_new.to(v_cache.dtype))
    lo = hi = k_new.to(k_cache.dtype)
    if valid_new is not None:  # a padded new token leaves the page's bounds untouched
        keep = valid_new.view(-1, 1, 1, 1)
        lo, hi = torch.where(keep, lo, float("inf")), torch.where(keep, hi, float("-inf"))
        valid.index_copy_(1, idx, valid_new.view(-1, 1))
    else:
        valid.index_fill_(1, idx, True)
    # A page starting at pos begins empty (like the kernel, whatever its old bounds held, e.g. after a crop).
    fresh = (idx % S == 0).view(1, 1, 1, 1)
    old_lo = torch.where(fresh, float("inf"), kmin.index_select(2, page))
    old_hi = torch.where(fresh, float("-inf"), kmax.index_select(2, page))
    kmin.index_copy_(2, page, torch.minimum(old_lo, lo).to(kmin.dtype))
    kmax.index_copy_(2, page, torch.maximum(old_hi, hi).to(kmax.dtype))
    if bounds8 is not None:  # the page holding slot pos (bounds8's _at takes the position after the write)
        bounds8, chan = _split_bounds8(bounds8, kmin.shape[1], kmin.shape[3], kmin.device)
        quantize_bounds_at_ref(kmin, kmax, *bounds8, pos + 1, S, chan=chan)
    if ticket is not None:
        pos += 1


def append_token_at(k_cache, v_cache, kmin, kmax, valid, k_new, v_new, valid_new, pos, bounds8=None,
                    ticket=None) -> None:
    """Triton twin of `append_token_at_ref`: one launch, the position read on the device (the 8-bit bounds too);
    with `ticket` the same launch advances `pos` (a captured decode step: one kernel a layer fewer)."""
    require_triton()
    _check_at(k_cache, v_cache, kmin, kmax, valid, k_new, v_new, valid_new, pos, ticket)
    _launch(k_cache, v_cache, kmin, kmax, valid, k_new, v_new, valid_new, 0, pos, 1, bounds8, ticket)
