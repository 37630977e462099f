"""Recall of the page selection per layer: do the chosen pages hold the tokens that matter?

One rule for every policy (quest, streaming, oracle). At a sparse decode step of a layer, each KV head
reads a token set (its chosen pages, or under the oracle the union of its query heads' exact top-`budget`
tokens). For each query head, take the `topk` tokens with the largest true attention weight (dense, same
query, same keys); its recall is the fraction of them inside the set its KV head reads, averaged over query
heads and decode steps. A layer whose context fits in the budget runs dense and counts as recall 1 (`dense`
gives the fraction of such steps).

With needle positions (the passkey's digits): `needle` / `needle_any`, the fraction of them read per KV
head / by any KV head of the layer; `needle_top`, the recall restricted to the needle tokens that are in a
head's true top-k (did the selector keep the needle where attention wanted it?); `needle_attended`, how
often a head's true top-k holds a needle token at all (which layers retrieve).

quest and streaming are measured through `QuestCache.selection_hooks` on their own decode. The oracle does
not select pages; it is scored on the quest run's queries (same steps, same q), so oracle >= quest is a
per-query comparison. Quest: arXiv 2406.10774.
"""
from __future__ import annotations

import dataclasses

import torch

from ..config import QuestConfig
from ..patch import patched
from .decode import greedy_continue
from .ppl import DENSE_BUDGET, fork_cache, prefill_cache, step_tokens

POLICIES = ("quest", "streaming", "oracle")


# --- token sets --------------------------------------------------------------------------------------

def _window_start(seq_len: int, sliding_window: int | None) -> int:
    # HF's window lets query q see keys k with k > q - window; the decode query is slot seq_len - 1.
    return max(0, seq_len - sliding_window) if sliding_window else 0


def _allowed(valid: torch.Tensor, seq_len: int, window_start: int) -> torch.Tensor:
    """Tokens a decode query may see `[B, L]`: valid, before `seq_len`, not before the window."""
    ok = valid[:, :seq_len].clone()
    ok[:, :window_start] = False
    return ok


def page_token_sets(page_ids: torch.Tensor, seq_len: int, page_size: int, valid: torch.Tensor,
                    window_start: int = 0) -> torch.Tensor:
    """Tokens `[B, H_kv, L]` (bool) that sparse attention reads for `page_ids [B, H_kv, K]` (int32, -1 unused)."""
    B, H, _ = page_ids.shape
    P = -(-seq_len // page_size)
    pages = torch.zeros(B, H, P + 1, dtype=torch.bool, device=page_ids.device)
    pages.scatter_(-1, torch.where(page_ids >= 0, page_ids.long(), P), True)  # -1 lands in a spare column
    tokens = pages[..., :P].repeat_interleave(page_size, dim=-1)[..., :seq_len]
    return tokens & _allowed(valid, seq_len, window_start)[:, None]


def _logits(q: torch.Tensor, keys: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """q.k `[B, H_kv, G, L]` of `q [B, H_q, D]` against `keys [B, H_kv, L, D]`, -inf where not `ok [B, L]`."""
    B, Hq, D = q.shape
    H = keys.shape[1]
    logits = torch.einsum("bhgd,bhnd->bhgn", q.float().reshape(B, H, Hq // H, D), keys.float())
    return logits.masked_fill(~ok[:, None, None], float("-inf"))


def oracle_token_sets(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, budget: int,
                      window_start: int = 0) -> torch.Tensor:
    """Tokens `[B, H_kv, L]` the oracle policy reads: each query head's top-`budget` by exact q.k, united per
    KV group (the rule of `quest_hf.selectors.OracleSelector`). `keys [B, H_kv, L, D]` hold the filled slots."""
    L = keys.shape[2]
    ok = _allowed(valid, L, window_start)
    logits = _logits(q, keys, ok)
    top = logits.topk(min(budget, L), dim=-1).indices
    chosen = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, top, True).any(2)
    return chosen & ok[:, None]


def true_top_tokens(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, k: int,
                    window_start: int = 0) -> torch.Tensor:
    """Per query head, the `k` tokens of largest dense attention weight: indices `[B, H_kv, G, k]`.

    Softmax is monotone, so these are the top-`k` by q.k among the tokens the query may see.
    """
    L = keys.shape[2]
    return _logits(q, keys, _allowed(valid, L, window_start)).topk(min(k, L), dim=-1).indices


def top_recall(sets: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Fraction `[B, H_q]` of each query head's top tokens (`top [B, H_kv, G, k]`) inside its KV head's set."""
    B, H, G, k = top.shape
    inside = torch.gather(sets[:, :, None].expand(B, H, G, sets.shape[-1]), -1, top)
    return inside.float().mean(-1).reshape(B, H * G)


def needle_recall(sets: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per KV head `[B, H_kv]`, any KV head `[B]`): fraction of `positions [N]` inside the token sets."""
    inside = sets[..., positions]  # [B, H, N]
    return inside.float().mean(-1), inside.any(1).float().mean(-1)


# --- measuring a decode ------------------------------------------------------------------------------

NEEDLE_METRICS = ("needle", "needle_any", "needle_top", "needle_attended")


class _Tally:
    """Running sums per layer of one policy's metrics over decode steps."""

    def __init__(self, num_layers: int):
        self.sums = {m: [0.0] * num_layers for m in ("recall", "dense", "needle", "needle_any", "needle_attended",
                                                     "top_hits", "top_pairs")}
        self.steps = [0] * num_layers

    def add(self, layer: int, **values: float):
        for m, v in values.items():
            self.sums[m][layer] += v
        self.steps[layer] += 1

    def result(self, layers: list[int], needle: bool) -> dict:
        per_step = ("recall", "dense") + (("needle", "needle_any", "needle_attended") if needle else ())
        out = {m: [self.sums[m][i] / max(self.steps[i], 1) for i in layers] for m in per_step}
        if needle:  # a ratio over all (head, needle token in its top-k) pairs; None where no head attended it
            hits, pairs = self.sums["top_hits"], self.sums["top_pairs"]
            out["needle_top"] = [hits[i] / pairs[i] if pairs[i] else (1.0 if out["dense"][k] == 1 else None)
                                 for k, i in enumerate(layers)]
        else:
            out.update(dict.fromkeys(NEEDLE_METRICS))
        for m in ("recall",) + NEEDLE_METRICS:
            vals = [v for v in (out[m] or []) if v is not None]
            out[f"mean_{m}"] = sum(vals) / len(vals) if vals else None
        out["steps"] = self.steps[layers[0]] if layers else 0
        return out


class RecallMeter:
    """A `selection_hooks` entry measuring the recall of the pages chosen in every sparse decode step.

    `meter = RecallMeter(cache, num_layers, dense_layers, topk=10, needle=[...], with_oracle=True)`;
    `cache.selection_hooks.append(meter)`; call `meter.end_step()` after each decode forward (it counts the
    sparse layers that ran dense as recall 1). `windows[layer]`: the layer's sliding window (None: full).
    `with_oracle`: also score the oracle's token sets on the same queries (`result(oracle=True)`).
    """

    def __init__(self, cache, num_layers: int, dense_layers: int, topk: int = 10, needle=None,
                 with_oracle: bool = False, windows=None):
        self.cache, self.topk, self.with_oracle = cache, topk, with_oracle
        self.layers = list(range(dense_layers, num_layers))
        self.windows = windows or {}
        self.needle = None if needle is None or len(needle) == 0 else torch.as_tensor(sorted(needle))
        self.tally = _Tally(num_layers)
        self.oracle = _Tally(num_layers)
        self._seen: set[int] = set()

    def __call__(self, layer_idx: int, q: torch.Tensor, page_ids: torch.Tensor) -> None:
        layer = self.cache.layers[layer_idx]
        L, cfg = layer.seq_len, layer.config
        ws = _window_start(L, self.windows.get(layer_idx))
        keys = layer.keys[:, :, :L]
        top = true_top_tokens(q, keys, layer.valid, self.topk, ws)
        sets = {self.tally: page_token_sets(page_ids, L, cfg.page_size, layer.valid, ws)}
        if self.with_oracle:
            sets[self.oracle] = oracle_token_sets(q, keys, layer.valid, cfg.budget, ws)
        if self.needle is not None:
            is_needle = torch.zeros(L, dtype=torch.bool, device=q.device)
            is_needle[self.needle.to(q.device)] = True
            top_needle = is_needle[top]  # [B, H, G, k]: the head attends this needle token
        for tally, s in sets.items():
            # Everything the query may see fits the budget: the selection reads all of it (exact, labelled dense).
            values = dict(recall=float(top_recall(s, top).mean()), dense=float(L - ws <= cfg.budget))
            if self.needle is not None:
                per_head, any_head = needle_recall(s, self.needle.to(s.device))
                inside = torch.gather(s[:, :, None].expand(*top.shape[:3], L), -1, top)
                values.update(needle=float(per_head.mean()), needle_any=float(any_head.mean()),
                              needle_attended=float(top_needle.any(-1).float().mean()),
                              top_hits=float((inside & top_needle).sum()), top_pairs=float(top_needle.sum()))
            tally.add(layer_idx, **values)
        self._seen.add(layer_idx)

    def end_step(self) -> None:
        """Close a decode step: each sparse layer that selected nothing ran dense (context within budget)."""
        for i in self.layers:
            if i not in self._seen:
                for tally in (self.tally, self.oracle):
                    tally.add(i, recall=1.0, dense=1.0, needle=1.0, needle_any=1.0)
        self._seen.clear()

    def result(self, oracle: bool = False) -> dict:
        """Per sparse layer (the list `layers`), averaged over decode steps: `recall` (top-k recall), `dense`
        (fraction of steps the layer ran dense); with a needle: `needle` / `needle_any` (fraction of the needle
        tokens read, per KV head / by any KV head), `needle_top` (of the (query head, needle token) pairs where
        the token is in the head's true top-k, the fraction read; None if there were none) and
        `needle_attended` (fraction of query heads whose true top-k holds a needle token). Plus `mean_*` over
        layers. Without a needle the needle entries are None."""
        return dict(layers=self.layers, **(self.oracle if oracle else self.tally).result(self.layers,
                                                                                         self.needle is not None))


def layer_windows(model) -> dict[int, int | None]:
    """Sliding window of each attention layer (None: full), as the model passes it to attention."""
    out = {}
    for m in model.modules():
        if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups"):
            w = getattr(m, "sliding_window", getattr(getattr(m, "config", None), "sliding_window", None))
            out[m.layer_idx] = w
    return out


def find_token_positions(tokenizer, ids, text: str) -> list[int]:
    """Positions in `ids` of the tokens of every occurrence of `text` (e.g. a passkey's digits).

    Tries `text` and `" " + text` (a leading space is often part of the first token), ignoring
    whitespace-only tokens at the start. Raises ValueError when `text` does not occur as whole tokens.
    """
    ids = list(ids)
    for variant in (text, " " + text):
        sub = tokenizer(variant, add_special_tokens=False).input_ids
        while sub and not tokenizer.decode(sub[:1]).strip():
            sub = sub[1:]
        n = len(sub)
        hits = [i for i in range(len(ids) - n + 1) if n and ids[i:i + n] == sub]
        if hits:
            return sorted({i + j for i in hits for j in range(n)})
    raise ValueError(f"{text!r} does not occur as whole tokens in the {len(ids)} ids")


# --- the sweep ---------------------------------------------------------------------------------------

def measure_recall(model, prefix: torch.Tensor, tail: torch.Tensor, budgets=(64, 128, 256, 512, 1024),
                   policies=POLICIES, *, page_size: int = 16, dense_layers: int = 2, gqa_mode: str = "union",
                   topk: int = 10, needle=None, answer_tokens: int = 0, eos_token_id=None, backend: str = "auto",
                   progress=None) -> dict:
    """Prefill `prefix [1, n]` once (dense); per budget and policy decode `tail [1, m]` token by token from a
    copy of the cache and measure the recall of every sparse step (see the module docstring).

    `needle`: token positions to track (e.g. `find_token_positions(tok, prefix[0], key)`).
    `answer_tokens > 0`: after the tail, also decode that many greedy tokens per run (stops at
    `eos_token_id`) and return them as `answer` (the oracle then gets its own decode for its answer).
    Returns `{"budgets", "layers", "context", "steps", "results": {policy: {budget: {...}}}}` where each
    entry holds per-layer lists `recall`, `needle`, `needle_any`, `dense` and their means.
    """
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise ValueError(f"unknown policies {sorted(unknown)}; choose from {POLICIES}")
    num_layers = model.config.get_text_config().num_hidden_layers
    windows = layer_windows(model)
    base = QuestConfig(budget=DENSE_BUDGET, page_size=page_size, dense_layers=dense_layers, gqa_mode=gqa_mode,
                       backend=backend)
    results = {p: {} for p in policies}
    with patched(model, config=base):
        cache, _ = prefill_cache(model, prefix)
        for budget in budgets:
            runs = [p for p in ("quest", "streaming") if p in policies or (p == "quest" and "oracle" in policies)]
            if "oracle" in policies and answer_tokens > 0:
                runs.append("oracle")
            for run in runs:
                cfg = dataclasses.replace(base, budget=budget, policy=run)
                fork = fork_cache(cache, cfg)
                meter = RecallMeter(fork, num_layers, dense_layers, topk, needle,
                                    with_oracle=run == "quest" and "oracle" in policies, windows=windows)
                if run != "oracle":
                    fork.selection_hooks.append(meter)
                logits = step_tokens(model, fork, tail, lambda i, _, meter=meter: meter.end_step())
                fork.selection_hooks.clear()
                answer = greedy_continue(model, fork, logits, answer_tokens, eos_token_id) if answer_tokens else None
                if run in policies and run != "oracle":
                    results[run][budget] = dict(meter.result(), answer=answer)
                if run == "quest" and "oracle" in policies:
                    results["oracle"][budget] = meter.result(oracle=True)
                if run == "oracle":
                    results["oracle"][budget]["answer"] = answer
                if progress is not None:
                    progress.update(1)
    return dict(budgets=list(budgets), layers=list(range(dense_layers, num_layers)), context=prefix.shape[1],
                steps=tail.shape[1], topk=topk, page_size=page_size, gqa_mode=gqa_mode,
                needle=None if needle is None else sorted(needle), results=results)


def num_runs(budgets, policies, answer_tokens: int = 0) -> int:
    """Decodes `measure_recall` runs (for a progress bar)."""
    runs = int("quest" in policies or "oracle" in policies) + int("streaming" in policies)
    return len(budgets) * (runs + int("oracle" in policies and answer_tokens > 0))

