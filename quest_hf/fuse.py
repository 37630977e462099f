"""Decode-only `torch.compile` of a patched model's norms, MLPs and rotary (`QuestConfig(compile_decode=True)`).

A captured Quest decode step of a 7B model spends ~1.5 ms of its ~8 ms in HF's unfused elementwise code
(RMSNorm alone is six kernels); HF's own static-cache path hides that by compiling the whole forward.
Here only what never touches the cache is compiled — every `*RMSNorm` and `*MLP` module of the decoder,
and the modeling file's `apply_rotary_pos_emb` (the attention modules call it by its module-global name,
so it is replaced in that module while a model patched with this option exists, and put back after the last
one is unpatched) — and only for one-token inputs on `QuestConfig._compile_devices` (CUDA), so prefill, CPU runs
and the attention stay eager, and the compiled kernels are captured into the decode graph like any other. One
compiled function per module class and backend serves every layer (modules are graph inputs, not constants).

Every replacement goes through the patch's record (quest_hf/binding.py); what compiled, with which backend, and
what failed belong to one patched model (`model._quest_state.compiled`, a `DecodeCompile`).
"""
from __future__ import annotations

import contextvars
import importlib
from dataclasses import dataclass, field

import torch
from transformers.utils import logging

from .binding import Bindings, Method, shared_kind

logger = logging.get_logger("quest_hf")

SUFFIXES = ("RMSNorm", "MLP")
_compiled: dict = {}  # (function, backend) -> its torch.compile'd version, shared by every model


@dataclass
class DecodeCompile:
    """What `compile_decode` set up on one patched model: its settings, what it wrapped, what failed."""

    backend: str  # the torch.compile backend (QuestConfig.compile_backend)
    device_types: tuple[str, ...]  # inputs on these device types compile (QuestConfig._compile_devices)
    bindings: Bindings  # the replacements, undone by `bindings.restore()`
    modules: list = field(default_factory=list)  # the norms/MLPs given a decode-only compiled forward
    rotary: str | None = None  # the modeling module whose apply_rotary_pos_emb routes through torch.compile
    rotary_calls: int = 0  # compiled rotary calls in this model's forwards
    failed: dict = field(default_factory=dict)  # what could not be compiled -> the error (it then runs eagerly)


# The compile settings of the patched forward in flight (None: none, or one without compile_decode): the shared
# `apply_rotary_pos_emb` replacement serves every model of its modeling file and compiles only inside such a forward.
_current: contextvars.ContextVar[DecodeCompile | None] = contextvars.ContextVar("quest_hf_compile", default=None)


def enter_forward(compiled: DecodeCompile | None) -> contextvars.Token:
    return _current.set(compiled)


def exit_forward(token: contextvars.Token) -> None:
    _current.reset(token)


def _is_decode(x, device_types) -> bool:
    # Not under tensor parallel: its sharded linears run collectives that the eager path already handles.
    # Not inside a compiled region (quest_hf.compiled's whole step): that compile covers these modules already.
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return (x.device.type in device_types and not torch.is_grad_enabled() and not distributed
            and not torch.compiler.is_compiling())


def _run_compiled(compiled: DecodeCompile, key: str, fn, eager, *args, **kwargs):
    """`fn` compiled with the model's backend, or (when compiling fails, logged once per model) `eager`."""
    if key not in compiled.failed:
        try:
            fast = _compiled.get((fn, compiled.backend))
            if fast is None:
                fast = _compiled[(fn, compiled.backend)] = torch.compile(fn, backend=compiled.backend, dynamic=False)
            return fast(*args, **kwargs), True
        except Exception as e:  # noqa: BLE001 - any compile error: fall back, loudly
            compiled.failed[key] = f"{type(e).__name__}: {e}"
            logger.warning(f"quest-hf: torch.compile of {key} failed, it runs eagerly: {compiled.failed[key][:500]}")
    return eager(*args, **kwargs), False


def _decode_forward(method: Method, x, *args, **kwargs):
    """A norm's/MLP's forward (bound by `compile_decode_modules`): compiled for one-token decode inputs.

    What compiles is the class's forward, or for an MLP fused by `fuse_projections` (quest_hf/fuse_proj.py, which
    sets `_quest_fused`) while its fused weight is intact, the fused function that its forward now runs."""
    module, compiled, eager = method.__self__, method.data, method.original
    if x.dim() >= 3 and x.shape[1] == 1 and _is_decode(x, compiled.device_types):
        cls = type(module)
        fn, key, operands = cls.forward, cls.__name__, (module, x, *args)
        fused = vars(module).get("_quest_fused")
        if fused is not None and not args and not kwargs and fused.intact():
            fn, key, operands = fused.function, f"{key} (fused {fused.name})", (module, x, *fused.operands(traced=True))
        out, ok = _run_compiled(compiled, key, fn, lambda *_, **__: eager(x, *args, **kwargs), *operands, **kwargs)
        module._quest_compiled_calls += ok
        return out
    return eager(x, *args, **kwargs)


@shared_kind("rotary")
def _route_rotary(bindings: Bindings, module_name: str) -> None:
    """Route the modeling module's `apply_rotary_pos_emb` through torch.compile for one-token steps of a forward
    of a model patched with compile_decode (process-wide: installed by the first such model, removed by the last)."""
    module = importlib.import_module(module_name)
    original = module.apply_rotary_pos_emb
    key = f"{module_name}.apply_rotary_pos_emb"
    # With the `kernels` package, transformers (5.25 on) makes the global a hub wrapper module, and unpickling the
    # wrapper copies each attention holds rebuilds them from the global's type: the global must stay that module.
    # Its instance `forward` is replaced instead (the module's call runs it); `original` is its class's forward.
    hub = isinstance(original, torch.nn.Module)
    if hub:
        original = type(original).forward.__get__(original)

    def apply_rotary_pos_emb(q, k, *args, **kwargs):
        if torch.compiler.is_compiling():  # inside a compiled region (quest_hf.compiled): it covers this call
            return original(q, k, *args, **kwargs)
        compiled = _current.get()
        if compiled is not None and q.dim() == 4 and q.shape[-2] == 1 and _is_decode(q, compiled.device_types):
            out, ok = _run_compiled(compiled, key, original, original, q, k, *args, **kwargs)  # q: [B, H, 1, D]
            compiled.rotary_calls += ok
            return out
        return original(q, k, *args, **kwargs)

    apply_rotary_pos_emb.quest_original = original
    if hub:
        bindings.set(original.__self__, "forward", apply_rotary_pos_emb)
    else:
        bindings.set(module, "apply_rotary_pos_emb", apply_rotary_pos_emb)


def rotary_route(module):
    """The `apply_rotary_pos_emb` replacement that the rotary routing installed in a modeling module (as its global,
    or as its hub wrapper's `forward`), or None where none is installed."""
    fn = module.apply_rotary_pos_emb
    if isinstance(fn, torch.nn.Module):
        fn = vars(fn).get("forward")
    return fn if hasattr(fn, "quest_original") else None


def _modeling_module(model) -> str | None:
    attn = next((m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")), None)
    name = type(attn).__module__ if attn is not None else None
    module = importlib.import_module(name) if name else None
    return name if module is not None and callable(getattr(module, "apply_rotary_pos_emb", None)) else None


def _wrapped(module) -> bool:
    forward = vars(module).get("forward")
    return isinstance(forward, Method) and forward.__func__ is _decode_forward


def compile_decode_modules(model, bindings: Bindings, backend: str = "inductor",
                           device_types: tuple[str, ...] = ("cuda",)) -> DecodeCompile:
    """Give every norm/MLP module of `model` a decode-only compiled `forward`, and hold the rotary routing of its
    modeling file, recording each replacement in `bindings`; `bindings.restore()` undoes them."""
    compiled = DecodeCompile(backend, tuple(device_types), bindings)
    for m in model.modules():
        if type(m).__name__.endswith(SUFFIXES) and not _wrapped(m):
            bindings.set(m, "_quest_compiled_calls", 0)
            bindings.method(m, "forward", _decode_forward, data=compiled)
            compiled.modules.append(m)
    compiled.rotary = _modeling_module(model)
    if compiled.rotary:
        bindings.shared("rotary", compiled.rotary)
    logger.info(f"quest-hf: decode-only torch.compile ({backend}) on {len(compiled.modules)} norm/MLP modules"
                + (f" and {compiled.rotary}.apply_rotary_pos_emb" if compiled.rotary else ""))
    return compiled
