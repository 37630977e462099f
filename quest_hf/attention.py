"""The "quest" attention function registered with HF's AttentionInterface.

Dense (HF's SDPA) for prefill, the first `dense_layers` layers and any layer whose context (or
sliding window) fits in the budget; otherwise one decode token attends to the selected pages only:

    keys ─append─► pages + min/max ─score─► bounds ─Top-K─► page ids ─sparse attention─► output
"""
from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .cache import QuestLayer
from .selectors import SELECTORS
from .static import StaticQuestLayer, static_decode_attention

NAME = "quest"  # avoid "sdpa"/"flash"/"paged": transformers matches those substrings specially


def _window_start(seq_len: int, sliding_window: int | None) -> int:
    # HF's window lets query q see keys k with k > q - window; the decode query is slot seq_len - 1.
    return max(0, seq_len - sliding_window) if sliding_window else 0


def select_pages(layer: QuestLayer, q: torch.Tensor, window_start: int) -> torch.Tensor:
    """Page ids `[B, H_kv, K]` (int32, -1 unused) for decode query `q [B, H_q, D]` under the layer's policy."""
    return SELECTORS[layer.config.policy].select(layer, q, window_start)


def oracle_attention(layer: QuestLayer, q: torch.Tensor, scale: float, window_start: int) -> torch.Tensor:
    """Attention over the exact top-`budget` tokens by q.k of each query head, united per KV group.

    Reads every key: the accuracy ceiling of any selector at this budget, for evaluation only.
    """
    L, budget = layer.seq_len, layer.config.budget
    B, Hq, D = q.shape
    H = layer.keys.shape[1]
    G = Hq // H
    keys = layer.keys[:, :, :L].float()
    vals = layer.values[:, :, :L].float()
    ok = layer.valid[:, None, None, :L].clone()
    ok[..., :window_start] = False
    logits = torch.einsum("bhgd,bhnd->bhgn", q.float().reshape(B, H, G, D), keys) * scale
    logits = logits.masked_fill(~ok, float("-inf"))
    top = logits.topk(min(budget, L), dim=-1).indices
    chosen = torch.zeros_like(ok.expand(B, H, G, L)).scatter_(-1, top, True).any(2, keepdim=True) & ok
    w = torch.softmax(logits.masked_fill(~chosen, float("-inf")), dim=-1)
    return torch.einsum("bhgn,bhnd->bhgd", w, vals).reshape(B, Hq, D).to(q.dtype)


def quest_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, **kwargs):
    """HF attention function: `query [B, H_q, q, D]`, `key/value [B, H_kv, L, D]` as the cache returned them.

    Returns `(output [B, q, H_q, D], None)`, like `sdpa_attention_forward`.
    """
    state = getattr(module, "_quest_state", None)
    cache = state.cache if state is not None else None
    layer = cache.layers[module.layer_idx] if cache is not None else None
    dense_kw = dict(dropout=dropout, scaling=scaling, sliding_window=sliding_window, **kwargs)
    if layer is None or query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **dense_kw)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(layer, StaticQuestLayer):  # fixed shapes, device positions: graph-capturable
        dense = module.layer_idx < layer.config.dense_layers
        return static_decode_attention(layer, query[:, :, 0], scale, dense, sliding_window)[:, None], None
    if module.layer_idx < layer.config.dense_layers:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **dense_kw)
    cfg, L = layer.config, layer.seq_len
    window_start = _window_start(L, sliding_window)
    if L - window_start <= cfg.budget:  # everything fits: exact dense attention, no selection
        return sdpa_attention_forward(module, query, key, value, attention_mask, **dense_kw)
    q = query[:, :, 0]
    if cfg.policy == "oracle":
        return oracle_attention(layer, q, scale, window_start)[:, None], None
    page_ids = select_pages(layer, q, window_start)
    for hook in cache.selection_hooks:
        hook(module.layer_idx, q, page_ids)
    out = layer.ops.sparse_decode_attention(q, layer.keys, layer.values, page_ids, layer.valid, L,
                                            cfg.page_size, scale, window_start)
    return out[:, None], None
