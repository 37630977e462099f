"""Key-code selectors (docs/selector.md): Quest's page min/max as a quantization grid, plus a few bits per key
channel and token.

Quest's bound `sum_c max(q_c min_c, q_c max_c)` adds every channel's worst case separately, so its slack over the
page's true best q.k is ~3-5 standard deviations of q.k and mostly the same on every page; in the layers where it
fails (18, 23, 24 of SmolLM2) it no longer ranks pages the way their best tokens do. 1-2-bit per-channel codes of
each token on that page's own min/max grid give every token an estimated q.k, and the page score is its best
token's estimate.

    keys ─append─► pages + min/max ─(page complete)─► codes on the page grid
    q ─► estimated q.k per token ─max per page─► Top-K per query head ─union per KV group─► page ids

`top_p` (adaptive budget): the page score becomes the page's estimated attention mass (`log sum exp` of the
estimated logits, the current page exact) and each query head keeps the fewest pages whose mass reaches `top_p`
of the total, never more than `budget // page_size`.

Per-slot state: `layer.side["qcode<bits>"]` uint8 `[B, H_kv, C, D * bits // 8]`, codes of complete pages (the
current page is read whole and scored from its exact keys); `layer.side_state["qcode<bits>"]`: pages encoded so
far by multi-token appends (a decode append encodes the page it completes on the device). A cache filled under
another policy (`QuestCache.copy(config)` of a quest prefill) gets its codes built at the first `select`.
"""
from __future__ import annotations

import math

import torch

import triton_kernels as tk
from triton_kernels.key_codes import code_bytes

from .base import Selector, metadata_bytes, top_pages


class QCodeSelector(Selector):
    """Pages ranked by their best token's q.k estimated from `bits`-bit per-channel codes on the page grid.

    Args:
        bits: 1, 2 (default) or 4 bits per channel and token (2 bits at fp16, page_size 16: as many bytes
            as Quest's min/max metadata).
        top_p: None (fixed budget) or a mass in (0, 1]: adaptive budget, at most `budget // page_size`
            pages per query head. Its log masses are scored over the whole allocation, the current page's exact
            from the device position, so its decode steps are captured like the fixed budget's.
    """

    def __init__(self, bits: int = 2, top_p: float | None = None):
        if bits not in tk.key_codes.CODE_BITS:
            raise ValueError(f"bits must be one of {tk.key_codes.CODE_BITS}, got {bits}")
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")
        self.bits, self.top_p = bits, top_p
        self.key = f"qcode{bits}"
        self.captured = True

    def __repr__(self):
        return f"{type(self).__name__}(bits={self.bits}, top_p={self.top_p})"

    # --------------------------------------------------------------------------------------- codes
    def _sync(self, layer, seq_len: int, known_upto: int | None = None) -> torch.Tensor:
        """The layer's code buffer with the complete pages of `seq_len` slots encoded (each page once)."""
        S = layer.page_size
        B, H, C, D = layer.keys.shape
        codes = layer.side.get(self.key)
        if codes is None or codes.shape[2] != C:
            codes = layer.keys.new_zeros(B, H, C, code_bytes(D, self.bits), dtype=torch.uint8)
            layer.side[self.key] = codes
            layer.side_state[self.key] = 0
        upto = layer.side_state.get(self.key, 0)
        if known_upto is not None:  # a crop may have reopened pages: re-encode them when they complete
            upto = min(upto, known_upto)
        full = seq_len // S
        if full > upto:
            layer.ops.encode_codes(layer.keys, layer.kmin, layer.kmax, codes, upto, full - upto, self.bits)
            upto = full
        layer.side_state[self.key] = upto
        return codes

    def on_append(self, layer, key_states, start, valid_new):
        if key_states.shape[2] == 1 and self.key in layer.side:
            # A decode append: the page it completed (if any), found from the device position.
            layer.ops.encode_codes_at(layer.keys, layer.kmin, layer.kmax, layer.side[self.key], layer.pos, self.bits)
        else:  # before seq_len moves: encode the pages this append completed
            self._sync(layer, start + key_states.shape[2], known_upto=start // layer.page_size)

    def on_crop(self, layer, new_len):
        if self.key in layer.side_state:
            layer.side_state[self.key] = min(layer.side_state[self.key], new_len // layer.page_size)

    def _codes(self, layer) -> torch.Tensor:
        codes = layer.side.get(self.key)
        if codes is None or self.key not in layer.side_state:  # filled under another policy: build them once
            codes = self._sync(layer, layer.seq_len)
        return codes

    # -------------------------------------------------------------------------------------- select
    def select(self, layer, q, window):
        if window:
            raise NotImplementedError(f"policy {layer.config.policy!r} does not support sliding-window layers; "
                                      "use policy='quest' for this model")
        cfg, S = layer.config, layer.page_size
        score, mask = layer.ops.code_scores, layer.ops.top_p_mask
        group = q.shape[1] // layer.keys.shape[1]
        if self.top_p is not None:
            # Log masses over the allocation (unwritten pages have none: -inf); the current page's mass is exact,
            # from its keys, at the device position, and that page is always kept.
            s = score(q, layer.keys, layer.kmin, layer.kmax, self._codes(layer), layer.valid, layer.keys.shape[2], S, 0,
                      self.bits, "lse", q.shape[-1] ** -0.5, pos=layer.pos)
            return top_pages(layer, mask(s, self.top_p, cfg.num_pages, pos=layer.pos, page_size=S), group,
                             cfg.num_pages)
        # The current page's codes are not written yet: pos= scores it +inf (and the spare page: + 1 page).
        s = score(q, layer.keys, layer.kmin, layer.kmax, self._codes(layer), layer.valid, layer.keys.shape[2], S, 0,
                  self.bits, "max", q.shape[-1] ** -0.5, pos=layer.pos)
        return top_pages(layer, s, group, cfg.num_pages + 1)

    def bytes_per_step(self, seq_len, kv_heads, head_dim, elt, page_size, pages_read, budget, group):
        # Quest's min/max + every token's codes + the exact current page + the chosen K/V.
        codes = math.ceil(seq_len * head_dim * self.bits / 8) * kv_heads
        current = kv_heads * page_size * head_dim * elt
        return (metadata_bytes(seq_len, kv_heads, head_dim, elt, page_size) + codes + current
                + pages_read * page_size * 2 * head_dim * elt)


class TwoStageCodeSelector(QCodeSelector):
    """Quest's bound picks `candidates` x the budget's pages per query head; the key codes re-rank only
    those pages (codes of the other pages are never read), and the best `budget // page_size` are kept.

    Where the bound fails, it still ranks the page holding the best token among its top few; the codes
    pick it out of them. Bytes: Quest's min/max + the candidates' codes (at most `group * candidates *
    budget` tokens a KV head) + the chosen pages' K/V. Kernels: `score_pages`, `topk_pages`, `code_scores(pages=)`.
    """

    def __init__(self, bits: int = 1, candidates: int = 8):
        super().__init__(bits=bits)
        if not isinstance(candidates, int) or candidates < 1:
            raise ValueError(f"candidates must be an int >= 1, got {candidates!r}")
        self.candidates = candidates

    def __repr__(self):
        return f"TwoStageCodeSelector(bits={self.bits}, candidates={self.candidates})"

    def select(self, layer, q, window):
        if window:
            raise NotImplementedError(f"policy {layer.config.policy!r} does not support sliding-window layers; "
                                      "use policy='quest' for this model")
        cfg, ops, S = layer.config, layer.ops, layer.page_size
        C = layer.keys.shape[2]
        bound = ops.score_pages(q, layer.kmin, layer.kmax, C, S, 0, "none", pos=layer.pos)  # [B, H_q, P]
        P = bound.shape[-1]
        # Candidates per query head (+ 1: the spare page, always +inf, takes a slot); every other page's bound
        # becomes -inf in place.
        cand = ops.topk_pages(bound, min(P, self.candidates * cfg.num_pages + 1), 1, mask_rest=True)
        score = layer.ops.code_scores
        # The code scores replace the candidates' bounds; pos= keeps the current page (codes unwritten) at +inf.
        s = score(q, layer.keys, layer.kmin, layer.kmax, self._codes(layer), layer.valid, C, S, 0, self.bits,
                  "max", 1.0, cand, bound, pos=layer.pos)
        return top_pages(layer, s, q.shape[1] // layer.keys.shape[1], cfg.num_pages + 1)

    def bytes_per_step(self, seq_len, kv_heads, head_dim, elt, page_size, pages_read, budget, group):
        # Quest's min/max + the candidates' codes (an upper bound: group x candidates) + the chosen K/V.
        tokens = min(math.ceil(seq_len / page_size), group * self.candidates * max(1, budget // page_size)) * page_size
        codes = math.ceil(tokens * head_dim * self.bits / 8) * kv_heads
        return (metadata_bytes(seq_len, kv_heads, head_dim, elt, page_size) + codes
                + pages_read * page_size * 2 * head_dim * elt)
