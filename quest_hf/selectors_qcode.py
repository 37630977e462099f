"""The "qcode" page selector: Quest's page min/max as a quantization grid, plus a few bits per key channel.

Why (docs/selector.md): Quest's bound `sum_c max(q_c min_c, q_c max_c)` adds every channel's worst case
separately, so its slack over the page's true best q.k is ~3-5 standard deviations of q.k and mostly the
same on every page; in the layers where it fails (18, 23, 24 of SmolLM2) it no longer ranks pages the way
their best tokens do. Spending as many bytes as the min/max metadata again on 2-bit per-channel codes of
each token *on that page's own min/max grid* gives every token an estimated q.k (rank correlation with the
page's true best 0.91-0.99 instead of 0.76-0.96), and the page score is its best token's estimate.

    keys ─append─► pages + min/max ─(page complete)─► 2-bit codes on the page grid
    q ─► estimated q.k per token ─max per page─► Top-K per query head ─union per KV group─► page ids

`top_p` (Twilight-style adaptive budget): the page score becomes the page's estimated attention mass
(`log sum exp` of the estimated logits; the current page exact) and each query head keeps the fewest pages
whose mass reaches `top_p` of the total, never more than `budget // page_size`.

Per-slot state: `layer.side["qcode<bits>"]` uint8 `[B, H_kv, C, D * bits // 8]`, codes of complete pages
(the current page is always read whole and scored from its exact keys). A cache filled under another policy
(e.g. `QuestCache.copy(config)` of a quest prefill) gets its codes built at the first `select`.
"""
from __future__ import annotations

import torch

import triton_kernels as tk
from triton_kernels.key_codes import code_bytes

from .selectors import Selector, top_pages


class QCodeSelector(Selector):
    """Pages ranked by their best token's q.k estimated from `bits`-bit per-channel codes on the page grid.

    Args:
        bits: 1, 2 (default) or 4 bits per channel and token (2 bits at fp16, page_size 16: as many bytes
            as Quest's min/max metadata).
        top_p: None (fixed budget) or a mass in (0, 1]: adaptive budget, at most `budget // page_size`
            pages per query head.
    """

    def __init__(self, bits: int = 2, top_p: float | None = None):
        if bits not in tk.key_codes.CODE_BITS:
            raise ValueError(f"bits must be one of {tk.key_codes.CODE_BITS}, got {bits}")
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")
        self.bits, self.top_p = bits, top_p
        self.key = f"qcode{bits}"
        self.captured = top_p is None  # the captured step runs the fixed-budget selectors

    def __repr__(self):
        return f"QCodeSelector(bits={self.bits}, top_p={self.top_p})"

    # --------------------------------------------------------------------------------------- codes
    def _sync(self, layer, seq_len: int, known_upto: int | None = None) -> torch.Tensor:
        """The layer's code buffer with the complete pages of `seq_len` slots encoded (each page once)."""
        S, L = layer.page_size, seq_len
        B, H, C, D = layer.keys.shape
        done = getattr(layer, "_qcode_done", {})
        codes = layer.side.get(self.key)
        if codes is None or codes.shape[2] != C:
            codes = layer.keys.new_zeros(B, H, C, code_bytes(D, self.bits), dtype=torch.uint8)
            layer.side[self.key] = codes
            done = {**done, self.key: 0}
        upto = done.get(self.key, 0)
        if known_upto is not None:  # a crop may have reopened pages: re-encode them when they complete
            upto = min(upto, known_upto)
        full = L // S
        if full > upto:
            encode = tk.encode_codes if layer.ops.name == "triton" else tk.encode_codes_ref
            encode(layer.keys, layer.kmin, layer.kmax, codes, upto, full - upto, self.bits)
            upto = full
        layer._qcode_done = {**done, self.key: upto}
        return codes

    def on_append(self, layer, key_states, start, valid_new):
        # Called after the append, before seq_len moves: encode the pages this append completed.
        self._sync(layer, start + key_states.shape[2], known_upto=start // layer.page_size)

    def on_append_at(self, layer):
        # Captured step: the page that the append completed (if any), found on the device.
        codes = layer.side[self.key]  # built at prefill (on_append)
        encode = tk.encode_codes_at if layer.ops.name == "triton" else tk.encode_codes_at_ref
        encode(layer.keys, layer.kmin, layer.kmax, codes, layer.pos, self.bits)

    def _static_codes(self, layer):
        codes = layer.side.get(self.key)
        if codes is None:
            raise RuntimeError(f"policy {layer.config.policy!r}: no key codes in this static cache; its prefill "
                               "must run under the same policy")
        return codes

    # -------------------------------------------------------------------------------------- select
    def select_static(self, layer, q):
        cfg, S = layer.config, layer.page_size
        score = tk.code_scores if layer.ops.name == "triton" else tk.code_scores_ref
        # The current page's codes are not written yet: pos= scores it +inf.
        s = score(q, layer.keys, layer.kmin, layer.kmax, self._static_codes(layer), layer.valid, layer.capacity,
                  S, 0, self.bits, "max", q.shape[-1] ** -0.5, pos=layer.pos)
        return top_pages(layer, s, q.shape[1] // layer.keys.shape[1], cfg.num_pages + 1)  # + the spare page

    def select(self, layer, q, window_start):
        cfg, ops = layer.config, layer.ops
        codes = self._sync(layer, layer.seq_len)
        H = layer.keys.shape[1]
        G = q.shape[1] // H
        score = tk.code_scores if ops.name == "triton" else tk.code_scores_ref
        mode = "max" if self.top_p is None else "lse"
        s = score(q, layer.keys, layer.kmin, layer.kmax, codes, layer.valid, layer.seq_len, cfg.page_size,
                  window_start, self.bits, mode, q.shape[-1] ** -0.5)
        if self.top_p is not None:  # keep the fewest pages holding top_p of each head's estimated mass
            mask = tk.top_p_mask if ops.name == "triton" else tk.top_p_mask_ref
            s = mask(s, self.top_p, cfg.num_pages)
        return top_pages(layer, s, G, cfg.num_pages)


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

    def select(self, layer, q, window_start):
        cfg, ops = layer.config, layer.ops
        codes = self._sync(layer, layer.seq_len)
        H, L = layer.keys.shape[1], layer.seq_len
        G = q.shape[1] // H
        bound = ops.score_pages(q, layer.kmin, layer.kmax, L, cfg.page_size, window_start, "none")  # [B, Hq, P]
        P = bound.shape[-1]
        # Candidates per query head; every other page's bound becomes -inf in place.
        cand = ops.topk_pages(bound, min(P, self.candidates * cfg.num_pages), 1, mask_rest=True)
        score = tk.code_scores if ops.name == "triton" else tk.code_scores_ref
        # The candidates' estimates over their bounds, +inf at the current page.
        s = score(q, layer.keys, layer.kmin, layer.kmax, codes, layer.valid, L, cfg.page_size, window_start,
                  self.bits, "max", 1.0, cand, bound)
        return top_pages(layer, s, G, cfg.num_pages)

    def select_static(self, layer, q):
        cfg, ops, S = layer.config, layer.ops, layer.page_size
        bound = ops.score_pages(q, layer.kmin, layer.kmax, layer.capacity, S, 0, "none", pos=layer.pos)
        P = bound.shape[-1]
        # + 1: the spare page (always +inf) takes a candidate slot
        cand = ops.topk_pages(bound, min(P, self.candidates * cfg.num_pages + 1), 1, mask_rest=True)
        score = tk.code_scores if ops.name == "triton" else tk.code_scores_ref
        # The code scores replace the candidates' bounds; pos= keeps the current page (codes unwritten) at +inf.
        s = score(q, layer.keys, layer.kmin, layer.kmax, self._static_codes(layer), layer.valid, layer.capacity, S,
                  0, self.bits, "max", 1.0, cand, bound, pos=layer.pos)
        return top_pages(layer, s, q.shape[1] // layer.keys.shape[1], cfg.num_pages + 1)  # + the spare page
