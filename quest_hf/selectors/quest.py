"""The paper's rule (arXiv 2406.10774): each page's upper bound of q.k from its key min/max, Top-K per query
head, united per KV group (or ranked by the group's max / sum, `gqa_mode`)."""
from __future__ import annotations

from .base import Selector, metadata_bytes


class QuestSelector(Selector):
    paged_reorder = True

    def select(self, layer, q, window):
        cfg, ops = layer.config, layer.ops
        reduce = "none" if cfg.gqa_mode == "union" else cfg.gqa_mode
        # Over the whole allocation: unwritten pages are empty (-inf); the current page is forced from the
        # device position inside the kernel, the spare last page by the kernel itself (+ 1 page).
        scores = ops.score_pages(q, layer.kmin, layer.kmax, layer.keys.shape[2], cfg.page_size, 0, reduce,
                                 pos=layer.pos, window=window, rows=layer.rows)
        group = q.shape[1] // layer.kmin.shape[1] if reduce == "none" else 1
        return ops.topk_pages(scores, cfg.num_pages + 1, group)

    def bytes_per_step(self, seq_len, kv_heads, head_dim, elt, page_size, pages_read, budget, group):
        return metadata_bytes(seq_len, kv_heads, head_dim, elt, page_size) + pages_read * page_size * 2 * head_dim * elt
