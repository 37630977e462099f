"""Backend dispatch: the Triton kernels or their PyTorch twins, chosen per device and visible to the user."""
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.utils import logging

import triton_kernels as tk

logger = logging.get_logger("quest_hf")


@dataclass(frozen=True)
class Ops:
    name: str
    append_kv: Callable
    score_pages: Callable
    topk_pages: Callable
    sparse_decode_attention: Callable
    append_token_at: Callable  # one decode token at a device position (the captured static cache)
    encode_codes: Callable  # the key-code selectors' kernels (quest_hf/selectors/codes.py)
    encode_codes_at: Callable
    code_scores: Callable
    top_p_mask: Callable
    quantize_bounds: Callable  # QuestConfig(bounds="int8"): triton_kernels/bounds8.py
    quantize_bounds_at: Callable
    reuse_pages: Callable  # QuestConfig(reselect_every > 1): triton_kernels/reuse.py


def _on_tensor_device(fn):
    """Launch a Triton kernel on its first tensor's GPU: with a device_map, layers live on several GPUs
    while the current device stays cuda:0, and Triton launches on the current device."""
    @functools.wraps(fn)
    def launch(first, *args, **kwargs):
        if first.device.type == "cuda" and first.device.index != torch.cuda.current_device():
            with torch.cuda.device(first.device):
                return fn(first, *args, **kwargs)
        return fn(first, *args, **kwargs)

    return launch


_PAIRS = ("append_kv", "score_pages", "topk_pages", "sparse_decode_attention", "append_token_at", "encode_codes",
          "encode_codes_at", "code_scores", "top_p_mask", "quantize_bounds", "quantize_bounds_at", "reuse_pages")
TORCH = Ops("torch", *(getattr(tk, f"{name}_ref") for name in _PAIRS))
TRITON = Ops("triton", *(_on_tensor_device(getattr(tk, name)) for name in _PAIRS))


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device`, or None when they can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton package is not installed (pip install triton)"
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1 for the slow interpreter), got {device.type}"


def resolve_backend(requested: str, device: torch.device) -> Ops:
    """Pick the ops for one cache layer on `device`. `"triton"` fails loudly; `"auto"` says when it falls back."""
    if requested == "torch":
        return TORCH
    reason = triton_unavailable_reason(device)
    if requested == "triton":
        if reason:
            raise RuntimeError(f"backend='triton' cannot run: {reason}. Use backend='auto' or backend='torch'.")
        return TRITON
    if reason is None and device.type == "cuda":
        return TRITON
    if device.type == "cuda":
        logger.warning_once(f"quest-hf: decode uses the PyTorch reference path, not Triton: {reason}")
    else:
        logger.info_once(f"quest-hf: {device.type} device, decode uses the PyTorch reference path")
    return TORCH
