"""The selector contract: how a sparse layer chooses the pages one decode query reads."""
from __future__ import annotations

import torch


class Selector:
    """A page-selection policy (`QuestConfig.policy`), stateless: per-layer state lives on the layer.

    Tensors a selector keeps per slot go in `layer.side[name]` (`[B, H_kv, C, ...]`: the layer grows, reorders
    and batch-edits them with its pages); host bookkeeping in `layer.side_state` (cleared by `reset`).

    `select` runs over the layer's whole allocation with the write position on the device (`layer.pos`), so a
    decode step keeps fixed shapes and can be captured as a CUDA graph: it returns int32 page ids
    `[B, H_kv, K + 1]` (ascending, -1 unused) holding the current page `(pos - 1) // S` and the spare last page
    (never written; see quest_hf/cache.py). A selector that needs host lengths sets `captured = False`; its
    decode steps then run uncaptured (`quest_hf.graph` says so).
    """

    captured = True
    # Whether a decode step (`on_append` of one token, `select`, `attend`) is plain device work that dynamo can trace
    # into quest_hf.compiled's graph (no host state read or written); False: the compiled step calls it as an op.
    traced = False
    # Whether `QuestConfig.budget` counts tokens (any number) rather than whole pages (a multiple of `page_size`).
    token_budget = False
    # Whether the selector reads `QuestConfig(bounds="int8")`'s 8-bit page bounds, and supports `reselect_every > 1`.
    int8_bounds = False
    reuses_selection = False
    # Whether every kernel of this selector reads pages through the layer's page table (`layer.rows`), so that a
    # beam-search reorder permutes page rows instead of copying the cache; False: the reorder copies the buffers.
    paged_reorder = False

    def on_append(self, layer, key_states: torch.Tensor, start: int, valid_new: torch.Tensor | None) -> None:
        """After `key_states [B, H_kv, T, D]` were stored at slots `[start, start + T)`. For one token (a decode
        step, which may be a graph replay) use the device position `layer.pos` only, never `start`."""

    def on_crop(self, layer, new_len: int) -> None:
        """After the layer dropped every token from `new_len` on."""

    def select(self, layer, q: torch.Tensor, window: int) -> torch.Tensor:
        """Page ids for decode query `q [B, H_q, D]`; `window` > 0: a sliding window of that many tokens."""
        raise NotImplementedError

    def attend(self, layer, q: torch.Tensor, scale: float, window: int, on_select, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The decode output `[B, H_q, D]`: attention over the selected pages. `on_select(ids)` sees the ids.
        `softcap` / `sinks` (fp32 `[H_q]`): the family's logit cap and softmax sinks, as `attend_pages` applies them
        (neither changes which pages a selector should rank first: tanh is monotonic, a sink attends nothing)."""
        ids = self.select(layer, q, window)
        on_select(ids)
        return attend_pages(layer, q, ids, scale, window, softcap, sinks)

    def bytes_per_step(self, seq_len: int, kv_heads: int, head_dim: int, elt: int, page_size: int,
                       pages_read: float, budget: int, group: int) -> float:
        """K/V + metadata bytes one decode step of one layer reads (for equal-bytes comparisons)."""
        raise NotImplementedError(f"{type(self).__name__} does not account its bytes")


def attend_pages(layer, q: torch.Tensor, ids: torch.Tensor, scale: float, window: int, softcap: float = 0.0,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention of `q [B, H_q, D]` over the tokens of pages `ids` (fixed shapes, device position), with the
    logit cap `softcap * tanh(s / softcap)` (0: none) and per-query-head `sinks` fp32 `[H_q]` (None: none)."""
    if getattr(layer, "pager", None) is not None:  # K/V in host memory: read through the resident pool
        return layer.pager.attend(layer, q, ids, scale, window, softcap, sinks)
    kw = {}
    if softcap:
        kw["softcap"] = softcap
    if sinks is not None:
        kw["sinks"] = sinks
    if layer.rows is not None:  # beam search's page table (QuestLayer.reorder_cache)
        kw["rows"] = layer.rows
    return layer.ops.sparse_decode_attention(q, layer.keys, layer.values, ids, layer.kernel_valid(),
                                             layer.keys.shape[2], layer.page_size, scale, 0,
                                             pos=layer.pos if window else None, window=window, **kw)


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


def metadata_bytes(seq_len: int, kv_heads: int, head_dim: int, elt: int, page_size: int,
                   bounds: str = "key_dtype") -> int:
    """Every page's key min/max: what Quest's scoring reads (`bounds="int8"` / `"int8_channel"`: two int8 codes a
    channel plus one fp32 scale a page and KV head; the channel scales, D floats a KV head, are not counted)."""
    per_page = 2 * head_dim * elt if bounds == "key_dtype" else 2 * head_dim + 4
    return -(-seq_len // page_size) * kv_heads * per_page


def reused_pages(layer, fresh: torch.Tensor, due: torch.Tensor, every: int) -> torch.Tensor:
    """Selection reuse (`QuestConfig.reselect_every`): the pages a decode step attends, on the device.

    `fresh` int32 `[B, H_kv, K]` is this step's selection (where `due` is 0 the score and Top-K launches wrote
    nothing: it is then unwritten and not read);
    `due` the layer's device flag (`layer.reuse["due"]`). The stored selection becomes `fresh` where
    due, and the step attends it plus the pages started since it was made (at most `ceil((every - 1) / S)`, none of
    which the stored selection can hold: they were empty then). One launch (`triton_kernels/reuse.py`), which also
    advances the counter and sets the next step's flag. Returns int32 `[B, H_kv, K + ceil((every - 1) / S)]`,
    ascending, -1 last (the contract)."""
    st = layer.reuse
    return layer.ops.reuse_pages(fresh, st["ids"], st["since"], st["step"], due, layer.pos, layer.page_size, every,
                                 st["ticket"])
