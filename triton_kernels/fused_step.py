"""A decode layer's whole Quest step in one launch (or three chained ones): page scores, Top-K, attention, merge.

A patched model's decode runs the three-launch form under `QuestConfig(fused_step=...)` ("auto": one sequence, MHA,
on a GPU with PDL; benchmarks/kernels/round19). On an H200 it gives the separate kernels' ids exactly.
- One launch (benchmarks/kernels/round16): 32.3 us against the separate kernels' 33.9 at Llama-2-7B B=1 32K
  (chained), but slower at 128K (73.8 vs 65.6), B=8 (151 vs 146) and Llama-3-8B shared scores (24.9 vs 20.5): one
  kernel holds the registers and shared memory of its largest role (the Top-K tile, the attention tiles), so the
  scoring runs at a quarter of its own kernel's occupancy, which costs more than the overlap below saves. A
  persistent variant (programs all resident, each walking its items) was slower still.
- Three launches (`StepLaunch.launches=3`, benchmarks/kernels/round17): each role in its own kernel with its own
  registers, chained by programmatic dependent launch and the same per-head counts and flags. 7B B=1 32K 32.5 us
  (separate 34.5, same call), `int8_channel` bounds 29.2 (separate 32.0: the fastest step measured there), 128K with
  8 warps 67.0 (67.1), Llama-3-8B shared scores 23.1 (20.3). Every KV head's scores finish at about the same time
  (the scoring grid runs in about one wave), so the Top-Ks do not overlap other heads' streaming; what it saves is
  the launch gaps and the merge launch.

The separate kernels (`score_pages`, `topk_pages`, `sparse_decode_attention`) run one after another: each waits
for the last program of the one before, and the Top-K (a few microseconds of one program a row's dependent
reductions) leaves the memory system idle. Here one grid does all of it, per KV head as soon as its inputs exist:

- programs take a role by an atomic ticket (not by program id: a program that waits only ever waits on programs
  that took earlier tickets, which are running or done, so the waits cannot deadlock whatever order the hardware
  starts programs in);
- the first `B * H_kv * NCHUNK` tickets score `score_item` pages of one KV head (head-major, so early heads finish
  first); the last item of a head to finish (a per-head counter) runs that head's Top-K (`topk._lean_topk_row`,
  reading the scores from L2) and raises the head's ready flag;
- the remaining tickets are attention splits (flash-decoding), head-major: each spins on its head's flag, attends
  its share of the chosen pages, and the last split of a head to finish merges the head's partials.

Rows are one a KV head: MHA, or GQA with a shared score (`reduce="max"` / `"sum"`); rows the lean Top-K holds
(`StepLaunch.lean_keys`). The state (three ints a KV head and the ticket) returns to zero by the end of every
launch, so a caller keeps one zeroed workspace per layer (or per stream) and a captured graph replays with no
memset.
"""
import functools
from dataclasses import dataclass, replace

import torch

from . import topk as _topk
from ._common import as_u8, cdiv, interpreting, next_pow2, num_sms, pdl_available, require_triton, tl, triton
from .score import ScoreLaunch, _score_block, mma_meta, score_pages_ref, word_form
from .score import _check as _check_score
from .sparse_attention import (
    LOG2E,
    AttentionLaunch,
    _attn_split,
    _merge_group,
    _num_splits,
    sparse_decode_attention_ref,
)
from .sparse_attention import (
    _check as _check_attention,
)
from .topk import _lean_topk_row, launch_config, lean_config, tail_config, topk_pages_ref

__all__ = ["DECODE_STEP_LAUNCH", "StepLaunch", "STEP_LAUNCH", "fused_step_supported", "quest_step", "quest_step_ref", "step_workspace"]


@dataclass(frozen=True)
class StepLaunch:
    """How `quest_step` launches (one num_warps for every role). score_item: pages of one head a scoring item
    reads (then counts once toward its head's Top-K), score_block at a time (a multiple of it);
    block_n / num_stages / programs_per_sm: the attention splits' tile, pipelining and splitting (as
    `AttentionLaunch`). lean_keys: the widest row tile (keys) the fused Top-K holds (`TopKLaunch.lean` for this
    launch: a head's Top-K here overlaps other heads' streaming). maxnreg: cap the registers a thread (Triton's
    launch option; None: the compiler's choice) so that more programs fit an SM. The defaults are round 16's fastest at
    Llama-2-7B B=1 32K among 32-128-page score blocks, 2-8 warps, 32/64-token attention tiles, 2/3 stages.

    launches: 1, or 3: the score items (one a program, head-major, counted toward their head), the Top-Ks (one a
    KV head, each waiting on its head's count) and the attention splits and merges (each waiting on its head's
    flag), each launch with its own registers and shared memory and chained by programmatic dependent launch
    (Hopper's PDL: a launch's programs start once every program of the launch before has started, so their waits
    end). Without PDL (pre-Hopper GPUs, the interpreter, QUEST_HF_PDL=0) each launch starts after the one before
    ends: same results, no overlap (`quest_step.overlapped` says which ran). A two-launch variant (scoring programs
    that each walk items and run Top-Ks, then the attention) measured slower everywhere on an H200
    (benchmarks/kernels/round17) and was removed.

    score_programs (three launches only): 0, one score item a program (every head's scores finish in the same
    wave); n > 0, a resident grid of n programs an SM, each walking items head-major, so that heads finish in order
    and the first heads' Top-Ks and attention overlap the later heads' scoring. On an H200 (benchmarks/kernels/
    round18) 4 an SM gave 7B B=1 32K 31.4 us against 32.6 with one item a program (int8_channel 30.0 vs 31.1) and
    128K 63.9-65.2 vs 68.6, tied at Llama-3-8B shared scores and slower at batch 8; 1-2 an SM score at a fraction of
    the rate (one item in flight a program), so the heads' rounds are few and the gain small. Off by default.

    topk_warps (three launches only): the Top-K launch's warps; None: the separate Top-K's for the row's tile
    (`topk.launch_config`: 4 at the 32K decode's 2053 pages, 8 at 128K's 8197). Before round 26 this launch ran
    num_warps (4) at every width: on an H100 (benchmarks/kernels/round26) the 7B/128K step took 101.7 us with 4 warps,
    79.8 with 8 (separate kernels 82.9); at 32K 4 and 8 tied (39.1 / 38.8 us); 1 and 2 warps were slower at every
    row timed (32K: 65.9 / 48.6 us).

    score_mma (three launches only): the scoring launch takes the score kernel's tensor-core form (`ScoreLaunch.mma`
    True: `score_form`) where the bounds allow it. packed_codes / trunc_parts / packed_bounds (three launches only):
    the scoring launch's `ScoreLaunch` options of the same names (benchmarks/kernels/round34; off, untimed)."""

    score_block: int = 64
    score_item: int = 64
    num_warps: int = 4
    block_n: int = 64
    num_stages: int = 2
    programs_per_sm: int = 4
    lean_keys: int = 8192
    maxnreg: int | None = None
    launches: int = 1
    score_programs: int = 0
    topk_warps: int | None = None
    score_mma: bool = False
    packed_codes: bool = False
    trunc_parts: bool = False
    packed_bounds: bool = False

    def __post_init__(self):
        if self.score_item % self.score_block:
            raise ValueError(f"score_item ({self.score_item}) must be a multiple of score_block ({self.score_block})")
        if self.launches not in (1, 3):
            raise ValueError(f"launches must be 1 or 3, got {self.launches}")
        if self.score_programs < 0 or (self.score_programs and self.launches != 3):
            raise ValueError(f"score_programs ({self.score_programs}) must be 0, or > 0 with launches=3 (the "
                             "resident scoring grid is the three-launch step's first launch)")
        if self.topk_warps is not None and (self.launches != 3 or self.topk_warps not in (1, 2, 4, 8, 16)):
            raise ValueError(f"topk_warps ({self.topk_warps}) must be None, or 1, 2, 4, 8 or 16 with launches=3 (the "
                             "Top-K launch of the three-launch step)")

    def topk(self):
        """The `TopKLaunch` whose lean path the fused Top-K takes."""
        return replace(_topk.TOPK_LAUNCH, lean=self.lean_keys)

    @functools.cached_property
    def score_form(self) -> ScoreLaunch:
        """The `ScoreLaunch` whose form (`score_form`) the three-launch step's scoring takes."""
        return ScoreLaunch(block_p=self.score_block, mma=self.score_mma, packed_codes=self.packed_codes,
                           trunc_parts=self.trunc_parts, packed_bounds=self.packed_bounds)


STEP_LAUNCH = StepLaunch()
# What a patched model's decode runs (`QuestConfig(fused_step=...)`): three launches, a resident scoring grid of 4
# programs an SM (benchmarks/kernels/round18-19), StepLaunch's 64-token attention tiles. The separate attention's
# 32-token tiles here measured no faster than the separate kernels in the captured 7B/32K step (round 19 call 3:
# 5.747 vs 5.747 ms, greedy tokens still not the separate kernels' own), the 64-token ones 5.720 vs 5.753.
DECODE_STEP_LAUNCH = StepLaunch(launches=3, score_programs=4)


def step_workspace(batch: int, kv_heads: int, device) -> torch.Tensor:
    """The zeroed int32 state `quest_step` needs for rows of `batch x kv_heads` (every launch leaves it zeroed)."""
    return torch.zeros(3 * batch * kv_heads + 1, dtype=torch.int32, device=device)


def fused_step_supported(P: int, group: int, reduce: str, rows=None, launch: StepLaunch = STEP_LAUNCH) -> str | None:
    """None when `quest_step` takes rows of `P` scored pages (query heads `group` a KV head, `reduce`), else why
    not (the caller runs the separate kernels and says so)."""
    if rows is not None:
        return "beam search's page table (rows=) is read by the separate kernels only"
    if reduce == "none" and group > 1:
        return "the GQA union (one score row a query head) runs as separate kernels"
    if not lean_config(P, 1, launch.topk()):
        return f"rows of {P} pages are wider than the fused Top-K's tile (StepLaunch.lean_keys {launch.lean_keys})"
    return None


def _check(q, kmin, kmax, k_cache, v_cache, valid, seq_len, page_size, k, reduce, pos, window, scale, chan,
           softcap, sinks, workspace, launch):
    """The score launcher's checks, then the attention launcher's (over an empty id list of the result's shape),
    then what only the fused launch needs."""
    B, H, G, D, P = _check_score(q, kmin, kmax, seq_len, page_size, 0, reduce, scale, chan)
    _check_attention(q, k_cache, v_cache, torch.empty(B, H, 0, dtype=torch.int32, device=q.device), valid, seq_len,
                     page_size, 0, pos, window, softcap, sinks)
    if kmin.shape[2] * page_size != k_cache.shape[2]:
        raise ValueError(f"the cache's {k_cache.shape[2]} slots must be the bounds' {kmin.shape[2]} pages of "
                         f"{page_size}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k (pages a row) must be an int >= 1, got {k!r}")
    why = fused_step_supported(P, G, reduce, launch=launch)
    if why is not None:
        raise ValueError(f"quest_step cannot run this step: {why}; call score_pages, topk_pages and "
                         "sparse_decode_attention instead")
    if workspace is not None and (workspace.dtype != torch.int32 or workspace.numel() < 3 * B * H + 1
                                  or workspace.device != q.device):
        raise ValueError(f"workspace must be int32 with >= {3 * B * H + 1} elements on {q.device} "
                         "(step_workspace(B, H_kv, device))")
    return B, H, G, D, P


def quest_step_ref(q, kmin, kmax, k_cache, v_cache, valid, seq_len: int, page_size: int, k: int, attn_scale: float,
                   reduce: str = "none", pos=None, window: int = 0, scale=None, chan=None, softcap: float = 0.0,
                   sinks=None):
    """The step `quest_step` fuses, by the references: `score_pages_ref` -> `topk_pages_ref(k)` (rows one a KV head)
    -> `sparse_decode_attention_ref`. Returns (out `[B, H_q, D]`, ids int32 `[B, H_kv, min(k, P)]`)."""
    s = score_pages_ref(q, kmin, kmax, seq_len, page_size, 0, reduce, pos=pos, window=window, scale=scale, chan=chan)
    ids = topk_pages_ref(s, k, 1)
    out = sparse_decode_attention_ref(q, k_cache, v_cache, ids, valid, seq_len, page_size, attn_scale, 0,
                                      pos=pos if window else None, window=window, softcap=softcap, sinks=sinks)
    return out, ids


@triton.jit
def _quest_step_kernel(
    q_ptr, kmin_ptr, kmax_ptr, scale_ptr, chan_ptr, s_ptr, ids_ptr, k_ptr, v_ptr, valid_ptr, pos_ptr,
    m_ptr, l_ptr, acc_ptr, out_ptr, sinks_ptr, state_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_nb, stride_nh, stride_np, stride_nd,
    stride_xb, stride_xh, stride_xp, stride_xd,
    stride_sb, stride_sh, stride_sp, stride_ch, stride_cd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_vb, stride_vh, stride_vc, stride_vd,
    stride_vab, stride_vac,
    stride_ob, stride_oh, stride_od,
    H_KV, P, NCHUNK, N_SCORE, N_TOTAL, KK, K_OUT, IDS_PER_SPLIT, NUM_SPLITS, SEQ_LEN, PAGE, WINDOW,
    qk_scale, softcap_log2, N_BH,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    SCORE_ITEM: tl.constexpr, REDUCE: tl.constexpr, USE_SCALE: tl.constexpr, USE_CHAN: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    TK_BLOCK: tl.constexpr, TAIL: tl.constexpr, RANK_BITS: tl.constexpr, ONE_REDUCE: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_FP32_DOT: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # The state: the KV heads' counters and flags (3 ints each), then the ticket counter.
    i_t = tl.atomic_add(state_ptr + 3 * N_BH, 1, sem="relaxed")
    if i_t == N_TOTAL - 1:  # the last ticket of the launch: the counter goes back to 0 for the next one
        tl.store(state_ptr + 3 * N_BH, 0)
    cur, p_dead, window_start = _step_positions(pos_ptr, P, PAGE, WINDOW, HAS_POS, HAS_WINDOW)
    _step_item(i_t, q_ptr, kmin_ptr, kmax_ptr, scale_ptr, chan_ptr, s_ptr, ids_ptr, k_ptr, v_ptr, valid_ptr,
               m_ptr, l_ptr, acc_ptr, out_ptr, sinks_ptr, state_ptr,
               stride_qb, stride_qh, stride_qd, stride_nb, stride_nh, stride_np, stride_nd,
               stride_xb, stride_xh, stride_xp, stride_xd, stride_sb, stride_sh, stride_sp, stride_ch, stride_cd,
               stride_kb, stride_kh, stride_kc, stride_kd, stride_vb, stride_vh, stride_vc, stride_vd,
               stride_vab, stride_vac, stride_ob, stride_oh, stride_od,
               H_KV, P, NCHUNK, N_SCORE, KK, K_OUT, IDS_PER_SPLIT, NUM_SPLITS, SEQ_LEN, PAGE,
               qk_scale, softcap_log2, cur, p_dead, window_start,
               G, G_PAD, D, BLOCK_D, BLOCK_P, SCORE_ITEM, REDUCE, USE_SCALE, USE_CHAN, TK_BLOCK, TAIL, RANK_BITS, ONE_REDUCE,
               BLOCK_N, USE_FP32_DOT, USE_SOFTCAP, USE_SINKS, BLOCK_S)


@triton.jit
def _step_positions(pos_ptr, P, PAGE, WINDOW, HAS_POS: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """(the current page, the first live page, the window's first slot): from the device position when HAS_POS
    (the page of the last token written; the sliding window's start), else (P - 1, 0, 0)."""
    cur = P - 1
    p_dead = 0
    window_start = 0
    if HAS_POS:
        i_pos = tl.load(pos_ptr).to(tl.int32)
        cur = (i_pos - 1) // PAGE
        if HAS_WINDOW:
            window_start = tl.maximum(i_pos - WINDOW, 0)
            p_dead = window_start // PAGE
    return cur, p_dead, window_start


@triton.jit
def _score_count_kernel(
    q_ptr, kmin_ptr, kmax_ptr, scale_ptr, chan_ptr, s_ptr, pos_ptr, state_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_nb, stride_nh, stride_np, stride_nd,
    stride_xb, stride_xh, stride_xp, stride_xd,
    stride_sb, stride_sh, stride_sp, stride_ch, stride_cd,
    H_KV, P, NCHUNK, N_SCORE, PAGE, WINDOW,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    SCORE_ITEM: tl.constexpr, REDUCE: tl.constexpr, USE_SCALE: tl.constexpr, USE_CHAN: tl.constexpr,
    HAS_POS: tl.constexpr, HAS_WINDOW: tl.constexpr, PDL: tl.constexpr, MMA: tl.constexpr, G_MMA: tl.constexpr,
    WORDS: tl.constexpr = 0,
):
    """The three-launch step's first launch (`StepLaunch.launches`): score items, head-major, each counted toward
    its head; no Top-K, so it holds only the scoring's registers. A program takes items `pid, pid + grid, ...`:
    with one item a program (the default grid) every head finishes in the same wave; with a resident grid
    (`StepLaunch.score_programs`) the heads finish in order, round by round, so the first heads' Top-Ks and
    attention run while later heads are still scored. Under PDL it is itself launched dependently (resident before
    the kernel before it, the append, ends; it reads nothing until that kernel has ended)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    cur, p_dead, _ = _step_positions(pos_ptr, P, PAGE, WINDOW, HAS_POS, HAS_WINDOW)
    for i_t in range(tl.program_id(0), N_SCORE, tl.num_programs(0)):
        _score_item(i_t, q_ptr, kmin_ptr, kmax_ptr, scale_ptr, chan_ptr, s_ptr, s_ptr, state_ptr,
                    stride_qb, stride_qh, stride_qd, stride_nb, stride_nh, stride_np, stride_nd,
                    stride_xb, stride_xh, stride_xp, stride_xd, stride_sb, stride_sh, stride_sp, stride_ch, stride_cd,
                    H_KV, P, NCHUNK, 1, 1, cur, p_dead,
                    G, D, BLOCK_D, BLOCK_P, SCORE_ITEM, REDUCE, USE_SCALE, USE_CHAN, 16, 0, 16, False, False,
                    MMA, G_MMA, WORDS)


@triton.jit
def _topk_wait_kernel(s_ptr, ids_ptr, state_ptr, P, NCHUNK, KK, K_OUT, TK_BLOCK: tl.constexpr, TAIL: tl.constexpr,
                      RANK_BITS: tl.constexpr, ONE_REDUCE: tl.constexpr, PDL: tl.constexpr):
    """The three-launch step's second launch: one KV head a program; waits until all of the head's score items
    are counted (their programs have all started before this launch's did), puts the count back to 0, then runs
    the head's Top-K and raises its flag."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    i_bh = tl.program_id(0).to(tl.int64)
    p_count = state_ptr + 3 * i_bh
    i_n = tl.load(p_count, volatile=True)
    while i_n < NCHUNK:
        i_n = tl.load(p_count, volatile=True)
    # Every warp leaves the loop before the count goes back to 0 (a warp still spinning would never see it full).
    tl.debug_barrier()
    tl.atomic_xchg(p_count, 0, sem="acquire")
    tl.debug_barrier()
    _head_topk(s_ptr, ids_ptr, state_ptr, i_bh, P, KK, K_OUT, TK_BLOCK, TAIL, RANK_BITS, ONE_REDUCE)


@triton.jit
def _attend_kernel(
    q_ptr, ids_ptr, k_ptr, v_ptr, valid_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, sinks_ptr, state_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_vb, stride_vh, stride_vc, stride_vd,
    stride_vab, stride_vac,
    stride_ob, stride_oh, stride_od,
    H_KV, P, K_OUT, IDS_PER_SPLIT, NUM_SPLITS, SEQ_LEN, PAGE, WINDOW, qk_scale, softcap_log2,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_POS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_FP32_DOT: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr,
    BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    """The three-launch step's last launch: one attention split a program (head-major), each waiting on its head's
    flag (the first launch's programs have all started before this one's do, so the waits end). Under PDL it lets
    the next launch start at once (the decode GEMV of the output projection: its programs take the SM room the
    attention leaves, load their first weight tiles and wait for this grid's end before reading its output)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    _, _, window_start = _step_positions(pos_ptr, P, PAGE, WINDOW, HAS_POS, HAS_WINDOW)
    _attend_item(tl.program_id(0), q_ptr, k_ptr, v_ptr, ids_ptr, valid_ptr, m_ptr, l_ptr, acc_ptr, out_ptr,
                 sinks_ptr, state_ptr, stride_qb, stride_qh, stride_qd,
                 stride_kb, stride_kh, stride_kc, stride_kd, stride_vb, stride_vh, stride_vc, stride_vd,
                 stride_vab, stride_vac, stride_ob, stride_oh, stride_od,
                 H_KV, K_OUT, IDS_PER_SPLIT, NUM_SPLITS, SEQ_LEN, PAGE, qk_scale, softcap_log2, window_start,
                 G, G_PAD, D, BLOCK_D, BLOCK_N, USE_FP32_DOT, USE_SOFTCAP, USE_SINKS, BLOCK_S)


@triton.jit
def _step_item(
    i_t, q_ptr, kmin_ptr, kmax_ptr, scale_ptr, chan_ptr, s_ptr, ids_ptr, k_ptr, v_ptr, valid_ptr,
    m_ptr, l_ptr, acc_ptr, out_ptr, sinks_ptr, state_ptr,
    stride_qb, stride_qh, stride_qd, stride_nb, stride_nh, stride_np, stride_nd,
    stride_xb, stride_xh, stride_xp, stride_xd, stride_sb, stride_sh, stride_sp, stride_ch, stride_cd,
    stride_kb, stride_kh, stride_kc, stride_kd, stride_vb, stride_vh, stride_vc, stride_vd,
    stride_vab, stride_vac, stride_ob, stride_oh, stride_od,
    H_KV, P, NCHUNK, N_SCORE, KK, K_OUT, IDS_PER_SPLIT, NUM_SPLITS, SEQ_LEN, PAGE,
    qk_scale, softcap_log2, cur, p_dead, window_start,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    SCORE_ITEM: tl.constexpr, REDUCE: tl.constexpr, USE_SCALE: tl.constexpr, USE_CHAN: tl.constexpr,
    TK_BLOCK: tl.constexpr, TAIL: tl.constexpr, RANK_BITS: tl.constexpr, ONE_REDUCE: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_FP32_DOT: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Work item `i_t` of the one-launch step: a score item (`_score_item`) or an attention split (`_attend_item`)."""
    if i_t < N_SCORE:
        _score_item(i_t, q_ptr, kmin_ptr, kmax_ptr, scale_ptr, chan_ptr, s_ptr, ids_ptr, state_ptr,
                    stride_qb, stride_qh, stride_qd, stride_nb, stride_nh, stride_np, stride_nd,
                    stride_xb, stride_xh, stride_xp, stride_xd, stride_sb, stride_sh, stride_sp, stride_ch, stride_cd,
                    H_KV, P, NCHUNK, KK, K_OUT, cur, p_dead,
                    G, D, BLOCK_D, BLOCK_P, SCORE_ITEM, REDUCE, USE_SCALE, USE_CHAN, TK_BLOCK, TAIL, RANK_BITS,
                    ONE_REDUCE)
    else:
        _attend_item(i_t - N_SCORE, q_ptr, k_ptr, v_ptr, ids_ptr, valid_ptr, m_ptr, l_ptr, acc_ptr, out_ptr,
                     sinks_ptr, state_ptr, stride_qb, stride_qh, stride_qd,
                     stride_kb, stride_kh, stride_kc, stride_kd, stride_vb, stride_vh, stride_vc, stride_vd,
                     stride_vab, stride_vac, stride_ob, stride_oh, stride_od,
                     H_KV, K_OUT, IDS_PER_SPLIT, NUM_SPLITS, SEQ_LEN, PAGE, qk_scale, softcap_log2, window_start,
                     G, G_PAD, D, BLOCK_D, BLOCK_N, USE_FP32_DOT, USE_SOFTCAP, USE_SINKS, BLOCK_S)


@triton.jit
def _score_item(
    i_t, q_ptr, kmin_ptr, kmax_ptr, scale_ptr, chan_ptr, s_ptr, ids_ptr, state_ptr,
    stride_qb, stride_qh, stride_qd, stride_nb, stride_nh, stride_np, stride_nd,
    stride_xb, stride_xh, stride_xp, stride_xd, stride_sb, stride_sh, stride_sp, stride_ch, stride_cd,
    H_KV, P, NCHUNK, KK, K_OUT, cur, p_dead,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    SCORE_ITEM: tl.constexpr, REDUCE: tl.constexpr, USE_SCALE: tl.constexpr, USE_CHAN: tl.constexpr,
    TK_BLOCK: tl.constexpr, TAIL: tl.constexpr, RANK_BITS: tl.constexpr, ONE_REDUCE: tl.constexpr,
    TOPK: tl.constexpr = True, MMA: tl.constexpr = 0, G_MMA: tl.constexpr = 16, WORDS: tl.constexpr = 0,
):
    """Score item `i_t`: `SCORE_ITEM` pages of one KV head (head-major), counted toward the head's Top-K; with TOPK,
    the head's last item to finish runs the head's Top-K and raises the head's flag (else `_topk_wait_kernel`
    does, and puts the count back to 0)."""
    i_bh = (i_t // NCHUNK).to(tl.int64)
    i_b = i_bh // H_KV
    o_row = tl.zeros([BLOCK_P], dtype=tl.int64) + i_b
    for i_p0 in range((i_t % NCHUNK) * SCORE_ITEM, (i_t % NCHUNK + 1) * SCORE_ITEM, BLOCK_P):
        _score_block(q_ptr, kmin_ptr, kmax_ptr, s_ptr, i_b, i_bh % H_KV, i_p0 + tl.arange(0, BLOCK_P), o_row,
                     stride_qb, stride_qh, stride_qd, stride_nb, stride_nh, stride_np, stride_nd,
                     stride_xb, stride_xh, stride_xp, stride_xd, H_KV * P, P, 1,
                     P, p_dead, cur, G, D, BLOCK_D, BLOCK_P, REDUCE,
                     scale_ptr, stride_sb, stride_sh, stride_sp, USE_SCALE, chan_ptr, stride_ch, stride_cd,
                     USE_CHAN, MMA, G_MMA, WORDS)
    # Every thread's score stores are ordered before the count by the barrier and the atomic's release; the
    # head's last item acquires them and reads the row from L2 (.cg: L1 is not coherent across programs).
    tl.debug_barrier()
    if TOPK:
        if tl.atomic_add(state_ptr + 3 * i_bh, 1, sem="acq_rel") == NCHUNK - 1:
            tl.store(state_ptr + 3 * i_bh, 0)
            _head_topk(s_ptr, ids_ptr, state_ptr, i_bh, P, KK, K_OUT, TK_BLOCK, TAIL, RANK_BITS, ONE_REDUCE)
    else:
        tl.atomic_add(state_ptr + 3 * i_bh, 1, sem="release")


@triton.jit
def _head_topk(s_ptr, ids_ptr, state_ptr, i_bh, P, KK, K_OUT, TK_BLOCK: tl.constexpr, TAIL: tl.constexpr,
               RANK_BITS: tl.constexpr, ONE_REDUCE: tl.constexpr):
    """KV head `i_bh`'s Top-K over its scores (read from L2: written by other programs), then its flag raised."""
    _lean_topk_row(s_ptr + i_bh * P, ids_ptr + i_bh * K_OUT, 1, 1, P, KK, K_OUT, TK_BLOCK, False,
                   RANK_BITS, TAIL, ONE_REDUCE, ".cg")
    tl.debug_barrier()
    tl.atomic_xchg(state_ptr + 1 + 3 * i_bh, 1, sem="release")


@triton.jit
def _attend_item(
    i_u, q_ptr, k_ptr, v_ptr, ids_ptr, valid_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, sinks_ptr, state_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd, stride_vb, stride_vh, stride_vc, stride_vd,
    stride_vab, stride_vac, stride_ob, stride_oh, stride_od,
    H_KV, K_OUT, IDS_PER_SPLIT, NUM_SPLITS, SEQ_LEN, PAGE, qk_scale, softcap_log2, window_start,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_FP32_DOT: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Attention split `i_u` (head-major): waits for its head's flag, attends its share of the head's pages; the
    head's last split to finish merges the head and puts its flag and count back to 0."""
    i_bh = (i_u // NUM_SPLITS).to(tl.int64)
    i_b = i_bh // H_KV
    i_h = i_bh % H_KV
    # Wait for the head's page ids (raised by a program that is running or done), then acquire them.
    p_ready = state_ptr + 1 + 3 * i_bh
    i_ready = tl.load(p_ready, volatile=True)
    while i_ready == 0:
        i_ready = tl.load(p_ready, volatile=True)
    tl.atomic_add(p_ready, 0, sem="acquire")
    tl.debug_barrier()
    _attn_split(q_ptr, k_ptr, v_ptr, ids_ptr, valid_ptr, m_ptr, l_ptr, acc_ptr, i_b, i_h, i_u % NUM_SPLITS,
                stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kc, stride_kd,
                stride_vb, stride_vh, stride_vc, stride_vd, H_KV * K_OUT, K_OUT, 1, stride_vab, stride_vac,
                H_KV, K_OUT, IDS_PER_SPLIT, NUM_SPLITS, SEQ_LEN, window_start, qk_scale, softcap_log2,
                valid_ptr, 0, G, G_PAD, D, BLOCK_D, PAGE, BLOCK_N, USE_FP32_DOT, USE_SOFTCAP, False, ".cg")
    tl.debug_barrier()
    if tl.atomic_add(state_ptr + 2 + 3 * i_bh, 1, sem="acq_rel") == NUM_SPLITS - 1:
        # Every split of the head has passed its wait: the head's flag and count go back to 0.
        tl.store(state_ptr + 2 + 3 * i_bh, 0)
        tl.store(p_ready, 0)
        _merge_group(m_ptr, l_ptr, acc_ptr, out_ptr, sinks_ptr, i_b, i_h, H_KV, stride_ob, stride_oh,
                     stride_od, NUM_SPLITS, G, D, BLOCK_D, BLOCK_S, USE_SINKS)


def quest_step(q, kmin, kmax, k_cache, v_cache, valid, seq_len: int, page_size: int, k: int, attn_scale: float,
               reduce: str = "none", pos=None, window: int = 0, scale=None, chan=None, softcap: float = 0.0,
               sinks=None, *, workspace=None, launch: StepLaunch = STEP_LAUNCH, ids_out=None):
    """Triton twin of `quest_step_ref` in one launch (module docstring). Returns (out `[B, H_q, D]` in q's dtype,
    ids int32 `[B, H_kv, min(k, P)]`: the pages each KV head attended, ascending, -1 padded).

    `workspace`: `step_workspace(B, H_kv, device)`, zeroed and left zeroed (None: a fresh one, one memset launch).
    Bounds as `score_pages` takes them (float, or int8 codes with `scale` and optionally `chan`); `pos` / `window`
    as there (the captured step's device position; a sliding window), `softcap` / `sinks` as in
    `sparse_decode_attention`. Raises ValueError for a step it does not take (`fused_step_supported`).
    Workspace besides: fp32 scores `[B, H_kv, P]`, ids, and the splits' fp32 partials."""
    require_triton()
    B, H, G, D, P = _check(q, kmin, kmax, k_cache, v_cache, valid, seq_len, page_size, k, reduce, pos, window,
                           scale, chan, softcap, sinks, workspace, launch)
    state = workspace if workspace is not None else step_workspace(B, H, q.device)
    K_out = min(k, P)
    scores = torch.empty(B, H, P, dtype=torch.float32, device=q.device)
    ids = ids_out if ids_out is not None else torch.empty(B, H, K_out, dtype=torch.int32, device=q.device)
    if ids.shape != (B, H, K_out) or ids.dtype != torch.int32 or not ids.is_contiguous():
        raise ValueError(f"ids_out must be a contiguous int32 [{B}, {H}, {K_out}], got {ids.dtype} {tuple(ids.shape)}")
    attn = AttentionLaunch(block_n=launch.block_n, num_warps=launch.num_warps, num_stages=launch.num_stages,
                           programs_per_sm=launch.programs_per_sm)
    splits, ids_each = _num_splits(q.device, B * H, K_out, page_size, attn)
    m_part = torch.empty(B * H * G, splits, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(B * H * G, splits, D, dtype=torch.float32, device=q.device)
    out = torch.empty(B, H * G, D, dtype=q.dtype, device=q.device)
    nchunk = cdiv(P, launch.score_item)
    n_score = B * H * nchunk
    n_total = n_score + B * H * splits
    tk_block, tk_warps, _ = launch_config(P, 1, launch.topk())
    _, tail = tail_config(P, 1, launch.topk())
    valid_u8 = as_u8(valid)
    # The kernels' arguments in groups, so that each launch takes the groups its roles read: pointers, strides, the
    # scoring's / Top-K's / attention's constexprs. Unused pointers get a tensor the kernel never reads.
    s_ptrs = (q, kmin, kmax, scale if scale is not None else scores, chan if chan is not None else scores, scores)
    s_strides = (*q.stride(), *kmin.stride(), *kmax.stride(), *(scale.stride() if scale is not None else (0, 0, 0)),
                 *(chan.stride() if chan is not None else (0, 0)))
    a_strides = (*k_cache.stride(), *v_cache.stride(), *valid_u8.stride(), *out.stride())
    pos_arg = pos if pos is not None else state
    sinks_arg = sinks if sinks is not None else m_part
    scales = (attn_scale / softcap if softcap else attn_scale * LOG2E, softcap * LOG2E)
    both = dict(G=G, D=D, BLOCK_D=max(16, next_pow2(D)), HAS_POS=pos is not None, HAS_WINDOW=window > 0)
    s_meta = dict(BLOCK_P=launch.score_block, SCORE_ITEM=launch.score_item, REDUCE={"none": 0, "max": 1, "sum": 2}[reduce],
                  USE_SCALE=scale is not None, USE_CHAN=chan is not None)
    t_meta = dict(TK_BLOCK=tk_block, TAIL=tail, RANK_BITS=launch.topk().rank_bits, ONE_REDUCE=not interpreting())
    a_meta = dict(G_PAD=max(16, next_pow2(G)), BLOCK_N=launch.block_n,
                  USE_FP32_DOT=k_cache.dtype == torch.float32 or (interpreting() and k_cache.dtype == torch.bfloat16),
                  USE_SOFTCAP=softcap > 0, USE_SINKS=sinks is not None, BLOCK_S=max(2, next_pow2(splits)))
    if launch.launches == 3:
        # `quest_step.compiled`: the three compiled kernels, for bench_fused_step.py's report.
        pdl = quest_step.overlapped = pdl_available(q.device)
        score_grid = n_score
        if launch.score_programs:
            score_grid = min(n_score, launch.score_programs * num_sms(q.device))
        after = {"launch_pdl": True} if pdl else {}
        quest_step.compiled = (
            _score_count_kernel[(score_grid,)](*s_ptrs, pos_arg, state, *s_strides, H, P, nchunk, n_score, page_size,
                                               window,
                                            **both, **s_meta, PDL=pdl, num_warps=launch.num_warps, **after,
                                            **mma_meta(q, kmin, scale, launch.score_form),
                                            WORDS=word_form(q, kmin, kmax, scale, chan, launch.score_form)),
            _topk_wait_kernel[(B * H,)](scores, ids, state, P, nchunk, K_out, K_out, **t_meta, PDL=pdl,
                                        num_warps=launch.topk_warps or tk_warps, **after),
            _attend_kernel[(B * H * splits,)](
                q, ids, k_cache, v_cache, valid_u8, pos_arg, m_part, l_part, acc_part, out, sinks_arg, state,
                *q.stride(), *a_strides, H, P, K_out, ids_each, splits, seq_len, page_size, window, *scales,
                **both, **a_meta, PDL=pdl, num_warps=launch.num_warps, num_stages=launch.num_stages, **after),
        )
        return out, ids
    quest_step.overlapped = False
    # The compiled kernel (registers, spills, shared memory) for bench_fused_step.py's report.
    quest_step.compiled = _quest_step_kernel[(n_total,)](
        *s_ptrs, ids, k_cache, v_cache, valid_u8, pos_arg, m_part, l_part, acc_part, out, sinks_arg, state,
        *s_strides, *a_strides,
        H, P, nchunk, n_score, n_total, K_out, K_out, ids_each, splits, seq_len, page_size, window, *scales, B * H,
        **both, **s_meta, **t_meta, **a_meta, num_warps=launch.num_warps, num_stages=launch.num_stages,
        **({"maxnreg": launch.maxnreg} if launch.maxnreg and not interpreting() else {}),
    )
    return out, ids
