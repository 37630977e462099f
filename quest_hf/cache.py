"""QuestCache: HF `Cache` of paged K/V plus per-page key min/max (arXiv 2406.10774).

One `QuestLayer` per model layer owns the storage; `QuestCache` only builds the list of layers and
carries the step information (which new tokens are padding) from the model's forward to them.
Storage per layer (see `triton_kernels/_contract.md`):

    keys, values  [B, H_kv, C, D]       slot order; page p = slots [p*S, (p+1)*S); C grows x1.5
    kmin, kmax    [B, H_kv, C // S, D]  element-wise min/max of each page's valid keys (+inf/-inf: empty)
    valid         [B, C] bool            False for padding and unwritten slots
"""
from __future__ import annotations

import copy as _copy
from dataclasses import replace as _replace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

import triton_kernels as tk

from .config import QuestConfig
from .ops import Ops, resolve_backend

_MIN_CAPACITY = 256


class _Step:
    """Which of the tokens entering the cache in this forward are real (not padding), per device."""

    def __init__(self):
        self.valid_new: torch.Tensor | None = None
        self._moved: dict[torch.device, torch.Tensor] = {}

    def set(self, valid_new: torch.Tensor | None):
        self.valid_new, self._moved = valid_new, {}

    def get(self, num_tokens: int, device: torch.device) -> torch.Tensor | None:
        v = self.valid_new
        if v is None:
            return None
        if v.shape[1] != num_tokens:
            raise ValueError(
                f"the attention_mask covers {v.shape[1]} new tokens but the layer received {num_tokens}; "
                "pass attention_mask of shape [batch, past + new tokens]"
            )
        if v.device != device:  # layers spread over devices (device_map): move once per device and step
            v = self._moved.setdefault(device, v.to(device, non_blocking=True))
        return v


class QuestLayer(CacheLayerMixin):
    """Paged K/V and key min/max of one model layer. `keys`/`values` are the full-capacity buffers;
    `seq_len` slots of them are filled. `ops` is the backend that runs on this layer (`ops.name`)."""

    is_compileable = False
    is_sliding = False  # every token is kept; a sliding window is applied at attention time
    is_croppable = True

    def __init__(self, config: QuestConfig, step: _Step | None = None):
        super().__init__()
        self.config = config
        self._step = step or _Step()
        self.seq_len = 0
        self.kmin = self.kmax = self.valid = None
        self.side: dict[str, torch.Tensor] = {}  # selectors' per-slot buffers [B, H_kv, C, ...]
        self.ops: Ops | None = None

    def __repr__(self):
        cap = 0 if self.keys is None else self.keys.shape[2]
        backend = self.ops.name if self.ops else "?"
        return f"QuestLayer(seq_len={self.seq_len}, capacity={cap}, backend={backend})"

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dtype not in tk._common.KV_DTYPES:
            raise TypeError(f"QuestCache stores fp16, bf16 or fp32 keys, got {key_states.dtype}")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.ops = resolve_backend(self.config.backend, self.device)
        B, H, _, D = key_states.shape
        self.keys = key_states.new_zeros(B, H, 0, D)
        self.values = value_states.new_zeros(B, H, 0, value_states.shape[-1])
        self.kmin = key_states.new_zeros(B, H, 0, D)
        self.kmax = key_states.new_zeros(B, H, 0, D)
        self.valid = torch.zeros(B, 0, dtype=torch.bool, device=self.device)
        self.is_initialized = True

    def _reserve(self, needed: int) -> None:
        """Grow every buffer geometrically so that `needed` slots fit (amortised O(1) per token)."""
        old = self.capacity
        if needed <= old:
            return
        self._allocate(max(needed, old + old // 2, _MIN_CAPACITY))

    def _allocate(self, tokens: int) -> None:
        """Move the buffers to a capacity of `tokens` rounded up to whole pages, keeping what is stored."""
        S, old = self.page_size, self.capacity
        cap = -(-tokens // S) * S
        B, H, _, D = self.keys.shape
        # Zero-filled so that no unwritten slot can leak NaN into a masked-out product.
        keys, values = self.keys.new_zeros(B, H, cap, D), self.values.new_zeros(B, H, cap, self.values.shape[-1])
        kmin = self.kmin.new_full((B, H, cap // S, D), float("inf"))
        kmax = self.kmax.new_full((B, H, cap // S, D), float("-inf"))
        valid = self.valid.new_zeros(B, cap)
        n, p = self.seq_len, old // S
        keys[:, :, :n], values[:, :, :n] = self.keys[:, :, :n], self.values[:, :, :n]
        kmin[:, :, :p], kmax[:, :, :p], valid[:, :old] = self.kmin, self.kmax, self.valid
        self.keys, self.values, self.kmin, self.kmax, self.valid = keys, values, kmin, kmax, valid
        for name, t in self.side.items():
            grown = t.new_zeros(t.shape[0], t.shape[1], cap, *t.shape[3:])
            grown[:, :, :old] = t
            self.side[name] = grown

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append `key_states/value_states [B, H_kv, T, D]`; return the filled K/V `[B, H_kv, seq_len, D]` (views)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H, T, D = key_states.shape
        if (B, H, D) != (self.keys.shape[0], self.keys.shape[1], self.keys.shape[3]):
            raise ValueError(
                f"this QuestCache holds batch {self.keys.shape[0]} x {self.keys.shape[1]} KV heads x head_dim "
                f"{self.keys.shape[3]}, got keys {tuple(key_states.shape)}; use a new QuestCache for a new batch"
            )
        if key_states.dtype != self.dtype:
            raise TypeError(f"this QuestCache stores {self.dtype} keys, got {key_states.dtype}")
        self._reserve(self.seq_len + T)
        valid_new = self._step.get(T, self.device)
        self.ops.append_kv(self.keys, self.values, self.kmin, self.kmax, self.valid,
                           key_states, value_states, valid_new, self.seq_len)
        self._selector.on_append(self, key_states, self.seq_len, valid_new)
        self.seq_len += T
        return self.keys[:, :, : self.seq_len], self.values[:, :, : self.seq_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return -1

    # Everything below acts on all five buffers (the mixin's versions only know keys/values).
    @property
    def _selector(self):
        from .selectors import SELECTORS

        return SELECTORS.get(self.config.policy, SELECTORS["quest"])  # "oracle" keeps no side state

    def _map(self, fn) -> None:
        if self.is_initialized:
            for name in ("keys", "values", "kmin", "kmax", "valid"):
                setattr(self, name, fn(getattr(self, name)))
            self.side = {name: fn(t) for name, t in self.side.items()}

    def reset(self) -> None:
        if self.is_initialized:
            self.kmin.fill_(float("inf"))
            self.kmax.fill_(float("-inf"))
            self.valid.zero_()
        self.seq_len = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def offload(self) -> None:
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized and self.keys.device != self.device:
            self._map(lambda t: t.to(self.device, non_blocking=True))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (HF's convention: a negative count), metadata included."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        new_len = self.seq_len + tokens_to_remove
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        if new_len < 0:
            raise ValueError(f"cannot remove {-tokens_to_remove} tokens from a cache of {self.seq_len}")
        S = self.page_size
        start = new_len // S * S  # the boundary page is rebuilt from its surviving tokens
        keep_k, keep_v = self.keys[:, :, start:new_len].clone(), self.values[:, :, start:new_len].clone()
        keep_valid = self.valid[:, start:new_len].clone()
        self.kmin[:, :, start // S:].fill_(float("inf"))
        self.kmax[:, :, start // S:].fill_(float("-inf"))
        self.valid[:, start:] = False
        self.ops.append_kv(self.keys, self.values, self.kmin, self.kmax, self.valid,
                           keep_k, keep_v, keep_valid, start)
        self.seq_len = new_len


class QuestCache(Cache):
    """A `transformers.Cache` for Quest sparse decoding: one `QuestLayer` per model layer.

    `generate()` of a patched model builds one by itself. To drive the model yourself, build one from
    the patched model and pass it as the cache argument::

        cache = QuestCache.from_model(model)
        out = model(input_ids, attention_mask=mask, past_key_values=cache)  # `cache=` on transformers >= 5.24

    `selection_hooks`: callables `fn(layer_idx, query [B, H_q, D], page_ids [B, H_kv, K])` run after each
    sparse selection (empty by default: no cost).
    """

    def __init__(self, config: QuestConfig, num_layers: int, max_length: int | None = None):
        from .static import DecodeGraph, StaticQuestLayer

        if not isinstance(config, QuestConfig):
            raise TypeError(f"QuestCache needs a QuestConfig, got {type(config).__name__}")
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        self.quest_config = config
        self._step = _Step()
        self.selection_hooks: list = []
        self.graph = None
        # Which stop check generate() ran over this cache: "deferred" (one step late, the host never waits)
        # or "per-token"; None until a generate() call (QuestConfig.defer_stop_check).
        self.stop_check: str | None = None
        # True when generate() took this cache (and its captured graph) over from its previous call, reset.
        self.reused = False
        if config.cuda_graph == "auto":  # a cache built by hand: static when given a length
            from .selectors import captured_policies

            config = _replace(config, cuda_graph=max_length is not None and config.policy in captured_policies())
            self.quest_config = config
        if config.cuda_graph:
            if not isinstance(max_length, int) or max_length < 1:
                raise ValueError("cuda_graph=True needs a static capacity: QuestCache(..., max_length=prompt + new "
                                 f"tokens), got max_length={max_length!r}")
            layers = [StaticQuestLayer(config, self._step, max_length) for _ in range(num_layers)]
            self.graph = DecodeGraph()
        else:
            layers = [QuestLayer(config, self._step) for _ in range(num_layers)]
        super().__init__(layers=layers)

    @classmethod
    def from_model(cls, model, max_length: int | None = None) -> "QuestCache":
        """A fresh cache with the configuration `patch_model` gave `model` (`max_length` for cuda_graph=True)."""
        state = getattr(model, "_quest_state", None)
        if state is None:
            raise ValueError("the model is not patched: call quest_hf.patch_model(model, ...) first, "
                             "or build QuestCache(QuestConfig(...), num_layers)")
        return cls(state.config, state.num_layers, max_length)

    def copy(self, config: QuestConfig | None = None) -> "QuestCache":
        """An independent copy (tensors included), optionally under another config with the same page_size:
        one dense prefill can then be decoded under many budgets or policies."""
        if self.graph is not None:
            raise NotImplementedError("copy() of a cuda_graph QuestCache is not supported")
        new = _copy.deepcopy(self)
        if config is not None:
            config = _replace(config, cuda_graph=False)  # copies are growing caches
            if config.page_size != self.quest_config.page_size:
                raise ValueError(f"a copy keeps the pages: page_size must stay {self.quest_config.page_size}")
            new.quest_config = config
            for layer in new.layers:
                layer.config = config
                if layer.is_initialized:
                    layer.ops = resolve_backend(config.backend, layer.device)
        return new

    def begin_step(self, attention_mask: torch.Tensor | None, num_new_tokens: int) -> None:
        """Record which of the `num_new_tokens` tokens of this forward are real, from HF's 2D padding mask."""
        if attention_mask is None:
            self._step.set(None)
            return
        if attention_mask.dim() != 2 or attention_mask.shape[1] < num_new_tokens:
            raise ValueError(
                f"quest-hf needs the 2D padding attention_mask [batch, past + new tokens], got shape "
                f"{tuple(attention_mask.shape)} for {num_new_tokens} new tokens"
            )
        self._step.set(attention_mask[:, attention_mask.shape[1] - num_new_tokens:].bool())

    @property
    def backends(self) -> set[str]:
        """Names of the backends the initialised layers run (`{"triton"}` on CUDA by default)."""
        return {layer.ops.name for layer in self.layers if layer.ops is not None}
