"""Top-K page ids per score row, with the union over the query heads of a KV group."""
import torch

__all__ = ["topk_pages", "topk_pages_ref"]


def _check(scores, k, group):
    if scores.dim() != 3 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be fp32 [B, R, P], got {scores.dtype} {tuple(scores.shape)}")
    B, R, P = scores.shape
    if k < 1 or group < 1 or R % group:
        raise ValueError(f"need k >= 1 and group >= 1 dividing {R} rows, got k={k}, group={group}")
    return B, R, P, min(group * k, P)


def topk_pages_ref(scores, k: int, group: int = 1):
    """Choose the `k` best pages of each row of `scores [B, R, P]`, then unite each `group` consecutive rows.

    Pages scoring `-inf` are never chosen. Returns int32 `[B, R // group, min(group * k, P)]`: the chosen ids
    of each group in ascending order, then `-1`. Ties at the k-th score are broken arbitrarily.
    """
    B, R, P, K_out = _check(scores, k, group)
    top = scores.topk(min(k, P), dim=-1)
    chosen = torch.zeros(B, R, P, dtype=torch.bool, device=scores.device)
    chosen.scatter_(-1, top.indices, top.values > float("-inf"))
    chosen = chosen.reshape(B, R // group, group, P).any(2)
    ids = torch.arange(P, device=scores.device).expand_as(chosen)
    # Unchosen pages sort after every chosen one, keeping the chosen ones ascending.
    key = torch.where(chosen, ids, ids + P)
    out = key.sort(-1).values[..., :K_out]
    return torch.where(out < P, out, -1).to(torch.int32)


def topk_pages(scores, k: int, group: int = 1):
    """Triton twin of `topk_pages_ref`."""
    raise NotImplementedError("Triton Top-K kernel not written yet")
