"""Query-agnostic baseline (StreamingLLM-like): the first non-empty page (attention sink), then the most recent
pages."""
from __future__ import annotations

import torch

from triton_kernels.score import window_start_at

from .base import Selector


class StreamingSelector(Selector):
    def select(self, layer, q, window):
        S = layer.page_size
        P = layer.kmin.shape[2]
        filled = layer.kmin[:, :, :, 0] <= layer.kmax[:, :, :, 0]  # [B, H_kv, P]
        first = filled.int().argmax(-1, keepdim=True)
        page = torch.arange(P, device=filled.device)
        s = page.float().expand(filled.shape).clone()  # recency
        s.scatter_(-1, first, float(P))  # above every recency score, below the forced pages
        if window:
            s = s.masked_fill(page < window_start_at(layer.pos, window, S), float("-inf"))
        s = s.masked_fill(~filled, float("-inf"))
        cur = torch.div(layer.pos - 1, S, rounding_mode="floor")
        s = s.masked_fill((page == cur) | (page == P - 1), float("inf"))  # current and spare page, as quest
        return layer.ops.topk_pages(s, layer.config.num_pages + 1, 1)

    def bytes_per_step(self, seq_len, kv_heads, head_dim, elt, page_size, pages_read, budget, group):
        return pages_read * page_size * 2 * head_dim * elt
