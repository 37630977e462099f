"""`patch_model` / `unpatch_model`: one line to make a HF model decode with Quest sparse attention.

Through HF's own extension points: the "quest" attention and mask functions are registered with
`AttentionInterface` / `AttentionMaskInterface`; a forward pre-hook on the decoder hands each forward's
`QuestCache` and padding mask to the attention function; `generate` is wrapped only to create a
`QuestCache` when the caller passes none, `forward` to replay captured decode steps (and, on a model whose
decoder layers sit on several devices, each decoder layer's `forward`: one captured graph per device segment).

Every replacement is recorded once in the model's `Bindings` (quest_hf/binding.py) and undone in reverse by
`unpatch_model`; the process-wide ones (the registrations, transformers' `DeferredStopCheck.is_supported`) are
installed by the first patched model and removed when the last is unpatched. A deepcopy or pickle of a patched
model is a patched model of its own.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import logging

from . import families
from .attention import NAME, family_eager, quest_attention_forward
from .binding import MISSING, Bindings, Method, shared_kind
from .cache import QuestCache
from .compiled import CompiledStep, compiled_step_active
from .config import QuestConfig
from .decode_gemv import DecodeGemv, bind_decode_gemv
from .fuse import DecodeCompile, compile_decode_modules, enter_forward, exit_forward
from .fuse_proj import Fusion, fuse_projections
from .graph import DecodeGraph, SegmentGraph, plan_segments
from .ops import triton_unavailable_reason
from .selectors import check_config, selector_for

logger = logging.get_logger("quest_hf")

def _deferred_stop_check():
    from transformers.generation import utils as generation_utils

    cls = getattr(generation_utils, "DeferredStopCheck", None)
    return cls if callable(getattr(cls, "is_supported", None)) else None


# False where this transformers has no DeferredStopCheck (generate() then checks after every token).
DEFERRED_STOP_AVAILABLE = _deferred_stop_check() is not None


def _defer_on_cuda(original):
    """transformers' `DeferredStopCheck.is_supported`, which also says yes on CUDA to a QuestCache whose config
    asks for it (`QuestConfig.defer_stop_check`, on the device types `QuestConfig._defer_devices`).

    transformers (5.17 to 5.24 at least) defers generate()'s stop check by one step only on "mps"; elsewhere
    the host waits for the GPU after every token. Every other cache gets transformers' own answer.
    """
    @functools.wraps(original)
    def is_supported(device, cache, cache_is_returned, *args, **kwargs):
        supported = original(device, cache, cache_is_returned, *args, **kwargs)
        if isinstance(cache, QuestCache):
            cfg = cache.quest_config
            is_assistant = kwargs.get("is_assistant", args[0] if args else False)
            if not supported and cfg.defer_stop_check and device.type in cfg._defer_devices and not is_assistant:
                supported = cache.is_croppable or not cache_is_returned  # transformers' own condition
            cache.stop_check = "deferred" if supported else "per-token"
        return supported

    return is_supported


@shared_kind("patch")
def _install_process_wide(bindings: Bindings, arg=None) -> None:
    """What every patched model needs of the process: held by the first patch, undone after the last unpatch."""
    bindings.item(AttentionInterface._global_mapping, NAME, quest_attention_forward)
    bindings.item(AttentionMaskInterface._global_mapping, NAME, sdpa_mask)  # without it padded batches get no mask
    cls = _deferred_stop_check()
    if cls is not None:
        bindings.set(cls, "is_supported", staticmethod(_defer_on_cuda(cls.is_supported)))


@dataclass(frozen=True)
class _SegmentSplit:
    """`_force_segments`'s request: segments also start at these decoder layers; `capture=False`: run uncaptured."""

    split_at: tuple[int, ...]
    capture: bool = True


@dataclass
class _PatchState:
    config: QuestConfig
    num_layers: int
    original_attn: str
    cache_arg: str  # the decoder's name for the cache argument: "cache" (>= 5.24) or "past_key_values"
    attention_modules: list = field(default_factory=list)
    bindings: Bindings = field(default_factory=Bindings)  # everything the patch replaced, undone by unpatch_model
    gemv_bindings: Bindings | None = None  # the part of `bindings` that decode_gemv replaced (before fusion)
    gemv: DecodeGemv | None = None  # decode_gemv's bound projections (quest_hf/decode_gemv.py); None: not bound
    fuse_bindings: Bindings | None = None  # the part of `bindings` that fuse_projections replaced
    fused: Fusion | None = None  # fuse_projections' fused layers (quest_hf/fuse_proj.py); None: not fused
    compile_bindings: Bindings | None = None  # the part of `bindings` that compile_decode replaced (after fusion)
    compiled: DecodeCompile | None = None  # compile_decode's settings, modules and failures (quest_hf/fuse.py)
    # Of the call in flight, never copied with the model (deepcopy, pickle):
    cache: QuestCache | None = None  # the cache of the forward in flight
    tokens: list = field(default_factory=list)  # fuse.enter_forward's, one per decoder forward in flight
    kept: QuestCache | None = None  # the last captured-decode cache, for the next generate() of the same shapes
    # The captured decode step (quest_hf/graph.py): a DecodeGraph on one device, a SegmentGraph per device segment.
    graph: DecodeGraph | SegmentGraph = field(default_factory=DecodeGraph)
    attention: dict = field(default_factory=dict)  # layer_idx -> families.LayerAttention (window, soft-cap, sinks)
    segments: _SegmentSplit | None = None  # tests and benchmarks only: set by `_force_segments`
    # The uncaptured decode step compiled whole (quest_hf/compiled.py), made by the first step that runs it.
    compiled_step: CompiledStep | None = None
    # The decode path of the last cache that decoded ("captured", "compiled, uncaptured: ...", "eager: ..."): what
    # ran, also where generate() did not return its cache.
    decode_path: str | None = None
    # The same cache's `step_kernels`: which kernels its sparse layers' decode steps ran (QuestConfig.fused_step).
    step_kernels: str | None = None


    def __getstate__(self):
        return dict(vars(self), cache=None, tokens=[], kept=None, graph=DecodeGraph(), compiled_step=None)

    def mark_bucket(self, model, cache: QuestCache) -> QuestCache:
        """Tell `cache`'s layers whether to round their capacity up to a compile bucket: only where this model's
        uncaptured step compiles whole (`_compilable`) and is not captured, so that an eager step (several devices,
        tensor parallel, a failed compile) allocates no more than it needs."""
        kind = next(model.parameters()).device.type
        cache._step.bucket = _compilable(model, self, cache.quest_config) and cache.quest_config.buckets_capacity(kind)
        return cache

    @property
    def compiled_modules(self) -> list:
        """The norms/MLPs given a decode-only compiled forward (empty without compile_decode)."""
        return self.compiled.modules if self.compiled is not None else []


def cache_arg_name(model) -> str:
    """The decoder's name for the cache argument: "cache" (transformers >= 5.24) or "past_key_values"."""
    return "cache" if "cache" in inspect.signature(model.base_model.forward).parameters else "past_key_values"


def _before_forward(decoder, args, kwargs):
    if compiled_step_active():  # traced into the compiled step: it has no cache, its caller did this work
        return None
    state: _PatchState = decoder._quest_state
    state.tokens.append(enter_forward(state.compiled))  # first: _after_forward (always called) pops it
    _cache_kwarg(state, kwargs)
    bound = inspect.signature(decoder.forward).bind_partial(*args, **kwargs).arguments
    cache = bound.get("cache", bound.get("past_key_values"))
    if cache is None:
        use_cache = bound.get("use_cache")
        use_cache = decoder.config.use_cache if use_cache is None else use_cache
        if use_cache and not decoder.training:
            cache = state.mark_bucket(decoder, QuestCache(state.config, state.num_layers))
            kwargs[state.cache_arg] = cache
    elif not isinstance(cache, QuestCache):
        raise TypeError(
            f"this model is patched for Quest and needs a QuestCache, got {type(cache).__name__}: pass "
            "QuestCache.from_model(model), pass no cache (generate() makes one), or unpatch_model(model) first"
        )
    if cache is not None:
        new = bound.get("input_ids")
        new = bound.get("inputs_embeds") if new is None else new
        cache.begin_step(bound.get("attention_mask"), new.shape[1])
        if new.shape[1] == 1 and "attention_mask" in kwargs:
            # A decode step reads padding from the cache's valid slots: skip HF's mask (and its host sync).
            kwargs["attention_mask"] = None
    state.cache = cache
    return args, kwargs


def _after_forward(decoder, args, kwargs, output):
    if compiled_step_active():
        return None
    state = decoder._quest_state
    state.cache = None  # drop the reference: the cache lives as long as its user keeps it
    if state.tokens:
        exit_forward(state.tokens.pop())


def _generate_length(model, args, kwargs) -> int | None:
    """Tokens a generate() call will hold: prompt + new tokens (None when it cannot be told: the cache grows)."""
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if ids is None or ids.dim() != 2:
        return None
    gen_cfg = kwargs.get("generation_config") or model.generation_config
    if kwargs.get("max_length") is not None:
        return kwargs["max_length"]
    new = kwargs.get("max_new_tokens", gen_cfg.max_new_tokens)
    return ids.shape[-1] + new if new is not None else gen_cfg.max_length


def _distributed() -> bool:
    """Tensor parallel runs all-reduce inside the forward; a captured graph would hold the collectives."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def capture_refusal(model, config: QuestConfig) -> str | None:
    """Why decode steps of `model` cannot run as captured CUDA graphs, or None when they can (on one CUDA device as
    one graph; with its decoder layers over several, as one graph per device segment: quest_hf.graph.SegmentGraph).

    The one place `cuda_graph` is resolved: `True` raises where "auto" would say why and run eagerly."""
    if config.cuda_graph is False:
        return "cuda_graph=False"
    devices = sorted({str(p.device) for p in model.parameters()})
    off = [d for d in devices if not d.startswith("cuda")]
    why = None
    if len(off) == len(devices):
        why = f"the model is not on one CUDA device ({', '.join(devices)})"
    elif off:
        why = f"parts of the model are not on a CUDA device ({', '.join(devices)})"
    elif _distributed():
        why = "tensor parallelism (a graph would hold the collectives)"
    elif not selector_for(config.policy).captured:
        why = f"policy {config.policy!r} scores pages from host lengths"
    elif len(devices) > 1:
        try:
            plan_segments(model)
        except ValueError as e:
            why = str(e)
    if why and config.cuda_graph is True:
        raise ValueError(f"cuda_graph=True cannot capture the decode step: {why}; use cuda_graph='auto' or False")
    return why


def _decode_path(model, state: _PatchState, cache: QuestCache) -> str:
    """"captured" (one graph), "captured: 2 segments (cuda:0 layers 0-15, cuda:1 layers 16-31)" (one graph per
    device segment), "compiled, uncaptured: <why>" (`compile_step`), or "eager: <why>"; resolved once per cache
    (and logged when a CUDA model runs eagerly). Under `_force_segments(..., capture=False)`: "uncaptured segments:
    <the segments>"."""
    if cache.decode_path is None:
        split = state.segments
        if split is not None and not split.capture:
            cache.decode_path = f"uncaptured segments: {_segment_graph(model, state, False).description}"
            return cache.decode_path
        why = capture_refusal(model, cache.quest_config)
        if why is None:
            segments = plan_segments(model, split.split_at if split is not None else ())
            cache.decode_path = "captured" if len(segments) == 1 else \
                f"captured: {_segment_graph(model, state, True, segments).description}"
        elif _compilable(model, state, cache.quest_config):
            cache.decode_path = f"compiled, uncaptured: {why}"
            asked = cache.quest_config.compile_step is True  # "auto" compiles unasked: say what the first step costs
            (logger.info_once if asked else logger.warning_once)(
                f"quest-hf: decode steps run uncaptured ({why}), the one-token forward through torch.compile "
                f"({state.config.compile_backend}); the first step of each new batch size or capacity bucket compiles "
                f"(minutes for a 7B model on an H200: about 2 with compile_wrapper='python', 4-5 with the C++ wrapper "
                f"that is the CUDA default and runs each step faster; inductor's cache serves a later process); "
                f"compile_step=False runs the steps eagerly instead")
        else:
            step = state.compiled_step
            if step is not None and step.failed is not None and cache.quest_config.compiles_step(
                    next(model.parameters()).device.type):
                why = f"{why}; compiling the step failed before: {step.failed[:300]}"
            cache.decode_path = f"eager: {why}"
            on_gpu = why != "cuda_graph=False" and next(model.parameters()).is_cuda
            (logger.warning_once if on_gpu else logger.info_once)(f"quest-hf: decode steps run uncaptured: {why}")
    return cache.decode_path


def _compilable(model, state: _PatchState, cfg: QuestConfig) -> bool:
    """Whether an uncaptured decode step of `model` runs compiled whole (quest_hf/compiled.py): `compile_step`, the
    model on one CPU or CUDA device, no tensor parallel, and no earlier failure to compile it."""
    devices = {p.device for p in model.parameters()}
    kind = next(iter(devices)).type
    step = state.compiled_step
    return (len(devices) == 1 and kind in ("cpu", "cuda") and cfg.compiles_step(kind)
            and not _distributed() and (step is None or step.failed is None))


def _compiled_decode(model, state: _PatchState, original, cache: QuestCache, ids, kwargs: dict):
    """One decode step through the model's CompiledStep; None when it could not compile (the cache's decode_path then
    says so, and this and later steps run eagerly)."""
    step = state.compiled_step
    cfg = state.config
    wrapper = cfg.wrapper_mode(ids.device.type)
    if step is None or step.backend != cfg.compile_backend or (
            step.wrapper not in (wrapper, None) and step.cpp_failed is None):
        step = state.compiled_step = CompiledStep(original, cfg.compile_backend, wrapper)
    fixed = {k: kwargs[k] for k in _STEP_CONSTANTS if k in kwargs and k not in ("use_cache", "return_dict")}
    state.cache = cache  # what the attention reads (the decoder's hook, which sets it, is not traced)
    if state.fused is not None:
        state.fused.check()  # whether each fused group still holds, asked here: the trace cannot
    try:
        args = (cache, state.cache_arg, ids, kwargs.get("position_ids"), kwargs.get("attention_mask"), fixed)
        out = step.step(*args)
        if out is None and step.wrapper == "cpp" and cfg.compile_wrapper == "auto":
            # the C++ wrapper is the CUDA default, not the user's ask: its failure costs the Python wrapper, not the
            # compiled step (the eager one runs at a fraction of its speed)
            logger.warning(f"quest-hf: inductor's C++ wrapper could not compile the decode step ({step.failed[:300]}); "
                           f"compiling it with the Python wrapper (compile_wrapper='python' skips the attempt)")
            failed = step.failed
            step = state.compiled_step = CompiledStep(original, cfg.compile_backend, "python")
            step.cpp_failed = failed
            out = step.step(*args)
    finally:
        state.cache = None
    if out is None:
        logger.warning(f"quest-hf: the compiled uncaptured decode step failed, steps run eagerly: {step.failed}")
        cache.decode_path = f"eager: {cache.decode_path.partition(': ')[2]}; compiling the step failed: " \
                            f"{step.failed[:300]}"
    return out


def _segment_graph(model, state: _PatchState, capture: bool, segments=None) -> SegmentGraph:
    """The model's SegmentGraph for its current plan (made, and the decoder layers intercepted, when it has none)."""
    if segments is None:
        segments = plan_segments(model, state.segments.split_at if state.segments is not None else ())
    graph = state.graph
    if not (isinstance(graph, SegmentGraph) and graph.capture == capture and graph.segments == segments):
        graph.release()
        graph = state.graph = SegmentGraph(segments, capture)
        _intercept_layers(model, state)
    return graph


def _step_graph(model, state: _PatchState, path: str):
    """The runner of a decode step over a cache whose decode path is `path` (not "eager: ...")."""
    if path == "captured":
        if not isinstance(state.graph, DecodeGraph):
            state.graph.release()
            state.graph = DecodeGraph()
        return state.graph
    graph = state.graph
    capture = path.startswith("captured")
    if isinstance(graph, SegmentGraph) and graph.capture == capture and path.endswith(graph.description):
        return graph
    return _segment_graph(model, state, capture)  # another cache's plan ran since: this one's again


def _layer_forward(method: Method, *args, **kwargs):
    """A decoder layer's `forward` (bound by `_intercept_layers`): in a decode step that runs per device segment,
    handed to the model's SegmentGraph; otherwise the layer's own (accelerate's hook included, when it has one)."""
    graph = method.__self__._quest_state.graph
    if getattr(graph, "mode", None) is None:
        return method.original(*args, **kwargs)
    return graph.layer_call(method.data, method.original, args, kwargs)


_layer_forward.outermost = True  # stays the outermost of the patch's Methods on a layer (quest_hf.fuse._bind_beneath)


def _intercept_layers(model, state: _PatchState) -> None:
    """Bind `_layer_forward` as every decoder layer's `forward`, once, recorded in the patch's bindings.

    Outside accelerate's hook when the model was dispatched before the patch (the layer's `forward` is the hook's
    wrapper, which moves inputs to the layer's device: the segment sees HF's own tensors, and a layer inside a
    segment skips the move); inside it when dispatched after (`_unbind_layer` then restores `_old_forward`)."""
    _, layers = families._decoder_layers(model)
    for j, layer in enumerate(layers):
        if any(isinstance(f, Method) and f.__func__ is _layer_forward
               for f in (vars(layer).get("forward"), vars(layer).get("_old_forward"))):
            continue
        state.bindings.set(layer, "_quest_state", state)
        method = Method(_layer_forward, layer, "forward", vars(layer).get("forward", MISSING), data=j)
        layer.forward = method
        state.bindings.call(_unbind_layer, layer, method)


def _unbind_layer(layer, method: Method) -> None:
    """Undo `_intercept_layers` on one layer, also when accelerate hooked it afterwards (its wrapper then calls
    ours as `_old_forward`: that gets the layer's own forward back, and the wrapper stays)."""
    if vars(layer).get("forward") is method:
        if method.previous is MISSING:
            del layer.forward
        else:
            layer.forward = method.previous
    elif vars(layer).get("_old_forward") is method:
        layer._old_forward = method.original


def _force_segments(model, split_at=(), *, capture: bool = True):
    """Tests and benchmarks only: decode steps of the patched `model` run per segment, a segment also starting
    at each decoder layer index in `split_at` (so one device holds several); `capture=False` runs the segments
    uncaptured on any device (the interception and static inputs, no graph: what CPU tests check). `split_at=None`
    goes back to the segments of the model's devices. Applies to caches that have not decoded yet; returns `model`."""
    state = model._quest_state
    if split_at is None:
        state.segments = None
    else:
        split = tuple(split_at)
        plan_segments(model, split)  # raises on a bad index
        state.segments = _SegmentSplit(split, capture)
    state.kept = None
    state.graph.release()
    return model


# A kept captured-decode cache serves a later generate() whose capacity it covers with at most this much to spare
# (every page of the capacity is scored each step, and the dense layers read all of it).
KEEP_SLACK = 1 / 8


def _reusable(cache: QuestCache | None, model, config: QuestConfig, length: int | None, batch: int) -> bool:
    """Whether the last generate()'s captured-decode cache can serve this call: same settings, batch, dtype and
    device, and a capacity that fits prompt + new tokens with at most KEEP_SLACK to spare."""
    if cache is None or cache.quest_config != config or length is None:
        return False
    layer = cache.layers[0]
    if not layer.is_initialized:
        return False
    need = -(-length // config.page_size) * config.page_size
    param = next(model.parameters())
    return (need <= layer.max_tokens <= need * (1 + KEEP_SLACK) and layer.keys.shape[0] == batch
            and layer.dtype == param.dtype and layer.device == param.device)


def _cache_kwarg(state: _PatchState, kwargs: dict) -> None:
    """Forward a cache under the name this transformers expects (in place): `cache=` from 5.24 on, where
    `past_key_values=` is deprecated; on older versions `cache=` would land in `**kwargs` and be ignored (the model
    would decode with no cache at all), so it is refused."""
    other = "past_key_values" if state.cache_arg == "cache" else "cache"
    if other not in kwargs:
        return
    if kwargs[other] is None:
        kwargs.pop(other)
    elif state.cache_arg == "cache":
        if kwargs.get("cache") is not None:
            raise TypeError("got both cache= and past_key_values=; pass the cache once, as cache=")
        kwargs["cache"] = kwargs.pop(other)
    else:
        import transformers

        raise TypeError(f"transformers {transformers.__version__} names the cache argument past_key_values=; it "
                        "would ignore cache= and decode without it: pass past_key_values=cache (cache= is the name "
                        "from transformers 5.24 on)")


def _refuse_attention_weights(model, kwargs: dict, gen_cfg=None) -> None:
    asked = kwargs.get("output_attentions")
    if asked is None:
        asked = getattr(gen_cfg if gen_cfg is not None else model.config, "output_attentions", False)
    if asked:
        raise ValueError("output_attentions=True: a model patched with quest-hf computes no attention weights (prefill "
                         "runs SDPA, decode attends over the chosen pages only); to inspect the chosen pages use "
                         "QuestCache.selection_hooks, or unpatch_model(model) for a dense run that returns weights")


# generate(cache_implementation=...) values that a QuestCache stands for: it is allocated once at a fixed capacity
# and its decode steps are captured, which is what "static" asks of HF's StaticCache.
_STANDS_FOR = ("static", "dynamic")


def _drop_cache_implementation(model, kwargs: dict) -> None:
    """generate() is about to pass its QuestCache: transformers refuses a cache_implementation beside a cache."""
    given = kwargs.get("generation_config")
    asked = kwargs.get("cache_implementation", getattr(given, "cache_implementation", None))
    if asked is not None and asked not in _STANDS_FOR:
        raise ValueError(f"cache_implementation={asked!r} asks transformers for its own cache, but a model patched "
                         "with quest-hf decodes from a QuestCache: leave cache_implementation out (or 'static': the "
                         "QuestCache is already allocated once and captured), or unpatch_model(model) first")
    if asked is not None:
        logger.info_once(f"quest-hf: cache_implementation={asked!r} runs as the QuestCache (fixed capacity, captured)")
    if asked is not None or getattr(model.generation_config, "cache_implementation", None) is not None:
        kwargs["cache_implementation"] = None  # the model's own default (e.g. "hybrid") too: the QuestCache serves


def _generate(method: Method, *args, **kwargs):
    """`model.generate` of a patched model: builds (or reuses) the QuestCache when the caller passes none."""
    model, original = method.__self__, method.original
    state: _PatchState = model._quest_state
    # Every call takes the kept cache: one that does not reuse it drops it before allocating its own (two
    # caches of a long prompt may not fit), and one that fails leaves nothing half-used behind.
    kept, state.kept = state.kept, None
    _cache_kwarg(state, kwargs)
    gen_cfg = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    _refuse_attention_weights(model, kwargs, gen_cfg)
    use_cache = kwargs.get("use_cache", getattr(gen_cfg, "use_cache", True))
    if kwargs.get(state.cache_arg) is not None or use_cache is False:
        del kept
        return original(*args, **kwargs)
    _drop_cache_implementation(model, kwargs)
    config = state.config
    length = _generate_length(model, args, kwargs)
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    beams = (kwargs.get("num_beams") or getattr(gen_cfg, "num_beams", None) or 1)
    batch = ids.shape[0] * beams if ids is not None else None
    if _reusable(kept, model, config, length, batch):
        cache = kept
        cache.reset()  # the captured graph replays from the first decode step: no eager step, no capture
        cache.stop_check = None
        cache.reused = True
    else:
        del kept
        cache = state.mark_bucket(model, QuestCache(config, state.num_layers, length))
    kwargs[state.cache_arg] = cache
    out = original(*args, **kwargs)
    returned = kwargs.get("return_dict_in_generate", getattr(gen_cfg, "return_dict_in_generate", False))
    if not returned and (cache.decode_path or "").startswith("captured"):  # a cache handed back is the caller's
        state.kept = cache
    return out


# What the captured forward takes: the step's tensors (copied into the graph's inputs each replay) and constants
# (part of the graph's key); any other argument runs that step eagerly, and decode_path says why.
_STEP_TENSORS = {"input_ids", "position_ids", "attention_mask", "cache", "past_key_values", "cache_position"}
_STEP_CONSTANTS = {"use_cache", "return_dict", "logits_to_keep"}


def _forward(method: Method, *args, **kwargs):
    """`model.forward` of a patched model: one-token steps over a QuestCache replay the captured graph
    (quest_hf/graph.py); all else runs as usual."""
    model, original = method.__self__, method.original
    state: _PatchState = model._quest_state
    _cache_kwarg(state, kwargs)
    _refuse_attention_weights(model, kwargs)
    cache = kwargs.get(state.cache_arg)
    ids = kwargs.get("input_ids", args[0] if args else None)
    if (isinstance(cache, QuestCache) and ids is not None and ids.dim() == 2 and ids.shape[1] == 1
            and cache.get_seq_length() > 0 and kwargs.get("inputs_embeds") is None):
        try:
            return _decode_step(model, state, original, cache, ids, args, kwargs)
        finally:
            state.decode_path = cache.decode_path  # what ran, also when generate() keeps the cache to itself
            state.step_kernels = cache.step_kernels
    return original(*args, **kwargs)


def _decode_step(model, state: _PatchState, original, cache: QuestCache, ids, args, kwargs):
    """One decode step over `cache` on the path `_decode_path` resolved: eager, compiled whole, or captured."""
    path = _decode_path(model, state, cache)
    extra = sorted(set(kwargs) - _STEP_TENSORS - _STEP_CONSTANTS) + (["positional arguments"] if args[1:] else [])
    if path.startswith("eager"):
        return original(*args, **kwargs)
    if path.startswith("compiled"):
        out = _compiled_decode(model, state, original, cache, ids, kwargs) if not extra else None
        if extra:
            cache.decode_path = f"eager: the compiled step does not take {', '.join(extra)}"
            logger.warning_once(f"quest-hf: decode steps run eagerly: the compiled step does not take "
                                f"{', '.join(extra)}")
        return out if out is not None else original(*args, **kwargs)
    graph = _step_graph(model, state, path)
    if isinstance(graph, SegmentGraph) and getattr(model.config, "output_hidden_states", False):
        extra.append("output_hidden_states (config)")  # the layers inside a segment hand on their input
    if not extra and isinstance(graph, SegmentGraph):
        out = graph.step(lambda: original(*args, **kwargs), cache, ids)
        if graph.refusal is not None:
            _refuse_segments(model, cache, graph.refusal)
        return out
    if not extra:
        fixed = {k: kwargs[k] for k in _STEP_CONSTANTS if k in kwargs and k not in ("use_cache", "return_dict")}
        return graph.step(original, lambda: original(*args, **kwargs), cache, state.cache_arg, ids,
                          kwargs.get("position_ids"), kwargs.get("attention_mask"), fixed)
    cache.decode_path = f"eager: the captured step does not take {', '.join(extra)}"
    logger.warning_once(f"quest-hf: decode steps run uncaptured: the captured step does not take "
                        f"{', '.join(extra)}")
    return original(*args, **kwargs)


def _refuse_segments(model, cache: QuestCache, why: str) -> None:
    """The observed step showed that the decoder's layers cannot be replayed per segment: later steps run eagerly."""
    if cache.quest_config.cuda_graph is True:
        raise ValueError(f"cuda_graph=True cannot capture the decode step: {why}; use cuda_graph='auto' or False")
    cache.decode_path = f"eager: {why}"
    logger.warning_once(f"quest-hf: decode steps run uncaptured: {why}")


_UNSET = object()  # a setting left out (None is passed on to QuestConfig, which refuses it)


def patch_model(model, budget: int = _UNSET, page_size: int = _UNSET, *,
                config: QuestConfig | None = None, **options):
    """Make `model` decode with Quest sparse attention, in place; returns `model`.

    `patch_model(model, budget=2048, page_size=16, dense_layers=2, gqa_mode="union", backend="auto")`, or
    `patch_model(model, config=QuestConfig(...))`. Calling it again re-configures (new caches use the
    new settings). The config is checked against its policy's selector here (`quest_hf.selectors.check_config`:
    an unregistered policy, or a setting that selector does not take, raises ValueError). Support is decided from
    what the model's attention does (`quest_hf.families.check_supported`: every decoder whose attention goes through
    HF's attention interface and caches post-RoPE keys; a ValueError names the reason otherwise);
    `describe_patch(model)` says which layers are sparse. Prefill runs HF's SDPA, or the family's eager attention
    where a layer has a logit soft-cap or sinks.
    """
    given = {k: v for k, v in dict(budget=budget, page_size=page_size, **options).items() if v is not _UNSET}
    if config is not None and given:
        raise TypeError(f"pass either config= or keyword settings, not both (got config and {sorted(given)})")
    config = config if config is not None else QuestConfig(**given)
    if not isinstance(config, QuestConfig):
        raise TypeError(f"config must be a QuestConfig, got {type(config).__name__}")
    check_config(config)  # the policy names a registered selector that takes these settings
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    attention = _supported_layers(model)

    _check_settings(model, config)
    state = vars(model).get("_quest_state")
    if state is not None:
        state.config = config
        state.kept = None
        state.graph.release()
        state.compiled_step = None
        _set_compiled(model, state)
        logger.info(f"quest-hf: re-configured {model_type} with {config}")
        return model

    decoder = model.base_model
    text_cfg = model.config.get_text_config()
    state = _PatchState(
        config=config,
        num_layers=text_cfg.num_hidden_layers,
        original_attn=model.config._attn_implementation,
        cache_arg=cache_arg_name(model),
        attention_modules=families.attention_modules(model),
        attention={a.layer_idx: a for a in attention},
    )
    if len(state.attention_modules) != state.num_layers:
        raise ValueError(f"found {len(state.attention_modules)} attention modules for "
                         f"{state.num_layers} layers; this model layout is not supported")
    record = state.bindings
    try:
        record.shared("patch")  # the registrations, DeferredStopCheck: the last unpatch removes them
        model.set_attn_implementation(NAME)
        record.call(model.set_attn_implementation, state.original_attn)
        for m in [*state.attention_modules, decoder, model]:
            record.set(m, "_quest_state", state)
        record.hook(decoder.register_forward_pre_hook(_before_forward, with_kwargs=True))
        record.hook(decoder.register_forward_hook(_after_forward, with_kwargs=True, always_call=True))
        if hasattr(model, "generate"):
            record.method(model, "generate", _generate)
        record.method(model, "forward", _forward)
        state.gemv_bindings = record.child()  # under fusion's: a fused group falls back to its projections' forwards
        state.fuse_bindings = record.child()  # before compile_decode's: its wrappers sit over the fused MLPs
        state.compile_bindings = record.child()
        _set_compiled(model, state)
    except BaseException:
        record.restore()
        raise
    logger.info(f"quest-hf: patched {model_type} ({state.num_layers} layers) with {config}")
    if config.defer_stop_check and not DEFERRED_STOP_AVAILABLE:
        logger.warning("quest-hf: this transformers has no DeferredStopCheck; generate() waits for the GPU after "
                       "every token (QuestConfig(defer_stop_check=False) silences this)")
    return model


def _supported_layers(model) -> list:
    """`families.check_supported(model)`, plus what this library's decode does not serve yet; raises ValueError."""
    if getattr(model, "config", None) is None:
        raise ValueError(f"quest-hf patches transformers models (with a .config), got {type(model).__name__}")
    name = getattr(model.config, "model_type", type(model).__name__)
    layers = families.check_supported(model, allow_hybrid=True)
    n = model.config.get_text_config().num_hidden_layers
    if len(layers) != n:
        other = sorted(set(range(n)) - {a.layer_idx for a in layers})
        raise ValueError(f"quest-hf: {name!r} is a hybrid: layers {families._ranges(other)} are linear-attention / "
                         "recurrent. A QuestCache holds pages for every layer; leaving those layers' state exact in "
                         "transformers' own cache layers is not implemented, so patch_model refuses hybrid models")
    for a in layers:
        if a.kind == "chunked":
            raise ValueError(f"quest-hf: {name!r} layer {a.layer_idx} uses chunked attention (chunks of {a.window}); "
                             "Quest's decode serves full and sliding-window layers only")
        if a.kind not in ("full", "sliding"):
            raise ValueError(f"quest-hf: {name!r} layer {a.layer_idx} has attention of kind {a.kind!r}, which "
                             "Quest's decode does not serve")
    module = families.attention_modules(model)
    for a in layers:
        if (a.softcap or a.has_sinks) and family_eager(module[a.layer_idx]) is None:
            raise ValueError(f"quest-hf: {name!r} layer {a.layer_idx} has a logit soft-cap or sinks, which SDPA "
                             f"cannot apply, and {type(module[a.layer_idx]).__module__} has no "
                             "eager_attention_forward to run its dense prefill; not supported")
    return layers


def _check_settings(model, config: QuestConfig) -> None:
    """What QuestConfig cannot check alone: the settings against this model (raises, or warns once); against the
    policy's selector: `check_config`, called before."""
    if config.backend == "triton":
        devices = sorted({p.device for p in model.parameters()}, key=str)
        reasons = {d.type: triton_unavailable_reason(d) for d in devices}
        reason = next((r for r in reasons.values() if r), None)
        if reason:
            raise ValueError(f"backend='triton' cannot run on this model: {reason}. Use backend='auto' (Triton on "
                             "CUDA, PyTorch elsewhere) or backend='torch'.")
    layers = model.config.get_text_config().num_hidden_layers
    config.check_layers(layers)  # layer_budgets / dense: one per layer, inside the model
    if config.dense is not None and len(config.dense) == layers:
        logger.warning(f"quest-hf: dense lists all {layers} layers of this model: Quest selects nothing")
    elif config.dense is None and config.dense_layers >= layers:
        logger.warning(f"quest-hf: dense_layers={config.dense_layers} covers all {layers} layers of this model: every "
                       f"layer decodes dense and Quest selects nothing; use dense_layers < {layers} for sparse layers")


def _set_compiled(model, state: _PatchState) -> None:
    """Bind or unbind the batch-1 decode GEMV, fuse or unfuse the projections, and wrap or unwrap the decode-only
    compiled norms/MLPs to match `config.decode_gemv`, `config.fuse_projections` and `config.compile_decode` (with
    its backend and `config.fuse_residual`). Each sits over the one before (the GEMV forwards, the fused groups, the
    compiled wrappers), so a change takes off what sits over it first and puts it back after."""
    cfg, compiled = state.config, state.compiled
    gemv_on = _decode_gemv_on(model, cfg)
    fuse_on = gemv_on if cfg.fuse_projections == "auto" else cfg.fuse_projections
    regemv = (state.gemv is not None) != gemv_on
    refusion = regemv or (state.fused is not None) != fuse_on  # fusion turns on or off, or rebinds
    if compiled is not None and (refusion or not cfg.compile_decode or compiled.backend != cfg.compile_backend
                                 or compiled.device_types != cfg._compile_devices
                                 or compiled.fuse_residual != cfg.fuse_residual):
        state.compile_bindings.restore()
        state.compiled = None
    if refusion and state.fused is not None:
        state.fuse_bindings.restore()  # each projection gets a copy of its own weight back
        state.fused = None
    if regemv and state.gemv is not None:
        state.gemv_bindings.restore()
        state.gemv = None
    elif regemv:
        state.gemv = bind_decode_gemv(model, state.gemv_bindings)
    if refusion and fuse_on:
        try:
            state.fused = fuse_projections(model, state.fuse_bindings, gemv=state.gemv)
        except BaseException:
            state.fuse_bindings.restore()  # nothing half-fused stays behind
            raise
    if cfg.compile_decode and state.compiled is None:
        state.compiled = compile_decode_modules(model, state.compile_bindings, cfg.compile_backend,
                                                cfg._compile_devices, cfg.fuse_residual)


def _decode_gemv_on(model, cfg: QuestConfig) -> bool:
    """`decode_gemv` resolved for `model`: True/False as given; "auto": the model's weights on CUDA, Triton there,
    and the backend not "torch"."""
    if cfg.decode_gemv != "auto":
        return cfg.decode_gemv
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda" or cfg.backend == "torch":
        return False
    return triton_unavailable_reason(param.device) is None


def unpatch_model(model):
    """Undo `patch_model`: every replacement it recorded, newest first (original attention implementation,
    hooks removed, `generate`/`forward`, compiled modules and fused projections back, each projection with its own
    weight again; the process-wide ones after the last model)."""
    state = vars(model).get("_quest_state")
    if state is None:
        return model
    state.kept = None
    state.graph.release()
    state.compiled_step = None
    state.bindings.restore()
    return model


def release_cache(model):
    """Free the cache that a patched model keeps from its last captured-decode `generate()` (see
    `QuestConfig.cuda_graph`); the next call allocates and captures anew. Returns `model`."""
    state = getattr(model, "_quest_state", None)
    if state is not None:
        state.kept = None
        state.graph.release()
    return model


@contextlib.contextmanager
def patched(model, budget: int = _UNSET, page_size: int = _UNSET, *,
            config: QuestConfig | None = None, **options):
    """`with patched(model, budget=1024): model.generate(...)` — unpatched on exit, also on error.

    A model patched before the block gets its previous settings back (its kept cache, built under the inner
    ones, is dropped); one that the block itself unpatched stays unpatched."""
    was_patched = vars(model).get("_quest_state")
    previous = was_patched.config if was_patched else None
    patch_model(model, budget, page_size, config=config, **options)
    try:
        yield model
    finally:
        if previous is None:
            unpatch_model(model)
        elif vars(model).get("_quest_state") is not None:
            patch_model(model, config=previous)
