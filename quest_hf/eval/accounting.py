"""Bytes a decode step reads from the KV cache in one sparse layer, per policy, and over a model's layers under a
config with per-layer budgets (for equal-bytes comparisons)."""
from __future__ import annotations

import math

from ..selectors import selector_for


def dense_bytes(seq_len: int, kv_heads: int, head_dim: int, elt: int) -> int:
    return seq_len * kv_heads * 2 * head_dim * elt


def step_bytes(policy: str, seq_len: int, kv_heads: int, head_dim: int, elt: int, page_size: int,
               pages_read: float = 0.0, budget: int = 0, group: int = 1, bounds: str = "key_dtype",
               reselect_every: int = 1) -> float:
    """K/V + metadata bytes of one decode step of one layer.

    `pages_read`: pages actually read over all KV heads (from the selection), for quest/streaming.
    quest: every page's min/max (2 * D per KV head) + the chosen pages' K and V. streaming: chosen K/V
    only. qcode*: quest's metadata + every token's `bits * D / 8` code bytes + the current page's keys
    (scored exactly) + the chosen pages' K and V. oracle: every key + the values of at most `group * budget`
    tokens per KV head. dense: all K/V. `bounds="int8"` (QuestConfig.bounds): quest's metadata is 2 * D int8 codes +
    one fp32 scale a page; `reselect_every=k`: quest reads it on one step in k (amortised).
    """
    if policy == "dense" or seq_len <= budget:
        return dense_bytes(seq_len, kv_heads, head_dim, elt)
    # The policy's own account (quest_hf/selectors/: `Selector.bytes_per_step`), registered selectors included;
    # the 8-bit / reuse settings only reach the selectors that take them (check_config refuses them elsewhere).
    extra = {k: v for k, v in (("bounds", bounds), ("reselect_every", reselect_every))
             if v != {"bounds": "key_dtype", "reselect_every": 1}[k]}
    return selector_for(policy).bytes_per_step(seq_len, kv_heads, head_dim, elt, page_size, pages_read, budget, group,
                                               **extra)


def layer_step_bytes(config, layer_idx: int, seq_len: int, kv_heads: int, head_dim: int, elt: int, group: int = 1,
                     pages_read: float | None = None) -> float:
    """`step_bytes` of layer `layer_idx` under `config`: dense bytes for a dense layer (`config.is_dense`), else the
    policy's bytes at the layer's own budget (`config.layer_budget`). `pages_read` (over all KV heads) defaults to
    the most that budget can read: `budget // page_size` pages a query head, united per KV group (`gqa_mode`
    "union"), at most the context's pages."""
    if config.is_dense(layer_idx):
        return dense_bytes(seq_len, kv_heads, head_dim, elt)
    budget, S = config.layer_budget(layer_idx), config.page_size
    if pages_read is None:
        share = group if config.gqa_mode == "union" and config.policy != "streaming" else 1
        pages_read = kv_heads * min(math.ceil(seq_len / S), share * (budget // S))
    return step_bytes(config.policy, seq_len, kv_heads, head_dim, elt, S, pages_read, budget, group, config.bounds,
                      config.reselect_every)


def model_step_bytes(config, num_layers: int, seq_len: int, kv_heads: int, head_dim: int, elt: int,
                     group: int = 1, pages_read=None) -> float:
    """Bytes one decode step reads over all `num_layers` layers under `config` (per-layer budgets and dense layers
    included): the sum of `layer_step_bytes`. `pages_read`: None (each layer's most) or per layer (a sequence or
    {layer: pages over all KV heads}, e.g. measured through `QuestCache.selection_hooks`)."""
    config.check_layers(num_layers)
    total = 0.0
    for i in range(num_layers):
        measured = None
        if pages_read is not None:
            measured = pages_read.get(i) if isinstance(pages_read, dict) else pages_read[i]
        total += layer_step_bytes(config, i, seq_len, kv_heads, head_dim, elt, group, measured)
    return total
