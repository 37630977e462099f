"""Page selectors: how a sparse layer chooses the pages one decode query reads.

A selector is a small stateless object registered under a policy name (`QuestConfig.policy`). Per-layer
state it needs (e.g. a per-token key sketch) lives in `layer.side`: tensors `[B, H_kv, C, ...]` indexed by
slot, which the layer grows, reorders (beam search) and batch-edits together with the K/V pages.
"""
from __future__ import annotations

import torch


class Selector:
    """Base: `select` returns int32 page ids `[B, H_kv, K]` (-1 unused, current page included).

    Selectors with `captured = True` also run in the captured decode step (`QuestConfig(cuda_graph=True)`,
    quest_hf/static.py): `select_static` over the whole fixed capacity with the position on the device, and
    `on_append_at` after each one-token append there. No host sync and no host-side lengths in either.
    """

    captured = False

    def on_append(self, layer, key_states: torch.Tensor, start: int, valid_new: torch.Tensor | None) -> None:
        """Called after `key_states [B, H_kv, T, D]` were stored at slots `[start, start + T)`."""

    def select(self, layer, q: torch.Tensor, window_start: int) -> torch.Tensor:
        raise NotImplementedError

    def on_append_at(self, layer) -> None:
        """Captured step: called after one token was stored at `layer.pos - 1` (`layer.pos` already advanced)."""

    def select_static(self, layer, q: torch.Tensor) -> torch.Tensor:
        """Captured step: page ids `[B, H_kv, K + 1]` over the capacity: the current page `(pos - 1) // S` and
        the spare last page (never written, the kernels' own forced page) always among them."""
        raise NotImplementedError(f"{type(self).__name__} does not run in the captured decode step")


def current_page(layer) -> torch.Tensor:
    """The page holding the last token, as a 1-element device tensor (captured step)."""
    return torch.div(layer.pos - 1, layer.page_size, rounding_mode="floor").view(1)


def top_pages(layer, scores: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """Top `k` pages of per-query-head `scores [B, H_q, P]`: the union over each KV group, or one Top-K of the
    group's max / sum (`gqa_mode`). (-inf/+inf pages are -inf/+inf in every row, so they stay so reduced.)"""
    cfg, ops = layer.config, layer.ops
    if cfg.gqa_mode == "union" or group == 1:
        return ops.topk_pages(scores, k, group)
    B, Hq, P = scores.shape
    s = scores.reshape(B, Hq // group, group, P)
    s = s.amax(2) if cfg.gqa_mode == "max" else s.sum(2)
    return ops.topk_pages(s.contiguous(), k, 1)


class QuestSelector(Selector):
    """The paper's rule: page upper bound from key min/max, Top-K per query head (union per group)."""

    captured = True

    def select_static(self, layer, q):
        # Over the whole capacity; the page of the last token is forced in the kernel, from the device position.
        return self._choose(layer, q, layer.capacity, 0, layer.config.num_pages + 1, layer.pos)

    def select(self, layer, q, window_start):
        return self._choose(layer, q, layer.seq_len, window_start, layer.config.num_pages)

    @staticmethod
    def _choose(layer, q, seq_len, window_start, k, pos=None):
        cfg, ops = layer.config, layer.ops
        reduce = "none" if cfg.gqa_mode == "union" else cfg.gqa_mode
        scores = ops.score_pages(q, layer.kmin, layer.kmax, seq_len, cfg.page_size, window_start, reduce, pos=pos)
        group = q.shape[1] // layer.kmin.shape[1] if reduce == "none" else 1
        return ops.topk_pages(scores, k, group)


class StreamingSelector(Selector):
    """Query-agnostic baseline: the first non-empty page (attention sink), then the most recent pages."""

    def select(self, layer, q, window_start):
        S, L = layer.page_size, layer.seq_len
        P = -(-L // S)
        filled = layer.kmin[:, :, :P, 0] <= layer.kmax[:, :, :P, 0]
        first = filled.int().argmax(-1, keepdim=True)
        s = torch.arange(P, device=filled.device, dtype=torch.float32).expand(filled.shape).clone()
        s.scatter_(-1, first, float(P))  # above every recency score, below the forced current page
        s[..., : window_start // S] = float("-inf")
        s[..., P - 1] = float("inf")
        return layer.ops.topk_pages(s.masked_fill(~filled, float("-inf")), layer.config.num_pages, 1)


SELECTORS: dict[str, Selector] = {"quest": QuestSelector(), "streaming": StreamingSelector()}
# "oracle" is not a page selector: it attends to exact top tokens (quest_hf.attention.oracle_attention).
SPECIAL_POLICIES = ("oracle",)


def register_selector(name: str, selector: Selector) -> None:
    """Make `QuestConfig(policy=name)` use `selector`."""
    if not isinstance(selector, Selector):
        raise TypeError(f"selector must be a quest_hf.selectors.Selector, got {type(selector).__name__}")
    SELECTORS[name] = selector


def policy_names() -> tuple[str, ...]:
    return (*SELECTORS, *SPECIAL_POLICIES)


def captured_policies() -> tuple[str, ...]:
    """Policies that run in the captured decode step (`QuestConfig(cuda_graph=True)`)."""
    return tuple(name for name, sel in SELECTORS.items() if sel.captured)


# Selectors beyond the paper (docs/selector.md): per-token key codes on the page's min/max grid.
from .selectors_qcode import QCodeSelector, TwoStageCodeSelector  # noqa: E402

register_selector("qcode", QCodeSelector(bits=2))
register_selector("qcode1", QCodeSelector(bits=1))
register_selector("qcode_topp", QCodeSelector(bits=2, top_p=0.9))
register_selector("qcode1_topp", QCodeSelector(bits=1, top_p=0.9))
# Two-stage: Quest's top 8 x budget pages per query head, re-ranked by the codes of those pages only.
register_selector("qcode2s", TwoStageCodeSelector(bits=2, candidates=8))
register_selector("qcode1_2s", TwoStageCodeSelector(bits=1, candidates=8))
