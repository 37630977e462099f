"""The "quest" attention function registered with HF's AttentionInterface.

Prefill (more than one query token) runs HF's dense SDPA. Every decode token runs one fixed-shape step over the
layer's pages (no host state, so the same step runs eagerly and inside a captured CUDA graph):

    dense layer (the first `dense_layers`; or the window fits the budget) ─► every page (of the window) ─┐
    sparse layer ─► the policy's selector: score ─► Top-K ─► page ids ──────────────────────────────────┴► attention
"""
from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .graph import selected
from .selectors import attend_pages

NAME = "quest"  # avoid "sdpa"/"flash"/"paged": transformers matches those substrings specially


def decode_attention(layer, q: torch.Tensor, scale: float, dense: bool, window: int, on_select) -> torch.Tensor:
    """One decode query `q [B, H_q, D]` over `layer` (a QuestLayer): `[B, H_q, D]`."""
    cfg = layer.config
    pages = layer.keys.shape[2] // cfg.page_size
    if cfg.num_pages + 1 >= pages or (window and window <= cfg.budget):
        dense = True  # everything the query may see fits the budget: exact dense attention, no selection
    if dense:
        return attend_pages(layer, q, layer.dense_pages(window), scale, window)
    return layer.selector.attend(layer, q, scale, window, on_select)


def quest_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, **kwargs):
    """HF attention function: `query [B, H_q, q, D]`, `key/value [B, H_kv, L, D]` as the cache returned them.

    Returns `(output [B, q, H_q, D], None)`, like `sdpa_attention_forward`.
    """
    state = getattr(module, "_quest_state", None)
    cache = state.cache if state is not None else None
    if cache is None or query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    idx = module.layer_idx
    layer = cache.layers[idx]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[:, :, 0]
    hooks = cache.selection_hooks

    def on_select(ids):
        if hooks:
            selected(getattr(state, "graph", None), idx, q, ids, layer, hooks)

    out = decode_attention(layer, q, scale, idx < layer.config.dense_layers, sliding_window or 0, on_select)
    return out[:, None], None
