"""Decode-only `torch.compile` of a patched model's norms, MLPs and rotary (`QuestConfig(compile_decode=True)`).

A captured Quest decode step of a 7B model spends ~1.5 ms of its ~8 ms in HF's unfused elementwise code
(RMSNorm alone is six kernels); HF's own static-cache path hides that by compiling the whole forward.
Here only what never touches the cache is compiled — every `*RMSNorm` and `*MLP` module of the decoder,
and the modeling file's `apply_rotary_pos_emb` (the attention modules call it by its module-global name,
so it is replaced in that module while a model patched with this option exists, and put back after the last
one is unpatched) — and only for one-token inputs on `QuestConfig._compile_devices` (CUDA), so prefill, CPU runs
and the attention stay eager, and the compiled kernels are captured into the decode graph like any other. One
compiled function per module class and backend serves every layer (modules are graph inputs, not constants), and
every patched model: past dynamo's recompile limit of shapes, fresh copies of it take the new ones
(quest_hf/recompile.py).

With `QuestConfig.fuse_residual`, a decoder layer whose forward is the plain pre-norm one (`standard_layer`) gets a
decode forward of the same steps in which each residual add runs inside the compiled kernel of the norm that reads
its sum (`_add_norm`): the layer's post-attention norm, and the next layer's input norm (or the final norm), whose
output waits on the DecodeCompile (`pending`) for that norm's call on that very tensor; any other call computes as
before. Two kernels a layer fewer in a captured 7B step (~64 of its ~260 small kernels).

Every replacement goes through the patch's record (quest_hf/binding.py); what compiled, with which backend, and
what failed belong to one patched model (`model._quest_state.compiled`, a `DecodeCompile`).
"""
from __future__ import annotations

import ast
import contextvars
import functools
import importlib
import inspect
import os
import textwrap
from dataclasses import dataclass, field

import torch
from transformers.utils import logging

from .binding import MISSING, Bindings, Method, shared_kind
from .families import _decoder_layers
from .recompile import Compiled

logger = logging.get_logger("quest_hf")

SUFFIXES = ("RMSNorm", "MLP")
_compiled: dict = {}  # (function, backend, pdl) -> its torch.compile'd version, shared by every model


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
    fuse_residual: bool = False  # QuestConfig.fuse_residual, as bound
    # fuse_residual: decoder layer index -> "fused" or why its forward was left as HF's (`standard_layer`)
    residual: dict = field(default_factory=dict)
    # A norm output computed with the add that made its input: (that sum, its version, the norm module, the output),
    # taken by the norm's next call on that sum (`_decode_forward`); cleared by every forward's start and end.
    pending: tuple | None = None
    residual_hits: int = 0  # norm calls that took a pending output (visible to tests)
    pdl: bool = False  # a compiled function ran with inductor's dependent launches (`inductor_pdl`)
    pdl_devices: dict = field(default_factory=dict)  # device -> inductor_pdl(device), read at its first call


# The compile settings of the patched forward in flight (None: none, or one without compile_decode): the shared
# `apply_rotary_pos_emb` replacement serves every model of its modeling file and compiles only inside such a forward.
_current: contextvars.ContextVar[DecodeCompile | None] = contextvars.ContextVar("quest_hf_compile", default=None)


def enter_forward(compiled: DecodeCompile | None) -> contextvars.Token:
    if compiled is not None:
        compiled.pending = None
    return _current.set(compiled)


def exit_forward(token: contextvars.Token) -> None:
    compiled = _current.get()
    if compiled is not None:
        compiled.pending = None  # holds no tensor past its forward
    _current.reset(token)


def _is_decode(x, device_types) -> bool:
    # Not under tensor parallel: its sharded linears run collectives that the eager path already handles.
    # Not inside a compiled region (quest_hf.compiled's whole step): that compile covers these modules already.
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return (x.device.type in device_types and not torch.is_grad_enabled() and not distributed
            and not torch.compiler.is_compiling())


def inductor_pdl(device: torch.device) -> bool:
    """Whether inductor's kernels for `device` launch programmatically dependent on the kernel before them
    (its `triton.enable_pdl`: each waits for that kernel's end before its first read of what it wrote, and lets the
    next kernel start after its own last load): where our own kernels do (`pdl_available`: Hopper or newer, not
    QUEST_HF_PDL=0) and the installed torch's inductor has the option; QUEST_HF_INDUCTOR_PDL=0 turns off inductor's
    alone."""
    from triton_kernels._common import pdl_available

    return pdl_available(device) and _inductor_has_pdl() and os.environ.get("QUEST_HF_INDUCTOR_PDL", "1") != "0"


@functools.cache
def _inductor_has_pdl() -> bool:
    import torch._inductor.config as inductor_config

    return hasattr(inductor_config.triton, "enable_pdl")


def _run_compiled(compiled: DecodeCompile, key: str, fn, eager, *args, **kwargs):
    """`fn` compiled with the model's backend, or (when compiling fails, logged once per model) `eager`."""
    if key not in compiled.failed:
        try:
            device = next((a.device for a in args if torch.is_tensor(a)), None)
            pdl = compiled.pdl_devices.get(device)
            if pdl is None:
                pdl = compiled.pdl_devices[device] = compiled.backend == "inductor" and device is not None \
                    and inductor_pdl(device)
            fast = _compiled.get((fn, compiled.backend, pdl))
            if fast is None:
                options = dict(_OPTIONS.get(fn, {})) if compiled.backend == "inductor" else None
                if pdl:
                    options["triton.enable_pdl"] = True
                fast = _compiled[(fn, compiled.backend, pdl)] = Compiled(
                    fn, f"torch.compile of {key}", fullgraph="prefer", backend=compiled.backend, dynamic=False,
                    options=options)
            compiled.pdl |= pdl
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
    pending = compiled.pending
    if pending is not None and pending[2] is module and pending[0] is x and x._version == pending[1] and not args \
            and not kwargs:
        compiled.pending = None  # computed by the add that made `x` (_decode_layer_forward), in the same kernel
        compiled.residual_hits += 1
        return pending[3]
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


def _add_norm(norm, x, residual):
    """`norm(residual + x)` and the sum: one kernel under inductor (the sum rounded to its dtype before the norm
    reads it, as HF's forward does: `_OPTIONS`)."""
    total = residual + x
    return type(norm).forward(norm, total), total


# inductor's options for a function of this file: rounding to fp16/bf16 where the eager code rounds (inductor keeps
# a fused intermediate in fp32 otherwise, and the norm would read an unrounded sum).
_OPTIONS = {_add_norm: {"emulate_precision_casts": True}}

# The forward that `_decode_layer_forward` stands for, with the layer's own arguments after `hidden_states` (each
# handed on to the attention under its name) in place of {passes}.
_PRE_NORM_LAYER = """
residual = hidden_states
hidden_states = self.input_layernorm(hidden_states)
hidden_states, _ = self.self_attn(hidden_states=hidden_states, {passes}**{kwargs})
hidden_states = residual + hidden_states
residual = hidden_states
hidden_states = self.post_attention_layernorm(hidden_states)
hidden_states = self.mlp(hidden_states)
hidden_states = residual + hidden_states
return hidden_states
"""


@functools.cache
def standard_layer(cls) -> tuple[str, ...] | str:
    """The names of the arguments after `hidden_states` of `cls.forward`, where that forward is the plain pre-norm
    layer's (`_PRE_NORM_LAYER`, statement for statement: the syntax trees are compared, so comments, decorators and
    annotations don't matter and any other statement does); else why not (a str)."""
    fn = inspect.unwrap(cls.forward)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError) as e:
        return f"the source of {cls.__name__}.forward cannot be read ({type(e).__name__})"
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef):
        return f"{cls.__name__}.forward is not a plain function"
    a = node.args
    names = [p.arg for p in a.posonlyargs + a.args]
    if names[:2] != ["self", "hidden_states"] or a.vararg or a.kwonlyargs or a.kwarg is None or a.posonlyargs:
        return f"{cls.__name__}.forward's arguments are not (self, hidden_states, ..., **kwargs)"
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    params = tuple(names[2:])
    expected = ast.parse(_PRE_NORM_LAYER.format(passes="".join(f"{p}={p}, " for p in params), kwargs=a.kwarg.arg))
    if [ast.dump(s) for s in body] != [ast.dump(s) for s in expected.body]:
        return (f"{cls.__name__}.forward is not the plain pre-norm layer's (residual, norm, attention, add, norm, MLP, "
                "add)")
    return params


def _decode_layer_forward(method: Method, hidden_states, *args, **kwargs):
    """A plain pre-norm decoder layer's forward (bound by `fuse_residual_adds`): HF's own for anything but a one-token
    decode input; for that, the same steps with each residual add run by the compiled norm that reads its sum."""
    layer, (compiled, params, following) = method.__self__, method.data
    if not (hidden_states.dim() == 3 and hidden_states.shape[1] == 1 and len(args) <= len(params)
            and _is_decode(hidden_states, compiled.device_types)):
        return method.original(hidden_states, *args, **kwargs)
    passed = dict(zip(params, args))
    if passed.keys() & kwargs.keys():
        return method.original(hidden_states, *args, **kwargs)  # let HF's forward raise its own TypeError
    passed.update(kwargs)
    if "cache" in params and "past_key_values" in passed and "cache" not in passed:
        passed["cache"] = passed.pop("past_key_values")  # what transformers' deprecate_kwarg does on 5.24 on
    residual = hidden_states
    hidden_states = layer.input_layernorm(hidden_states)  # the previous layer's pending output, when it made it
    hidden_states, _ = layer.self_attn(hidden_states=hidden_states, **passed)
    hidden_states, residual = _norm_of_sum(compiled, layer.post_attention_layernorm, hidden_states, residual)
    hidden_states = layer.mlp(hidden_states)
    if following is None:
        return residual + hidden_states
    normed, out = _norm_of_sum(compiled, following, hidden_states, residual)
    compiled.pending = (out, out._version, following, normed)
    return out


def _norm_of_sum(compiled: DecodeCompile, norm, x, residual):
    key = f"residual add + {type(norm).__name__}"
    (normed, total), ok = _run_compiled(compiled, key, _add_norm, _add_norm, norm, x, residual)
    norm._quest_compiled_calls += ok
    return normed, total


def _bind_beneath(bindings: Bindings, layer, fn, data) -> None:
    """Bind `fn` as `layer.forward` beneath the patch's own interception of it (a Method whose function is marked
    `outermost`: quest_hf.patch._layer_forward, which hands a layer's calls to a SegmentGraph, and may be bound before
    or after this), so that each keeps its place in the chain; `bindings.restore()` takes it out of the chain wherever
    it then sits."""
    top = vars(layer).get("forward")
    if isinstance(top, Method) and getattr(top.__func__, "outermost", False):
        method = Method(fn, layer, "forward", top.previous, data)
        top.previous = method
    else:
        method = Method(fn, layer, "forward", vars(layer).get("forward", MISSING), data)
        layer.forward = method
    bindings.call(_unbind_beneath, layer, method)


def _unbind_beneath(layer, method: Method) -> None:
    top = vars(layer).get("forward")
    if top is method:
        if method.previous is MISSING:
            del layer.forward
        else:
            layer.forward = method.previous
        return
    if vars(layer).get("_old_forward") is method:  # accelerate, hooked after the patch, keeps ours as _old_forward
        layer._old_forward = method.original
        return
    for f in (top, vars(layer).get("_old_forward")):
        while isinstance(f, Method):
            if f.previous is method:
                f.previous = method.previous
                return
            f = f.previous


def _hooked(module) -> bool:
    """Whether something other than compile_decode replaced `module`'s forward (accelerate's `_hf_hook`s do)."""
    forward = vars(module).get("forward")
    return hasattr(module, "_hf_hook") or (forward is not None and not isinstance(forward, Method))


def _device(module):
    param = next(module.parameters(), None)
    return param.device if param is not None else None


def fuse_residual_adds(model, bindings: Bindings, compiled: DecodeCompile) -> None:
    """Give each plain pre-norm decoder layer of `model` whose norms `compiled` wraps the decode forward
    `_decode_layer_forward`, recording it in `bindings`; `compiled.residual` says which layers and why not others."""
    try:
        decoder, layers = _decoder_layers(model)
    except ValueError as e:
        compiled.residual[None] = str(e)
        return
    final = getattr(decoder, "norm", None)
    wrapped = set(map(id, compiled.modules))
    kinds = [standard_layer(type(layer)) for layer in layers]
    for i, (layer, params) in enumerate(zip(layers, kinds)):
        if isinstance(params, str):
            compiled.residual[i] = params
            continue
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not all(id(n) in wrapped for n in norms):
            compiled.residual[i] = "its norms are not compiled by compile_decode"
            continue
        if _hooked(layer):
            # accelerate's hooks (device_map, offload) move its inputs in the forward they replace: keep that forward
            compiled.residual[i] = "its forward is replaced on the module (accelerate's hooks: device_map, offload)"
            continue
        # The norm that reads this layer's output next: the next layer's input norm (when that layer is plain
        # pre-norm too, so that it calls it first thing), or after the last layer the model's final norm; none where
        # that norm is not compiled by compile_decode, is hooked or sits on another device (a device_map's hop).
        if i + 1 < len(layers):
            following = layers[i + 1].input_layernorm if not isinstance(kinds[i + 1], str) else None
        else:
            following = final
        if following is not None and (id(following) not in wrapped or _hooked(following)
                                      or _device(following) != _device(layer.post_attention_layernorm)):
            following = None
        _bind_beneath(bindings, layer, _decode_layer_forward, (compiled, params, following))
        compiled.residual[i] = "fused"


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
                           device_types: tuple[str, ...] = ("cuda",), fuse_residual: bool = False) -> DecodeCompile:
    """Give every norm/MLP module of `model` a decode-only compiled `forward`, and hold the rotary routing of its
    modeling file (and with `fuse_residual` fuse the residual adds of its plain pre-norm layers into their norms:
    `fuse_residual_adds`), recording each replacement in `bindings`; `bindings.restore()` undoes them."""
    compiled = DecodeCompile(backend, tuple(device_types), bindings, fuse_residual=fuse_residual)
    for m in model.modules():
        if type(m).__name__.endswith(SUFFIXES) and not _wrapped(m):
            bindings.set(m, "_quest_compiled_calls", 0)
            bindings.method(m, "forward", _decode_forward, data=compiled)
            compiled.modules.append(m)
    compiled.rotary = _modeling_module(model)
    if compiled.rotary:
        bindings.shared("rotary", compiled.rotary)
    if fuse_residual:
        fuse_residual_adds(model, bindings, compiled)
    fused = sum(v == "fused" for v in compiled.residual.values())
    logger.info(f"quest-hf: decode-only torch.compile ({backend}) on {len(compiled.modules)} norm/MLP modules"
                + (f" and {compiled.rotary}.apply_rotary_pos_emb" if compiled.rotary else "")
                + (f"; residual adds fused into the norms of {fused} of {len(compiled.residual)} layers"
                   if fuse_residual else ""))
    return compiled
