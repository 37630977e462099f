"""What a decoder's attention does, read from the model itself: layer kinds, windows, soft-caps, sinks, scaling.

Quest (arXiv 2406.10774) replaces one decode query's softmax attention over the KV cache by attention over the
selected pages. That is only a drop-in where a layer's attention goes through HF's attention interface
(`ALL_ATTENTION_FUNCTIONS.get_interface(...)`) and caches its keys after RoPE (`cache.update(k, v, self.layer_idx)`),
and it is only exact where the sparse path honours what the family's own attention function applies on top of
`softmax(q.k * scaling + mask)`: a logit soft-cap (Gemma 2), per-head sinks in the softmax denominator (GPT-OSS), a
scaling other than `head_dim**-0.5` (Gemma 2/3, Granite) and the per-layer window that the *mask* carries (the
`sliding_window` keyword the attention function gets does not always say it: Qwen2-MoE passes none).

`describe(model)` lists that per attention layer; `check_supported(model)` refuses what a sparse decode attention
cannot serve exactly, naming the reason. Nothing here imports the rest of quest_hf.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch

# Layer types (config.layer_types) of softmax attention over a KV cache, and what they are called here.
ATTENTION_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
                         "attention": "full"}  # the last: `layers_block_type` of Jamba/Zamba configs
# Layer types whose state is recurrent (no per-token keys): transformers keeps them in its own cache layers
# (`LinearAttentionLayer`), so a hybrid can leave them untouched. "hybrid"/"hybrid_sliding" layers hold both in one.
RECURRENT_LAYER_TYPES = {"linear_attention", "conv", "mamba", "mamba2", "ssm", "recurrent", "rwkv", "deltanet"}
# Class-name fragments of token mixers that are not softmax attention over a KV cache.
RECURRENT_MODULE_NAMES = re.compile(r"Mamba|DeltaNet|ShortConv|Recurrent|Rwkv|RWKV|LinearAttention|SSM|Mixer|Conv")
# Where a decoder layer keeps its token mixer.
ATTENTION_CHILD_NAMES = ("self_attn", "attention", "self_attention", "attn")

_INTERFACE_CALL = re.compile(r"ALL_ATTENTION_FUNCTIONS|get_interface\(")
_CACHE_UPDATE = re.compile(r"\.update\(\s*key_states\s*,\s*value_states\s*,\s*self\.layer_idx")
_ROPE_CALL = re.compile(r"apply_rotary_pos_emb\w*\(|apply_rotary\w*\(|rotary_emb\(")


@dataclass(frozen=True)
class LayerAttention:
    """One attention layer as its own code runs it.

    kind: "full" | "sliding" | "chunked", from the mask the decoder hands this layer (not the keyword the attention
    function receives). window: keys a query may see for "sliding" (HF's window keeps keys k > q - window, i.e. the
    last `window` positions including the query's own), the chunk size for "chunked", None for "full".
    softcap: `tanh` logit cap passed as `softcap=` to the attention function (Gemma 2), else None.
    scaling: the module's own `scaling` (multiplies q.k before the cap and the mask).
    has_sinks: per-query-head logits `module.sinks [H_q]` joined to the softmax denominator (GPT-OSS).
    rope: whether keys are rotated (False on SmolLM3's NoPE layers). qk_norm: q/k normalised before RoPE.
    """

    layer_idx: int
    kind: str
    window: int | None
    softcap: float | None
    scaling: float
    has_sinks: bool
    rope: bool
    qk_norm: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _code(src: str) -> str:
    """Source without comments and docstring lines, so that a mention in prose does not count as a call."""
    src = re.sub(r'"""[\s\S]*?"""', "", src)
    return "\n".join(line.split("#", 1)[0] for line in src.splitlines())


def _decoder_layers(model) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """(decoder, its layer list): the module list of `num_hidden_layers` layers of the text decoder."""
    text_cfg = model.config.get_text_config()
    n = text_cfg.num_hidden_layers
    roots = [getattr(model, "base_model", model), model]
    try:  # multimodal models: the text decoder, not a vision encoder that may have as many layers
        roots.insert(0, model.get_decoder())
    except (AttributeError, NotImplementedError, ValueError):
        pass
    for root in roots:
        for _, module in root.named_modules():
            layers = getattr(module, "layers", None)
            if isinstance(layers, torch.nn.ModuleList) and len(layers) == n:
                return module, layers
    raise ValueError(f"quest-hf: cannot find the {n} decoder layers of this {type(model).__name__} "
                     "(no `layers` module list of config.num_hidden_layers entries)")


def _mixer(layer: torch.nn.Module) -> tuple[str | None, torch.nn.Module | None]:
    """(child name, module) of a decoder layer's token mixer: its attention, or the recurrent block in its place."""
    for name in ATTENTION_CHILD_NAMES:
        child = getattr(layer, name, None)
        if isinstance(child, torch.nn.Module):
            return name, child
    for name, child in layer.named_children():
        if hasattr(child, "layer_idx") or RECURRENT_MODULE_NAMES.search(type(child).__name__):
            return name, child
    return None, None


def _is_recurrent(module: torch.nn.Module) -> bool:
    code = _code(_source(type(module).forward))
    return bool(RECURRENT_MODULE_NAMES.search(type(module).__name__) or "recurrent_state" in code
                or "conv_state" in code or "ssm_state" in code)


def _layer_types(text_cfg, n: int) -> list[str] | None:
    types = getattr(text_cfg, "layer_types", None)
    if types is None:
        block = getattr(text_cfg, "layers_block_type", None)  # Jamba, Zamba: "attention" / "mamba" / "hybrid"
        types = list(block) if block is not None else None
    return list(types)[:n] if types is not None else None


def _mask_kinds(decoder, text_cfg, n: int) -> list[tuple[str, int | None]]:
    """(kind, window) per layer, as the decoder builds the mask it hands each layer.

    Decoders that index a mask mapping by `config.layer_types[i]` (Qwen2/3, Gemma 2/3, OLMo 3, GPT-OSS, SmolLM3,
    Qwen2-MoE) give each layer its type's mask; those that call `create_sliding_window_causal_mask` for all
    (Mistral, Mixtral, Phi-3, StarCoder2, Qwen3-MoE) window every layer when `config.sliding_window` is set;
    the rest (Llama, Gemma, OLMo 2, Granite, Cohere, GLM-4, ERNIE 4.5) build one causal mask.
    """
    code = _code(_source(type(decoder).forward))
    types = _layer_types(text_cfg, n)
    window = getattr(text_cfg, "sliding_window", None) or None  # Qwen2-MoE stores 0 for "off"
    chunk = getattr(text_cfg, "attention_chunk_size", None)
    if types is not None and re.search(r"layer_types\s*\[", code):
        out = []
        for t in types:
            kind = ATTENTION_LAYER_TYPES.get(t, t)
            out.append((kind, window if kind == "sliding" else chunk if kind == "chunked" else None))
        return out
    if "create_sliding_window_causal_mask" in code and window is not None:
        return [("sliding", window)] * n
    if "create_chunked_causal_mask" in code and chunk is not None:
        return [("chunked", chunk)] * n
    return [("full", None)] * n


def _passes(code: str, keyword: str) -> bool:
    """Whether the forward passes `keyword=` to the attention function (not merely stores it)."""
    return re.search(rf"\b{keyword}\s*=", code) is not None


def _describe_layer(module, text_cfg, kind: str, window: int | None) -> LayerAttention:
    code = _code(_source(type(module).forward))
    head_dim = int(getattr(module, "head_dim", text_cfg.hidden_size // text_cfg.num_attention_heads))
    num_heads = int(getattr(module, "num_heads", None) or text_cfg.num_attention_heads)
    num_kv_heads = int(getattr(module, "num_key_value_heads", None) or text_cfg.num_key_value_heads
                       or num_heads)
    softcap = None
    if _passes(code, "softcap"):  # Gemma 3 stores attn_logit_softcapping but never passes it: no cap there
        softcap = getattr(module, "attn_logit_softcapping", None)
    scaling = getattr(module, "scaling", None)
    sinks = getattr(module, "sinks", None)
    return LayerAttention(
        layer_idx=int(module.layer_idx),
        kind=kind,
        window=window,
        softcap=float(softcap) if softcap is not None else None,
        scaling=float(scaling) if scaling is not None else head_dim ** -0.5,
        has_sinks=isinstance(sinks, torch.Tensor),
        rope=bool(_ROPE_CALL.search(code)) and bool(getattr(module, "use_rope", True)),
        qk_norm=any(isinstance(getattr(module, n, None), torch.nn.Module)
                    for n in ("q_norm", "k_norm", "q_layernorm", "k_layernorm")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )


def _layers(model):
    """[(layer index, layer type or None, mixer name, mixer module, (kind, window))] of the text decoder."""
    text_cfg = model.config.get_text_config()
    decoder, layers = _decoder_layers(model)
    n = len(layers)
    types = _layer_types(text_cfg, n)
    kinds = _mask_kinds(decoder, text_cfg, n)
    out = []
    for i, layer in enumerate(layers):
        name, mixer = _mixer(layer)
        out.append((i, types[i] if types else None, name, mixer, kinds[i]))
    return out


def _is_attention(layer_type: str | None, mixer) -> bool:
    if mixer is None or (layer_type is not None and layer_type not in ATTENTION_LAYER_TYPES):
        return False
    return not _is_recurrent(mixer) or bool(_INTERFACE_CALL.search(_code(_source(type(mixer).forward))))


def describe(model) -> list[LayerAttention]:
    """One `LayerAttention` per softmax-attention layer of `model`'s text decoder, in layer order.

    Read from the modules (`scaling`, `head_dim`, `sinks`, `use_rope`, q/k norms, whether `softcap=` reaches the
    attention function) and from `config.get_text_config()` as the decoder uses it to build masks (`layer_types`,
    `sliding_window`, `attention_chunk_size`). Recurrent layers of a hybrid are left out (their index is missing).
    Does not decide support: see `check_supported`.
    """
    text_cfg = model.config.get_text_config()
    return [_describe_layer(mixer, text_cfg, kind, window)
            for _, layer_type, _, mixer, (kind, window) in _layers(model) if _is_attention(layer_type, mixer)]


def attention_modules(model) -> list[torch.nn.Module]:
    """The attention module of each softmax-attention layer of the text decoder, in `describe` order."""
    return [mixer for _, layer_type, _, mixer, _ in _layers(model) if _is_attention(layer_type, mixer)]


def _ranges(idx: list[int]) -> str:
    parts, start = [], None
    for k, i in enumerate(idx):
        if start is None:
            start = i
        if k + 1 == len(idx) or idx[k + 1] != i + 1:
            parts.append(f"{start}" if start == i else f"{start}-{i}")
            start = None
    return ",".join(parts)


def _check_attention_code(i: int, mixer) -> None:
    cls = type(mixer)
    where = f"layer {i}'s {cls.__name__} ({cls.__module__})"
    code = _code(_source(cls.forward))
    if not code:
        raise ValueError(f"quest-hf: cannot read the source of {where}.forward, so cannot check that it calls "
                         "HF's attention interface; load the model from its transformers modeling file")
    if not _INTERFACE_CALL.search(code):
        raise ValueError(f"quest-hf: {where} does not call HF's attention interface "
                         "(ALL_ATTENTION_FUNCTIONS.get_interface), so a registered attention function never sees it; "
                         "quest-hf supports decoders whose attention goes through that interface")
    update = _CACHE_UPDATE.search(code)
    if update is None:
        raise ValueError(f"quest-hf: {where} does not update the cache with `cache.update(key_states, value_states, "
                         "self.layer_idx, ...)`, so quest-hf cannot keep its keys in pages; not supported")
    rope = [m.start() for m in _ROPE_CALL.finditer(code)]
    if rope and min(rope) > update.start():
        raise ValueError(f"quest-hf: {where} caches its keys before applying RoPE; quest-hf pages post-RoPE keys "
                         "(what the decode query is scored against), so this model is not supported")
    if not _INTERFACE_CALL.search(code, update.end()) and "attention_interface(" not in code[update.end():]:
        raise ValueError(f"quest-hf: {where} calls its attention before updating the cache, so the attention "
                         "function would not see the cached keys; not supported")


def check_supported(model, *, allow_hybrid: bool = False) -> list[LayerAttention]:
    """Raise ValueError naming the reason when Quest's sparse decode cannot run `model` exactly; else `describe(model)`.

    Refused: encoder-decoder models; bidirectional (non-causal) attention; latent attention (MLA: `kv_lora_rank`);
    KV shared across layers; attention modules that do not call HF's attention interface or do not cache post-RoPE
    keys with `cache.update(key_states, value_states, self.layer_idx, ...)`; a number of attention modules other than
    the number of layers. Linear-attention / recurrent / conv layers are refused unless `allow_hybrid=True`: then
    they are accepted when transformers keeps their state in its own cache layers (`config.layer_types` names
    them, e.g. "linear_attention", "conv"), which a Quest cache must hold unchanged; layers mixing both in one
    ("hybrid") are always refused. The returned list then covers the attention layers only.
    """
    config = model.config
    text_cfg = config.get_text_config()
    name = getattr(config, "model_type", type(model).__name__)
    if getattr(config, "is_encoder_decoder", False) or getattr(text_cfg, "is_encoder_decoder", False):
        raise ValueError(f"quest-hf: {name!r} is an encoder-decoder model; Quest sparsifies the self-attention of a "
                         "decoder-only model over its KV cache (the decoder's cross-attention and encoder are not "
                         "served). Use a decoder-only model")
    for attr in ("kv_lora_rank", "q_lora_rank"):
        if getattr(text_cfg, attr, None):
            raise ValueError(f"quest-hf: {name!r} uses latent attention (MLA, config.{attr}={getattr(text_cfg, attr)}):"
                             " keys are expanded from a compressed latent and key and value head sizes differ; quest-hf"
                             " pages ordinary per-head keys and does not support MLA models (e.g. DeepSeek-V2/V3)")
    if getattr(text_cfg, "use_bidirectional_attention", False):
        raise ValueError(f"quest-hf: {name!r} is configured with bidirectional attention "
                         "(use_bidirectional_attention=True); Quest serves causal decoding only")
    for attr in ("kv_sharing_modes", "num_kv_shared_layers"):
        if getattr(text_cfg, attr, None):
            raise ValueError(f"quest-hf: {name!r} shares KV caches between layers (config.{attr}); each layer of a "
                             "Quest cache owns its pages, so this model is not supported")

    layers = _layers(model)
    recurrent, odd = [], []
    for i, layer_type, child, mixer, _ in layers:
        if layer_type in ("hybrid", "hybrid_sliding"):
            raise ValueError(f"quest-hf: {name!r} layer {i} is of type {layer_type!r}: attention and a recurrent "
                             "state side by side in one layer; quest-hf cannot page its attention exactly")
        if not _is_attention(layer_type, mixer):
            (recurrent if mixer is not None and (layer_type in RECURRENT_LAYER_TYPES or _is_recurrent(mixer))
             else odd).append((i, layer_type, child, mixer))
    if odd:
        i, layer_type, child, mixer = odd[0]
        what = type(mixer).__name__ if mixer is not None else "no attention module"
        raise ValueError(f"quest-hf: {name!r} layer {i} (type {layer_type!r}) has {what}, neither softmax attention "
                         f"over a KV cache nor a known recurrent block; not supported")
    if recurrent:
        idx = [r[0] for r in recurrent]
        kinds = sorted({str(r[1] or type(r[3]).__name__) for r in recurrent})
        if not allow_hybrid:
            raise ValueError(f"quest-hf: {name!r} has linear-attention / recurrent layers ({', '.join(kinds)} on "
                             f"layers {_ranges(idx)}); Quest sparsifies softmax attention over a KV cache. Pass "
                             "allow_hybrid=True to run Quest on its attention layers only, leaving the others' state "
                             "in transformers' own cache layers")
        untyped = [r[0] for r in recurrent if r[1] not in RECURRENT_LAYER_TYPES]
        if untyped:
            raise ValueError(f"quest-hf: {name!r} layers {_ranges(untyped)} are recurrent but config.layer_types does "
                             "not name them as such, so transformers' cache would not keep their state in its own "
                             "layers; quest-hf cannot leave them untouched exactly")

    attention = [(i, mixer) for i, layer_type, _, mixer, _ in layers if _is_attention(layer_type, mixer)]
    if not attention:
        raise ValueError(f"quest-hf: {name!r} has no softmax-attention layer to sparsify")
    for i, mixer in attention:
        if getattr(mixer, "kv_lora_rank", None):
            raise ValueError(f"quest-hf: layer {i}'s {type(mixer).__name__} uses latent attention (MLA, "
                             "kv_lora_rank); not supported")
        if getattr(mixer, "is_causal", True) is False:
            raise ValueError(f"quest-hf: layer {i}'s {type(mixer).__name__} is not causal; Quest serves causal "
                             "decoding only")
        if getattr(mixer, "layer_idx", None) != i:
            raise ValueError(f"quest-hf: layer {i}'s {type(mixer).__name__} has layer_idx "
                             f"{getattr(mixer, 'layer_idx', None)!r}; the cache is indexed by layer: they must agree")
        _check_attention_code(i, mixer)
    decoder, _ = _decoder_layers(model)  # a vision tower's attention has no slot in the text cache: not counted
    n_attn = sum(1 for m in decoder.modules() if _is_attention_module(m))
    if n_attn != len(attention):
        raise ValueError(f"quest-hf: found {n_attn} attention modules in the decoder for {len(attention)} attention "
                         f"layers ({len(layers)} layers); this model layout is not supported")
    return describe(model)


def _is_attention_module(m: torch.nn.Module) -> bool:
    """Modules that take a layer's slot in the cache: they have a `layer_idx` and call the attention interface."""
    return hasattr(m, "layer_idx") and bool(_INTERFACE_CALL.search(_code(_source(type(m).forward))))


def summary(model) -> str:
    """Human summary, one line per group of layers alike, e.g.

    "layers 0,2 sliding window 8, softcap 50.0, scaling 0.177; layers 1,3 full, softcap 50.0, scaling 0.177".
    """
    groups: dict[tuple, list[int]] = {}
    for a in describe(model):
        key = (a.kind, a.window, a.softcap, round(a.scaling, 6), a.has_sinks, a.rope, a.qk_norm)
        groups.setdefault(key, []).append(a.layer_idx)
    lines = []
    for (kind, window, softcap, scaling, sinks, rope, qk_norm), idx in groups.items():
        parts = [kind + (f" window {window}" if kind == "sliding" else f" chunk {window}" if kind == "chunked" else "")]
        if softcap is not None:
            parts.append(f"softcap {softcap:g}")
        parts.append(f"scaling {scaling:.4g}")
        if sinks:
            parts.append("sinks")
        if not rope:
            parts.append("NoPE")
        if qk_norm:
            parts.append("q/k norm")
        lines.append(f"layers {_ranges(idx)}: " + ", ".join(parts))
    return "\n".join(lines)
