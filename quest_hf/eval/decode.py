"""A forward loop that decodes token by token through whatever attention the model has (patched or not)."""
from __future__ import annotations

import torch
from transformers import DynamicCache

from ..cache import QuestCache
from ..patch import cache_arg_name as cache_kwarg


def new_cache(model):
    """A QuestCache for a patched model, HF's DynamicCache otherwise."""
    return QuestCache.from_model(model) if getattr(model, "_quest_state", None) else DynamicCache(config=model.config)




@torch.no_grad()
def prefill_then_step(model, prefix: torch.Tensor, tail: torch.Tensor, on_logits=None):
    """Prefill `prefix [1, n]` in one forward (dense), then feed `tail [1, m]` one token at a time (decode).

    `on_logits(i, logits [1, V])` sees the logits after each tail token. Returns (cache, last logits).
    """
    cache, name = new_cache(model), cache_kwarg(model)
    out = model(input_ids=prefix, use_cache=True, **{name: cache})
    logits = out.logits[:, -1]
    for i in range(tail.shape[1]):
        out = model(input_ids=tail[:, i:i + 1], use_cache=True, **{name: cache})
        logits = out.logits[:, -1]
        if on_logits is not None:
            on_logits(i, logits)
    return cache, logits


@torch.no_grad()
def greedy_continue(model, cache, logits: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> list[int]:
    """Greedy decode `max_new_tokens` tokens from `logits` and a filled cache, one token per forward."""
    name, tokens = cache_kwarg(model), []
    for _ in range(max_new_tokens):
        nxt = int(logits.argmax(-1)[0])
        if eos_token_id is not None and nxt == eos_token_id:
            break
        tokens.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]], device=logits.device), use_cache=True, **{name: cache})
        logits = out.logits[:, -1]
    return tokens
