"""Quest page scores: the upper bound `sum_i max(q_i * min_i, q_i * max_i)` of q.k over a page (arXiv 2406.10774)."""
from dataclasses import dataclass

import torch

from ._common import (
    cdiv,
    check_due,
    check_out,
    check_query,
    due_arg,
    due_flag,
    interpreting,
    next_pow2,
    require_triton,
    tl,
    triton,
)
from .bounds8 import check_chan

__all__ = ["packed_halves", "packed_words", "score_form", "score_pages", "score_pages_ref", "REDUCES"]

# How the query heads of a KV group are combined: "none" keeps one row per query head (the union
# policy takes the union of their Top-K later); "max"/"sum" share one score row per KV head.
REDUCES = ("none", "max", "sum")


def _check(q, kmin, kmax, seq_len, page_size, window_start, reduce, scale=None, chan=None):
    B, H, P_cap, D = kmin.shape
    G = check_query(q, H, D, B)
    if kmax.shape != kmin.shape or kmax.dtype != kmin.dtype:
        raise ValueError(f"kmin/kmax must share shape and dtype, got {kmin.dtype} {tuple(kmin.shape)} and "
                         f"{kmax.dtype} {tuple(kmax.shape)}")
    if (kmin.dtype == torch.int8) != (scale is not None):
        raise ValueError("int8 bounds (triton_kernels/bounds8.py) need their fp32 scale= [B, H_kv, P]; "
                         f"float bounds take none (got {kmin.dtype} bounds, scale {'given' if scale is not None else None})")
    if scale is not None and (scale.shape != (B, H, P_cap) or scale.dtype != torch.float32 or scale.device != q.device):
        raise ValueError(f"scale must be fp32 [B={B}, H_kv={H}, P={P_cap}] on {q.device}, got {scale.dtype} "
                         f"{tuple(scale.shape)} on {scale.device}")
    if chan is not None and scale is None:
        raise ValueError("chan= (channel scales) goes with int8 codes and their per-page scale=; float bounds take none")
    check_chan(chan, H, D, q.device)
    if reduce not in REDUCES:
        raise ValueError(f"reduce must be one of {REDUCES}, got {reduce!r}")
    P = -(-seq_len // page_size)
    if seq_len < 1 or P > P_cap:
        raise ValueError(f"seq_len {seq_len} must be in [1, {P_cap * page_size}]")
    if not 0 <= window_start < seq_len:
        raise ValueError(f"window_start {window_start} must be in [0, seq_len={seq_len})")
    return B, H, G, D, P


def _check_pos(pos, device, window=0, window_start=0, due=None):
    check_due(due, device)
    if pos is not None and (pos.numel() != 1 or pos.dtype.is_floating_point or pos.device != device):
        raise ValueError(f"pos must be one integer tensor on {device}, "
                         f"got {pos.dtype} {tuple(pos.shape)} on {pos.device}")
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: no sliding window), got {window!r}")
    if window and (pos is None or window_start):
        raise ValueError("window= is the device-side sliding window: it needs pos= and window_start=0")


def window_start_at(pos, window: int, page_size: int = 1):
    """First slot a query at the device position `pos` may see under a sliding `window` (0: none), divided by
    `page_size` (floor): a device tensor, no host sync. HF's window lets the query at slot `pos - 1` see keys
    `k > pos - 1 - window`."""
    start = (pos.view(1).long() - window).clamp_min(0) if window else pos.view(1).long() * 0
    return torch.div(start, page_size, rounding_mode="floor")


def check_rows(rows, batch: int, pages: int, device):
    """A page table `rows` int32 `[B, P_cap]`: the batch row holding each sequence's page (None: its own row)."""
    if rows is not None and (rows.dtype != torch.int32 or rows.dim() != 2 or rows.shape[0] != batch
                             or rows.shape[1] < pages or rows.device != device):
        raise ValueError(f"rows must be int32 [B={batch}, >= {pages} pages] on {device}, "
                         f"got {rows.dtype} {tuple(rows.shape)} on {rows.device}")


def gather_rows(t, rows):
    """`t [B, H, P, ...]` read through a page table `rows [B, >= P]`: `out[b, h, p] = t[rows[b, p], h, p]`."""
    if rows is None:
        return t
    P = t.shape[2]
    return t[rows[:, :P].long(), :, torch.arange(P, device=t.device)].transpose(1, 2)


def score_pages_ref(q, kmin, kmax, seq_len: int, page_size: int, window_start: int = 0, reduce: str = "none",
                    pos=None, window: int = 0, rows=None, scale=None, due=None, *, chan=None, out=None):
    """Score the `P = ceil(seq_len / S)` pages of a layer for one decode query.

    q `[B, H_q, D]`; kmin/kmax `[B, H_kv, P_cap, D]`. Returns fp32 `[B, H_q, P]` (`reduce="none"`) or
    `[B, H_kv, P]` (`"max"`/`"sum"` over each KV group). The current page `P - 1` scores `+inf` (always
    chosen); empty pages (padding only) and pages ending before `window_start` score `-inf` (never chosen).
    `pos` (one integer on q's device: the captured step's write position) forces page `(pos - 1) // S` too;
    with `window > 0` (a sliding window, read with `pos` on the device) the pages ending before
    `max(0, pos - window)` score `-inf` as well. `rows` (int32 `[B, P_cap]`, beam search's page table): page
    `p` of sequence `b` is read from batch row `rows[b, p]`.

    8-bit bounds (triton_kernels/bounds8.py): kmin/kmax int8 codes with `scale` fp32 `[B, H_kv, P_cap]`; the
    bounds are `code * scale` (one fp32 product, as bounds8 rounded them), or with channel scales `chan` fp32
    `[H_kv, D]` `code * (chan * scale)`. `out`: fp32 of the result's shape,
    written and returned instead of a fresh tensor. `due` (one device integer, selection reuse): where it is 0 the
    scores are unspecified and unused (`score_pages` reads and writes nothing then, nor does `topk_pages` given the
    same flag read them): `out` keeps its values; without `out=` this returns the forced pages only (+inf; every
    other page -inf). Device ops only, no host sync.
    """
    B, H, G, D, P = _check(q, kmin, kmax, seq_len, page_size, window_start, reduce, scale, chan)
    _check_pos(pos, q.device, window, window_start, due)
    check_out(out, (B, H * G if reduce == "none" else H, P), torch.float32, q.device)
    check_rows(rows, B, P, q.device)
    kmin, kmax = gather_rows(kmin[:, :, :P], rows), gather_rows(kmax[:, :, :P], rows)
    qf = q.float().reshape(B, H, G, 1, D)
    lo, hi = kmin[:, :, None, :P].float(), kmax[:, :, None, :P].float()
    if scale is not None:
        sc = gather_rows(scale[:, :, :P], rows)[:, :, None, :, None]
        if chan is not None:  # the kernel's order: (channel scale x page scale), then x code
            sc = chan[None, :, None, None, :] * sc
        lo, hi = lo * sc, hi * sc
    empty = (kmin[:, :, :P, 0] > kmax[:, :, :P, 0])[:, :, None]  # [B, H, 1, P]
    # An empty page's bounds are +-inf, so its sum may be NaN (0 * inf): masked_fill overwrites NaN too.
    s = torch.maximum(qf * lo, qf * hi).sum(-1)  # [B, H, G, P]
    s = s.masked_fill(empty, float("-inf"))
    s[..., : window_start // page_size] = float("-inf")
    if window:
        dead = torch.arange(P, device=q.device) < window_start_at(pos, window, page_size)
        s = s.masked_fill(dead, float("-inf"))
    if due is not None:
        s = s.masked_fill(due.view(()) == 0, float("-inf"))
    s[..., -1] = float("inf")  # the spare page P - 1 (a constant index: no guard on P in a compiled step)
    if pos is not None:
        s.index_fill_(-1, torch.div(pos - 1, page_size, rounding_mode="floor").view(1), float("inf"))
    s = s.amax(2) if reduce == "max" else s.sum(2) if reduce == "sum" else s.reshape(B, H * G, P)
    if out is None:
        return s
    return out.copy_(s if due is None else torch.where(due.view(()) != 0, s, out))


@dataclass(frozen=True)
class ScoreLaunch:
    """How `score_pages` launches. block_p pages per program: a 32 x 128 fp16 tile of kmin plus one of kmax is 16 KB
    in flight per program; 32K tokens x 32 KV heads give ~2000 programs. Picked on an H200 among 32..128 pages x
    2..8 warps (benchmarks/kernels/NOTES.md).

    mma: the tensor-core form (`score_form`): None takes it for GQA groups only, True wherever the dtypes allow,
    False never. On an H100 (benchmarks/kernels/round27) it made Llama-3-8B union layer steps 3-9% faster (batch 8
    128K 244.1 -> 223.0 us) and MHA ones 3-9% slower (one query row padded to 16, the dot's layout conversion).
    8-bit codes take their own tensor-core form ("mma8") under the same rule: H100, int8_channel Llama-3-8B union
    chained steps 2-9% faster (batch 8 128K 216.8 -> 197.6 us), the shared mode within noise (benchmarks/kernels/round29).

    packed_codes: MHA rows (G = 1) over channel-scale 8-bit codes (`chan`) read the codes as 32-bit words, 4 channels
    a word, and score each channel by one code chosen by q's sign (`packed_words` says where the layout allows it).
    Compiled offline for sm_90 (benchmarks/kernels/round34), the elementwise 8-bit score issues 2.3x the instructions a
    byte of the fp16 one (a quarter-rate int-to-float conversion, two products, a max and an add a code): more than
    an H200 issues at its bandwidth. Off until timed on a GPU.

    trunc_parts: "mma8" splits q' into its three bf16 parts by truncating bits (`_part_trunc`: integer ops) instead of
    rounding conversions, 72 of them a thread at 4 warps and 32 pages, issued at a quarter rate on sm_90 (offline
    SASS, benchmarks/kernels/round34). Same products (exact either way), sums rounded in another order. Off until
    timed on a GPU.

    packed_bounds: MHA rows over fp16 / bf16 bounds read them as 32-bit words, 2 channels a word, and take each
    channel's bound by q's sign (`packed_halves` says where). Offline, 2.5 instructions a channel instead of 6; the
    fp16 score is under the issue budget, but at 84-89% of its read floor (round 34). Off until timed on a GPU."""

    block_p: int = 32
    num_warps: int = 4
    mma: bool | None = None
    packed_codes: bool = False
    trunc_parts: bool = False
    packed_bounds: bool = False


SCORE_LAUNCH = ScoreLaunch()
_MMA_DTYPES = (torch.float16, torch.bfloat16)


def score_form(q, kmin, scale=None, launch: ScoreLaunch = SCORE_LAUNCH) -> str:
    """How `score_pages` computes a block's scores for these inputs: "mma" (two tensor-core products a KV group,
    `max(q, 0) @ hi^T + min(q, 0) @ lo^T`), "mma8" (the same over 8-bit codes: `q' = q x channel scales` in fp32,
    split into three bf16 parts stacked as rows, two products, times the page's scale) or "elementwise" (each query head's
    `max(q * lo, q * hi)` summed over channels). "mma" needs float bounds in q's own 16-bit dtype (the halves of q
    stay exact in it), "mma8" int8 codes with their scale; `launch.mma` True takes either wherever it can, False
    never, None (default) where a KV group has two or more query heads."""
    G = q.shape[1] // kmin.shape[1]
    want = (launch.mma if launch.mma is not None else G >= 2) and launch.block_p >= 16
    if want and kmin.dtype == torch.int8 and scale is not None and q.dtype in (*_MMA_DTYPES, torch.float32):
        return "mma8"
    ok = kmin.dtype == q.dtype and q.dtype in _MMA_DTYPES and scale is None
    return "mma" if ok and want else "elementwise"


def mma_meta(q, kmin, scale, launch) -> dict:
    """`_score_block`'s MMA constexprs for a launch: MMA 0 elementwise, 1 tensor-core products, 2 the same in fp32
    operands (bf16 under Triton's interpreter, which holds bf16 as raw bits), 3 8-bit codes' products over bf16 parts
    of q', 4 the same with one fp32 part (the interpreter), 5 as 3 with q' split by truncation (`trunc_parts`); G_MMA
    the group's rows padded."""
    form, mma = score_form(q, kmin, scale, launch), 0
    if form == "mma":
        mma = 2 if interpreting() and q.dtype == torch.bfloat16 else 1
    elif form == "mma8":  # rows: 3 parts (padded to 4) x the group's heads (padded)
        mma = 4 if interpreting() else 5 if launch.trunc_parts else 3
        return dict(MMA=mma, G_MMA=max(16, 4 * next_pow2(q.shape[1] // kmin.shape[1])))
    return dict(MMA=mma, G_MMA=max(16, next_pow2(q.shape[1] // kmin.shape[1])))


_REDUCE_CODE = {"none": 0, "max": 1, "sum": 2}


@triton.jit
def _bound_words(q_ptr, p_lo0, p_hi0, i_b, i_h, m_p, stride_qb, stride_qh, stride_qd, D: tl.constexpr,
                 BLOCK_D: tl.constexpr, LANES: tl.constexpr):
    """What both word paths read (`ScoreLaunch.packed_codes` / `packed_bounds`): each page's bounds as int32 words of
    LANES channels (`p_lo0` / `p_hi0`: the pages' channel-0 addresses; D % LANES == 0, unit channel stride, word-aligned
    rows: the launcher checks), and q as fp32 [BLOCK_D // LANES, LANES] (one vector load a word; lane i of word w is
    channel LANES w + i, little-endian). Returns (lo, hi, q, channels, channel mask)."""
    BLOCK_W: tl.constexpr = BLOCK_D // LANES
    o_w = tl.arange(0, BLOCK_W)
    m_w = o_w < D // LANES
    m_pw = m_p[:, None] & m_w[None, :]
    b_lo = tl.load(p_lo0.to(tl.pointer_type(tl.int32))[:, None] + o_w[None, :], mask=m_pw, other=0)
    b_hi = tl.load(p_hi0.to(tl.pointer_type(tl.int32))[:, None] + o_w[None, :], mask=m_pw, other=0)
    o_d = LANES * o_w[:, None] + tl.arange(0, LANES)[None, :]
    m_d = m_w[:, None] & (o_d < D)
    b_q = tl.load(q_ptr + i_b * stride_qb + i_h * stride_qh + o_d * stride_qd, mask=m_d, other=0.0).to(tl.float32)
    return b_lo, b_hi, b_q, o_d, m_d


@triton.jit
def _code_word_score(q_ptr, p_lo0, p_hi0, i_b, i_h, m_p, stride_qb, stride_qh, stride_qd, chan_ptr, stride_ch,
                     stride_cd, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """One query head's sum over channels of `max(q'_d * lo_d, q'_d * hi_d)`, `q' = q x channel scale`, over int8
    codes read 4 channels a word (`_bound_words`). Since the channel scales are positive and lo <= hi on a live page,
    the max is q'_d * hi_d where q'_d > 0, else q'_d * lo_d: one masked select picks 4 codes at once, and each code
    becomes fp32 exactly by integer ops and one add (2^23 + u as bits, u = code + 128, minus 2^23 + 128). [BLOCK_P]
    fp32, before the page's scale."""
    b_lo, b_hi, b_q, o_d, m_d = _bound_words(q_ptr, p_lo0, p_hi0, i_b, i_h, m_p, stride_qb, stride_qh, stride_qd, D,
                                             BLOCK_D, 4)
    b_q = b_q * tl.load(chan_ptr + i_h * stride_ch + o_d * stride_cd, mask=m_d, other=0.0)
    q02, q13 = tl.split(tl.reshape(b_q, [BLOCK_D // 4, 2, 2]))  # lanes (0, 2) and (1, 3)
    q0, q2 = tl.split(q02)
    q1, q3 = tl.split(q13)
    b_take = tl.where(q0 > 0.0, 0xFF, 0) | tl.where(q1 > 0.0, 0xFF00, 0) | tl.where(q2 > 0.0, 0xFF0000, 0)
    b_take = b_take | tl.where(q3 > 0.0, -16777216, 0)  # 0xFF000000 as int32
    # Each lane's byte x-or 0x80: the code + 128 as an unsigned byte.
    b_u = ((b_hi & b_take[None, :]) | (b_lo & ~b_take[None, :])) ^ -2139062144  # 0x80808080
    b_s = _lane_f32(b_u, 0) * q0[None, :]
    b_s += _lane_f32(b_u, 8) * q1[None, :]
    b_s += _lane_f32(b_u, 16) * q2[None, :]
    b_s += _lane_f32(b_u, 24) * q3[None, :]
    return tl.sum(b_s, axis=1)


@triton.jit
def _half_word_score(q_ptr, p_lo0, p_hi0, i_b, i_h, m_p, stride_qb, stride_qh, stride_qd,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, IS_BF16: tl.constexpr):
    """One query head's sum over channels of `max(q_d * lo_d, q_d * hi_d)` over 16-bit float bounds read 2 channels a
    word (`_bound_words`). The max is q_d * hi_d where q_d > 0, else q_d * lo_d (lo <= hi on a live page; a dead
    page's +-inf bounds are overwritten by the caller): one masked select picks both halves of a word, and each channel
    costs a widening and a fused multiply-add instead of two widenings, two products, a max and an add. The products
    are the elementwise form's; only the sum's rounding differs (fused). [BLOCK_P] fp32."""
    b_lo, b_hi, b_q, _, _ = _bound_words(q_ptr, p_lo0, p_hi0, i_b, i_h, m_p, stride_qb, stride_qh, stride_qd, D,
                                         BLOCK_D, 2)
    q0, q1 = tl.split(b_q)
    b_take = tl.where(q0 > 0.0, 0xFFFF, 0) | tl.where(q1 > 0.0, -65536, 0)  # 0xFFFF0000 as int32
    b_u = (b_hi & b_take[None, :]) | (b_lo & ~b_take[None, :])
    b_s = _half_f32(b_u, IS_BF16) * q0[None, :]
    b_s += _half_f32(b_u >> 16, IS_BF16) * q1[None, :]
    return tl.sum(b_s, axis=1)


@triton.jit
def _half_f32(b_u, IS_BF16: tl.constexpr):
    """The low 16 bits of int32 `b_u`, a 16-bit float's bits, as fp32 (exact)."""
    if IS_BF16:
        return (b_u << 16).to(tl.float32, bitcast=True)
    return b_u.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _lane_f32(b_u, SHIFT: tl.constexpr):
    """Byte (b_u >> SHIFT) & 0xFF, an 8-bit code + 128, as its code in fp32: exact."""
    b_bits = ((b_u >> SHIFT) & 0xFF) | 0x4B000000  # 2^23 + byte
    return b_bits.to(tl.float32, bitcast=True) - 8388736.0  # 2^23 + 128


@triton.jit
def _part_trunc(x, part):
    """Part `part` (0, 1, 2: a row's) of fp32 `x` split by truncation into three bf16 values whose sum is x: each part
    is the top 8 significant bits of what the parts before it left (x's low 16 bits cleared, then the rest's), so every
    step is exact in fp32, the last part has at most 8 significant bits, and each part becomes bf16 by keeping its high
    16 bits: integer ops, where `_part_of`'s rounding conversions issue at a quarter of the fp32 rate on sm_90
    (ScoreLaunch.trunc_parts)."""
    p0 = (x.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)  # 0xFFFF0000
    r1 = x - p0
    p1 = (r1.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
    v = tl.where(part == 0, p0, tl.where(part == 1, p1, r1 - p1))
    return (v.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _trunc_parts_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + o, mask=o < N, other=0.0)
    for part in tl.static_range(3):
        tl.store(out_ptr + part * N + o, _part_trunc(x, part).to(tl.float32), mask=o < N)


def truncated_parts(x: torch.Tensor) -> torch.Tensor:
    """`_part_trunc`'s three parts of fp32 `x [N]` as fp32 `[3, N]` (what "mma8" with `ScoreLaunch.trunc_parts` feeds
    its products; tested against `truncated_parts_ref`)."""
    require_triton()
    if x.dim() != 1 or x.dtype != torch.float32:
        raise ValueError(f"x must be fp32 [N], got {x.dtype} {tuple(x.shape)}")
    out = torch.empty(3, x.numel(), dtype=torch.float32, device=x.device)
    _trunc_parts_kernel[(cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out


def truncated_parts_ref(x: torch.Tensor) -> torch.Tensor:
    """PyTorch twin of `truncated_parts`: x's low 16 bits cleared, then the rest's, then what is left."""
    def trunc(v):
        return (v.view(torch.int32) & -65536).view(torch.float32)

    p0 = trunc(x)
    p1 = trunc(x - p0)
    return torch.stack([p0, p1, x - p0 - p1])


@triton.jit
def _part_of(x, part, part_ty: tl.constexpr):
    """Part `part` (0, 1, 2: a row's) of fp32 `x` split into three `part_ty` values whose sum is x (bf16: 8 bits a
    part); fp32 parts: x, 0, 0."""
    p0 = x.to(part_ty)
    r1 = x - p0.to(tl.float32)
    p1 = r1.to(part_ty)
    p2 = (r1 - p1.to(tl.float32)).to(part_ty)
    return tl.where(part == 0, p0, tl.where(part == 1, p1, p2))


@triton.jit
def _score_block(
    q_ptr, kmin_ptr, kmax_ptr, out_ptr, i_b, i_h, o_p, o_row,
    stride_qb, stride_qh, stride_qd,
    stride_nb, stride_nh, stride_np, stride_nd,
    stride_xb, stride_xh, stride_xp, stride_xd,
    stride_ob, stride_oh, stride_op,
    P, P_DEAD, CUR,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, REDUCE: tl.constexpr,
    scale_ptr, stride_sb, stride_sh, stride_sp, USE_SCALE: tl.constexpr,
    chan_ptr, stride_ch, stride_cd, USE_CHAN: tl.constexpr,
    MMA: tl.constexpr = 0, G_MMA: tl.constexpr = 16, WORDS: tl.constexpr = 0,
):
    """Score pages `o_p` of KV head (i_b, i_h) for its G query heads; pages P - 1 and CUR score +inf. The pages'
    bounds are read from batch rows `o_row` (beam search's page table; i_b otherwise). USE_SCALE: int8 codes
    times their page's fp32 scale (triton_kernels/bounds8.py); USE_CHAN: times the KV head's channel scales too.
    MMA 1 (float bounds in q's 16-bit dtype, see `score_form`; 2: the same under the interpreter with bf16): the
    group's scores as two tensor-core products, `max(q * lo, q * hi) = max(q, 0) * hi + min(q, 0) * lo` per channel,
    so `s = q+ @ hi^T + q- @ lo^T` with q's G rows padded to G_MMA: the halves of q are exact in its dtype and each
    product exact in the fp32 accumulator, so only the sum's rounding differs from the elementwise form. MMA 3 (8-bit
    codes, "mma8"; 4: the same with fp32 parts under the interpreter): the same two products over the codes, q times
    the channel scales split into exact parts stacked as rows (see the branch). WORDS (G = 1; `word_form`): the
    bounds read as 32-bit words, one bound a channel chosen by q's sign: 1 channel-scale codes
    (`ScoreLaunch.packed_codes`, `_code_word_score`), 2 16-bit float bounds (`ScoreLaunch.packed_bounds`,
    `_half_word_score`)."""
    o_d = tl.arange(0, BLOCK_D)
    m_p = o_p < P
    m_d = o_d < D
    m_pd = m_p[:, None] & m_d[None, :]
    # The tile is read from HBM once and scored for every query head of the KV group.
    p_lo = kmin_ptr + o_row[:, None] * stride_nb + i_h * stride_nh + o_p[:, None] * stride_np + o_d[None, :] * stride_nd
    p_hi = kmax_ptr + o_row[:, None] * stride_xb + i_h * stride_xh + o_p[:, None] * stride_xp + o_d[None, :] * stride_xd
    # Same emptiness test as the reference (first channel only); these addresses are already in L1.
    p_lo0 = kmin_ptr + o_row * stride_nb + i_h * stride_nh + o_p * stride_np  # each page's channel 0
    p_hi0 = kmax_ptr + o_row * stride_xb + i_h * stride_xh + o_p * stride_xp
    b_lo0 = tl.load(p_lo0, mask=m_p, other=0)
    b_hi0 = tl.load(p_hi0, mask=m_p, other=0)
    m_dead = (b_lo0.to(tl.float32) > b_hi0.to(tl.float32)) | (o_p < P_DEAD)
    m_cur = (o_p == P - 1) | (o_p == CUR)
    if MMA >= 3:
        # 8-bit codes: sum_d max(q_d * c_d * s_d, ...) = (q+ * s) @ hi8^T + (q- * s) @ lo8^T, with s_d the channel
        # scale (1 without) and the page's scale factored out of the sum. q' = q * s in fp32 is split into three bf16
        # parts (8 bits each: 24, all of fp32's) and each part x code (integers |c| <= 128) is exact in the fp32
        # accumulator, so this differs from the elementwise form by the sums' rounding only. The parts ride as rows of
        # one operand (row = part x G_PAD + head; parts padded to 4), so two products serve all three, summed after.
        G_PAD: tl.constexpr = G_MMA // 4
        o_r = tl.arange(0, G_MMA)
        r_part = (o_r // G_PAD)[:, None]
        r_g = o_r % G_PAD
        m_r = (r_g < G) & (o_r < 3 * G_PAD)
        b_x = tl.load(q_ptr + i_b * stride_qb + (i_h * G + r_g)[:, None] * stride_qh + o_d[None, :] * stride_qd,
                      mask=m_r[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        if USE_CHAN:
            b_cs = tl.load(chan_ptr + i_h * stride_ch + o_d * stride_cd, mask=m_d, other=0.0)
            b_x = b_x * b_cs[None, :]
        part_ty: tl.constexpr = tl.float32 if MMA == 4 else tl.bfloat16
        b_lo = tl.load(p_lo, mask=m_pd, other=0).to(tl.float32).to(part_ty)
        b_hi = tl.load(p_hi, mask=m_pd, other=0).to(tl.float32).to(part_ty)
        b_sc = tl.load(scale_ptr + o_row * stride_sb + i_h * stride_sh + o_p * stride_sp, mask=m_p, other=0.0)
        if MMA == 5:
            b_ap = _part_trunc(tl.maximum(b_x, 0.0), r_part)
            b_an = _part_trunc(tl.minimum(b_x, 0.0), r_part)
        else:
            b_ap = _part_of(tl.maximum(b_x, 0.0), r_part, part_ty)
            b_an = _part_of(tl.minimum(b_x, 0.0), r_part, part_ty)
        b_sr = tl.dot(b_ap, tl.trans(b_hi), out_dtype=tl.float32, input_precision="ieee")
        b_sr = tl.dot(b_an, tl.trans(b_lo), acc=b_sr, input_precision="ieee")  # [G_MMA, BLOCK_P]: part x head rows
        b_sg = tl.sum(tl.reshape(b_sr, [4, G_PAD, BLOCK_P]), axis=0) * b_sc[None, :]  # [G_PAD, BLOCK_P]
        o_g = tl.arange(0, G_PAD)
        m_g = o_g < G
    elif MMA:
        o_g = tl.arange(0, G_MMA)
        m_g = o_g < G
        b_lo = tl.load(p_lo, mask=m_pd, other=0)
        b_hi = tl.load(p_hi, mask=m_pd, other=0)
        b_qg = tl.load(q_ptr + i_b * stride_qb + (i_h * G + o_g)[:, None] * stride_qh + o_d[None, :] * stride_qd,
                       mask=m_g[:, None] & m_d[None, :], other=0.0)
        if MMA == 2:  # Triton's interpreter holds bf16 as raw bits: its dot takes them in fp32 (the same products)
            b_qg, b_lo, b_hi = b_qg.to(tl.float32), b_lo.to(tl.float32), b_hi.to(tl.float32)
        b_zero = tl.zeros_like(b_qg)
        m_qp = b_qg > b_zero  # (a select keeps q's dtype: bf16 max / min would be fp32)
        b_qp = tl.where(m_qp, b_qg, b_zero)
        b_qn = tl.where(m_qp, b_zero, b_qg)
        b_sg = tl.dot(b_qp, tl.trans(b_hi), out_dtype=tl.float32)
        b_sg = tl.dot(b_qn, tl.trans(b_lo), acc=b_sg)  # [G_MMA, BLOCK_P]
    if MMA:
        # Empty pages hold +-inf bounds, so their sum may be NaN (0 * inf): overwritten here.
        b_sg = tl.where(m_dead[None, :], float("-inf"), b_sg)
        b_sg = tl.where(m_cur[None, :], float("inf"), b_sg)
        if REDUCE == 0:
            tl.store(out_ptr + i_b * stride_ob + (i_h * G + o_g)[:, None] * stride_oh + o_p[None, :] * stride_op,
                     b_sg, mask=m_g[:, None] & m_p[None, :])
        elif REDUCE == 1:
            tl.store(out_ptr + i_b * stride_ob + i_h * stride_oh + o_p * stride_op,
                     tl.max(tl.where(m_g[:, None], b_sg, float("-inf")), axis=0), mask=m_p)
        else:
            tl.store(out_ptr + i_b * stride_ob + i_h * stride_oh + o_p * stride_op,
                     tl.sum(tl.where(m_g[:, None], b_sg, 0.0), axis=0), mask=m_p)
    elif WORDS == 2:
        b_s = _half_word_score(q_ptr, p_lo0, p_hi0, i_b, i_h, m_p, stride_qb, stride_qh, stride_qd, D, BLOCK_D,
                               kmin_ptr.dtype.element_ty == tl.bfloat16)
        b_s = tl.where(m_dead, float("-inf"), b_s)
        b_s = tl.where(m_cur, float("inf"), b_s)
        tl.store(out_ptr + i_b * stride_ob + i_h * stride_oh + o_p * stride_op, b_s, mask=m_p)
    elif WORDS == 1:
        b_sc = tl.load(scale_ptr + o_row * stride_sb + i_h * stride_sh + o_p * stride_sp, mask=m_p, other=0.0)
        # x the page's 2^e: exact, so the page's scale leaves the sum (as below).
        b_s = _code_word_score(q_ptr, p_lo0, p_hi0, i_b, i_h, m_p, stride_qb, stride_qh, stride_qd, chan_ptr,
                               stride_ch, stride_cd, D, BLOCK_D) * b_sc
        b_s = tl.where(m_dead, float("-inf"), b_s)
        b_s = tl.where(m_cur, float("inf"), b_s)
        tl.store(out_ptr + i_b * stride_ob + i_h * stride_oh + o_p * stride_op, b_s, mask=m_p)
    else:
        b_lo = tl.load(p_lo, mask=m_pd, other=0).to(tl.float32)
        b_hi = tl.load(p_hi, mask=m_pd, other=0).to(tl.float32)
        if USE_SCALE:  # the same fp32 product bounds8 checked its rounding against
            b_sc = tl.load(scale_ptr + o_row * stride_sb + i_h * stride_sh + o_p * stride_sp, mask=m_p, other=0.0)
            if USE_CHAN:
                # code x channel scale here, x the page's 2^e on the page's sum below: scaling by a power of two is
                # exact, so this is the reference's code x (channel scale x 2^e) up to the order of the D-term sum,
                # with one product an element (the same work as the page-scale codes).
                b_cs = tl.load(chan_ptr + i_h * stride_ch + o_d * stride_cd, mask=m_d, other=0.0)
                b_lo = b_lo * b_cs[None, :]
                b_hi = b_hi * b_cs[None, :]
            else:
                b_lo = b_lo * b_sc[:, None]
                b_hi = b_hi * b_sc[:, None]

        b_acc = tl.full([BLOCK_P], float("-inf") if REDUCE == 1 else 0.0, tl.float32)
        for g in tl.static_range(G):
            b_q = tl.load(q_ptr + i_b * stride_qb + (i_h * G + g) * stride_qh + o_d * stride_qd,
                          mask=m_d, other=0.0).to(tl.float32)
            b_s = tl.sum(tl.maximum(b_q[None, :] * b_lo, b_q[None, :] * b_hi), axis=1)
            if USE_CHAN:  # (the launcher takes chan only with scale)
                b_s = b_s * b_sc
            # Empty pages hold +-inf bounds, so their sum may be NaN (0 * inf): overwritten here.
            b_s = tl.where(m_dead, float("-inf"), b_s)
            b_s = tl.where(m_cur, float("inf"), b_s)
            if REDUCE == 0:
                tl.store(out_ptr + i_b * stride_ob + (i_h * G + g) * stride_oh + o_p * stride_op, b_s, mask=m_p)
            elif REDUCE == 1:
                b_acc = tl.maximum(b_acc, b_s)
            else:
                b_acc = b_acc + b_s
        if REDUCE != 0:
            tl.store(out_ptr + i_b * stride_ob + i_h * stride_oh + o_p * stride_op, b_acc, mask=m_p)


@triton.jit
def _score_pages_kernel(
    q_ptr, kmin_ptr, kmax_ptr, out_ptr, pos_ptr, rows_ptr, scale_ptr, due_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_nb, stride_nh, stride_np, stride_nd,
    stride_xb, stride_xh, stride_xp, stride_xd,
    stride_ob, stride_oh, stride_op, stride_rb,
    stride_sb, stride_sh, stride_sp,
    P, P_DEAD, WINDOW, chan_ptr, stride_ch, stride_cd,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, REDUCE: tl.constexpr,
    HAS_POS: tl.constexpr, HAS_ROWS: tl.constexpr, USE_SCALE: tl.constexpr, HAS_DUE: tl.constexpr,
    USE_CHAN: tl.constexpr, MMA: tl.constexpr, G_MMA: tl.constexpr, PAGE: tl.constexpr, WORDS: tl.constexpr = 0,
):
    # Selection reuse (HAS_DUE): on a step that keeps its stored pages every program returns here, having read
    # one flag and nothing else (no bound, page table or position) and written nothing: `topk_pages(due=)` reads
    # the same flag and none of these scores (`due_flag`: without HAS_DUE no branch is emitted).
    if due_flag(due_ptr, HAS_DUE) != 0:
        # grid (KV head, page block, batch row): no division for either index. int64: batch x head offsets pass 2^31
        # elements on large caches.
        i_h = tl.program_id(0).to(tl.int64)
        i_b = tl.program_id(2).to(tl.int64)
        o_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        if HAS_ROWS:  # beam search: each page of this sequence lives in the batch row its page table names
            o_row = tl.load(rows_ptr + i_b * stride_rb + o_p, mask=o_p < P, other=0).to(tl.int64)
        else:
            o_row = tl.zeros([BLOCK_P], dtype=tl.int64) + i_b
        cur = P - 1
        p_dead = P_DEAD
        if HAS_POS:  # the page of the last token written, read on the device (no host sync, graph-capturable)
            i_pos = tl.load(pos_ptr).to(tl.int32)
            cur = (i_pos - 1) // PAGE
            if WINDOW > 0:  # sliding window: pages ending before the window's first slot are never chosen
                p_dead = tl.maximum(i_pos - WINDOW, 0) // PAGE
        _score_block(q_ptr, kmin_ptr, kmax_ptr, out_ptr, i_b, i_h, o_p, o_row,
                     stride_qb, stride_qh, stride_qd, stride_nb, stride_nh, stride_np, stride_nd,
                     stride_xb, stride_xh, stride_xp, stride_xd, stride_ob, stride_oh, stride_op,
                     P, p_dead, cur, G, D, BLOCK_D, BLOCK_P, REDUCE,
                     scale_ptr, stride_sb, stride_sh, stride_sp, USE_SCALE, chan_ptr, stride_ch, stride_cd, USE_CHAN,
                     MMA, G_MMA, WORDS)


def _word_aligned(kmin, kmax, per_word: int) -> bool:
    D = kmin.shape[-1]
    return D % per_word == 0 and all(
        t.stride(-1) == 1 and all(st % per_word == 0 for st in t.stride()[:-1]) and t.data_ptr() % 4 == 0
        for t in (kmin, kmax))


def packed_halves(q, kmin, kmax, scale=None, launch: ScoreLaunch = SCORE_LAUNCH) -> bool:
    """Whether `score_pages` reads these 16-bit float bounds as 32-bit words (`ScoreLaunch.packed_bounds`): MHA
    (G = 1), fp16 or bf16 bounds without a scale, D even, unit channel stride, every other stride even and both
    bases 4-byte aligned, and the elementwise form (`score_form`). Elsewhere the element path runs, same products."""
    if not (launch.packed_bounds and scale is None and kmin.dtype in _MMA_DTYPES and q.shape[1] == kmin.shape[1]):
        return False
    return score_form(q, kmin, scale, launch) == "elementwise" and _word_aligned(kmin, kmax, 2)


def word_form(q, kmin, kmax, scale, chan, launch: ScoreLaunch = SCORE_LAUNCH) -> int:
    """`_score_block`'s WORDS constexpr: 1 codes as words (`packed_words`), 2 16-bit floats as words
    (`packed_halves`), 0 neither."""
    return 1 if packed_words(q, kmin, kmax, chan, launch) else 2 if packed_halves(q, kmin, kmax, scale, launch) else 0


def packed_words(q, kmin, kmax, chan, launch: ScoreLaunch = SCORE_LAUNCH) -> bool:
    """Whether `score_pages` reads these channel-scale codes as 32-bit words (`ScoreLaunch.packed_codes`): MHA
    (G = 1), int8 codes with `chan`, D % 4 == 0, unit channel stride, every other stride and both bases 4-byte
    aligned. Elsewhere the byte path runs, same scores up to rounding."""
    if not (launch.packed_codes and chan is not None and kmin.dtype == torch.int8 and q.shape[1] == kmin.shape[1]):
        return False
    return _word_aligned(kmin, kmax, 4)


def score_pages(q, kmin, kmax, seq_len: int, page_size: int, window_start: int = 0, reduce: str = "none",
                pos=None, window: int = 0, rows=None, scale=None, due=None, *, chan=None,
                launch: ScoreLaunch = SCORE_LAUNCH, out=None):
    """Triton twin of `score_pages_ref`.

    q `[B, H_q, D]` (any float dtype, any strides); kmin/kmax `[B, H_kv, P_cap, D]` (any strides, unit stride
    on D is fastest), in a float dtype or int8 codes with `scale` (constexpr USE_SCALE: half the bytes of fp16
    bounds, plus 4 a page) and, for channel-scale codes, `chan` (USE_CHAN: D floats a program, from L2).
    `due` (HAS_DUE): a device flag every program reads first; 0 (a step that reuses its
    stored selection) returns at once: nothing else read, nothing written (`out` keeps its values; a fresh result
    stays unwritten, which `topk_pages(due=)` under the same flag never reads). Returns a fresh contiguous fp32
    `[B, H_q, P]` (`"none"`) or `[B, H_kv, P]`, or `out` (that shape, any strides) filled.
    """
    require_triton()
    B, H, G, D, P = _check(q, kmin, kmax, seq_len, page_size, window_start, reduce, scale, chan)
    _check_pos(pos, q.device, window, window_start, due)
    check_rows(rows, B, P, q.device)
    shape = (B, H * G if reduce == "none" else H, P)
    check_out(out, shape, torch.float32, q.device)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=q.device)
    grid = (H, cdiv(P, launch.block_p), B)
    s_strides = scale.stride() if scale is not None else (0, 0, 0)
    _score_pages_kernel[grid](
        q, kmin, kmax, out, pos if pos is not None else out, rows if rows is not None else out,
        scale if scale is not None else out, due_arg(due, out),
        *q.stride(), *kmin.stride(), *kmax.stride(), *out.stride(), rows.stride(0) if rows is not None else 0,
        *s_strides,
        P, window_start // page_size, window,
        chan if chan is not None else out, *(chan.stride() if chan is not None else (0, 0)),
        G=G, D=D, BLOCK_D=max(16, next_pow2(D)), BLOCK_P=launch.block_p, REDUCE=_REDUCE_CODE[reduce], HAS_POS=pos is not None,
        HAS_ROWS=rows is not None, USE_SCALE=scale is not None, HAS_DUE=due is not None, USE_CHAN=chan is not None,
        **mma_meta(q, kmin, scale, launch), PAGE=page_size, WORDS=word_form(q, kmin, kmax, scale, chan, launch),
        num_warps=launch.num_warps,
    )
    return out
