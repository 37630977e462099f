"""Quest page scores: the upper bound `sum_i max(q_i * min_i, q_i * max_i)` of q.k over a page (arXiv 2406.10774)."""
import torch

from ._common import check_query

__all__ = ["score_pages", "score_pages_ref", "REDUCES"]

# How the query heads of a KV group are combined: "none" keeps one row per query head (the union
# policy takes the union of their Top-K later); "max"/"sum" share one score row per KV head.
REDUCES = ("none", "max", "sum")


def _check(q, kmin, kmax, seq_len, page_size, window_start, reduce):
    B, H, P_cap, D = kmin.shape
    G = check_query(q, H, D, B)
    if reduce not in REDUCES:
        raise ValueError(f"reduce must be one of {REDUCES}, got {reduce!r}")
    P = -(-seq_len // page_size)
    if seq_len < 1 or P > P_cap:
        raise ValueError(f"seq_len {seq_len} must be in [1, {P_cap * page_size}]")
    if not 0 <= window_start < seq_len:
        raise ValueError(f"window_start {window_start} must be in [0, seq_len={seq_len})")
    return B, H, G, D, P


def score_pages_ref(q, kmin, kmax, seq_len: int, page_size: int, window_start: int = 0, reduce: str = "none"):
    """Score the `P = ceil(seq_len / S)` pages of a layer for one decode query.

    q `[B, H_q, D]`; kmin/kmax `[B, H_kv, P_cap, D]`. Returns fp32 `[B, H_q, P]` (`reduce="none"`) or
    `[B, H_kv, P]` (`"max"`/`"sum"` over each KV group). The current page `P - 1` scores `+inf` (always
    chosen); empty pages (padding only) and pages ending before `window_start` score `-inf` (never chosen).
    """
    B, H, G, D, P = _check(q, kmin, kmax, seq_len, page_size, window_start, reduce)
    qf = q.float().reshape(B, H, G, 1, D)
    lo, hi = kmin[:, :, None, :P].float(), kmax[:, :, None, :P].float()
    empty = (kmin[:, :, :P, 0] > kmax[:, :, :P, 0])[:, :, None]  # [B, H, 1, P]
    # 0 * inf is NaN: empty pages are overwritten below, so zero them first.
    lo = torch.where(empty[..., None], 0.0, lo)
    hi = torch.where(empty[..., None], 0.0, hi)
    s = torch.maximum(qf * lo, qf * hi).sum(-1)  # [B, H, G, P]
    s = s.masked_fill(empty, float("-inf"))
    s[..., : window_start // page_size] = float("-inf")
    s[..., P - 1] = float("inf")
    if reduce == "max":
        return s.amax(2)
    if reduce == "sum":
        return s.sum(2)
    return s.reshape(B, H * G, P)


def score_pages(q, kmin, kmax, seq_len: int, page_size: int, window_start: int = 0, reduce: str = "none"):
    """Triton twin of `score_pages_ref`."""
    raise NotImplementedError("Triton score kernel not written yet")
