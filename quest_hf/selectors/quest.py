"""The paper's rule (arXiv 2406.10774): each page's upper bound of q.k from its key min/max, Top-K per query
head, united per KV group (or ranked by the group's max / sum, `gqa_mode`)."""
from __future__ import annotations

import contextlib

import torch

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

    def attend(self, layer, q, scale, window, on_select, softcap=0.0, sinks=None):
        why = fused_step_declined(layer, q)
        if why is not None:
            layer.step_kernels = f"separate: {why}"
            return super().attend(layer, q, scale, window, on_select, softcap, sinks)
        import triton_kernels.fused_step as fs

        cfg = layer.config
        reduce = "none" if cfg.gqa_mode == "union" else cfg.gqa_mode
        int8 = cfg.bounds != "key_dtype"
        if int8 and layer.bounds_stale():
            layer.sync_bounds()
        lo, hi, bscale = (layer.kmin8, layer.kmax8, layer.kscale) if int8 else (layer.kmin, layer.kmax, None)
        B, H = q.shape[0], layer.kmin.shape[1]
        ws = layer.step_state
        if ws is None or ws.numel() < 3 * B * H + 1:  # first step of this batch shape (never inside a capture)
            ws = layer.step_state = fs.step_workspace(B, H, q.device)
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():  # a device_map's other GPUs
            out, ids = fs.quest_step(q, lo, hi, layer.keys, layer.values, layer.kernel_valid(), layer.keys.shape[2],
                                     cfg.page_size, cfg.num_pages + 1, scale, reduce, pos=layer.pos, window=window,
                                     scale=bscale, chan=layer.kchan if int8 else None, softcap=softcap,
                                     sinks=sinks, workspace=ws, launch=fs.DECODE_STEP_LAUNCH)
        layer.step_kernels = "fused: " + ("three launches chained by PDL" if fs.quest_step.overlapped else
                                          "three launches, one after another (no PDL)")
        on_select(ids)
        return out

    def bytes_per_step(self, seq_len, kv_heads, head_dim, elt, page_size, pages_read, budget, group,
                       bounds="key_dtype", reselect_every=1):
        # Reuse reads the bounds on one step in `reselect_every`; `pages_read` (measured) counts the added pages.
        meta = metadata_bytes(seq_len, kv_heads, head_dim, elt, page_size, bounds) / reselect_every
        return meta + pages_read * page_size * 2 * head_dim * elt


def fused_step_declined(layer, q) -> str | None:
    """None when this decode step runs `quest_step` (`QuestConfig.fused_step`), else why it runs the separate
    kernels (kept on the layer as `layer.step_kernels`)."""
    from quest_hf import compiled
    from triton_kernels._common import pdl_available
    from triton_kernels.fused_step import DECODE_STEP_LAUNCH, fused_step_supported

    cfg = layer.config
    if cfg.fused_step is False:
        return "QuestConfig(fused_step=False)"
    if layer.ops.name != "triton":
        return "the PyTorch reference path"
    if cfg.reselect_every > 1:
        return "reselect_every > 1 (the reuse kernels)"
    if getattr(layer, "pager", None) is not None:
        return "offload='cpu' (the resident pool)"
    if compiled.compiled_step_active():
        return "a compiled step (its kernels are traced one by one)"
    reduce = "none" if cfg.gqa_mode == "union" else cfg.gqa_mode
    group = q.shape[1] // layer.kmin.shape[1]
    why = fused_step_supported(layer.kmin.shape[2], group, reduce, rows=layer.rows, launch=DECODE_STEP_LAUNCH)
    if why is not None:
        return why
    if cfg.fused_step == "auto":
        if q.shape[0] != 1:
            return "fused_step='auto' takes batch 1 only (slower at batch 8 on an H200)"
        if group != 1:
            return "fused_step='auto' takes MHA only (tied with the separate kernels at a GQA group's shared score)"
        if cfg.bounds != "key_dtype":
            return "fused_step='auto' takes key-dtype bounds only (slower with 8-bit bounds at 128K on an H100)"
        if not pdl_available(q.device):
            return "fused_step='auto' needs programmatic dependent launch (Hopper or newer)"
    if layer.step_state is None and q.is_cuda and torch.cuda.is_current_stream_capturing():
        return "its workspace is made on an uncaptured step first"
    return None
