"""The "quest" attention function registered with HF's AttentionInterface.

Prefill (more than one query token) runs HF's dense SDPA, or the family's own `eager_attention_forward` where the
layer has a logit soft-cap or sinks (SDPA drops or refuses them). Every decode token runs one fixed-shape step over
the layer's pages (no host state, so the same step runs eagerly and inside a captured CUDA graph), with the layer's
window, soft-cap, sinks and scaling as `quest_hf.families.describe` reads them from the model:

    dense layer (`QuestConfig.is_dense`; or the window fits the budget) ─► every page (of the window) ───┐
    sparse layer ─► the policy's selector: score ─► Top-K ─► page ids ──────────────────────────────────┴► attention
"""
from __future__ import annotations

import importlib
import sys

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import triton_kernels as tk

from .compiled import active_cache, compiled_step_active, compiled_step_traced
from .graph import selected
from .selectors import attend_pages

NAME = "quest"  # avoid "sdpa"/"flash"/"paged": transformers matches those substrings specially


def decode_attention(layer, q: torch.Tensor, scale: float, dense: bool, window: int, on_select,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One decode query `q [B, H_q, D]` over `layer` (a QuestLayer): `[B, H_q, D]`. `softcap` (0: none) and
    `sinks` (fp32 `[H_q]` or None) are the family's, applied by the page kernel on either path."""
    cfg = layer.config
    pages = layer.keys.shape[2] // cfg.page_size
    if cfg.num_pages + 1 >= pages or (window and window <= cfg.budget):
        dense = True  # everything the query may see fits the budget: exact dense attention, no selection
    if dense:
        if (q.device.type == "cpu" and layer.ops.name == "torch" and layer.rows is None and layer.pager is None
                and not torch.compiler.is_compiling()):
            # The host knows the length on CPU (never captured; a compiled step's graph reads it on the device):
            # attend the filled prefix in place.
            start = max(layer.seq_len - window, 0) if window else 0
            return tk.prefix_decode_attention_ref(q, layer.keys, layer.values, layer.valid, layer.seq_len, scale,
                                                  start, softcap, sinks)
        return attend_pages(layer, q, layer.dense_pages(window), scale, window, softcap, sinks)
    return layer.selector.attend(layer, q, scale, window, on_select, softcap, sinks)


# The compiled step's two ways in (quest_hf/compiled.py): traced, or one opaque op a layer.
def traced_decode(layer, layer_idx: int, query, key, value, scale: float, window: int, softcap: float, sinks):
    """Layer `layer_idx`'s decode token as the graph traces it: the device half of the append
    (`QuestLayer.append_decode`) and the eager step's attention, with no hook."""
    layer.append_decode(key, value)
    return decode_attention(layer, query, scale, layer.config.is_dense(layer_idx), window, _no_hook, softcap, sinks)


def _no_hook(ids):
    pass


@torch.library.custom_op("quest_hf::decode_attention", mutates_args=())
def decode_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scale: float,
                        window: int, softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """One decode token of layer `layer_idx` of the cache in flight: append `key/value [B, H_kv, 1, D]`, then attend
    `query [B, H_q, D]` as the eager step does (`decode_attention`). Returns `[B, H_q, D]`."""
    cache = active_cache()
    layer = cache.layers[layer_idx]
    cache.update(key, value, layer_idx)
    hooks = cache.selection_hooks

    def on_select(ids):
        if hooks:
            selected(None, layer_idx, query, ids, layer, hooks)

    out = decode_attention(layer, query, scale, layer.config.is_dense(layer_idx), window, on_select, softcap, sinks)
    return out if out.data_ptr() != query.data_ptr() else out.clone()


@decode_attention_op.register_fake
def _(query, key, value, layer_idx, scale, window, softcap, sinks):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def family_eager(module):
    """The `eager_attention_forward` of `module`'s own modeling file (None when it has none)."""
    modeling = sys.modules.get(type(module).__module__) or importlib.import_module(type(module).__module__)
    return getattr(modeling, "eager_attention_forward", None)


def _eager_prefill(module, query, key, value, attention_mask, **kwargs):
    """Dense attention through the family's eager function (it applies soft-caps and sinks as the family does).

    The "quest" mask is SDPA's: bool (True: attend), or None where SDPA may run causally; eager adds a float mask."""
    q, L = query.shape[2], key.shape[2]
    if attention_mask is None:  # no padding and nothing past any window: plain causal over the last q positions
        attention_mask = torch.ones(q, L, dtype=torch.bool, device=query.device).tril(L - q)[None, None]
    if attention_mask.dtype == torch.bool:
        attention_mask = torch.where(attention_mask, 0.0, torch.finfo(query.dtype).min).to(query.dtype)
    return family_eager(module)(module, query, key, value, attention_mask, **kwargs)


def _window(state, idx: int, sliding_window) -> int:
    """Layer `idx`'s sliding window (0: none): the one the mask carries (families.describe), not the keyword
    (Qwen2-MoE's sliding layers pass none)."""
    info = state.attention.get(idx) if getattr(state, "attention", None) else None
    return (info.window if info.kind == "sliding" else 0) if info is not None else (sliding_window or 0)


def quest_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, **kwargs):
    """HF attention function: `query [B, H_q, q, D]`, `key/value [B, H_kv, L, D]` as the cache returned them.

    Returns `(output [B, q, H_q, D], None)`, like `sdpa_attention_forward`.
    """
    state = getattr(module, "_quest_state", None)
    cache = state.cache if state is not None else None
    softcap = kwargs.get("softcap") or 0.0
    sinks = kwargs.get("s_aux")
    if sinks is None and getattr(module, "sinks", None) is not None:
        sinks = module.sinks
    if compiled_step_active() and query.shape[2] == 1:  # traced into quest_hf.compiled: key/value are the new token's
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        args = (query[:, :, 0], key, value, scale, _window(state, module.layer_idx, sliding_window), float(softcap),
                sinks.float() if sinks is not None else None)
        if compiled_step_traced():
            out = traced_decode(cache.layers[module.layer_idx], module.layer_idx, *args)
        else:
            q, k, v, *rest = args
            out = torch.ops.quest_hf.decode_attention(q, k, v, module.layer_idx, *rest)
        return out[:, None], None
    if cache is not None and query.shape[2] > 1 and cache.layers[module.layer_idx].prefill_block:
        layer = cache.layers[module.layer_idx]  # a chunk of quest_hf.prefill: the past read in blocks
        if layer.seq_len > query.shape[2]:
            from .offload import chunk_attention

            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return chunk_attention(layer, query, key, value, scale, layer.prefill_block), None
    if cache is None or query.shape[2] != 1:
        if softcap or sinks is not None:
            return _eager_prefill(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  sliding_window=sliding_window, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    idx = module.layer_idx
    layer = cache.layers[idx]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = _window(state, idx, sliding_window)
    q = query[:, :, 0]
    hooks = cache.selection_hooks

    def on_select(ids):
        if hooks:
            selected(getattr(state, "graph", None), idx, q, ids, layer, hooks)

    out = decode_attention(layer, q, scale, layer.config.is_dense(idx), window, on_select, softcap,
                           sinks.float() if sinks is not None else None)
    return out[:, None], None
