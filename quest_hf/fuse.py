"""Decode-only `torch.compile` of a patched model's norms, MLPs and rotary (`QuestConfig(compile_decode=True)`).

A captured Quest decode step of a 7B model spends ~1.5 ms of its ~8 ms in HF's unfused elementwise code
(RMSNorm alone is six kernels); HF's own static-cache path hides that by compiling the whole forward.
Here only what never touches the cache is compiled — every `*RMSNorm` and `*MLP` module of the decoder,
and the modeling file's `apply_rotary_pos_emb` (the attention modules call it by its module-global name,
so it is replaced in that module while a model is patched with this option, and put back after) — and
only for one-token CUDA inputs, so prefill, CPU runs and the attention stay eager, and the compiled
kernels are captured into the decode graph like any other. One compiled function per module class serves
every layer (modules are graph inputs, not constants).
"""
from __future__ import annotations

import sys

import torch
from transformers.utils import logging

logger = logging.get_logger("quest_hf")

SUFFIXES = ("RMSNorm", "MLP")
DEVICE_TYPES = ("cuda",)  # tests add "cpu" with BACKEND = "eager"
BACKEND = "inductor"
_compiled: dict = {}


def _compiled_forward(cls):
    fn = _compiled.get((cls, BACKEND))
    if fn is None:
        fn = _compiled[(cls, BACKEND)] = torch.compile(cls.forward, backend=BACKEND, dynamic=False)
    return fn


FAILED: dict = {}  # what could not be compiled -> the error; it then runs eagerly (logged once)


def _run_compiled(key, get_fn, eager, *args, **kwargs):
    """The compiled function's output, or (when compiling fails, logged) the eager one's."""
    if key not in FAILED:
        try:
            return get_fn()(*args, **kwargs), True
        except Exception as e:  # noqa: BLE001 - any compile error: fall back, loudly
            FAILED[key] = f"{type(e).__name__}: {e}"
            logger.warning(f"quest-hf: torch.compile of {key} failed, it runs eagerly: {FAILED[key][:500]}")
    return eager(*args, **kwargs), False


def _decode_forward(module, eager):
    cls = type(module)

    def forward(x, *args, **kwargs):
        if x.dim() >= 3 and x.shape[1] == 1 and _is_decode(x):
            out, ok = _run_compiled(cls.__name__, lambda: _compiled_forward(cls),
                                    lambda *a, **k: eager(*a[1:], **k), module, x, *args, **kwargs)
            module._quest_compiled_calls += ok
            return out
        return eager(x, *args, **kwargs)

    return forward


_rotary_users: dict = {}  # modeling module -> [original function, number of patched models using it]
# The replaced `apply_rotary_pos_emb` serves every model of its modeling file; it compiles only inside the
# forward of a model patched with compile_decode (the decoder's pre/post hooks push/pop this stack).
_forwards: list = []


def enter_forward(compile_decode: bool) -> None:
    _forwards.append(compile_decode)


def exit_forward() -> None:
    if _forwards:
        _forwards.pop()


def _is_decode(x) -> bool:
    # Not under tensor parallel: its sharded linears run collectives that the eager path already handles.
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return x.device.type in DEVICE_TYPES and not torch.is_grad_enabled() and not distributed


def _patch_rotary(model) -> object | None:
    """Route the modeling module's `apply_rotary_pos_emb` through torch.compile for one-token steps."""
    attn = next((m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")), None)
    module = sys.modules.get(type(attn).__module__) if attn is not None else None
    if module is None or not callable(getattr(module, "apply_rotary_pos_emb", None)):
        return None
    if module in _rotary_users:
        _rotary_users[module][1] += 1
        return module
    original = module.apply_rotary_pos_emb
    compiled = {}

    def apply_rotary_pos_emb(q, k, *args, **kwargs):
        if _forwards and _forwards[-1] and q.dim() == 4 and q.shape[-2] == 1 and _is_decode(q):  # [B, H, 1, D]
            def get():
                if BACKEND not in compiled:
                    compiled[BACKEND] = torch.compile(original, backend=BACKEND, dynamic=False)
                return compiled[BACKEND]

            out, ok = _run_compiled(f"{module.__name__}.apply_rotary_pos_emb", get, original, q, k, *args, **kwargs)
            apply_rotary_pos_emb.compiled_calls += ok
            return out
        return original(q, k, *args, **kwargs)

    apply_rotary_pos_emb.compiled_calls = 0
    apply_rotary_pos_emb.quest_original = original
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    _rotary_users[module] = [original, 1]
    return module


def _unpatch_rotary(module) -> None:
    entry = _rotary_users.get(module)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        module.apply_rotary_pos_emb = entry[0]
        del _rotary_users[module]


def compile_decode_modules(model) -> list:
    """Give every norm/MLP module of `model` a decode-only compiled `forward`; returns the modules wrapped.

    The previous instance `forward` (if any) is kept on the module and put back by `restore`."""
    wrapped = []
    for m in model.modules():
        if type(m).__name__.endswith(SUFFIXES) and not hasattr(m, "_quest_eager_forward"):
            m._quest_eager_forward = m.__dict__.get("forward")
            m._quest_compiled_calls = 0
            m.forward = _decode_forward(m, m.forward)
            wrapped.append(m)
    rotary = _patch_rotary(model)
    logger.info(f"quest-hf: decode-only torch.compile on {len(wrapped)} norm/MLP modules"
                + (f" and {rotary.__name__}.apply_rotary_pos_emb" if rotary else ""))
    return wrapped + ([rotary] if rotary else [])


def restore(wrapped) -> None:
    """Undo `compile_decode_modules` (its returned list)."""
    for m in wrapped:
        if not isinstance(m, torch.nn.Module):
            _unpatch_rotary(m)
            continue
        previous = m.__dict__.pop("_quest_eager_forward", None)
        m.__dict__.pop("forward", None)
        m.__dict__.pop("_quest_compiled_calls", None)
        if previous is not None:
            m.forward = previous
