"""Long prompts in chunks: `quest_hf.prefill(model, ids, chunk=8192)`, each chunk attending to its past in blocks.

Activations scale with the chunk, not the prompt, and under `QuestConfig(offload="cpu")` an offloaded layer's past
is read back from host memory block by block (quest_hf/offload.py `chunk_attention`), so a prompt whose KV cache is
several times the card's memory prefills layer by layer without its cache ever sitting on the GPU at once.
"""
from __future__ import annotations

import time

import torch
from transformers.masking_utils import AttentionMaskInterface
from transformers.utils import logging

from .attention import NAME
from .binding import Bindings
from .cache import QuestCache
from .patch import cache_arg_name

logger = logging.get_logger("quest_hf")

__all__ = ["prefill"]


def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None,
            chunk: int = 8192, max_length: int | None = None, progress=None, block: int = 32768):
    """Run a long prompt through a patched model in chunks of `chunk` tokens; returns `(cache, logits [B, V])` of
    the last token. Activations then scale with the chunk, not the prompt. Each later chunk attends to the layer's
    earlier tokens in blocks of `block` tokens (`chunk_attention`: flash attention per block, merged by log-sum-exp;
    under `offload="cpu"` the blocks are read from host memory), so neither the whole past nor a [chunk, past] mask
    is on the GPU. A padded batch, sliding-window, soft-capped or sink layers, or `block=0` attend through HF's SDPA
    over the whole past instead (`cache.prefill_mode` says which): correct, but an offloaded layer's past then
    comes back to the GPU, with its repeated heads and the mask, while that layer runs.

    Continue with `model.generate(full_ids, attention_mask=full_mask, cache=cache, ...)` (`past_key_values=` before
    transformers 5.24) after prefilling all but the last prompt token (`input_ids[:, :-1]`): generate() feeds the
    tokens the cache lacks. `max_length` (default: the prompt) sizes the cache once; `progress(done, total, s)`
    is called after each chunk."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    B, T = input_ids.shape
    if cache is None:
        cache = QuestCache.from_model(model, max_length or T)
    elif cache.get_seq_length():
        raise ValueError(f"prefill starts from an empty cache; this one holds {cache.get_seq_length()} tokens")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    # generate()'s positions: real tokens counted from 0, padding at 1.
    positions = (attention_mask.long().cumsum(1) - 1).masked_fill(attention_mask == 0, 1)
    arg = cache_arg_name(model)
    blockwise = _blockwise_layers(model, attention_mask) if block else set()
    cache.prefill_mode = (f"blockwise over the past ({len(blockwise)} of {len(cache.layers)} layers)" if blockwise
                          else "sdpa over the whole past" + ("" if block else " (block=0)"))
    logits, t0 = None, time.perf_counter()
    bindings = Bindings()
    try:
        if len(blockwise) == len(cache.layers):
            # No layer reads a later chunk's mask, and the first chunk (no past, no padding) is plain causal: skip
            # HF's [chunk, past + chunk] mask (1 GiB a chunk of 8K at 128K), which would sit beside the blocks.
            bindings.item(AttentionMaskInterface._global_mapping, NAME, _no_mask)
        for i in blockwise:
            cache.layers[i].prefill_block = block
        starts = list(range(0, T, chunk))
        if len(starts) > 1 and T - starts[-1] == 1:
            starts.pop()  # a one-token forward is a decode step (sparse): the last chunk takes that token
        for s, e in zip(starts, starts[1:] + [T]):
            with torch.no_grad():
                out = model(input_ids=input_ids[:, s:e], attention_mask=attention_mask[:, :e],
                            position_ids=positions[:, s:e], use_cache=True, logits_to_keep=1, **{arg: cache})
            logits = out.logits[:, -1]
            if progress is not None:
                progress(e, T, time.perf_counter() - t0)
    finally:
        bindings.restore()
        for layer in cache.layers:
            layer.prefill_block = 0
    return cache, logits


def _no_mask(*args, **kwargs):
    """The "quest" mask function while `prefill` runs a model whose every layer attends in blocks: no mask (SDPA
    then runs the first chunk causally; later chunks ignore masks)."""
    return None


def _blockwise_layers(model, attention_mask) -> set[int]:
    """Layers whose chunks `chunk_attention` can serve: full causal attention, no soft-cap or sinks, no padding.
    The others attend through HF's SDPA over their whole past (an offloaded layer's then comes back to the GPU for
    that layer's attention); `cache.prefill_mode` says which."""
    state = model._quest_state
    if not bool(attention_mask.all()):
        logger.info_once("quest-hf prefill: a padded batch: chunks attend through SDPA over the whole past (the "
                         "layer's K/V on the GPU while it runs); prefill unpadded prompts to stream the past in blocks")
        return set()
    return {i for i, a in state.attention.items() if a.kind == "full" and not a.softcap and not a.has_sinks}
