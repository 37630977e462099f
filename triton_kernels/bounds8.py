"""8-bit page bounds: each page's key min/max (per KV head) as int8 codes on one fp32 scale, rounded outward.

For a page with element-wise min `lo` and max `hi` over D channels (fp32 math on the stored key dtype):

    scale = max(max_d |lo_d|, max_d |hi_d|) / 126, at least 2^-126 (a normal float: no flush to zero on a GPU)
    lo8_d = floor(lo_d / scale) - 1 where fp32's `lo8_d * scale` is still above lo_d (else floor)
    hi8_d = ceil(hi_d / scale) + 1 where fp32's `hi8_d * scale` is still below hi_d (else ceil)

so that `lo8 * scale <= lo` and `hi8 * scale >= hi` hold exactly as the score kernel computes them (one fp32
product): Quest's score over the codes, `sum_d max(q_d * lo8_d * scale, q_d * hi8_d * scale)`, is term by term
at least the score over `lo/hi` and stays an upper bound of q.k over the page. |lo / scale| <= 126 (+ 1 code
outward at most) fits int8. An empty page (`lo > hi`: +inf / -inf) gets lo8 = 127 > hi8 = -128 and scale 0, so
the score kernels' emptiness test (first channel, lo > hi) reads it as empty. Keys are finite (no inf / NaN).

Layouts: kmin/kmax `[B, H_kv, P, D]` in the key dtype; kmin8/kmax8 int8 `[B, H_kv, P, D]`; kscale fp32
`[B, H_kv, P]`. Scores read 2 * D + 4 bytes a page and KV head instead of 4 * D (fp16) or 8 * D (fp32).

Channel scales (QuestConfig(bounds="int8_channel")): the codes sit on a per-(KV head, channel) scale `chan [H_kv, D]`
fixed from the first keys the layer stores (`channel_scales`: max |k| / 127 over the prefill's valid tokens, at
least 2^-24), times a per-page power of two `kscale = 2^e`, e >= 0 the page's smallest exponent whose codes fit
in +-127 (one retry covers the division's rounding). With `se_d = chan_d * 2^e` (exact):

    lo8_d = floor(lo_d / se_d) - 1 where fp32's `lo8_d * se_d` is still above lo_d (else floor); hi8_d likewise

so `lo8_d * (chan_d * kscale) <= lo_d` holds exactly as the score kernel computes it. Keys spread over channels of
very different sizes keep codes on their own channel's step (a page's largest channel does not coarsen the rest);
a page past the prefill's range takes a larger exponent instead of clipping. Pages whose keys reach 2^100 times
their channel scale saturate at e = 126 (no longer an upper bound): far beyond any model's keys.
"""
import torch

from ._common import next_pow2, require_triton, tl, triton

__all__ = ["quantize_bounds", "quantize_bounds_ref", "quantize_bounds_at", "quantize_bounds_at_ref",
           "empty_bounds8", "channel_scales", "channel_scales_of_bounds", "CODE_LO_EMPTY", "CODE_HI_EMPTY"]

CODE_LO_EMPTY, CODE_HI_EMPTY = 127, -128
STEPS = 126.0  # codes a side: one below int8's 127 leaves room for the outward correction
MIN_SCALE = 2.0 ** -126
CHANNEL_STEPS = 127.0  # channel scales: the prefill's largest |key| of a channel is 127 codes
MIN_CHANNEL_SCALE = 2.0 ** -24  # below fp16's smallest subnormal step nothing is gained; keeps 2^e normal
MAX_EXP = 126


def empty_bounds8(B: int, H: int, P: int, D: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kmin8, kmax8, kscale of `P` empty pages."""
    return (torch.full((B, H, P, D), CODE_LO_EMPTY, dtype=torch.int8, device=device),
            torch.full((B, H, P, D), CODE_HI_EMPTY, dtype=torch.int8, device=device),
            torch.zeros(B, H, P, dtype=torch.float32, device=device))


def _check(kmin, kmax, kmin8, kmax8, kscale):
    if kmin.dim() != 4 or kmin.shape != kmax.shape or kmin.dtype != kmax.dtype or not kmin.is_floating_point():
        raise ValueError(f"kmin/kmax must be float [B, H_kv, P, D] of one dtype, got {kmin.dtype} "
                         f"{tuple(kmin.shape)} and {kmax.dtype} {tuple(kmax.shape)}")
    if kmin8.shape != kmin.shape or kmax8.shape != kmin.shape or kmin8.dtype != torch.int8 or kmax8.dtype != torch.int8:
        raise ValueError(f"kmin8/kmax8 must be int8 {tuple(kmin.shape)}, got {kmin8.dtype} {tuple(kmin8.shape)} and "
                         f"{kmax8.dtype} {tuple(kmax8.shape)}")
    if kscale.shape != kmin.shape[:3] or kscale.dtype != torch.float32:
        raise ValueError(f"kscale must be fp32 {tuple(kmin.shape[:3])}, got {kscale.dtype} {tuple(kscale.shape)}")
    return kmin.shape


def check_chan(chan, heads: int, dim: int, device):
    """Channel scales `chan` fp32 `[H_kv, D]` on `device` (QuestConfig(bounds="int8_channel")), or None."""
    if chan is not None and (chan.shape != (heads, dim) or chan.dtype != torch.float32 or chan.device != device):
        raise ValueError(f"chan must be fp32 [H_kv={heads}, D={dim}] on {device} (bounds8.channel_scales), got "
                         f"{chan.dtype} {tuple(chan.shape)} on {chan.device}")


def channel_scales(keys, valid=None, out=None):
    """The channel scales of `keys [B, H_kv, T, D]` (the first keys a layer stores: its prefill): fp32 `[H_kv, D]`,
    `max |k| / 127` over the batch and the tokens where `valid [B, T]` (None: all), at least 2^-24. Device ops only;
    `out` (fp32 `[H_kv, D]`) is written in place and returned (a captured step keeps reading the same tensor)."""
    B, H, T, D = keys.shape
    mag = keys.float().abs()
    if valid is not None:
        mag = mag * valid.to(mag.dtype)[:, None, :, None]
    return _scales_of(mag.amax(dim=(0, 2)) if T else mag.new_zeros(H, D), out)


def channel_scales_of_bounds(kmin, kmax, pages: int, out=None):
    """`channel_scales` from the page bounds `[B, H_kv, P, D]` of a layer's first `pages` pages (the same max |k|:
    a page's min and max range over its valid keys; empty pages count nothing)."""
    lo, hi = kmin[:, :, :pages].float(), kmax[:, :, :pages].float()
    mag = torch.where(lo > hi, 0.0, torch.maximum(lo.abs(), hi.abs()))
    return _scales_of(mag.amax(dim=(0, 2)) if pages else mag.new_zeros(kmin.shape[1], kmin.shape[3]), out)


def _scales_of(m, out):
    """Channel scales from each channel's largest |k| `m [H_kv, D]` (a tensor divisor: correctly rounded on every
    device, see _quantize)."""
    sc = (m / torch.full_like(m, CHANNEL_STEPS)).clamp_min(MIN_CHANNEL_SCALE)
    return sc if out is None else out.copy_(sc)


def _pow2(e):
    """2^e (integer-valued e in [0, 126]) built from its exponent bits: exact on every device."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _codes_on(lo, hi, se):
    """floor/ceil codes of `lo/hi` on the step `se`, corrected outward so `code * se` encloses them in fp32."""
    lo_q = torch.floor(lo / se)
    hi_q = torch.ceil(hi / se)
    lo_q = torch.where(lo_q * se > lo, lo_q - 1, lo_q)
    hi_q = torch.where(hi_q * se < hi, hi_q + 1, hi_q)
    return lo_q, hi_q


def _first_exp(mag):
    """ceil(log2(x)) clamped to [0, MAX_EXP] for fp32 x >= 0, from its bits (exact, the kernels' rule)."""
    bits = mag.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return e.clamp(0, MAX_EXP)


def _quantize_chan(lo, hi, chan):
    """fp32 `[B, H, P, D]` page bounds on channel scales `chan [H, D]` -> (lo8, hi8 int8, kscale = 2^e fp32)."""
    empty = lo > hi
    zero = torch.zeros((), dtype=torch.float32, device=lo.device)
    lo, hi = torch.where(empty, zero, lo), torch.where(empty, zero, hi)
    cs = chan[None, :, None, :]
    r = torch.maximum(lo.abs(), hi.abs()) / cs
    x = r.amax(-1, keepdim=True) / torch.full_like(r[..., :1], CHANNEL_STEPS)
    e = _first_exp(x)
    lo_q, hi_q = _codes_on(lo, hi, cs * _pow2(e))
    over = ((lo_q < -127) | (hi_q > 127)).any(-1, keepdim=True) & (e < MAX_EXP)
    e = torch.where(over, e + 1, e)  # the rounded division can put a code one past +-127: the next step fits
    lo_q, hi_q = _codes_on(lo, hi, cs * _pow2(e))
    lo_q, hi_q = lo_q.clamp(-127, 127), hi_q.clamp(-127, 127)  # only reached past MAX_EXP (module docstring)
    lo_q = torch.where(empty, float(CODE_LO_EMPTY), lo_q)
    hi_q = torch.where(empty, float(CODE_HI_EMPTY), hi_q)
    scale = torch.where(empty[..., :1], 0.0, _pow2(e))
    return lo_q.to(torch.int8), hi_q.to(torch.int8), scale[..., 0]


def _quantize(lo, hi):
    """fp32 `[..., D]` page bounds -> (lo8, hi8 int8, scale fp32 `[...]`): the module docstring's rule."""
    empty = lo > hi
    mag = torch.where(empty, 0.0, torch.maximum(lo.abs(), hi.abs())).amax(-1, keepdim=True)
    # A tensor divisor: torch on CUDA divides by a Python scalar as a product with its reciprocal (not correctly
    # rounded), which would make the reference differ from the kernel's div_rn on a GPU.
    scale = (mag / torch.full_like(mag, STEPS)).clamp_min(MIN_SCALE)
    zero = torch.zeros((), dtype=torch.float32, device=lo.device)
    lo_q, hi_q = _codes_on(torch.where(empty, zero, lo), torch.where(empty, zero, hi), scale)
    lo_q = torch.where(empty, float(CODE_LO_EMPTY), lo_q)
    hi_q = torch.where(empty, float(CODE_HI_EMPTY), hi_q)
    scale = torch.where(empty[..., :1], 0.0, scale)
    return lo_q.to(torch.int8), hi_q.to(torch.int8), scale[..., 0]


def quantize_bounds_ref(kmin, kmax, kmin8, kmax8, kscale, first: int = 0, count: int | None = None,
                        chan=None) -> None:
    """Write the 8-bit bounds of pages `[first, first + count)` (None: to the end) from kmin/kmax, in place; on the
    channel scales `chan [H_kv, D]` (module docstring) where given, else on one scale a page."""
    B, H, P, D = _check(kmin, kmax, kmin8, kmax8, kscale)
    check_chan(chan, H, D, kmin.device)
    count = P - first if count is None else count
    if not (0 <= first and count >= 0 and first + count <= P):
        raise ValueError(f"pages [{first}, {first + count}) are not within the {P} pages")
    if count == 0:
        return
    sl = slice(first, first + count)
    lo, hi, scale = _quantize_any(kmin[:, :, sl].float(), kmax[:, :, sl].float(), chan)
    kmin8[:, :, sl], kmax8[:, :, sl], kscale[:, :, sl] = lo, hi, scale


def _quantize_any(lo, hi, chan):
    return _quantize(lo, hi) if chan is None else _quantize_chan(lo, hi, chan)


def _check_pos(pos, device):
    if pos.numel() != 1 or pos.dtype not in (torch.int32, torch.int64) or pos.device != device:
        raise ValueError(f"pos must be one int32/int64 element on {device}, got {pos.dtype} {tuple(pos.shape)} "
                         f"on {pos.device}")


def quantize_bounds_at_ref(kmin, kmax, kmin8, kmax8, kscale, pos, page_size: int, chan=None) -> None:
    """`quantize_bounds_ref` of the one page holding slot `pos - 1` (the device position after a decode append:
    the page just written), read on the device. Index ops only, so a CUDA graph can capture it."""
    _, H, _, D = _check(kmin, kmax, kmin8, kmax8, kscale)
    check_chan(chan, H, D, kmin.device)
    _check_pos(pos, kmin.device)
    page = torch.div(pos.view(1).long() - 1, page_size, rounding_mode="floor")
    lo, hi, scale = _quantize_any(kmin.index_select(2, page).float(), kmax.index_select(2, page).float(), chan)
    kmin8.index_copy_(2, page, lo)
    kmax8.index_copy_(2, page, hi)
    kscale.index_copy_(2, page, scale)


@triton.jit
def quantize_tile(b_lo, b_hi, m_d):
    """The module docstring's rule on one page's fp32 bounds `[BLOCK_D]` (lanes past D masked by `m_d`): (lo8, hi8
    as fp32 code values, scale). Shared by the quantize kernels and the append kernel (USE_BOUNDS8)."""
    b_lo = tl.where(m_d, b_lo, 0.0)
    b_hi = tl.where(m_d, b_hi, 0.0)
    m_empty = b_lo > b_hi
    b_lo = tl.where(m_empty, 0.0, b_lo)
    b_hi = tl.where(m_empty, 0.0, b_hi)
    mag = tl.max(tl.maximum(tl.abs(b_lo), tl.abs(b_hi)), axis=0)
    # Correctly rounded division (as torch's), so that the codes equal the reference's bit for bit.
    scale = tl.maximum(tl.math.div_rn(mag, 126.0), 1.1754943508222875e-38)
    b_lo8 = tl.floor(tl.math.div_rn(b_lo, scale + tl.zeros_like(b_lo)))
    b_hi8 = tl.ceil(tl.math.div_rn(b_hi, scale + tl.zeros_like(b_hi)))
    b_lo8 = tl.where(b_lo8 * scale > b_lo, b_lo8 - 1.0, b_lo8)
    b_hi8 = tl.where(b_hi8 * scale < b_hi, b_hi8 + 1.0, b_hi8)
    b_lo8 = tl.where(m_empty, 127.0, b_lo8)
    b_hi8 = tl.where(m_empty, -128.0, b_hi8)
    # Every channel of a page is empty or none is (min and max range over the same valid tokens).
    scale = tl.where(tl.max(m_empty.to(tl.int32), axis=0) > 0, 0.0, scale)
    return b_lo8, b_hi8, scale


@triton.jit
def _tile_codes_on(b_lo, b_hi, b_se):
    b_lo8 = tl.floor(tl.math.div_rn(b_lo, b_se))
    b_hi8 = tl.ceil(tl.math.div_rn(b_hi, b_se))
    b_lo8 = tl.where(b_lo8 * b_se > b_lo, b_lo8 - 1.0, b_lo8)
    b_hi8 = tl.where(b_hi8 * b_se < b_hi, b_hi8 + 1.0, b_hi8)
    return b_lo8, b_hi8


@triton.jit
def _tile_pow2(e):
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def quantize_tile_chan(b_lo, b_hi, b_cs, m_d):
    """The channel-scale rule (module docstring) on one page's fp32 bounds `[BLOCK_D]` with its KV head's channel
    scales `b_cs` (lanes past D masked by `m_d`, their scale any positive value): (lo8, hi8 as fp32 code values,
    kscale = 2^e). Shared by the quantize kernels and the append kernel (USE_CHAN)."""
    b_lo = tl.where(m_d, b_lo, 0.0)
    b_hi = tl.where(m_d, b_hi, 0.0)
    m_empty = b_lo > b_hi
    b_lo = tl.where(m_empty, 0.0, b_lo)
    b_hi = tl.where(m_empty, 0.0, b_hi)
    b_r = tl.math.div_rn(tl.maximum(tl.abs(b_lo), tl.abs(b_hi)), b_cs)
    x = tl.math.div_rn(tl.max(b_r, axis=0), 127.0)
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.minimum(tl.maximum(e, 0), 126)
    b_lo8, b_hi8 = _tile_codes_on(b_lo, b_hi, b_cs * _tile_pow2(e))
    m_over = tl.where(m_d, (b_lo8 < -127.0) | (b_hi8 > 127.0), False)
    over = (tl.max(m_over.to(tl.int32), axis=0) > 0) & (e < 126)
    e = tl.where(over, e + 1, e)
    b_lo8, b_hi8 = _tile_codes_on(b_lo, b_hi, b_cs * _tile_pow2(e))
    b_lo8 = tl.minimum(tl.maximum(b_lo8, -127.0), 127.0)
    b_hi8 = tl.minimum(tl.maximum(b_hi8, -127.0), 127.0)
    b_lo8 = tl.where(m_empty, 127.0, b_lo8)
    b_hi8 = tl.where(m_empty, -128.0, b_hi8)
    scale = tl.where(tl.max(m_empty.to(tl.int32), axis=0) > 0, 0.0, _tile_pow2(e))
    return b_lo8, b_hi8, scale


@triton.jit
def _quantize_bounds_kernel(
    kmin_ptr, kmax_ptr, lo8_ptr, hi8_ptr, scale_ptr, pos_ptr,
    stride_nb, stride_nh, stride_np, stride_nd,
    stride_xb, stride_xh, stride_xp, stride_xd,
    stride_lb, stride_lh, stride_lp, stride_ld,
    stride_hb, stride_hh, stride_hp, stride_hd,
    stride_sb, stride_sh, stride_sp,
    H_KV, FIRST, chan_ptr, stride_ch, stride_cd,
    PAGE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, POS_ON_DEVICE: tl.constexpr, USE_CHAN: tl.constexpr,
):
    i_bh = tl.program_id(0).to(tl.int64)
    i_b = i_bh // H_KV
    i_h = i_bh % H_KV
    if POS_ON_DEVICE:  # a decode step: the page holding the last token written
        i_p = (tl.load(pos_ptr).to(tl.int64) - 1) // PAGE
    else:
        i_p = FIRST + tl.program_id(1).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_lo = tl.load(kmin_ptr + i_b * stride_nb + i_h * stride_nh + i_p * stride_np + o_d * stride_nd,
                   mask=m_d, other=0.0).to(tl.float32)
    b_hi = tl.load(kmax_ptr + i_b * stride_xb + i_h * stride_xh + i_p * stride_xp + o_d * stride_xd,
                   mask=m_d, other=0.0).to(tl.float32)
    if USE_CHAN:
        b_cs = tl.load(chan_ptr + i_h * stride_ch + o_d * stride_cd, mask=m_d, other=1.0)
        b_lo8, b_hi8, scale = quantize_tile_chan(b_lo, b_hi, b_cs, m_d)
    else:
        b_lo8, b_hi8, scale = quantize_tile(b_lo, b_hi, m_d)
    tl.store(lo8_ptr + i_b * stride_lb + i_h * stride_lh + i_p * stride_lp + o_d * stride_ld, b_lo8.to(tl.int8),
             mask=m_d)
    tl.store(hi8_ptr + i_b * stride_hb + i_h * stride_hh + i_p * stride_hp + o_d * stride_hd, b_hi8.to(tl.int8),
             mask=m_d)
    tl.store(scale_ptr + i_b * stride_sb + i_h * stride_sh + i_p * stride_sp, scale)


def _launch(kmin, kmax, kmin8, kmax8, kscale, first, pages, pos, page_size, chan=None):
    B, H, _, D = kmin.shape
    _quantize_bounds_kernel[(B * H, pages)](
        kmin, kmax, kmin8, kmax8, kscale, pos if pos is not None else kscale,
        *kmin.stride(), *kmax.stride(), *kmin8.stride(), *kmax8.stride(), *kscale.stride(),
        H, first, chan if chan is not None else kscale, *(chan.stride() if chan is not None else (0, 0)),
        PAGE=page_size, D=D, BLOCK_D=max(16, next_pow2(D)), POS_ON_DEVICE=pos is not None, USE_CHAN=chan is not None,
        num_warps=1,
    )


def quantize_bounds(kmin, kmax, kmin8, kmax8, kscale, first: int = 0, count: int | None = None,
                    chan=None) -> None:
    """Triton twin of `quantize_bounds_ref` (one program per batch row, KV head and page; any strides)."""
    require_triton()
    B, H, P, D = _check(kmin, kmax, kmin8, kmax8, kscale)
    check_chan(chan, H, D, kmin.device)
    count = P - first if count is None else count
    if not (0 <= first and count >= 0 and first + count <= P):
        raise ValueError(f"pages [{first}, {first + count}) are not within the {P} pages")
    if count:
        _launch(kmin, kmax, kmin8, kmax8, kscale, first, count, None, 1, chan)


def quantize_bounds_at(kmin, kmax, kmin8, kmax8, kscale, pos, page_size: int, chan=None) -> None:
    """Triton twin of `quantize_bounds_at_ref`: one launch, the page read from the device position."""
    require_triton()
    _, H, _, D = _check(kmin, kmax, kmin8, kmax8, kscale)
    check_chan(chan, H, D, kmin.device)
    _check_pos(pos, kmin.device)
    _launch(kmin, kmax, kmin8, kmax8, kscale, 0, 1, pos, page_size, chan)
