"""Append new K/V tokens to a paged layer cache and update the pages' key min/max in one pass.

Layouts follow `_contract.md`: caches `[B, H_kv, C, D]`, metadata `[B, H_kv, C // S, D]`, `valid [B, C]`.
"""
import torch

from ._common import check_cache

__all__ = ["append_kv", "append_kv_ref"]


def _check(k_cache, v_cache, kmin, kmax, valid, k_new, v_new, valid_new, start):
    B, H, C, D = check_cache(k_cache, v_cache, kmin, kmax, valid)
    if k_new.shape != v_new.shape or k_new.shape[:2] != (B, H) or k_new.shape[3] != D:
        raise ValueError(f"new keys/values must be [B={B}, H_kv={H}, T, D={D}], got {tuple(k_new.shape)} and {tuple(v_new.shape)}")
    T = k_new.shape[2]
    if start < 0 or start + T > C:
        raise ValueError(f"appending {T} tokens at slot {start} overflows the capacity {C}; grow the cache first")
    if valid_new is not None and (valid_new.shape != (B, T) or valid_new.dtype != torch.bool):
        raise ValueError(f"valid_new must be a bool [B={B}, T={T}] tensor, got {valid_new.dtype} {tuple(valid_new.shape)}")
    return B, H, C, D, T


def append_kv_ref(k_cache, v_cache, kmin, kmax, valid, k_new, v_new, valid_new, start: int) -> None:
    """Write `k_new/v_new [B, H_kv, T, D]` into slots `[start, start+T)` and fold the valid ones into min/max.

    In place on every cache tensor; `valid_new [B, T]` bool (None: all valid). Plain PyTorch; also the CPU path.
    """
    B, H, C, D, T = _check(k_cache, v_cache, kmin, kmax, valid, k_new, v_new, valid_new, start)
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


def append_kv(k_cache, v_cache, kmin, kmax, valid, k_new, v_new, valid_new, start: int) -> None:
    """Triton twin of `append_kv_ref` (same signature, same in-place effect)."""
    raise NotImplementedError("Triton append kernel not written yet")
