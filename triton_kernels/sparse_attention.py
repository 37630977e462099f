"""Decode attention over the chosen pages only (exact softmax over exactly their valid tokens)."""
import torch

from ._common import check_cache, check_query

__all__ = ["sparse_decode_attention", "sparse_decode_attention_ref"]


def _check(q, k_cache, v_cache, page_ids, valid, seq_len, page_size, window_start):
    B, H, C, D = k_cache.shape
    G = check_query(q, H, D, B)
    if page_ids.dim() != 3 or page_ids.shape[:2] != (B, H) or page_ids.dtype != torch.int32:
        raise ValueError(f"page_ids must be int32 [B={B}, H_kv={H}, K], got {page_ids.dtype} {tuple(page_ids.shape)}")
    if valid.shape != (B, C) or valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool [B={B}, C={C}] tensor, got {valid.dtype} {tuple(valid.shape)}")
    if not 1 <= seq_len <= C or C % page_size:
        raise ValueError(f"seq_len {seq_len} must be in [1, {C}] and the capacity a multiple of page_size {page_size}")
    if not 0 <= window_start < seq_len:
        raise ValueError(f"window_start {window_start} must be in [0, seq_len={seq_len})")
    return B, H, G, D


def sparse_decode_attention_ref(q, k_cache, v_cache, page_ids, valid, seq_len: int, page_size: int,
                                scale: float, window_start: int = 0):
    """Attention of one decode query per row over the tokens of the chosen pages.

    q `[B, H_q, D]`; caches `[B, H_kv, C, D]`; page_ids int32 `[B, H_kv, K]` (-1 unused); valid `[B, C]`.
    A token takes part when its page is chosen for the query head's KV head, it is `< seq_len`,
    `>= window_start` and valid. Returns `[B, H_q, D]` in q's dtype; fp32 math; all-masked rows give 0.
    """
    B, H, G, D = _check(q, k_cache, v_cache, page_ids, valid, seq_len, page_size, window_start)
    K = page_ids.shape[2]
    slots = page_ids.long()[..., None] * page_size + torch.arange(page_size, device=q.device)  # [B, H, K, S]
    slots = slots.reshape(B, H, K * page_size)
    ok = (page_ids.long()[..., None] >= 0).expand(B, H, K, page_size).reshape(B, H, -1)
    ok &= (slots < seq_len) & (slots >= window_start)
    safe = slots.clamp(0, k_cache.shape[2] - 1)
    ok &= torch.gather(valid[:, None].expand(B, H, -1), 2, safe)
    idx = safe[..., None].expand(-1, -1, -1, D)
    keys = torch.gather(k_cache, 2, idx).float()  # [B, H, N, D]
    vals = torch.gather(v_cache, 2, idx).float()
    qf = q.float().reshape(B, H, G, D)
    logits = torch.einsum("bhgd,bhnd->bhgn", qf, keys) * scale
    logits = logits.masked_fill(~ok[:, :, None], float("-inf"))
    w = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with no token at all gives 0, not NaN
    out = torch.einsum("bhgn,bhnd->bhgd", w, vals)
    return out.reshape(B, H * G, D).to(q.dtype)


def sparse_decode_attention(q, k_cache, v_cache, page_ids, valid, seq_len: int, page_size: int,
                            scale: float, window_start: int = 0):
    """Triton twin of `sparse_decode_attention_ref`."""
    raise NotImplementedError("Triton sparse attention kernel not written yet")
