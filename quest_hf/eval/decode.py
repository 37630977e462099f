"""Forward loops that decode token by token through whatever attention the model has (patched or not)."""
from __future__ import annotations

import torch
from transformers import DynamicCache

from ..cache import QuestCache
from ..patch import cache_arg_name


def new_cache(model):
    """A QuestCache for a patched model, HF's DynamicCache otherwise."""
    return QuestCache.from_model(model) if getattr(model, "_quest_state", None) else DynamicCache(config=model.config)


@torch.no_grad()
def prefill(model, ids: torch.Tensor, cache=None):
    """One forward over `ids [1, n]` (dense: more than one new token). Returns (cache, last logits [1, V])."""
    cache = new_cache(model) if cache is None else cache
    out = model(input_ids=ids, use_cache=True, **{cache_arg_name(model): cache})
    return cache, out.logits[:, -1]


@torch.no_grad()
def feed(model, cache, tokens: torch.Tensor, on_logits=None) -> torch.Tensor:
    """Feed `tokens [1, m]` one per forward (decode steps); `on_logits(i, logits [1, V])` after each."""
    name, logits = cache_arg_name(model), None
    for i in range(tokens.shape[1]):
        logits = model(input_ids=tokens[:, i:i + 1], use_cache=True, **{name: cache}).logits[:, -1]
        if on_logits is not None:
            on_logits(i, logits)
    return logits


def prefill_then_step(model, prefix: torch.Tensor, tail: torch.Tensor, on_logits=None):
    """Prefill `prefix` densely, then decode `tail` token by token. Returns (cache, last logits)."""
    cache, _ = prefill(model, prefix)
    return cache, feed(model, cache, tail, on_logits)


@torch.no_grad()
def greedy_continue(model, cache, logits: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> list[int]:
    """Greedy decode up to `max_new_tokens` tokens from `logits` and a filled cache, one token per forward."""
    name, tokens = cache_arg_name(model), []
    for _ in range(max_new_tokens):
        nxt = int(logits.argmax(-1)[0])
        if eos_token_id is not None and nxt == eos_token_id:
            break
        tokens.append(nxt)
        logits = model(input_ids=torch.tensor([[nxt]], device=logits.device), use_cache=True,
                       **{name: cache}).logits[:, -1]
    return tokens
