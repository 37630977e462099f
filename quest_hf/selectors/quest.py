"""The paper's rule (arXiv 2406.10774): each page's upper bound of q.k from its key min/max, Top-K per query
head, united per KV group (or ranked by the group's max / sum, `gqa_mode`)."""
from __future__ import annotations

from .base import Selector, metadata_bytes, reused_pages


class QuestSelector(Selector):
    """`QuestConfig.bounds="int8"` / `"int8_channel"`: the score reads the layer's 8-bit bounds (`kmin8/kmax8/kscale`,
    and `kchan` for the channel scales).
    `reselect_every=k > 1`: the score and Top-K choose every k steps (`reused_pages`); in between both launches
    read the layer's device flag and return at once (no bound or score read, nothing written), and the reuse
    kernel attends the stored selection."""

    paged_reorder = True
    traced = True
    int8_bounds = True
    reuses_selection = True

    def select(self, layer, q, window):
        cfg, ops = layer.config, layer.ops
        reduce = "none" if cfg.gqa_mode == "union" else cfg.gqa_mode
        group = q.shape[1] // layer.kmin.shape[1] if reduce == "none" else 1
        k, P = cfg.num_pages + 1, layer.kmin.shape[2]
        due = layer.reuse_due((q.shape[0], layer.kmin.shape[1], min(group * k, P))) if cfg.reselect_every > 1 else None
        int8 = cfg.bounds != "key_dtype"
        if int8 and layer.bounds_stale():  # a cache filled under other bounds, now read under these
            layer.sync_bounds()
        lo, hi, scale = (layer.kmin8, layer.kmax8, layer.kscale) if int8 else (layer.kmin, layer.kmax, None)
        # Over the whole allocation: unwritten pages are empty (-inf); the current page is forced from the
        # device position inside the kernel, the spare last page by the kernel itself (+ 1 page).
        scores = ops.score_pages(q, lo, hi, layer.keys.shape[2], cfg.page_size, 0, reduce,
                                 pos=layer.pos, window=window, rows=layer.rows, scale=scale, due=due,
                                 chan=layer.kchan if int8 else None)
        ids = ops.topk_pages(scores, k, group, due=due)  # due=0: unwritten, and unread by reused_pages
        return ids if due is None else reused_pages(layer, ids, due, cfg.reselect_every)

    def bytes_per_step(self, seq_len, kv_heads, head_dim, elt, page_size, pages_read, budget, group,
                       bounds="key_dtype", reselect_every=1):
        # Reuse reads the bounds on one step in `reselect_every`; `pages_read` (measured) counts the added pages.
        meta = metadata_bytes(seq_len, kv_heads, head_dim, elt, page_size, bounds) / reselect_every
        return meta + pages_read * page_size * 2 * head_dim * elt
